"""The async/ssp shard: it owns a slice of the parameters and applies updates serially.

The shard *owns* its slice of each prepared model's trainable parameters (a
contiguous range of the flattened parameter vector) and is the only place they are
updated: one asyncio event loop applies the workers' updates one at a time (Ray's
actor-based parameter-server pattern). Every worker pushes the change its own
optimizer made to its copy during one step (its *delta*) and gets the shard's
current parameters back in the same call.

Clocks (Petuum SSP): a worker's clock is the number of updates it has pushed. Each
push carries the clock it completes, so the shard applies an update once however
often it is delivered. With a staleness bound ``s`` a push completing clock ``c``
is answered only once every worker has reached clock ``c - s``: the parameters the
worker then trains on already contain every update of clock ``<= c - s`` from
everybody. ``s = 0`` is bulk-synchronous; no bound (``"async"``) never waits.
A held-back read is answered in the event-loop turn of the update that lets it
through, before a later one lands: with ``s = 0`` a worker at clock ``c`` trains on
exactly clock ``c``'s parameters, as DDP does.

Master parameters are kept in the model's dtype, widened to fp32 for 16-bit models
(fp16 and bf16), so small updates are not lost to 16-bit rounding: each worker's
delta is added to the fp32 master, and workers receive it rounded to their dtype.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import torch

from ray_ps_plugin._codec import Codec, as_torch
from ray_ps_plugin._dtypes import model_dtype, storage
from ray_ps_plugin._errors import ShardProtocolError, ShardTimeoutError
from ray_ps_plugin._param.replica import ReplayOrder, ReplicaLink, Replicated
from ray_ps_plugin._param.replica_slots import SlotRef, lane_update
from ray_ps_plugin._param.reply import Reply
from ray_ps_plugin._param.reseed import Reseeding
from ray_ps_plugin._param.state import ParamState, Waiting, export_models, import_model
from ray_ps_plugin._shard import resized
from ray_ps_plugin._shm import Segment, SegmentHandle
from ray_ps_plugin._tables.host import TableHost
from ray_ps_plugin._types import Compression
from ray_ps_plugin._wire.frames import PARAM_LOCAL, REPLAY, Frame

__all__ = ["ParamShard", "Reply"]


class ParamShard(TableHost, Replicated, Reseeding):
    """Owns one slice of each model's parameters; applies the workers' updates serially.

    Args:
        shard_index: This shard's index, used in error messages.
        num_workers: Number of workers pushing updates.
        staleness: Largest clock gap a read may have (``"ssp"``), or ``None`` for no
            bound (``"async"``).
        timeout_s: How long a read waits for slow workers, and a push for the
            initial parameters, before it fails.
        compression: The encoding of deltas and parameters through the object store.
    """

    def __init__(
        self,
        shard_index: int,
        num_workers: int,
        staleness: int | None,
        timeout_s: float,
        compression: Compression | None = None,
    ) -> None:
        super().__init__(shard_index, num_workers, timeout_s)
        self._codec = Codec(compression)
        self.staleness = staleness
        self._models: dict[int, ParamState] = {}
        self._changed = asyncio.Condition()  # a reseed's generation (wait_generation)
        self._max_read_gap = 0
        self._link = ReplicaLink(shard_index, timeout_s, num_workers)
        self._order = ReplayOrder(shard_index, timeout_s)

    def _model(self, model: int) -> ParamState:
        state = self._models.get(model)
        if state is None:
            state = self._models[model] = ParamState(self.num_workers)
        return state

    def attach(
        self, model: int, rank: int, inputs: SegmentHandle, lo: int, nbytes: int
    ) -> tuple[SegmentHandle, SegmentHandle]:
        """Connects a worker of this node through shared memory, for one model.

        From then on the worker writes its deltas into ``inputs`` and calls
        :meth:`push_local` / :meth:`pull_local` naming the output segment (``slot``)
        the shard writes its parameters into. The worker chooses the slot so that a
        reply it has not read yet is never overwritten.

        Returns:
            The handles of the worker's two output segments.
        """
        self._check(model, rank)
        outputs = (Segment.create(nbytes), Segment.create(nbytes))
        self._model(model).lanes[rank] = (Segment.open(inputs), outputs)
        self._link.map_inputs(inputs)  # the replica may read updates there
        return outputs[0].handle, outputs[1].handle

    async def init(self, model: int, params: np.ndarray, clock: int = 0) -> bool:
        """Adopts initial parameters (from rank 0, after DDP's broadcast).

        Only the first call counts, so a retried init is harmless.

        Args:
            model: The prepared model's id.
            params: This shard's slice of the flattened parameters, model dtype
                (bfloat16 as ``int16`` patterns).
            clock: The clock every worker starts from.

        Returns:
            True if these parameters were adopted, False if the shard had some.
        """
        dtype = model_dtype(params)
        self._check(model, 0, dtype)
        state = self._model(model)
        if state.params is not None:
            return False
        wide = torch.float32 if params.dtype.itemsize < 4 else getattr(torch, dtype)
        state.params = as_torch(params).to(wide, copy=True)
        state.dtype = dtype
        state.clocks = [clock] * self.num_workers
        self._bytes_in += params.nbytes
        state.initialised.set()
        self._link.forward("init", model, params, clock)
        await self._link.confirm()
        return True

    async def _on_frame(self, frame: Frame, payload: np.ndarray) -> np.ndarray:
        """A worker's notice on the direct path that its update of clock ``step``
        lies in shared memory (else a table's frame)."""
        if frame.kind == REPLAY:
            return await self.replay_frame(frame, payload)
        if frame.kind != PARAM_LOCAL:
            return await super()._on_frame(frame, payload)
        (slot,) = payload.view("<i8").tolist()
        reply = await self.push_local(frame.model, frame.source, frame.step, slot)
        return reply.packed()

    async def push_local(self, model: int, rank: int, clock: int, slot: int) -> Reply:
        """:meth:`push_pull` for a worker attached through shared memory."""
        self._check(model, rank)
        state = self._model(model)
        with self._queued():
            params = await self._wait_initialised(state, model, rank)
            inputs = self._lane(state, model, rank)[0]
            found = lane_update(inputs, clock, storage(state.dtype), params.numel())
            if found is None:
                raise ShardProtocolError(
                    f"shard {self.shard_index}: model {model}: rank {rank} attached a "
                    f"{inputs.handle.nbytes}-byte slice for {params.numel()} parameters "
                    f"of {state.dtype}; the workers' models differ."
                )
            delta, ref = found
            return await self._push_pull(state, model, rank, clock, delta, delta.nbytes, slot, ref)

    async def pull_local(self, model: int, rank: int, clock: int, slot: int) -> Reply:
        """:meth:`pull` for a worker attached through shared memory."""
        self._check(model, rank)
        state = self._model(model)
        with self._queued():
            await self._wait_initialised(state, model, rank)
            return await self._read(state, model, rank, clock, slot)

    async def push_pull(self, model: int, rank: int, clock: int, delta: np.ndarray) -> Reply:
        """Applies one worker's update and returns the parameters it may train on.

        Args:
            model: The prepared model's id.
            rank: The pushing worker.
            clock: The clock this update completes (the worker's update count).
            delta: The change the worker's optimizer made to this slice in one step,
                in the codec's encoding.

        Returns:
            A copy of this shard's parameters, every worker's clock at the time and
            the slowest unfinished worker's clock (all its updates are included).

        Raises:
            ShardTimeoutError: No initial parameters, or (ssp) the slow workers do
                not catch up, within the timeout.
            ShardProtocolError: An update is missing (clock jumps) or the slice's
                size differs from the shard's (the workers' models differ).
        """
        self._check(model, rank)
        state = self._model(model)
        with self._queued():
            params = await self._wait_initialised(state, model, rank)
            values = self._codec.decode(delta, params.dtype)
            return await self._push_pull(state, model, rank, clock, values, delta.nbytes)

    async def pull(self, model: int, rank: int, clock: int) -> Reply:
        """Returns the parameters without pushing (same staleness rule as a push)."""
        self._check(model, rank)
        state = self._model(model)
        with self._queued():
            await self._wait_initialised(state, model, rank)
            return await self._read(state, model, rank, clock)

    async def finish(self, model: int, rank: int) -> None:
        """Marks a worker whose loop ended: the others stop waiting for it."""
        self._check(model, rank)
        state = self._model(model)
        state.finished.add(rank)
        self._link.forward("finish", model, rank)
        self._serve_waiting(model, state)
        await self._link.confirm()

    # --- membership: a worker lost, replaced, or a whole group restarted ------------
    async def leave(self, rank: int) -> None:
        """A worker is gone (its process died): no model or table waits for it. What
        it had in flight was applied or not; a push is applied whole or not at all."""
        self._check(0, rank)
        self._link.forward("leave", rank)
        for model in list(self._models):
            await self.finish(model, rank)
        await self._tables.leave(rank)

    async def admit(self, rank: int) -> None:
        """A worker replaces one that left. It goes on from the clock the one it
        replaces stopped at (it reads that clock with its first pull), so no step
        of its data is done twice or skipped. Where the shards bound the clock gap
        (ssp) the others ran ahead meanwhile: it holds no one back until it is
        within the bound again."""
        self._check(0, rank)
        self._link.forward("admit", rank)
        for model, state in self._models.items():
            state.finished.discard(rank)
            if self.staleness is not None:
                state.free.add(rank)
                self._catch_up(state, rank)
                self._serve_waiting(model, state)
        self._tables.admit(rank)
        await self._link.confirm()

    def _catch_up(self, state: ParamState, rank: int) -> None:
        """A free rank within the bound of the others again waits and is waited for."""
        if rank in state.free and state.clocks[rank] >= state.slowest() - (self.staleness or 0):
            state.free.discard(rank)

    def export_state(self) -> dict[str, Any]:
        """Everything a run's later shards need to go on where these stopped: each
        model's parameters, dtype, clocks and reseed generation, and the tables."""
        return {"models": export_models(self._models), "tables": self._tables.export()}

    def import_state(self, exported: dict[str, Any]) -> None:
        """Takes what a shard of an earlier worker group exported (the same slice of
        every model), for this group's workers (their number may differ)."""
        bounded = self.staleness is not None
        for model, m in exported["models"].items():
            import_model(
                self._model(model), m, resized(m["clocks"], self.num_workers, set(), bounded)
            )
        self._tables.import_(exported["tables"], bounded)

    async def restore(self, exported: dict[str, Any]) -> None:
        """Takes a live primary's snapshot (a new replica's first change): as
        :meth:`import_state`, keeping which workers finished or catch up."""
        self.import_state(exported)
        for model, m in exported["models"].items():
            self._model(model).finished = set(m["finished"])
            self._model(model).free = set(m.get("free", ()))

    async def _push_pull(
        self,
        state: ParamState,
        model: int,
        rank: int,
        clock: int,
        delta: np.ndarray | torch.Tensor,
        nbytes: int,
        slot: int | None = None,
        shared: SlotRef | None = None,
    ) -> Reply:
        before = self._link.latest((model, rank))
        self._take(state, model, rank, clock, delta, nbytes, shared)
        # Confirmed one push late (see _param/replica.py): the replica holds this
        # worker's previous update; this one the worker keeps until the next answer.
        await self._link.confirm(through=before)
        return await self._read(state, model, rank, clock, slot)

    async def mirror(self, model: int, rank: int, clock: int, update: np.ndarray) -> None:
        """Takes an update its primary applied (a replica's :meth:`replay`), or one
        a worker sends again to the replica that took over (a repeat is ignored)."""
        state = self._model(model)
        await self._wait_initialised(state, model, rank)
        self._take(state, model, rank, clock, update, update.nbytes)

    def _take(
        self,
        state: ParamState,
        model: int,
        rank: int,
        clock: int,
        delta: np.ndarray | torch.Tensor,
        nbytes: int,
        shared: SlotRef | None = None,
    ) -> None:
        """Applies ``rank``'s update of ``clock`` once (a repeat is counted, not
        applied) and forwards it to the replica (``shared``: where it lies).

        Raises:
            ShardProtocolError: Updates before ``clock`` are missing, or the update
                does not fit the slice.
        """
        assert state.params is not None
        last = state.clocks[rank]
        if clock <= last:
            self._duplicates += 1  # a retried or duplicated delivery
            return
        if clock != last + 1:
            raise ShardProtocolError(
                f"shard {self.shard_index}: model {model}: rank {rank} pushed the update "
                f"of clock {clock} after clock {last}; updates {last + 1}..{clock - 1} "
                "are missing."
            )
        update = as_torch(delta) if isinstance(delta, np.ndarray) else delta
        self._check_slice(model, f"rank {rank}", update, state.params)
        state.clocks[rank] = clock
        self._apply(model, state, rank, update)
        # Forwarded before any await: the replica replays in this order.
        self._link.forward_update(model, rank, clock, update.to(state.params.dtype), shared)
        self._catch_up(state, rank)
        self._serve_waiting(model, state)
        self._pushes += 1
        self._bytes_in += nbytes

    def _check_slice(
        self, model: int, sender: str, update: torch.Tensor, params: torch.Tensor
    ) -> None:
        """Raises ``ShardProtocolError`` unless ``update`` has the slice's shape."""
        if update.shape != params.shape:
            raise ShardProtocolError(
                f"shard {self.shard_index}: model {model}: {sender} pushed "
                f"{list(update.shape)} elements for a slice of {list(params.shape)}; "
                "the workers' models differ."
            )

    def _apply(self, model: int, state: ParamState, rank: int, update: torch.Tensor) -> None:
        """Applies one update of ``rank`` (its clock is already counted)."""
        assert state.params is not None
        # Each worker contributes 1/W of its step: W updates, one from each worker,
        # move the parameters as far as one DDP step (mean of steps), so learning
        # rates tuned for DDP carry over.
        state.params.add_(update.to(state.params.dtype), alpha=1.0 / self.num_workers)

    async def _wait_initialised(self, state: ParamState, model: int, rank: int) -> torch.Tensor:
        if not state.initialised.is_set():
            try:
                await asyncio.wait_for(state.initialised.wait(), self.timeout_s)
            except asyncio.TimeoutError:
                raise ShardTimeoutError(
                    f"shard {self.shard_index}: model {model}: rank {rank} waited "
                    f"{self.timeout_s:g}s for rank 0's initial parameters; rank 0 is "
                    "stuck or dead, or prepared its models in another order."
                ) from None
        assert state.params is not None
        return state.params

    def _lane(
        self, state: ParamState, model: int, rank: int
    ) -> tuple[Segment, tuple[Segment, Segment]]:
        lane = state.lanes.get(rank)
        if lane is None:
            raise ShardProtocolError(
                f"shard {self.shard_index}: model {model}: rank {rank} used shared "
                "memory without attaching first."
            )
        return lane

    async def _read(
        self, state: ParamState, model: int, rank: int, clock: int, slot: int | None = None
    ) -> Reply:
        if self.staleness is not None and rank not in state.free:
            need = clock - self.staleness
            if state.slowest() < need:
                waiting = Waiting(
                    rank, clock, need, slot, asyncio.get_running_loop().create_future()
                )
                state.waiting.append(waiting)
                try:
                    return await asyncio.wait_for(waiting.answer, self.timeout_s)
                except asyncio.TimeoutError:
                    state.waiting = [w for w in state.waiting if w is not waiting]
                    behind = {
                        r: c
                        for r, c in enumerate(state.clocks)
                        if c < need and r not in state.finished
                    }
                    raise ShardTimeoutError(
                        f"shard {self.shard_index}: model {model}: rank {rank} at clock "
                        f"{clock} waited {self.timeout_s:g}s for workers {sorted(behind)} "
                        f"(clocks {behind}) to reach clock {need} (staleness bound "
                        f"{self.staleness}); a worker is stuck or dead. Raise "
                        "PSConfig.staleness or ps_timeout_s if it is only slow."
                    ) from None
        return self._answer(state, model, rank, clock, slot)

    def _serve_waiting(self, model: int, state: ParamState) -> None:
        """Answers the held-back reads the clocks, just changed, let through."""
        for w in state.let_through():
            if w.answer.done():  # its wait timed out in this same turn
                continue
            try:
                w.answer.set_result(self._answer(state, model, w.rank, w.clock, w.slot))
            except Exception as e:  # the reader's error, not the pusher's
                w.answer.set_exception(e)

    def _answer(
        self, state: ParamState, model: int, rank: int, clock: int, slot: int | None
    ) -> Reply:
        """The parameters as they are now, for a read of ``rank`` at ``clock``."""
        assert state.params is not None
        slowest = state.slowest()
        self._max_read_gap = max(self._max_read_gap, clock - slowest)
        self.record_read(rank, clock, slowest)
        if slot is not None:
            outputs = self._lane(state, model, rank)[1]
            held = outputs[slot].view(0, storage(state.dtype), state.params.numel())
            as_torch(held).copy_(state.params)  # rounded to the model's dtype by torch
            self._bytes_out += held.nbytes
            return Reply(None, tuple(state.clocks), slowest)
        # A fresh array: later updates must not change a reply Ray has not sent yet.
        out = self._codec.encode_np(state.params.numpy(), state.dtype)
        self._bytes_out += out.nbytes
        return Reply(out, tuple(state.clocks), slowest)

    def record_read(self, rank: int, clock: int, slowest: int) -> None:
        """Called on every answered read; tests override it to log reads."""

    def stats(self) -> dict[str, Any]:
        """Counters since start, every model's clocks, and the largest gap read."""
        return {
            **super().stats(),
            "clocks": {m: list(s.clocks) for m, s in self._models.items()},
            "max_read_gap": self._max_read_gap,
        }
