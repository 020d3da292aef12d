"""What travels on the direct path (:mod:`ray_ps_plugin._wire`): the frame
format, the run's token, and the blocking helpers both ends read and write frames with.

Frames (little-endian)::

    header  = magic(4) kind(u8) dtype(u8) model(i32) step(i64) key(i64) source(i32) nbytes(i64)
    payload = nbytes bytes

``kind`` is a push, an answer or an error (the payload is then a UTF-8 message), or
a *local push*: a worker's notice to a shard of its own node that chunks already lie
in their shared-memory segment (the payload lists ``(key, numel, owner)`` of each as
``int64`` triples, owner ``-1`` for the shard itself; ``key`` is the first chunk's;
the answer carries no data), or a sharded table's *pull* or *push*
(``ray_ps_plugin._tables.frames``; ``step`` is then the pusher's sequence number and
``key`` :data:`TABLE_KEY`), or a primary shard's *replay* of a change for its replica
(``step`` its number, ``key`` :data:`REPLAY_KEY`, the payload the pickled call).
As a Ray call, each such notice and its reply sit at the ends of every step's
transfer, where a loaded machine pays more for them than for a frame on a socket
already open. A push is matched to its answer by
``(model, step, key)``, unique per connection because a source pushes each chunk of
a step once.

A connection opens with the run's secret token (:data:`TOKEN_BYTES` random bytes the
backend draws and hands to shards and workers through Ray, which authenticates its
own traffic). A shard closes a connection that does not present it, so the port
accepts pushes only from processes of the run.
"""

from __future__ import annotations

import queue
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ray_ps_plugin._dtypes import MODEL_DTYPES

__all__ = [
    "ANSWER",
    "DTYPES",
    "ERROR",
    "HEADER_BYTES",
    "LOCAL",
    "PARAM_KEY",
    "PARAM_LOCAL",
    "PUSH",
    "REPLAY",
    "REPLAY_KEY",
    "REQUESTS",
    "ROWS",
    "ROWS_KEY",
    "TABLE_KEY",
    "TABLE_PULL",
    "TABLE_PUSH",
    "TABLE_WAIT",
    "TOKEN_BYTES",
    "Frame",
    "FrameSender",
    "pack_local",
    "recv_exact",
    "relayed_rows_key",
    "rows_owner",
    "tune_socket",
    "unpack_local",
]

_HEADER = struct.Struct("<4sBBiqqiq")
_MAGIC = b"PSW1"
#: Size of a frame's header.
HEADER_BYTES = _HEADER.size
PUSH, ANSWER, ERROR, LOCAL, ROWS, TABLE_PULL, TABLE_PUSH, PARAM_LOCAL, TABLE_WAIT = range(9)
REPLAY = 9  # a primary shard's change for its replica
#: The frames a pusher sends (the others are answers).
REQUESTS = (PUSH, LOCAL, ROWS, TABLE_PULL, TABLE_PUSH, PARAM_LOCAL, TABLE_WAIT, REPLAY)
#: The key of a ``ROWS`` frame: one per model, step and shard (chunk keys are >= 0).
ROWS_KEY = -1
#: The key of a table frame, whose ``step`` is a number the pusher never repeats.
TABLE_KEY = -2
#: The key of a ``REPLAY`` frame (a primary shard's change for its replica, number
#: ``step``: see :mod:`ray_ps_plugin._param.replica`).
REPLAY_KEY = -3
#: The key of a ``PARAM_LOCAL`` frame (async/ssp: a worker's notice that its update
#: of clock ``step`` lies in shared memory); far below any relayed rows' key.
PARAM_KEY = -(1 << 62)


def relayed_rows_key(owner: int) -> int:
    """The key of a ``ROWS`` frame that a worker sends its node's relay with the rows
    shard ``owner`` owns: below :data:`TABLE_KEY`, one per owner, so unique per
    connection and step as every key is."""
    return TABLE_KEY - 1 - owner


def rows_owner(key: int) -> int | None:
    """The owner a ``ROWS`` frame's rows are relayed to, or ``None`` (its target owns
    them); the inverse of :func:`relayed_rows_key`."""
    return None if key == ROWS_KEY else TABLE_KEY - 1 - key


#: Element types a frame may name (the model's dtype; the payload is in the wire
#: format the run's compression chooses), by their index in the header.
DTYPES = MODEL_DTYPES

#: Length of the per-run token a connection starts with.
TOKEN_BYTES = 32


@dataclass(frozen=True)
class Frame:
    """One frame's header.

    Attributes:
        kind: ``PUSH``, ``ANSWER``, ``ERROR``, ``LOCAL``, ``ROWS`` (the touched
            rows of a model's sparse tables, packed by :func:`ray_ps_plugin._rows.pack`),
            ``TABLE_PULL`` or ``TABLE_PUSH`` (a sharded table's rows, see
            :mod:`ray_ps_plugin._tables.frames`), ``REPLAY`` (a change for a replica).
        dtype: The model's dtype (an entry of :data:`DTYPES`).
        model: The prepared model's id.
        step: The synchronisation round.
        key: The chunk's byte offset in the model's gradient stream (``ROWS``:
            :data:`ROWS_KEY`, or the owner of relayed rows, see
            :func:`relayed_rows_key`).
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
        if magic != _MAGIC or kind not in (*REQUESTS, ANSWER, ERROR) or dtype >= len(DTYPES):
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


def tune_socket(sock: socket.socket) -> None:
    """Sets a data-path connection's options (and leaves it non-blocking)."""
    # No SO_SNDBUF/SO_RCVBUF: fixed buffers turn the kernel's autotuning off, and
    # large fixed windows let a flow overrun a switch's shallow queue; autotuning
    # sizes the window to the path.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)


def recv_exact(sock: socket.socket, buf: memoryview) -> None:
    """Fills ``buf`` from a blocking socket; ``ConnectionError`` if the peer closes."""
    while buf.nbytes:
        n = sock.recv_into(buf)
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        buf = buf[n:]


def _send_blocking(sock: socket.socket, frame: Frame, payload: np.ndarray | bytes) -> None:
    sock.sendall(frame.pack())
    if frame.nbytes:
        sock.sendall(payload if isinstance(payload, bytes) else payload.data.cast("B"))


class FrameSender:
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
