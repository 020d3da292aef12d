"""The parameter shard of the asynchronous and bounded-staleness modes.

Here the shard *owns* its slice of the model's trainable parameters (a contiguous
range of the flattened parameter vector) and is the only place they are updated:
one asyncio event loop applies the workers' updates one at a time (Ray's
actor-based parameter-server pattern). Every worker pushes the change its own
optimizer made to its copy during one step (its *delta*) and gets the shard's
current parameters back in the same call.

Clocks (Petuum SSP): a worker's clock is the number of updates it has pushed. Each
push carries the clock it completes, so the shard applies an update once however
often it is delivered. With a staleness bound ``s`` a push completing clock ``c``
is answered only once every worker has reached clock ``c - s``: the parameters the
worker then trains on already contain every update of clock ``<= c - s`` from
everybody. ``s = 0`` is bulk-synchronous; no bound (``"async"``) never waits.
"""

from __future__ import annotations

import asyncio
import collections
import warnings
from typing import Any

import numpy as np
import torch

from ray_ps_plugin._codec import Codec
from ray_ps_plugin._server import ShardBase, ShardProtocolError, ShardTimeoutError
from ray_ps_plugin._shm import Segment, SegmentHandle

__all__ = ["ParamShardServer", "Read", "Reply"]

# One read per worker step is logged for the staleness checks; bounded so a long
# run does not grow the actor without limit.
_READ_LOG_LIMIT = 100_000

Read = tuple[int, int, int]
"""(rank, clock of the reader, slowest worker's clock included in what it read)."""

Reply = tuple[np.ndarray | None, tuple[int, ...], int]
"""(parameter slice, every worker's clock, slowest unfinished worker's clock).

The slice is ``None`` when it was written to the worker's shared memory instead."""


