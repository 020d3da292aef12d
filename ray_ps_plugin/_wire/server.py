"""The shard's end of the direct path: a listening socket, a reader and a writer per
connection, each complete frame handed to the shard's event loop.

See :mod:`ray_ps_plugin._wire` for what the direct path is and why it exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import threading
from collections.abc import Awaitable, Callable

import numpy as np

from ray_ps_plugin._wire.frames import (
    ANSWER,
    ERROR,
    HEADER_BYTES,
    REQUESTS,
    TOKEN_BYTES,
    Frame,
    FrameSender,
    recv_exact,
    tune_socket,
)

__all__ = ["Handler", "WireServer"]

logger = logging.getLogger(__name__)

Handler = Callable[[Frame, np.ndarray], Awaitable[np.ndarray]]


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
        self._tokens = [token]
        self._token_timeout_s = token_timeout_s
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Future[None]] = set()
        self._conns: set[socket.socket] = set()

    def allow(self, token: bytes) -> None:
        """Accepts connections that start with ``token`` too (a primary shard's own
        token for its replica: see :mod:`ray_ps_plugin._param.replica`)."""
        if len(token) != TOKEN_BYTES:
            raise ValueError(f"the token must be {TOKEN_BYTES} bytes")
        if token not in self._tokens:
            self._tokens.append(token)

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
            tune_socket(conn)
            conn.setblocking(True)
            self._conns.add(conn)
            threading.Thread(
                target=self._serve, args=(conn, loop), name="ps-wire-serve", daemon=True
            ).start()

    def _serve(self, conn: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        # Pushes are read as they come and answered as their sums complete, in any
        # order; the sender thread keeps answers from interleaving on the stream.
        sender = FrameSender(lambda: conn, "ps-wire-answer")
        try:
            presented = bytearray(TOKEN_BYTES)
            conn.settimeout(self._token_timeout_s)
            recv_exact(conn, memoryview(presented))
            if not any(hmac.compare_digest(bytes(presented), t) for t in self._tokens):
                logger.warning("closed a data-path connection without the run's token")
                return
            conn.settimeout(None)
            head = bytearray(HEADER_BYTES)
            while True:
                recv_exact(conn, memoryview(head))
                frame = Frame.unpack(head)
                if frame.kind not in REQUESTS:
                    raise ConnectionError(f"expected a push, got frame kind {frame.kind}")
                payload = np.empty(frame.nbytes, np.uint8)
                recv_exact(conn, payload.data)
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

    async def _answer(self, sender: FrameSender, frame: Frame, payload: np.ndarray) -> None:
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
