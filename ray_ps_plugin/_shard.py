"""What every shard actor has: identity, the workers it serves, checks, counters.

Both shard kinds (sync summation, async/ssp parameters) are asyncio actors: all
their coroutines run on one event-loop thread, so state is updated serially without
locks (Ray's actor-based parameter-server pattern), while thousands of calls may
wait at once without holding a thread each. They are plain classes here, wrapped
with ``ray.remote`` by the backend, so unit tests can drive them on an event loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ray_ps_plugin._dtypes import MODEL_DTYPES
from ray_ps_plugin._errors import ShardProtocolError
from ray_ps_plugin._metrics import ShardMetrics
from ray_ps_plugin._wire.frames import Frame
from ray_ps_plugin._wire.server import WireServer

if TYPE_CHECKING:
    from ray_ps_plugin._codec import Codec

__all__ = ["MAX_MODELS", "ShardBase", "rejoin_clock", "resized"]

logger = logging.getLogger(__name__)

# Prepared models per worker process that one run may have (each has its own keys,
# clocks and segments on every shard).
MAX_MODELS = 1024


class ShardBase:
    """Identity, argument checks and counters shared by every shard actor.

    Args:
        shard_index: This shard's index, used in error messages.
        num_workers: Number of workers it serves.
        timeout_s: Bound on every wait inside the shard.
    """

    def __init__(self, shard_index: int, num_workers: int, timeout_s: float) -> None:
        self.shard_index = shard_index
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self._bytes_in = 0
        self._bytes_out = 0
        self._pushes = 0
        self._duplicates = 0
        self._started = time.time()
        self._metrics: ShardMetrics | None = None
        self._wire_server: WireServer | None = None
        self._address: tuple[str, int] | None = None

    def ready(self) -> dict[str, Any]:
        """Answers once the actor is up; tells where it runs; starts its metrics."""
        import ray

        try:
            self._metrics = ShardMetrics(self.shard_index)
        except Exception:
            logger.debug("shard %d: no metrics", self.shard_index, exc_info=True)
        return {
            "shard": self.shard_index,
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
        }

    async def open_wire(self, token: bytes, host: str | None = None) -> tuple[str, int]:
        """Starts listening on the direct path (once); returns its address.

        Args:
            token: A secret a connection may start with (the run's, or a primary's
                for its replica); every call adds one.
            host: Address to listen on; by default the node's address in Ray.
        """
        if self._wire_server is not None:
            self._wire_server.allow(token)
        if self._address is None:
            if host is None:
                import ray

                host = ray.util.get_node_ip_address()
            self._wire_server = WireServer(self._on_frame, token, self.timeout_s)
            self._address = await self._wire_server.start(host)
        return self._address

    async def _on_frame(self, frame: Frame, payload: np.ndarray) -> np.ndarray:
        """Answers a frame that came on the direct path (each shard kind handles its
        own kinds and hands the rest on).

        Raises:
            ShardProtocolError: For a kind no one handles.
        """
        raise ShardProtocolError(
            f"shard {self.shard_index}: a frame of kind {frame.kind} is not for this shard."
        )

    def _check(self, model: object, rank: object | None, dtype: object = "float32") -> None:
        """Refuses caller-supplied ids a worker of this run cannot send.

        A negative rank would silently index another worker's clock; an unknown
        dtype would reinterpret shared memory as anything. ``rank=None``: the caller
        checks the sender another way.

        Raises:
            ShardProtocolError: Naming the bad argument.
        """
        checks = [("model", model, MAX_MODELS)]
        if rank is not None:
            checks.append(("rank", rank, self.num_workers))
        for name, value, bound in checks:
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < bound:
                raise ShardProtocolError(
                    f"shard {self.shard_index}: {name} {value!r} is not an int in [0, {bound})."
                )
        if dtype not in MODEL_DTYPES:
            raise ShardProtocolError(
                f"shard {self.shard_index}: dtype {dtype!r} is not one of {list(MODEL_DTYPES)}."
            )

    @contextlib.contextmanager
    def _queued(self) -> Iterator[None]:
        """Counts a call as waiting on this shard for as long as it runs."""
        if self._metrics is not None:
            self._metrics.enter()
        try:
            yield
        finally:
            if self._metrics is not None:
                self._metrics.leave()

    def feedback_state(self) -> dict[str, Any] | None:
        """What this shard's error feedback holds (its sums' errors, and a node
        relay's), for a checkpoint; ``None`` without a lossy compression."""
        codec = self._feedback_codec()
        return codec.feedback_state() if codec is not None else None

    def load_feedback_state(self, state: dict[str, Any] | None) -> None:
        """Holds what :meth:`feedback_state` returned (``None``: nothing to hold)."""
        codec = self._feedback_codec()
        if state is not None and codec is not None:
            codec.load_feedback_state(state)

    def _feedback_codec(self) -> Codec | None:
        # Each shard kind makes its own codec (``_codec``) after this base is set up.
        codec: Codec | None = getattr(self, "_codec", None)
        return codec

    def stats(self) -> dict[str, Any]:
        """Counters since start: bytes in/out, pushes, duplicate pushes ignored."""
        return {
            "shard": self.shard_index,
            "bytes_in": self._bytes_in,
            "bytes_out": self._bytes_out,
            "pushes": self._pushes,
            "duplicates": self._duplicates,
            "uptime_s": time.time() - self._started,
        }


def rejoin_clock(clocks: list[int], finished: set[int], rank: int, bounded: bool) -> int:
    """The clock a (re)joining worker continues from: its own, or, where the shards
    bound the clock gap, at least the slowest worker still training's, so that no
    one waits for it to catch up."""
    others = [c for r, c in enumerate(clocks) if r not in finished and r != rank]
    own = clocks[rank] if rank < len(clocks) else 0
    return max(own, min(others)) if bounded and others else own


def resized(clocks: list[int], num_workers: int, finished: set[int], bounded: bool) -> list[int]:
    """``clocks`` for a run of ``num_workers`` workers (an elastic restart): ranks
    that remain keep theirs, new ranks join as :func:`rejoin_clock` says."""
    out = list(clocks[:num_workers]) + [0] * max(0, num_workers - len(clocks))
    for rank in range(len(clocks), num_workers):
        out[rank] = rejoin_clock(out[: len(clocks)], finished, rank, bounded) if clocks else 0
    return out
