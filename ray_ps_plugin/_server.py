"""The server shard: one Ray actor per shard, the single owner of its chunks' state.

Synchronous mode (BytePS's "summation server"): every worker pushes its chunk
``key`` of step ``step``; the shard sums the pushes into one accumulator and, once
all workers have pushed, answers every one of them with the sum. Workers divide by
the world size *before* pushing, exactly as DDP's default hook does before its
all-reduce, so the result is bit-for-bit DDP's arithmetic for two workers.

The actor is an asyncio actor: all coroutines run on one event loop thread, so
updates are serial without locks (Ray's actor-based parameter-server pattern), while
thousands of pushes may wait concurrently without holding a thread each.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ray_ps_plugin._codec import Codec
from ray_ps_plugin._metrics import ShardMetrics

logger = logging.getLogger(__name__)

__all__ = ["ShardBase", "ShardServer", "ShardTimeoutError", "ShardProtocolError"]


class ShardTimeoutError(TimeoutError):
    """A shard waited longer than ``PSConfig.ps_timeout_s`` for the other workers."""


class ShardProtocolError(RuntimeError):
    """Workers pushed steps that cannot belong to one synchronous run."""


@dataclass
class _Slot:
    """Accumulator of one chunk for one step."""

    step: int
    acc: np.ndarray
    ranks: set[int] = field(default_factory=set)
    wire: np.ndarray | None = None  # the sum in the wire format, once complete
    done: asyncio.Event = field(default_factory=asyncio.Event)


class ShardBase:
    """What every shard actor has: its identity, the workers it serves, counters.

    Args:
        shard_index: This shard's index, used in error messages.
        num_workers: Number of workers pushing to it.
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

    def ready(self) -> dict[str, Any]:
        """Answers once the actor is up; tells where it runs; starts its metrics."""
        import ray

        try:
            self._metrics = ShardMetrics(self.shard_index)
        except Exception:  # noqa: BLE001 - metrics are optional, training is not
            logger.debug("shard %d: no metrics", self.shard_index, exc_info=True)
        return {"shard": self.shard_index, "node_id": ray.get_runtime_context().get_node_id()}

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


class ShardServer(ShardBase):
    """Sums one shard's gradient chunks across workers (sync mode).

    Wrapped with ``ray.remote`` by the backend; kept a plain class so unit tests can
    drive it directly on an event loop.

    Args:
        shard_index: This shard's index, used in error messages.
        num_workers: Number of workers whose pushes make up one step.
        timeout_s: How long a push waits for the other workers before it fails.
    """

    def __init__(
        self,
        shard_index: int,
        num_workers: int,
        timeout_s: float,
        compression: str | None = None,
    ) -> None:
        super().__init__(shard_index, num_workers, timeout_s)
        self._codec = Codec(compression)
        # Two slots per chunk, by step parity. A worker can push step s+2 only after
        # every worker pushed s+1, i.e. after every worker has received step s's sum,
        # so the slot of step s is free again by then and never reallocated.
        self._slots: dict[tuple[int, int], _Slot] = {}

    async def push_pull(self, step: int, key: int, rank: int, grad: np.ndarray) -> np.ndarray:
        """Adds one worker's chunk and returns the sum once all workers pushed it.

        A second push of the same (step, key) by the same rank — a retried or
        duplicated message — is not added again; it just receives the sum.

        Args:
            step: The worker's synchronisation round, counted from 1.
            key: The chunk's byte offset in the gradient stream.
            rank: The pushing worker's world rank.
            grad: The chunk, already divided by the world size.

        Returns:
            The sum of all workers' chunks for this step.

        Raises:
            ShardTimeoutError: If the other workers do not push within the timeout.
            ShardProtocolError: If the step does not follow the chunk's current step.
        """
        with self._queued():
            return await self._push_pull(step, key, rank, grad)

    async def _push_pull(self, step: int, key: int, rank: int, grad: np.ndarray) -> np.ndarray:
        wire_bytes = grad.nbytes
        grad = self._codec.decode_np(grad)  # fp32 accumulation whatever the wire
        slot = self._slot_for(step, key, grad)
        if rank in slot.ranks:
            self._duplicates += 1
        else:
            if slot.ranks:
                np.add(slot.acc, grad, out=slot.acc)
            else:
                np.copyto(slot.acc, grad)
            slot.ranks.add(rank)
            self._pushes += 1
            self._bytes_in += wire_bytes
            if len(slot.ranks) == self.num_workers:
                slot.done.set()
        if not slot.done.is_set():
            try:
                await asyncio.wait_for(slot.done.wait(), self.timeout_s)
            except asyncio.TimeoutError:
                missing = sorted(set(range(self.num_workers)) - slot.ranks)
                raise ShardTimeoutError(
                    f"shard {self.shard_index}: step {step}, chunk at byte {key} waited "
                    f"{self.timeout_s:g}s for workers {missing}; a worker is stuck, dead "
                    "or its model differs. Raise PSConfig.ps_timeout_s if steps are slow."
                ) from None
        if not self._codec.active:
            self._bytes_out += slot.acc.nbytes
            return slot.acc
        if slot.wire is None:
            slot.wire = self._codec.encode_np(slot.acc)  # once per chunk and step
        self._bytes_out += slot.wire.nbytes
        return slot.wire

    def _slot_for(self, step: int, key: int, grad: np.ndarray) -> _Slot:
        slot = self._slots.get((key, step % 2))
        if slot is not None and slot.step == step:
            if slot.acc.shape != grad.shape or slot.acc.dtype != grad.dtype:
                raise ShardProtocolError(
                    f"shard {self.shard_index}: step {step}, chunk at byte {key} got "
                    f"{grad.dtype}{list(grad.shape)} after {slot.acc.dtype}"
                    f"{list(slot.acc.shape)}; the workers' models differ."
                )
            return slot
        if slot is not None and slot.step > step:
            raise ShardProtocolError(
                f"shard {self.shard_index}: a push for step {step} arrived after step "
                f"{slot.step} of chunk at byte {key}; the workers are out of step."
            )
        if slot is not None and not slot.done.is_set():
            raise ShardProtocolError(
                f"shard {self.shard_index}: step {step} of chunk at byte {key} started "
                f"while step {slot.step} still waits for workers "
                f"{sorted(set(range(self.num_workers)) - slot.ranks)}."
            )
        if slot is not None and slot.acc.shape == grad.shape and slot.acc.dtype == grad.dtype:
            acc = slot.acc  # reuse the buffer: no allocation in the steady state
        else:
            acc = np.empty_like(grad)
        slot = _Slot(step=step, acc=acc)
        self._slots[(key, step % 2)] = slot
        return slot
