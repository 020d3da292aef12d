"""The pushers' end of the direct path: gradient chunks and other frames on TCP streams.

Through Ray's object store every cross-node chunk is an object that is created,
sealed, located, pulled by the object managers and read back: several round trips
and copies per chunk, which cost more than the bytes on a 1 Gbit/s link. Here a
chunk is one frame (:mod:`ray_ps_plugin._wire.frames`) on a long-lived TCP
connection from the pusher (a worker, a node's relay shard, or a primary shard
sending its replica changes) to the owner shard: a fixed header, then the chunk's
bytes, sent straight from the gradient buffer
(``sendall`` on a memoryview) and received straight into a fresh array
(``recv_into``). The answer — the sum — comes back the same way on the same
connection. Both ends move bytes with blocking sockets on threads of their own,
which hold no GIL while bytes move: a shard accepts in its event loop and reads and
answers each connection on two threads (:class:`WireServer`), handing each complete
push to the event loop; pushers — workers, relay shards, primaries — do the same
from their side (:class:`WireStreams`).

Ray still starts, places and supervises every process: the shard opens its
listening socket on its node's address when the backend asks
(:meth:`WireServer.start`), and the addresses reach the workers with the rest of the
run's description. Failure handling stays Ray's and the callers': a broken
connection fails every push waiting on it (a ``ConnectionError`` naming the
shard), and every wait is bounded by the caller (``ps_timeout_s``). Only processes
of the run can push: a connection opens with the run's secret token.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import socket
import threading
from collections.abc import Sequence

import numpy as np

from ray_ps_plugin._errors import ShardLinkError, ShardProtocolError, ShardTimeoutError
from ray_ps_plugin._wire.frames import (
    ANSWER,
    ERROR,
    HEADER_BYTES,
    LOCAL,
    PARAM_KEY,
    PARAM_LOCAL,
    PUSH,
    REPLAY,
    REPLAY_KEY,
    ROWS,
    ROWS_KEY,
    TABLE_KEY,
    TABLE_PULL,
    TABLE_PUSH,
    TABLE_WAIT,
    Frame,
    FrameSender,
    pack_local,
    recv_exact,
    relayed_rows_key,
    tune_socket,
)

__all__ = ["RemoteError", "WireStreams", "await_answer", "relay_failure"]

logger = logging.getLogger(__name__)


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
        self._sender = FrameSender(
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
        tune_socket(sock)
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
        head = bytearray(HEADER_BYTES)
        try:
            while True:
                recv_exact(sock, memoryview(head))
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
                recv_exact(sock, payload.data)
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
    """Pushes on the direct path, from any thread: a worker's, a relay's or a primary's.

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
        # Table frames' ``step``: never repeated, so a pull or push is matched to
        # its answer whatever the clocks (two pulls of one clock may be in flight).
        self._table_frames = itertools.count()

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
            fut.set_exception(ConnectionError(f"shard {shard} has no direct path"))
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

    def param_local(
        self, shard: int, model: int, source: int, clock: int, slot: int
    ) -> concurrent.futures.Future[np.ndarray]:
        """Tells a shard of this node that the source's update of ``clock`` lies in
        its shared-memory input (as ``ParamShard.push_local`` through Ray); the
        future holds the packed reply, the parameters being in output ``slot``."""
        payload = np.array([slot], "<i8").view(np.uint8)
        frame = Frame(PARAM_LOCAL, "float32", model, clock, PARAM_KEY, source, payload.nbytes)
        return self._stream(shard).push(frame, payload)

    def push_rows(
        self,
        shard: int,
        model: int,
        step: int,
        source: int,
        payload: np.ndarray,
        owner: int | None = None,
    ) -> concurrent.futures.Future[np.ndarray]:
        """Sends a shard the step's touched rows of a model's sparse tables (packed by
        :func:`ray_ps_plugin._rows.pack`); the future holds the packed answer.

        ``owner``: the shard that owns the rows, when ``shard`` is the sender's node
        relay for them (``None``: ``shard`` owns them)."""
        key = ROWS_KEY if owner is None else relayed_rows_key(owner)
        frame = Frame(ROWS, "float32", model, step, key, source, payload.nbytes)
        return self._stream(shard).push(frame, payload)

    def table_pull(
        self, shard: int, model: int, source: int, payload: np.ndarray
    ) -> concurrent.futures.Future[np.ndarray]:
        """Asks a shard for a sharded table's rows (packed by
        :func:`ray_ps_plugin._tables.frames.pack_pull`); the future holds them."""
        return self._table_frame(shard, TABLE_PULL, model, source, payload)

    def table_push(
        self, shard: int, model: int, source: int, payload: np.ndarray
    ) -> concurrent.futures.Future[np.ndarray]:
        """Sends a shard one optimizer step on a model's sharded tables (packed by
        :func:`ray_ps_plugin._tables.frames.pack_push`); the future holds the answer."""
        return self._table_frame(shard, TABLE_PUSH, model, source, payload)

    def table_wait(
        self, shard: int, model: int, source: int, clocks: dict[int, int]
    ) -> concurrent.futures.Future[np.ndarray]:
        """Asks a shard to answer once its rows of each table in ``clocks`` are as
        fresh as a worker at that clock may train on (ssp's bound); no data."""
        payload = np.array(sorted(clocks.items()), "<i8").reshape(-1).view(np.uint8)
        return self._table_frame(shard, TABLE_WAIT, model, source, payload)

    def _table_frame(
        self, shard: int, kind: int, model: int, source: int, payload: np.ndarray
    ) -> concurrent.futures.Future[np.ndarray]:
        step = next(self._table_frames)
        frame = Frame(kind, "float32", model, step, TABLE_KEY, source, payload.nbytes)
        return self._stream(shard).push(frame, payload)

    def replay(
        self, shard: int, seq: int, source: int, payload: np.ndarray
    ) -> concurrent.futures.Future[np.ndarray]:
        """Sends a primary's change number ``seq`` (``payload``: the pickled call) to
        its replica, listening as ``shard``; the future completes once replayed."""
        frame = Frame(REPLAY, "float32", 0, seq, REPLAY_KEY, source, payload.nbytes)
        return self._stream(shard).push(frame, payload)

    def close(self, timeout_s: float = 5.0) -> None:
        """Closes every connection (waits at most ``timeout_s`` per sender)."""
        with self._lock:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.close(timeout_s)


async def await_answer(
    answer: asyncio.Future[np.ndarray], timeout_s: float, late: str
) -> np.ndarray:
    """A relay's wait for the owner's answer to what it forwarded, bounded.

    The send is not cancelled on timeout: a half-sent frame would corrupt the stream.

    Raises:
        ShardTimeoutError: ``late``, if no answer came within ``timeout_s``.
    """
    answer.add_done_callback(lambda t: t.cancelled() or t.exception())
    done, _ = await asyncio.wait({answer}, timeout=timeout_s)
    if not done:
        raise ShardTimeoutError(late)
    return answer.result()


def relay_failure(error: Exception, what: str) -> Exception:
    """The error a relay leaves for every waiter: a timeout or refusal as it is,
    anything else (a lost link) as a ``ShardLinkError`` saying ``what`` failed."""
    if isinstance(error, (ShardTimeoutError, ShardProtocolError)):
        return error
    return ShardLinkError(f"{what} failed: {error}")