class ParamShardServer(ShardBase):
    """Owns one slice of the parameters; applies the workers' updates serially.

    Wrapped with ``ray.remote`` by the backend; kept a plain class so unit tests can
    drive it on an event loop.

    Args:
        shard_index: This shard's index, used in error messages.
        num_workers: Number of workers pushing updates.
        staleness: Largest clock gap a read may have (``"ssp"``), or ``None`` for no
            bound (``"async"``).
        timeout_s: How long a read waits for slow workers, and a push for the
            initial parameters, before it fails.
    """

    def __init__(
        self,
        shard_index: int,
        num_workers: int,
        staleness: int | None,
        timeout_s: float,
        compression: str | None = None,
    ) -> None:
        super().__init__(shard_index, num_workers, timeout_s)
        self._codec = Codec(compression)
        self.staleness = staleness
        self._params: torch.Tensor | None = None
        self._clocks = [0] * num_workers
        # A worker that finished its loop no longer holds the others back.
        self._finished: set[int] = set()
        self._initialised = asyncio.Event()
        self._changed = asyncio.Condition()
        self._reads: collections.deque[Read] = collections.deque(maxlen=_READ_LOG_LIMIT)
        # Workers of this node attached through shared memory (see attach).
        self._lanes: dict[int, tuple[Segment, tuple[Segment, ...]]] = {}

    def attach(self, rank: int, inputs: SegmentHandle, outputs: tuple[SegmentHandle, ...]) -> None:
        """Connects a worker of this node through shared memory.

        From then on the worker writes its deltas into ``inputs`` and calls
        :meth:`push_local` / :meth:`pull_local` naming the output segment
        (``slot``) the shard writes its parameters into. The worker chooses the
        slot so that a reply it has not read yet is never overwritten.
        """
        self._lanes[rank] = (Segment.open(inputs), tuple(Segment.open(h) for h in outputs))

    async def push_local(self, rank: int, clock: int, slot: int) -> Reply:
        """:meth:`push_pull` for a worker attached through shared memory."""
        with self._queued():
            params = await self._wait_initialised(rank)
            inputs, _ = self._lanes[rank]
            if inputs.handle.nbytes != params.numel() * params.element_size():
                raise ShardProtocolError(
                    f"shard {self.shard_index}: rank {rank} attached a "
                    f"{inputs.handle.nbytes}-byte slice for "
                    f"{params.numel() * params.element_size()} bytes of parameters; the "
                    "workers' models differ."
                )
            delta = inputs.view(0, params.numpy().dtype, params.numel())
            return await self._push_pull(rank, clock, delta, wire=False, slot=slot)

    async def pull_local(self, rank: int, clock: int, slot: int) -> Reply:
        """:meth:`pull` for a worker attached through shared memory."""
        with self._queued():
            await self._wait_initialised(rank)
            return await self._read(rank, clock, slot)

    async def init(self, params: np.ndarray, clock: int = 0) -> bool:
        """Adopts initial parameters (from rank 0, after DDP's broadcast).

        Only the first call counts, so a retried init is harmless.

        Args:
            params: This shard's slice of the flattened parameters.
            clock: The clock every worker starts from.

        Returns:
            True if these parameters were adopted, False if the shard had some.
        """
        if self._params is not None:
            return False
        self._params = torch.tensor(params)  # own, writable copy
        self._clocks = [clock] * self.num_workers
        self._bytes_in += params.nbytes
        self._initialised.set()
        return True

    async def push_pull(
        self, rank: int, clock: int, delta: np.ndarray
    ) -> Reply:
        """Applies one worker's update and returns the parameters it may train on.

        Args:
            rank: The pushing worker.
            clock: The clock this update completes (the worker's update count).
            delta: The change the worker's optimizer made to this slice in one step.

        Returns:
            A copy of this shard's parameters, every worker's clock at the time and
            the slowest unfinished worker's clock (all its updates are included).

        Raises:
            ShardTimeoutError: No initial parameters, or (ssp) the slow workers do
                not catch up, within the timeout.
            ShardProtocolError: An update is missing (clock jumps) or the slice's
                size differs from the shard's (the workers' models differ).
        """
        with self._queued():
            return await self._push_pull(rank, clock, delta, wire=True)

    async def _push_pull(
        self, rank: int, clock: int, delta: np.ndarray, wire: bool, slot: int | None = None
    ) -> Reply:
        params = await self._wait_initialised(rank)
        wire_bytes = delta.nbytes
        if wire:
            delta = self._codec.decode_np(delta)  # fp32 master parameters
        last = self._clocks[rank]
        if clock <= last:
            self._duplicates += 1  # a retried or duplicated delivery
        elif clock == last + 1:
            if delta.shape != tuple(params.shape) or delta.dtype != params.numpy().dtype:
                raise ShardProtocolError(
                    f"shard {self.shard_index}: rank {rank} pushed "
                    f"{delta.dtype}{list(delta.shape)} for a slice of "
                    f"{params.dtype}{list(params.shape)}; the workers' models differ."
                )
            with warnings.catch_warnings():
                # Ray hands arrays over read-only and zero-copy; they are only read.
                warnings.simplefilter("ignore", UserWarning)
                update = torch.from_numpy(delta)
            # Each worker contributes 1/W of its step: W updates, one from each
            # worker, move the parameters as far as one DDP step (mean of steps),
            # so learning rates tuned for DDP carry over.
            params.add_(update, alpha=1.0 / self.num_workers)
            self._clocks[rank] = clock
            self._pushes += 1
            self._bytes_in += wire_bytes
            async with self._changed:
                self._changed.notify_all()
        else:
            raise ShardProtocolError(
                f"shard {self.shard_index}: rank {rank} pushed the update of clock "
                f"{clock} after clock {last}; updates {last + 1}..{clock - 1} are missing."
            )
        return await self._read(rank, clock, slot)

    async def pull(self, rank: int, clock: int) -> Reply:
        """Returns the parameters without pushing (same staleness rule as a push).

        Args:
            rank: The reading worker.
            clock: The reader's current clock.
        """
        with self._queued():
            await self._wait_initialised(rank)
            return await self._read(rank, clock)

    async def finish(self, rank: int) -> None:
        """Marks a worker whose loop ended: the others stop waiting for it."""
        self._finished.add(rank)
        async with self._changed:
            self._changed.notify_all()

    async def _wait_initialised(self, rank: int) -> torch.Tensor:
        if not self._initialised.is_set():
            try:
                await asyncio.wait_for(self._initialised.wait(), self.timeout_s)
            except asyncio.TimeoutError:
                raise ShardTimeoutError(
                    f"shard {self.shard_index}: rank {rank} waited {self.timeout_s:g}s "
                    "for rank 0's initial parameters; rank 0 is stuck or dead."
                ) from None
        assert self._params is not None
        return self._params

    def _slowest(self) -> int:
        active = [c for r, c in enumerate(self._clocks) if r not in self._finished]
        return min(active) if active else max(self._clocks)

    async def _read(self, rank: int, clock: int, slot: int | None = None) -> Reply:
        if self.staleness is not None:
            need = clock - self.staleness
            if self._slowest() < need:
                try:
                    async with self._changed:
                        await asyncio.wait_for(
                            self._changed.wait_for(lambda: self._slowest() >= need),
                            self.timeout_s,
                        )
                except asyncio.TimeoutError:
                    behind = {
                        r: c
                        for r, c in enumerate(self._clocks)
                        if c < need and r not in self._finished
                    }
                    raise ShardTimeoutError(
                        f"shard {self.shard_index}: rank {rank} at clock {clock} waited "
                        f"{self.timeout_s:g}s for workers {sorted(behind)} (clocks "
                        f"{behind}) to reach clock {need} (staleness bound "
                        f"{self.staleness}); a worker is stuck or dead. Raise "
                        "PSConfig.staleness or ps_timeout_s if it is only slow."
                    ) from None
        assert self._params is not None
        slowest = self._slowest()
        self._reads.append((rank, clock, slowest))
        if slot is not None:
            _, outputs = self._lanes[rank]
            values = self._params.numpy()
            np.copyto(outputs[slot].view(0, values.dtype, values.size), values)
            self._bytes_out += values.nbytes
            return None, tuple(self._clocks), slowest
        # A fresh array: later updates must not change a reply Ray has not sent yet.
        out = self._codec.encode_np(self._params.numpy())
        self._bytes_out += out.nbytes
        return out, tuple(self._clocks), slowest

    def reads(self) -> list[Read]:
        """Every logged read: (rank, reader's clock, slowest clock included)."""
        return list(self._reads)

    def stats(self) -> dict[str, Any]:
        """Counters since start, the clocks, and the largest clock gap read."""
        gaps = [c - m for _, c, m in self._reads]
        return {
            **super().stats(),
            "clocks": list(self._clocks),
            "max_read_gap": max(gaps, default=0),
        }
