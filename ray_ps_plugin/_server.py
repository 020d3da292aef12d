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
from ray_ps_plugin._shm import Segment, SegmentHandle

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
    shared: bool = False  # whether ``acc`` lies in the shard's output segment
    wired: bool = False  # whether some worker pushed (and so pulls) through the wire
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
        # Shared memory with colocated workers (see attach): one input segment per
        # worker, and the sums in two output segments, by step parity as the slots.
        self._inputs: dict[int, Segment] = {}
        self._outputs: list[Segment] = []
        self._lo = 0  # stream byte at which this shard's segments start

    def attach(
        self, rank: int, inputs: SegmentHandle, lo: int, nbytes: int
    ) -> tuple[SegmentHandle, ...]:
        """Connects a worker of this node through shared memory.

        From then on the worker writes its chunks into its ``inputs`` segment and
        calls :meth:`push_local` with only the chunk's coordinates; it reads the sum
        from the returned output segments (byte ``key - lo`` of segment
        ``step % 2``).

        Args:
            rank: The worker's world rank.
            inputs: The worker's segment for this shard's range of the stream.
            lo: Stream byte at which the segments start.
            nbytes: Size of this shard's segments.

        Returns:
            Handles of the two output segments (even steps, odd steps).

        Raises:
            ShardProtocolError: If workers describe the shard's range differently.
        """
        if not self._outputs:
            self._lo = lo
            self._outputs = [Segment.create(nbytes), Segment.create(nbytes)]
        elif (lo, nbytes) != (self._lo, self._outputs[0].handle.nbytes):
            raise ShardProtocolError(
                f"shard {self.shard_index}: rank {rank} describes the shard's range as "
                f"{nbytes} bytes at {lo}, others as {self._outputs[0].handle.nbytes} at "
                f"{self._lo}; the workers' models differ."
            )
        self._inputs[rank] = Segment.open(inputs)
        return tuple(s.handle for s in self._outputs)

    async def push_local(self, step: int, key: int, rank: int, dtype: str, numel: int) -> None:
        """Like :meth:`push_pull` for a worker attached through shared memory.

        The chunk is read from the worker's input segment; the sum is left in the
        output segment of ``step % 2``; the reply carries no data.
        """
        grad = self._inputs[rank].view(key - self._lo, dtype, numel)
        with self._queued():
            await self._push_pull(step, key, rank, grad, wire=False)

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
            out = await self._push_pull(step, key, rank, grad, wire=True)
        assert out is not None  # a push by wire is answered by wire
        return out

    async def _push_pull(
        self, step: int, key: int, rank: int, grad: np.ndarray, wire: bool
    ) -> np.ndarray | None:
        wire_bytes = grad.nbytes
        if wire:
            grad = self._codec.decode_np(grad)  # fp32 accumulation whatever the wire
        slot = self._slot_for(step, key, grad)
        slot.wired = slot.wired or wire
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
                self._complete(slot, key)
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
        if not wire or not self._codec.active:
            self._bytes_out += slot.acc.nbytes
            return slot.acc if wire else None  # shared memory: the worker reads it there
        assert slot.wire is not None  # set by _complete: this push came by wire
        self._bytes_out += slot.wire.nbytes
        return slot.wire

    def _complete(self, slot: _Slot, key: int) -> None:
        """Makes the finished sum readable by every worker, then releases them."""
        if self._outputs and not slot.shared:
            # The slot began before a worker attached (only possible in step 1).
            out = self._output_view(slot.step, key, slot.acc)
            np.copyto(out, slot.acc)
            slot.acc, slot.shared = out, True
        if self._codec.active and slot.wired:
            # Some workers receive the sum on the wire: round it once, in place, so a
            # worker reading shared memory gets exactly the values they decode. (When
            # every worker shares memory, nothing is encoded and nothing rounded.)
            slot.wire = self._codec.encode_np(slot.acc)
            np.copyto(slot.acc, self._codec.decode_np(slot.wire))
        slot.done.set()

    def _output_view(self, step: int, key: int, like: np.ndarray) -> np.ndarray:
        return self._outputs[step % 2].view(key - self._lo, like.dtype, like.size)

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
        shared = bool(self._outputs)
        if shared:
            acc = self._output_view(step, key, grad)
        elif slot is not None and slot.acc.shape == grad.shape and slot.acc.dtype == grad.dtype:
            acc = slot.acc  # reuse the buffer: no allocation in the steady state
        else:
            acc = np.empty_like(grad)
        slot = _Slot(step=step, acc=acc, shared=shared)
        self._slots[(key, step % 2)] = slot
        return slot
