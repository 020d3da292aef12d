"""The direct data path between nodes: gradient chunks on plain TCP streams.

Through Ray's object store every cross-node chunk is an object that is created,
sealed, located, pulled by the object managers and read back: several round trips
and copies per chunk, which cost more than the bytes on a 1 Gbit/s link. Here a
chunk is one frame on a long-lived TCP connection from the pusher (a worker, or a
node's relay shard) to the owner shard: a fixed header, then the chunk's bytes,
sent straight from the gradient buffer (``sendall`` on a memoryview) and received
straight into a fresh array (``recv_into``). The answer — the sum — comes back the
same way on the same connection. Both ends move bytes with blocking sockets on
threads of their own, which hold no GIL while bytes move: a shard accepts in its
event loop and reads and answers each connection on two threads
(:class:`WireServer`), handing each complete push to the event loop; pushers —
workers, and relay shards — do the same from their side (:class:`WireStreams`).

Ray still starts, places and supervises every process: the shard opens its
listening socket on its node's address when the backend asks
(:meth:`WireServer.start`), and the addresses reach the workers with the rest of the
run's description. Failure handling stays Ray's and the callers': a broken
connection fails every push waiting on it (a ``ConnectionError`` naming the
shard), and every wait is bounded by the caller (``ps_timeout_s``).

Frames (little-endian)::

    header  = magic(4) kind(u8) dtype(u8) model(i32) step(i64) key(i64) source(i32) nbytes(i64)
    payload = nbytes bytes

``kind`` is a push, an answer or an error (the payload is then a UTF-8 message), or
a *local push*: a worker's notice to a shard of its own node that chunks already lie
in their shared-memory segment (the payload lists ``(key, numel, owner)`` of each as
``int64`` triples, owner ``-1`` for the shard itself; ``key`` is the first chunk's;
the answer carries no data). As a Ray call, each such notice and its reply sit at
the ends of every step's transfer, where a loaded machine pays more for them than
for a frame on a socket already open. A push is matched to its answer by
``(model, step, key)``, unique per connection because a source pushes each chunk of
a step once.

A connection opens with the run's secret token (:data:`TOKEN_BYTES` random bytes the
backend draws and hands to shards and workers through Ray, which authenticates its
own traffic). A shard closes a connection that does not present it, so the port
accepts pushes only from processes of the run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import logging
import queue
import socket
import struct
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ray_ps_plugin._dtypes import MODEL_DTYPES

__all__ = [
    "DTYPES",
    "ROWS",
    "ROWS_KEY",
    "Frame",
    "RemoteError",
    "WireServer",
    "WireStreams",
    "pack_local",
    "unpack_local",
]

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<4sBBiqqiq")
_MAGIC = b"PSW1"
PUSH, ANSWER, ERROR, LOCAL, ROWS = 0, 1, 2, 3, 4
#: The key of a ``ROWS`` frame: one per model, step and shard (chunk keys are >= 0).
ROWS_KEY = -1

#: Element types a frame may name (the model's dtype; the payload is in the wire
#: format the run's compression chooses), by their index in the header.
DTYPES = MODEL_DTYPES

#: Length of the per-run token a connection starts with.
TOKEN_BYTES = 32


@dataclass(frozen=True)
class Frame:
    """One frame's header.

    Attributes:
        kind: ``PUSH``, ``ANSWER``, ``ERROR``, ``LOCAL`` or ``ROWS`` (the touched
            rows of a model's sparse tables, packed by :func:`ray_ps_plugin._rows.pack`).
        dtype: The model's dtype (an entry of :data:`DTYPES`).
        model: The prepared model's id.
        step: The synchronisation round.
        key: The chunk's byte offset in the model's gradient stream.
        source: Who pushes (a worker rank or a relay's source id).
        nbytes: Payload size.
    """

    kind: int
    dtype: str
    model: int
    step: int
    key: int
    source: int
    nbytes: int

    def pack(self) -> bytes:
        return _HEADER.pack(
            _MAGIC,
            self.kind,
            DTYPES.index(self.dtype),
            self.model,
            self.step,
            self.key,
            self.source,
            self.nbytes,
        )

    @classmethod
    def unpack(cls, raw: bytes | bytearray | memoryview) -> Frame:
        magic, kind, dtype, model, step, key, source, nbytes = _HEADER.unpack(raw)
        if (
            magic != _MAGIC
            or kind not in (PUSH, ANSWER, ERROR, LOCAL, ROWS)
            or dtype >= len(DTYPES)
        ):
            raise ConnectionError("not a ray_ps_plugin frame: the stream is corrupt")
        if nbytes < 0:
            raise ConnectionError(f"frame with a negative size {nbytes}")
        return cls(kind, DTYPES[dtype], model, step, key, source, nbytes)


def pack_local(chunks: Sequence[tuple[int, int, int | None]]) -> np.ndarray:
    """The payload of a local push: ``(key, numel, owner)`` per chunk."""
    return np.array(
        [(key, numel, -1 if owner is None else owner) for key, numel, owner in chunks],
        dtype="<i8",
    ).reshape(-1)


def unpack_local(payload: np.ndarray) -> list[tuple[int, int, int | None]]:
    """The chunks a local push names (see :func:`pack_local`)."""
    if payload.nbytes % 24:
        raise ConnectionError(f"a local push of {payload.nbytes} bytes is not whole triples")
    triples = payload.view("<i8").reshape(-1, 3).tolist()
    return [(key, numel, None if owner < 0 else owner) for key, numel, owner in triples]


def _tune(sock: socket.socket) -> None:
    # No SO_SNDBUF/SO_RCVBUF: fixed buffers turn the kernel's autotuning off, and
    # large fixed windows let a flow overrun a switch's shallow queue; autotuning
    # sizes the window to the path.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)


Handler = Callable[[Frame, np.ndarray], Awaitable[np.ndarray]]


def _recv_exact_blocking(sock: socket.socket, buf: memoryview) -> None:
    while buf.nbytes:
        n = sock.recv_into(buf)
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        buf = buf[n:]


def _send_blocking(sock: socket.socket, frame: Frame, payload: np.ndarray | bytes) -> None:
    sock.sendall(frame.pack())
    if frame.nbytes:
        sock.sendall(payload if isinstance(payload, bytes) else payload.data.cast("B"))


class _Sender:
    """A connection's outgoing frames, sent in order by a thread of its own.

    The thread first calls ``connect`` (so whoever queues frames never waits for a
    connection), then sends. Blocking ``sendall`` releases the GIL for the whole
    transfer, so a frame in flight costs the queueing thread nothing.

    Args:
        connect: Returns the connected socket (or raises ``OSError``).
        name: The thread's name.
        on_error: Called with the ``OSError`` and whether it came from ``connect``;
            ``None``: the peer went away, and its waits end there.
        on_connected: Called with the socket once connected (before any send).
    """

    def __init__(
        self,
        connect: Callable[[], socket.socket],
        name: str,
        on_error: Callable[[OSError, bool], None] | None = None,
        on_connected: Callable[[socket.socket], None] | None = None,
    ) -> None:
        self._connect = connect
        self._on_error = on_error
        self._on_connected = on_connected
        self._queue: queue.SimpleQueue[tuple[Frame, np.ndarray | bytes] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, frame: Frame, payload: np.ndarray | bytes) -> None:
        self._queue.put((frame, payload))

    def close(self, timeout_s: float | None = None) -> None:
        """Sends what is queued, then stops; waits up to ``timeout_s`` if given."""
        self._queue.put(None)
        if timeout_s is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            sock = self._connect()
        except OSError as e:
            if self._on_error is not None:
                self._on_error(e, True)
            return
        if self._on_connected is not None:
            self._on_connected(sock)
        try:
            while (item := self._queue.get()) is not None:
                _send_blocking(sock, *item)
        except OSError as e:
            if self._on_error is not None:
                self._on_error(e, False)


class WireServer:
    """The listening side of a shard.

    Connections are accepted in the shard's event loop; each is then read by a
    thread of its own with blocking ``recv_into`` and answered by another with
    blocking ``sendall``, which hold no GIL while bytes move. (Read by the event
    loop, every socket buffer's worth of a 1 MiB frame cost a wake-up and a pass
    through the loop.) Each complete push is handed to ``handler`` in the event
    loop, which owns all of the shard's state.

    Args:
        handler: Called with each push's header and payload; returns the answer's
            payload, or raises (the pusher then gets the error's message).
        token: The run's secret; a connection that does not start with it is closed.
        token_timeout_s: How long a new connection may take to present the token
            (the run's ``ps_timeout_s``) before it is closed.
    """

    def __init__(self, handler: Handler, token: bytes, token_timeout_s: float = 30.0) -> None:
        if len(token) != TOKEN_BYTES:
            raise ValueError(f"the token must be {TOKEN_BYTES} bytes")
        self._handler = handler
        self._token = token
        self._token_timeout_s = token_timeout_s
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Future[None]] = set()
        self._conns: set[socket.socket] = set()

    async def start(self, host: str) -> tuple[str, int]:
        """Listens on ``host`` (the node's address) on a free port; returns both."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, 0))
        listener.listen(256)
        listener.setblocking(False)
        self._listener = listener
        self._loop = asyncio.get_running_loop()
        self._spawn(self._accept(listener))
        return host, listener.getsockname()[1]

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(listener)
            _tune(conn)
            conn.setblocking(True)
            self._conns.add(conn)
            threading.Thread(
                target=self._serve, args=(conn, loop), name="ps-wire-serve", daemon=True
            ).start()

    def _serve(self, conn: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        # Pushes are read as they come and answered as their sums complete, in any
        # order; the sender thread keeps answers from interleaving on the stream.
        sender = _Sender(lambda: conn, "ps-wire-answer")
        try:
            presented = bytearray(TOKEN_BYTES)
            conn.settimeout(self._token_timeout_s)
            _recv_exact_blocking(conn, memoryview(presented))
            if not hmac.compare_digest(bytes(presented), self._token):
                logger.warning("closed a data-path connection without the run's token")
                return
            conn.settimeout(None)
            head = bytearray(_HEADER.size)
            while True:
                _recv_exact_blocking(conn, memoryview(head))
                frame = Frame.unpack(head)
                if frame.kind not in (PUSH, LOCAL, ROWS):
                    raise ConnectionError(f"expected a push, got frame kind {frame.kind}")
                payload = np.empty(frame.nbytes, np.uint8)
                _recv_exact_blocking(conn, payload.data)
                loop.call_soon_threadsafe(self._spawn, self._answer(sender, frame, payload))
        except (ConnectionError, OSError, RuntimeError):
            pass  # the pusher went away (or the loop closed); its waits end on its side
        finally:
            # Answers still queued have no one to go to: the pusher is gone.
            sender.close()
            self._conns.discard(conn)
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # also wakes the sender if it blocks
            conn.close()

    async def _answer(self, sender: _Sender, frame: Frame, payload: np.ndarray) -> None:
        try:
            out = await self._handler(frame, payload)
            reply: np.ndarray | bytes = out
            kind, nbytes = ANSWER, out.nbytes
        except Exception as e:
            reply = str(e).encode()[:65536]
            kind, nbytes = ERROR, len(reply)
        # A sum stays unchanged until it is sent: its buffer is reused two steps
        # later, which this pusher cannot reach before it has this answer.
        sender.put(
            Frame(kind, frame.dtype, frame.model, frame.step, frame.key, frame.source, nbytes),
            reply,
        )

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for conn in list(self._conns):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class RemoteError(RuntimeError):
    """The shard refused a push; carries the shard's message."""


class _Stream:
    """A worker's connection to one shard, driven by two threads of its own.

    Blocking ``sendall``/``recv_into`` release the GIL for the whole transfer, so a
    chunk in flight costs the training thread nothing; an event loop would wake up
    (and take the GIL) for every socket-buffer's worth of bytes. A sender thread
    takes pushes from a queue, so the caller — DDP's hook on the autograd thread —
    never blocks on the network; a receiver thread matches answers to pushes.
    """

    def __init__(
        self, shard: int, address: tuple[str, int], token: bytes, connect_timeout_s: float
    ) -> None:
        self.shard = shard
        self.address = address
        self._token = token
        self._connect_timeout_s = connect_timeout_s
        self._lock = threading.Lock()
        # (model, step, key) -> the push's future and where its answer may land.
        self._waiting: dict[
            tuple[int, int, int], tuple[concurrent.futures.Future[np.ndarray], np.ndarray | None]
        ] = {}
        self._error: BaseException | None = None
        self._sock: socket.socket | None = None
        self._sender = _Sender(
            self._connect,
            f"ps-wire-send-{shard}",
            on_error=self._send_failed,
            on_connected=self._start_receiving,
        )

    def _where(self) -> str:
        return f"shard {self.shard} at {self.address[0]}:{self.address[1]}"

    def push(
        self, frame: Frame, payload: np.ndarray, into: np.ndarray | None = None
    ) -> concurrent.futures.Future[np.ndarray]:
        fut: concurrent.futures.Future[np.ndarray] = concurrent.futures.Future()
        with self._lock:
            if self._error is not None:
                fut.set_exception(self._error)
                return fut
            self._waiting[(frame.model, frame.step, frame.key)] = (fut, into)
        self._sender.put(frame, payload)
        return fut

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
            waiting, self._waiting = self._waiting, {}
        for fut, _ in waiting.values():
            if not fut.done():
                fut.set_exception(self._error)

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=self._connect_timeout_s)
        sock.sendall(self._token)
        sock.settimeout(None)
        _tune(sock)
        sock.setblocking(True)
        return sock

    def _start_receiving(self, sock: socket.socket) -> None:
        self._sock = sock
        threading.Thread(
            target=self._recv_loop, args=(sock,), name=f"ps-wire-recv-{self.shard}", daemon=True
        ).start()

    def _send_failed(self, error: OSError, connecting: bool) -> None:
        if connecting:
            self._fail(
                ConnectionError(
                    f"cannot reach {self._where()} within {self._connect_timeout_s:g}s: {error}"
                )
            )
        else:
            self._fail(ConnectionError(f"sending to {self._where()} failed: {error}"))

    def _recv_loop(self, sock: socket.socket) -> None:
        head = bytearray(_HEADER.size)
        try:
            while True:
                _recv_exact_blocking(sock, memoryview(head))
                frame = Frame.unpack(head)
                key = (frame.model, frame.step, frame.key)
                with self._lock:
                    fut, into = self._waiting.pop(key, (None, None))
                if (
                    frame.kind == ANSWER
                    and into is not None
                    and into.nbytes == frame.nbytes
                    and into.flags.c_contiguous
                ):
                    payload = into.reshape(-1).view(np.uint8)  # straight into place
                else:
                    payload = np.empty(frame.nbytes, np.uint8)
                _recv_exact_blocking(sock, payload.data)
                if fut is None or fut.done():
                    continue
                if frame.kind == ERROR:
                    fut.set_exception(RemoteError(payload.tobytes().decode(errors="replace")))
                else:
                    fut.set_result(payload)
        except (ConnectionError, OSError) as e:
            self._fail(ConnectionError(f"connection to {self._where()} lost: {e}"))

    def close(self, timeout_s: float) -> None:
        self._sender.close(timeout_s)
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self._fail(ConnectionError(f"connection to {self._where()} closed"))


class WireStreams:
    """Pushes on the direct path, from any thread: a worker's, or a relay shard's.

    One connection per shard pushed to, opened on first use, each with a sender and
    a receiver thread (see :class:`_Stream`). Pushes return
    ``concurrent.futures.Future`` objects; the caller bounds its wait on them (a
    shard's event loop through ``asyncio.wrap_future``).

    Args:
        addresses: ``(host, port)`` of each shard's data path, by shard index
            (``None`` for shards without one).
        token: The run's secret, sent first on every connection.
        connect_timeout_s: Bound on opening one connection.
    """

    def __init__(
        self,
        addresses: Sequence[tuple[str, int] | None],
        token: bytes,
        connect_timeout_s: float,
    ) -> None:
        self._addresses = list(addresses)
        self._token = token
        self._timeout_s = connect_timeout_s
        self._streams: dict[int, _Stream] = {}
        self._lock = threading.Lock()  # models of one process share the streams

    def push(
        self,
        shard: int,
        model: int,
        step: int,
        key: int,
        source: int,
        dtype: str,
        payload: np.ndarray,
        into: np.ndarray | None = None,
    ) -> concurrent.futures.Future[np.ndarray]:
        """Sends one chunk to ``shard``; the future holds the answer's bytes (``uint8``).

        ``payload`` must stay unchanged until the future completes. The future fails
        with ``ConnectionError`` if the connection cannot be opened or breaks, and
        with :class:`RemoteError` if the shard refuses the push.

        ``into``: a contiguous array the answer is received into, without a copy,
        when its size matches (the future then holds its bytes); it may be the
        payload itself, since the answer comes only after the whole push arrived.
        """
        if not self.reaches(shard):
            fut: concurrent.futures.Future[np.ndarray] = concurrent.futures.Future()
            fut.set_exception(ConnectionError(f"shard {shard} has no direct data path"))
            return fut
        frame = Frame(PUSH, dtype, model, step, key, source, payload.nbytes)
        return self._stream(shard).push(frame, payload, into)

    def _stream(self, shard: int) -> _Stream:
        with self._lock:
            stream = self._streams.get(shard)
            if stream is None:
                address = self._addresses[shard]
                assert address is not None  # callers check
                stream = _Stream(shard, address, self._token, self._timeout_s)
                self._streams[shard] = stream
        return stream

    def reaches(self, shard: int) -> bool:
        """Whether ``shard`` listens on the direct path."""
        return self._addresses[shard] is not None

    def push_local(
        self,
        shard: int,
        model: int,
        step: int,
        source: int,
        dtype: str,
        chunks: Sequence[tuple[int, int, int | None]],
    ) -> concurrent.futures.Future[np.ndarray]:
        """Tells a shard of this node that ``chunks`` lie in the source's shared-memory
        segment (as ``SumShard.push_local`` through Ray); the future completes, with
        no data, once their sums are in the shard's output segment."""
        payload = pack_local(chunks)
        frame = Frame(LOCAL, dtype, model, step, chunks[0][0], source, payload.nbytes)
        return self._stream(shard).push(frame, payload)

    def push_rows(
        self, shard: int, model: int, step: int, source: int, payload: np.ndarray
    ) -> concurrent.futures.Future[np.ndarray]:
        """Sends a shard the step's touched rows of a model's sparse tables (packed by
        :func:`ray_ps_plugin._rows.pack`); the future holds the packed answer."""
        frame = Frame(ROWS, "float32", model, step, ROWS_KEY, source, payload.nbytes)
        return self._stream(shard).push(frame, payload)

    def close(self, timeout_s: float = 5.0) -> None:
        """Closes every connection (waits at most ``timeout_s`` per sender)."""
        with self._lock:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.close(timeout_s)
