"""The async/ssp worker client: keeps one model in step with the parameter shards.

One step of a worker, top to bottom:

1. ``model(x)`` trains on the parameters the client last installed. In ``"ssp"``
   the first forward pass after a step blocks if they are too stale and installs the
   newest reply; ``"async"`` never blocks here. Later forward passes of the same
   step never change the parameters under autograd's feet.
2. ``loss.backward()`` and ``optimizer.step()`` run locally, unchanged: the user's
   optimizer (momentum, Adam state, learning-rate schedule) steps the worker's copy.
3. Right after ``optimizer.step()`` a global optimizer hook takes the difference
   between the parameters and the values the client installed last (the *delta*:
   what the optimizer changed) and sends each shard its slice in one non-blocking
   ``push_pull`` that also brings back the shard's current parameters. A colocated
   shard gets the delta through shared memory and answers in it.
4. In the same hook the worker installs the newest reply it holds (that of its
   previous push) plus ``delta / W``: its own step counts exactly as much as the
   shards count it, so the model is what the shards will hold once this push lands,
   short of what other workers pushed since.

At most one round trip per worker is in flight: the next push first waits for the
previous one (with a timeout), so a fast worker cannot queue unbounded work on the
shards (async's only wait). With replicas, an answered update is kept until the
next answer confirms the replica holds it (:mod:`.replica`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ray_ps_plugin._client import ClientBase, ClientSetup, ModelHook, warn_kept_live
from ray_ps_plugin._codec import Codec, to_numpy
from ray_ps_plugin._nonfinite import all_finite
from ray_ps_plugin._param.flat import FlatParams
from ray_ps_plugin._param.lanes import LaneCalls
from ray_ps_plugin._param.layout import single_dtype, split_bounds
from ray_ps_plugin._param.reply import InFlight, Reply
from ray_ps_plugin._transport import Handle, Lane, Transport, open_lanes

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

logger = logging.getLogger(__name__)

__all__ = ["ParamClient"]


class ParamClient(ClientBase):
    """Keeps one worker's model in step with the parameter shards (async / ssp).

    Args:
        setup: The model, its worker and the run (see :class:`ClientSetup`).
        transport: How calls reach the shards.

    Raises:
        TypeError: If the trainable parameters are not all of one floating dtype.
    """

    def __init__(self, setup: ClientSetup, transport: Transport) -> None:
        # With "raise" the update is checked inside the delta pass (see _advance),
        # not the gradients before the step: one pass over the parameters fewer.
        super().__init__(setup, setup.num_shards, check_local=setup.settings.nan_policy != "raise")
        self._codec = Codec.of(setup.settings)
        self._staleness = setup.staleness
        self._transport = transport
        params = list(setup.params)
        self._bounds = split_bounds(sum(p.numel() for p in params), setup.num_shards)
        itemsize = torch.empty(0, dtype=single_dtype(params)).element_size()
        # Shards of this node are reached through shared memory, slice by slice.
        self._lanes: dict[int, Lane] = open_lanes(
            transport,
            setup.model_id,
            {
                s: (0, (self._bounds[s + 1] - self._bounds[s]) * itemsize)
                for s in setup.local_shards
            },
            setup.rank,
            inputs=2 if setup.settings.shard_replicas else 1,  # kept until the replica has it
        )
        # The parameters as this worker exchanges them (rank 0 seeds the shards now).
        self._flat = FlatParams(
            params, self._bounds, {s: lane.inputs for s, lane in self._lanes.items()}
        )
        self._lane_calls = LaneCalls(
            transport,
            setup.model_id,
            setup.rank,
            lambda s: self._codec.encode(self._flat.delta_parts[s]),
            self._push_by_message,
        )
        # The weight the shards give one worker's delta (see ParamShard._push_pull).
        self._scale = 1.0 / setup.world_size
        # Bytes exchanged with each shard per push or reply: shared memory carries the
        # parameters' dtype, messages the codec's.
        encoded_size = self._codec.encoded_dtype.itemsize if self._codec.active else itemsize
        self._slice_bytes = [
            (b - a) * (itemsize if s in self._lanes else encoded_size)
            for s, (a, b) in enumerate(self._slices())
        ]
        self._clock = 0
        self._stamp = 0  # slowest worker's clock contained in the installed parameters
        self._inflight: InFlight | None = None
        self._installed = True  # whether the in-flight push's reply is in the model
        self._first_forward = True  # no forward yet since the last optimizer step
        self._counted_step = -1
        self._forwards = 0
        self._generation = 0  # checkpoints loaded into the model since prepare_model
        self._gaps_sum = 0
        self._samples = 0
        self._finished = False

    @classmethod
    def build(cls, setup: ClientSetup, transport: Transport) -> ParamClient:
        """The client of one prepared model (the mode table's constructor)."""
        return cls(setup, transport)

    def bind(self, ddp: DistributedDataParallel) -> None:
        """Seeds the shards and hooks the model's checkpoints to them.

        ``state_dict()`` first pulls the shards' parameters, so a checkpoint holds
        them; ``load_state_dict()`` afterwards hands the loaded parameters to the
        shards, so a resume after ``prepare_model`` is not overwritten.
        """
        if self.setup.joined:
            self._join()
        else:
            self._start()
        module = self.setup.module
        module.register_state_dict_pre_hook(ModelHook(module, self.sync))
        module.register_load_state_dict_post_hook(ModelHook(module, self.reseed))

    def _join(self) -> None:
        """Takes the live shards' parameters (not rank 0's) and goes on from the
        lowest clock the shards hold for this rank: what a worker that died here
        applied counts, once. A push in flight at the death that reached some shards
        only is filled in by this worker's first update (the others ignore it)."""
        replies = self._pull(0)
        self._clock = self.start_clock = min(r.clocks[self.rank] for r in replies)
        self._stamp = min(r.slowest for r in replies)
        with self._lock:
            self._stats.clock = self._stats.steps = self._clock

    def peers_behind(self) -> bool:
        """Whether another rank's clock on the shards (the lowest over them) is at a
        step before this worker's: that worker, or its replacement, is behind."""
        handles = [self._transport.call(s, "stats") for s in range(self.num_shards)]
        stats = self._wait(handles, "reading the workers' clocks")
        clocks = [min(cs) for cs in zip(*(st["clocks"][self.model_id] for st in stats))]
        here = self.loop_step
        return any(self.step_of(c) < here for r, c in enumerate(clocks) if r != self.rank)

    @property
    def loop_step(self) -> int:
        """The optimizer steps taken since the run's start (a replacement's too)."""
        return self._clock

    def step_of(self, clock: int) -> int:
        """The loop step a worker that goes on from ``clock`` starts at."""
        return clock

    def _start(self) -> None:
        """Rank 0 seeds the shards with its parameters (DDP broadcast them); waits."""
        if self.rank != 0:
            return
        base = to_numpy(self._flat.base)
        handles = [
            self._transport.call(s, "init", self.model_id, base[a:b])
            for s, (a, b) in enumerate(self._slices())
        ]
        self._wait(handles, "initial parameters")

    @property
    def next_step(self) -> int:
        """The clock the next update will complete."""
        return self._clock + 1

    @property
    def num_shards(self) -> int:
        return len(self._bounds) - 1

    @property
    def shared_memory_shards(self) -> tuple[int, ...]:
        return tuple(sorted(self._lanes))

    def feedback_codec(self) -> Codec | None:
        return self._codec if self._codec.lossy else None

    # --- the step ---------------------------------------------------------------
    def before_forward(self) -> None:
        """In ssp, waits for fresher parameters when the installed ones are too stale.

        Only the first forward pass after an optimizer step may change the
        parameters: a later one (a second forward before the same backward) would
        modify tensors autograd saved for that backward. ``"async"`` never waits or
        installs here: :meth:`after_step` already installed the newest reply.
        """
        super().before_forward()
        self._forwards += 1
        if not self._first_forward:
            return
        self._first_forward = False
        inflight = self._inflight
        if (
            inflight is not None
            and not self._installed
            and self._staleness is not None
            and self._stamp < self._clock - self._staleness
        ):
            started = time.perf_counter()
            self._install(
                self._wait(inflight.handles, f"clock {inflight.clock}"), inflight.clock % 2
            )
            with self._lock:
                self._stats.wait_s += time.perf_counter() - started
        if self._counted_step != self._clock:
            # One staleness sample per step.
            self._counted_step = self._clock
            self._sample_staleness()

    def after_step(self) -> None:
        """Pushes this step's delta to every shard and installs the newest reply plus
        ``delta / W`` (called after optimizer.step)."""
        self._first_forward = True
        self._overlapped_push("clock")
        with self._lock:
            self._stats.steps = self._clock
        self._export_metrics()

    def _overlapped_push(self, what: str) -> None:
        """Confirms the previous push, installs its reply plus this step's change
        counted as the shards count it, and sends the change without waiting
        (``what``: a clock or a round, for error messages)."""
        previous = None
        if self._inflight is not None:
            # The shards apply a worker's updates in clock order; Ray does not order
            # calls to an asyncio actor, so the previous push must be confirmed first
            # (which also frees the shared-memory input the delta is written to).
            previous = self._wait_counted(self._inflight.handles, f"{what} {self._inflight.clock}")
            self._inflight.hold(self._transport, self.model_id, self.rank)
        # Train on the newest parameters at hand (the previous reply: every earlier
        # step of this worker) plus this step counted as the shards count it. The
        # whole step would run the worker ahead of the shards by (1 - 1/W) of a step
        # each time: a delayed feedback that diverges at learning rates plain SGD
        # and DDP take (Ray's linear example did). The install shares one pass with
        # taking the delta, so it comes before the push (the previous reply's output
        # segment is not the one this push answers in). A reply ssp installed
        # before the forward pass is the base now: not installed or counted again.
        self._flat.use_half(self._clock + 1)
        self._advance(None if self._installed else previous, self._clock % 2)
        self._inflight = InFlight(self._clock + 1, [], time.perf_counter())
        self._inflight.handles = self._push(self._inflight.held)
        self._installed = False

    def _push(self, held: dict[int, np.ndarray] | None = None) -> list[Handle[Any]]:
        """Sends the delta taken into the push buffers as the next clock's update;
        returns the calls' handles (each answers with its shard's parameters) and
        copies into ``held`` what each shard with a replica applies."""
        self._clock += 1
        slot = self._clock % 2
        by_message = len(self._lanes) < self.num_shards
        lossy = self._codec.lossy
        delta = self._codec.encode(self._flat.delta) if by_message and not lossy else None
        handles, sent = [], list(self._slice_bytes)
        for s, (a, b) in enumerate(self._slices()):
            if s not in self._lanes:
                if delta is None:  # lossy (diloco's int4/8): per slice, its error kept
                    part = self._codec.encode_chunk(s, self._flat.delta[a:b])
                else:
                    part = delta[a:b]
                sent[s] = part.nbytes
                handles.append(self._push_by_message(s, part, self._clock))
            else:
                handles.append(self._lane_calls.push(s, self._clock, slot))
            if held is not None and self._transport.replica(s) is not None:
                carried = self._codec.decode(part) if s not in self._lanes else None
                held[s] = self._flat.held_part(s, carried)
        with self._lock:
            self._stats.clock = self._clock
            self._stats.pushes += len(handles)
            for s, nbytes in enumerate(sent):
                self._count_push(s, nbytes)
        return handles

    def _push_by_message(self, shard: int, delta: Any, clock: int) -> Handle[Any]:
        """Sends one shard its slice of the delta (encoded) as ``clock``'s update."""
        return self._transport.call(shard, "push_pull", self.model_id, self.rank, clock, delta)

    # --- consistency points -------------------------------------------------------
    def flush(self) -> None:
        """Waits until this worker's last update is applied on every shard."""
        super().flush()
        if self._inflight is not None:
            replies = self._wait(self._inflight.handles, f"clock {self._inflight.clock}")
            self._inflight.hold(self._transport, self.model_id, self.rank)
            if not self._installed:
                self._install(replies, self._inflight.clock % 2)
            self._inflight = None

    def sync(self) -> None:
        """Installs the shards' current parameters (all updates applied so far).

        Used before ``state_dict()``, so a checkpoint holds the servers' parameters,
        not this worker's possibly stale copy.
        """
        self.flush()
        self._pull(self._clock)

    def _pull(self, clock: int) -> list[Reply]:
        """Installs the shards' current parameters, as fresh as a worker at
        ``clock`` may train on; returns the replies."""
        # Nothing is in flight now, so either output slot is free; the next push
        # (clock + 1) will answer in the other one.
        slot = clock % 2
        handles = [
            self._lane_calls.pull(s, clock, slot)
            if s in self._lanes
            else self._transport.call(s, "pull", self.model_id, self.rank, clock)
            for s in range(self.num_shards)
        ]
        replies = self._wait(handles, "a parameter pull")
        self._install(replies, slot)
        return replies

    def reseed(self) -> None:
        """Hands parameters just loaded into the model to the shards.

        Every worker that loads waits until rank 0's copy is on the shards, so no
        worker pushes an update relative to values the shards do not hold. A worker
        that joined live shards does not roll them back to an older checkpoint: the
        model takes the shards' parameters again (see :meth:`_join`).
        """
        self.flush()
        if self.setup.joined:
            warn_kept_live(self.rank)
            self._pull(self._clock)
            return
        self._generation += 1
        self._flat.snapshot()
        base = to_numpy(self._flat.base)
        if self.rank == 0:
            handles = [
                self._transport.call(s, "reseed", self.model_id, self._generation, base[a:b])
                for s, (a, b) in enumerate(self._slices())
            ]
        else:
            handles = [
                self._transport.call(
                    s, "wait_generation", self.model_id, self.rank, self._generation
                )
                for s in range(self.num_shards)
            ]
        self._wait(handles, "loading a state dict")
        self._installed = True  # the loaded values are what the shards hold now

    def finish(self, clean: bool = True) -> None:
        """Confirms the last update and releases the workers waiting for this one."""
        if self._finished:
            return
        self._finished = True
        super().finish(clean)
        if self._forwards and not self._clock:
            logger.warning(
                "rank %d ran %d forward passes but no optimizer.step() on the PS model's "
                "parameters: in async/ssp mode updates reach the servers only through "
                "an optimizer's step(); nothing was sent.", self.rank, self._forwards
            )  # fmt: skip
        self.flush()
        self._wait(
            [
                self._transport.call(s, "finish", self.model_id, self.rank)
                for s in range(self.num_shards)
            ],
            "finishing",
        )

    def close(self) -> None:
        """Unmaps the shared memory (nothing runs in the background)."""
        lanes, self._lanes = self._lanes, {}
        for lane in lanes.values():
            lane.close()

    # --- helpers ------------------------------------------------------------------
    def _slices(self) -> list[tuple[int, int]]:
        return list(zip(self._bounds, self._bounds[1:]))

    def _install(self, replies: list[Reply], slot: int) -> None:
        """Writes the shards' replies into the model (and the installed copy)."""
        sources = self._sources(replies, slot)
        assert sources is not None
        self._flat.install(sources)
        self._note_replies(replies)

    def _advance(self, replies: list[Reply] | None, slot: int) -> None:
        """Takes this step's delta into the push buffers and installs the replies plus
        ``delta / W`` (:meth:`FlatParams.advance`); with ``nan_policy="raise"`` the
        same pass sums the delta's chunks, and a non-finite update raises.

        Args:
            replies: The newest replies (one per shard), or ``None`` (first step, or
                right after :meth:`flush`: the step is added to the installed copy).
            slot: The output segment that colocated shards answered in.

        Raises:
            PSError: The update holds NaN or Inf (``nan_policy="raise"``).
        """
        check = self.guard.policy == "raise"
        sums = self._flat.advance(self._sources(replies, slot), self._scale, check)
        if check and sums:
            self.guard.check_update(self.next_step, all_finite(torch.stack(sums)))
        self._flat.publish()
        if replies is not None:
            self._note_replies(replies)

    def _note_replies(self, replies: list[Reply]) -> None:
        """Records what installed replies say: staleness stamp, clocks, bytes."""
        self._stamp = min(r.slowest for r in replies)
        self._installed = True
        clocks = [max(cs) for cs in zip(*(r.clocks for r in replies))]
        with self._lock:
            self._stats.clocks = clocks
            for s, nbytes in enumerate(self._slice_bytes):
                self._stats.bytes_pulled += nbytes
                if s in self.remote_shards:
                    self._stats.bytes_cross_node += nbytes

    def _sources(self, replies: list[Reply] | None, slot: int) -> list[torch.Tensor] | None:
        """Each shard's slice of the replies: shared memory or the decoded reply."""
        if replies is None:
            return None
        return [
            self._flat.segment_tensor(self._lanes[s].outputs[slot], b - a)
            if r.params is None
            else self._codec.decode(r.params, self._flat.base.dtype)
            for s, ((a, b), r) in enumerate(zip(self._slices(), replies))
        ]

    def _sample_staleness(self) -> None:
        """Counts one staleness sample: how many clocks the slowest worker's
        contribution in the installed parameters lags behind this worker's."""
        gap = self._clock - self._stamp
        self._gaps_sum += gap
        self._samples += 1
        with self._lock:
            self._stats.staleness_max = max(self._stats.staleness_max, gap)
            self._stats.staleness_mean = self._gaps_sum / self._samples
