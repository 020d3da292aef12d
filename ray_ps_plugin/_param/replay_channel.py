"""A primary shard's frames to its replica: the direct path instead of Ray calls.

A primary forwards every change to its replica, one per worker per step. As Ray
actor calls, Ray's and asyncio's handling of them cost the replica more CPU than
replaying the changes (``benchmarks/replication_profile.py``: about 2 ms a call on
a loaded 2-core machine, and half as much again on the primary); on one node that
was most of what replication still added to a step. So once the replica listens on the
direct path, each change goes as one ``REPLAY`` frame on a TCP connection the
primary keeps open to it (:mod:`ray_ps_plugin._wire`), with the call pickled in
the payload: a change that lies in shared memory is a few hundred bytes.

The channel opens in the background: the primary draws a token of its own, has
the replica accept it (``open_wire``), and connects. Until then, or where the
run has no direct path (``data_path="object_store"``) or the replica cannot open
one, changes go as Ray calls: the replica replays by number either way, so the
two may interleave.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import pickle
import secrets
from typing import Any

import numpy as np

from ray_ps_plugin._wire.frames import TOKEN_BYTES
from ray_ps_plugin._wire.streams import WireStreams

__all__ = ["ReplayChannel", "decode_call"]

logger = logging.getLogger(__name__)


def decode_call(payload: np.ndarray) -> tuple[str, tuple[Any, ...]]:
    """The ``(method, args)`` a ``REPLAY`` frame carries (the replica's side; the
    frame came on a connection that presented its primary's token)."""
    method, args = pickle.loads(payload.tobytes())
    return str(method), tuple(args)


class ReplayChannel:
    """The direct path from a primary to one replica, opened once in the background.

    Args:
        replica: The replica's actor handle.
        shard_index: The shard's index (the frames' source, for messages).
        timeout_s: Bound on opening it.
    """

    def __init__(self, replica: Any, shard_index: int, timeout_s: float) -> None:
        self._replica = replica
        self._shard_index = shard_index
        self._timeout_s = timeout_s
        self._streams: WireStreams | None = None
        self._opening: asyncio.Task[None] | None = None
        self._closed = False

    def submit(
        self, seq: int, method: str, args: tuple[Any, ...]
    ) -> concurrent.futures.Future[np.ndarray] | None:
        """Sends change ``seq`` as a frame; ``None`` while the channel is not open
        (the caller makes a Ray call), which starts opening it."""
        if self._streams is None:
            self._open_soon()
            return None
        payload = np.frombuffer(pickle.dumps((method, args), protocol=5), np.uint8)
        return self._streams.replay(0, seq, self._shard_index, payload)

    def _open_soon(self) -> None:
        if self._opening is not None or self._closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not on the shard's event loop: the next change opens it
        self._opening = loop.create_task(self._open())

    async def _open(self) -> None:
        token = secrets.token_bytes(TOKEN_BYTES)
        try:
            ref = self._replica.open_wire.remote(token)
            host, port = await asyncio.wait_for(_awaited(ref), self._timeout_s)
        except Exception as e:
            logger.info(
                "shard %d: its replica did not open the direct path (%r); changes go as Ray calls.",
                self._shard_index,
                e,
            )
            return
        if not self._closed:
            self._streams = WireStreams([(str(host), int(port))], token, self._timeout_s)

    def close(self) -> None:
        """Closes the connection (changes in flight fail: their replica is dropped)."""
        self._closed = True
        if self._opening is not None:
            self._opening.cancel()
        streams, self._streams = self._streams, None
        if streams is not None:
            streams.close(timeout_s=1.0)


async def _awaited(ref: Any) -> Any:
    return await ref
