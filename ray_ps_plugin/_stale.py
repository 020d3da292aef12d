"""Worker side of the asynchronous and bounded-staleness modes.

One step of a worker, top to bottom:

1. ``model(x)``: before the forward pass the worker installs the newest parameters
   the shards have sent, if they are already back; it blocks only when the
   staleness bound demands fresher ones (``"ssp"``), never in ``"async"``.
2. ``loss.backward()`` and ``optimizer.step()`` run locally, unchanged: the user's
   optimizer (momentum, Adam state, learning-rate schedule) steps the worker's copy.
3. Right before ``optimizer.step()`` a global optimizer hook snapshots the
   parameters; right after it, another takes the difference (the *delta*: what the
   optimizer changed) and sends each shard its slice in one non-blocking
   ``push_pull`` that also brings back the shard's current parameters. They travel
   while the user's loop loads the next batch; step 1 of the next iteration picks
   them up. A colocated shard gets the delta through shared memory and answers in
   it.

At most one round trip per worker is in flight: the next push first waits for the
previous one (with a timeout), so a fast worker cannot queue unbounded work on the
shards and every update is confirmed before the one after it is sent.
"""

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ray_ps_plugin._codec import Codec
from ray_ps_plugin._metrics import WorkerMetrics
from ray_ps_plugin._errors import PSError, PSTimeoutError, WaitTimeout, failed_indices
from ray_ps_plugin._nonfinite import NonFiniteGuard
from ray_ps_plugin._stats import PSStats
from ray_ps_plugin import _shm as shm
from ray_ps_plugin._shm import Segment, SegmentHandle

logger = logging.getLogger(__name__)

__all__ = ["StaleClient", "StaleTransport", "RayStaleTransport", "split_bounds"]


class StaleTransport(Protocol):
    """How a worker reaches the parameter shards; the real one is Ray."""

    def init(self, shard: int, params: np.ndarray) -> Any:
        """Starts handing the shard its initial slice; returns a handle."""
        ...

    def push_pull(self, shard: int, rank: int, clock: int, delta: np.ndarray) -> Any:
        """Starts one update + read; returns a handle to the shard's reply."""
        ...

    def pull(self, shard: int, rank: int, clock: int) -> Any:
        """Starts a read without update; returns a handle to the shard's reply."""
        ...

    def finish(self, shard: int, rank: int) -> Any:
        """Tells the shard this worker's loop has ended."""
        ...

    def attach(
        self,
        shard: int,
        rank: int,
        inputs: SegmentHandle,
        outputs: tuple[SegmentHandle, SegmentHandle],
    ) -> None:
        """Connects through shared memory (blocking)."""
        ...

    def push_local(self, shard: int, rank: int, clock: int, slot: int) -> Any:
        """Like ``push_pull`` with the delta in shared memory; the reply's
        parameters land in output segment ``slot``."""
        ...

    def pull_local(self, shard: int, rank: int, clock: int, slot: int) -> Any:
        """Like ``pull``, the parameters landing in output segment ``slot``."""
        ...

    def done(self, handles: list[Any]) -> bool:
        """Whether every handle's result is available, without waiting."""
        ...

    def wait(self, handles: list[Any], timeout_s: float) -> list[Any]:
        """Waits for all results; raises ``WaitTimeout`` after ``timeout_s``."""
        ...


class RayStaleTransport:
    """Calls ``ParamShardServer`` actors through Ray."""

    def __init__(self, servers: Sequence[Any], timeout_s: float) -> None:
        self._servers = list(servers)
        self._timeout_s = timeout_s

    def attach(
        self,
        shard: int,
        rank: int,
        inputs: SegmentHandle,
        outputs: tuple[SegmentHandle, SegmentHandle],
    ) -> None:
        import ray

        ray.get(self._servers[shard].attach.remote(rank, inputs, outputs), timeout=self._timeout_s)

    def init(self, shard: int, params: np.ndarray) -> Any:
        return self._servers[shard].init.remote(params)

    def push_pull(self, shard: int, rank: int, clock: int, delta: np.ndarray) -> Any:
        return self._servers[shard].push_pull.remote(rank, clock, delta)

    def pull(self, shard: int, rank: int, clock: int) -> Any:
        return self._servers[shard].pull.remote(rank, clock)

    def finish(self, shard: int, rank: int) -> Any:
        return self._servers[shard].finish.remote(rank)

    def push_local(self, shard: int, rank: int, clock: int, slot: int) -> Any:
        return self._servers[shard].push_local.remote(rank, clock, slot)

    def pull_local(self, shard: int, rank: int, clock: int, slot: int) -> Any:
        return self._servers[shard].pull_local.remote(rank, clock, slot)

    def done(self, handles: list[Any]) -> bool:
        import ray

        ready, _ = ray.wait(handles, num_returns=len(handles), timeout=0, fetch_local=False)
        return len(ready) == len(handles)

    def wait(self, handles: list[Any], timeout_s: float) -> list[Any]:
        import ray

        try:
            return ray.get(handles, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise WaitTimeout(str(e)) from e


def split_bounds(numel: int, num_shards: int) -> list[int]:
    """Element offsets cutting ``numel`` elements into near-equal contiguous slices."""
    return [numel * i // num_shards for i in range(num_shards + 1)]


@dataclass
class StaleLane:
    """Shared memory between this worker and one parameter shard of its node.

    Attributes:
        inputs: This worker's delta for the shard's slice.
        outputs: Two buffers for the shard's parameters; a push completing clock
            ``c`` is answered in ``outputs[c % 2]``, so the reply of clock ``c - 1``
            stays readable while the next push is in flight.
    """

    inputs: Segment
    outputs: tuple[Segment, Segment]

    def close(self) -> None:
        for seg in (self.inputs, *self.outputs):
            seg.close()


def open_stale_lanes(
    transport: StaleTransport, shards: Sequence[int], slice_bytes: Sequence[int], rank: int
) -> dict[int, StaleLane]:
    """Attaches this worker to parameter ``shards`` of its node through shared memory
    (see :func:`~ray_ps_plugin._shm.attach_each` for what happens where it cannot)."""

    def attach(s: int, created: list[Segment]) -> StaleLane:
        created.extend(Segment.create(slice_bytes[s]) for _ in range(3))
        inputs, out0, out1 = created
        transport.attach(s, rank, inputs.handle, (out0.handle, out1.handle))
        return StaleLane(inputs, (out0, out1))

    return shm.attach_each(shards, rank, attach)


@dataclass(frozen=True)
class _Piece:
    """The part of one parameter that lies in one shard's slice."""

    param: int  # index of the parameter
    p0: int  # first element inside the (flattened) parameter
    p1: int  # one past the last
    shard: int
    s0: int  # first element inside the shard's slice
    flat0: int  # first element in the flattened parameter vector

    @property
    def numel(self) -> int:
        return self.p1 - self.p0


def _pieces(numels: Sequence[int], bounds: Sequence[int]) -> list[_Piece]:
    """Cuts parameters of ``numels`` elements at the shard ``bounds`` (flat offsets)."""
    pieces = []
    offset = 0
    for i, n in enumerate(numels):
        for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
            lo, hi = max(offset, a), min(offset + n, b)
            if lo < hi:
                pieces.append(_Piece(i, lo - offset, hi - offset, s, lo - a, lo))
        offset += n
    return pieces


@dataclass
class _InFlight:
    clock: int
    handles: list[Any]
    started: float


class StaleClient:
    """Keeps one worker's model in step with the parameter shards (async / ssp).

    Args:
        transport: How the shards are reached.
        params: The model's trainable parameters, in ``module.parameters()`` order
            (the same order on every worker).
        num_shards: Number of parameter shards.
        world_rank: This worker's rank.
        world_size: Number of workers.
        staleness: The ssp bound, or ``None`` for async (no bound).
        timeout_s: Bound on every wait for a shard.
        nan_policy: ``PSConfig.nan_policy``, checked on the local gradients.
        remote_shards: Shards on other nodes, whose traffic is counted as crossing.
        codec: Wire format of deltas and parameters (default fp32).
        metrics: Exports the counters through ``ray.util.metrics`` (optional).
        lanes: Shards of this node reached through shared memory, by shard index
            (see :func:`open_stale_lanes`); the others through the object store.

    Raises:
        TypeError: If the trainable parameters are not all of one floating dtype.
    """

    def __init__(
        self,
        transport: StaleTransport,
        params: Sequence[torch.Tensor],
        num_shards: int,
        world_rank: int,
        world_size: int,
        staleness: int | None,
        timeout_s: float,
        nan_policy: str = "raise",
        remote_shards: frozenset[int] = frozenset(),
        codec: Codec | None = None,
        metrics: WorkerMetrics | None = None,
        lanes: dict[int, StaleLane] | None = None,
    ) -> None:
        self._metrics = metrics
        self._lanes = dict(lanes or {})
        self._remote = remote_shards
        self._codec = codec or Codec(None)
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise TypeError(
                "The async and ssp modes keep the trainable parameters in one flat "
                f"buffer per shard and need a single floating dtype; this model has "
                f"{sorted(str(d) for d in dtypes) or 'no trainable parameters'}. Cast "
                "the model (e.g. model.float()) or use mode='sync'."
            )
        self._transport = transport
        self._params = list(params)
        self.guard = NonFiniteGuard(nan_policy, world_rank, self._params, check_local=True)
        self._rank = world_rank
        self._staleness = staleness
        self._timeout_s = timeout_s
        numel = sum(p.numel() for p in self._params)
        self._bounds = split_bounds(numel, num_shards)
        dtype = next(iter(dtypes))
        # The parameters when the optimizer step began (host copy), and the step's
        # delta for shards reached through the object store.
        self._base = torch.empty(numel, dtype=dtype)
        # Only shards reached by wire need a host delta; colocated ones get theirs
        # written straight into shared memory.
        wired = len(self._lanes) < num_shards
        self._delta = torch.empty(numel if wired else 0, dtype=dtype)
        self._on_gpu = any(p.is_cuda for p in self._params)
        self._flat = torch.empty(numel if self._on_gpu else 0, dtype=dtype)  # GPU staging
        # Where each shard's delta is computed: straight into the shared memory of a
        # colocated shard (saving a copy), else into ``_delta`` for the wire.
        self._np_dtype = self._base.numpy().dtype
        self._delta_parts = [
            self._lane_tensor(self._lanes[s].inputs, b - a)
            if s in self._lanes
            else self._delta[a:b]
            for s, (a, b) in enumerate(self._slices())
        ]
        # Where each parameter's values lie among the shards' slices: deltas and
        # installs run per (parameter, shard) piece, with no flat intermediate copy.
        self._pieces = _pieces([p.numel() for p in self._params], self._bounds)
        # Each parameter's first element in the flat vector (also for empty ones,
        # which have no piece).
        self._offsets = list(itertools.accumulate((p.numel() for p in self._params), initial=0))
        # Bytes exchanged with each shard per push or reply: shared memory carries the
        # parameters' dtype, the wire the codec's.
        local_size = self._base.element_size()
        wire_size = self._codec.wire_dtype.itemsize if self._codec.active else local_size
        self._slice_bytes = [
            (b - a) * (local_size if s in self._lanes else wire_size)
            for s, (a, b) in enumerate(self._slices())
        ]
        self._clock = 0
        self._stamp = 0  # slowest worker's clock contained in the installed parameters
        self._inflight: _InFlight | None = None
        self._installed = True  # whether the newest reply is in the model
        self._counted_step = -1
        self._forwards = 0
        self._lock = threading.Lock()
        self._gaps_sum = 0
        self._samples = 0
        self._stats = PSStats(bytes_pushed_per_shard=[0] * num_shards)
        self._finished = False
        self.before_step()  # rank 0 seeds the shards with this snapshot

    # --- set-up -----------------------------------------------------------------
    def start(self) -> None:
        """Rank 0 seeds the shards with its parameters (identical on every rank
        after DDP's initial broadcast); it waits so a failure surfaces here."""
        if self._rank != 0:
            return
        base = self._base.numpy()
        handles = [self._transport.init(s, base[a:b]) for s, (a, b) in enumerate(self._slices())]
        self._wait(handles, "initial parameters")

    def owns(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` steps any of this model's trainable parameters."""
        return self.guard.owns(optimizer)

    @property
    def next_step(self) -> int:
        """The clock the next update will complete."""
        return self._clock + 1

    # --- the step ---------------------------------------------------------------
    def before_step(self) -> None:
        """Snapshots the parameters the optimizer step starts from (pre-step hook)."""
        self._flatten(self._base)

    def before_forward(self) -> None:
        """Installs the newest reply if it is back, or waits when ssp demands it."""
        self._forwards += 1
        if self._inflight is not None and not self._installed:
            must_wait = self._staleness is not None and self._stamp < self._clock - self._staleness
            if must_wait or self._transport.done(self._inflight.handles):
                started = time.perf_counter()
                replies = self._wait(self._inflight.handles, f"clock {self._inflight.clock}")
                self._install(replies, self._inflight.clock % 2)
                if must_wait:
                    with self._lock:
                        self._stats.wait_s += time.perf_counter() - started
        if self._counted_step != self._clock:
            # One staleness sample per step: how many clocks the slowest worker's
            # contribution lags behind this worker's.
            self._counted_step = self._clock
            gap = self._clock - self._stamp
            self._gaps_sum += gap
            self._samples += 1
            with self._lock:
                self._stats.staleness_max = max(self._stats.staleness_max, gap)
                self._stats.staleness_mean = self._gaps_sum / self._samples

    def after_step(self) -> None:
        """Pushes this step's delta to every shard (called after optimizer.step)."""
        previous = None
        if self._inflight is not None:
            # The shards apply a worker's updates in clock order; Ray does not order
            # calls to an asyncio actor, so the previous push must be confirmed first
            # (which also frees the shared-memory input the delta is written to).
            started = time.perf_counter()
            previous = self._wait(self._inflight.handles, f"clock {self._inflight.clock}")
            with self._lock:
                self._stats.wait_s += time.perf_counter() - started
        params = self._host_params()
        for pc in self._pieces:
            torch.sub(
                params[pc.param][pc.p0 : pc.p1],
                self._base[pc.flat0 : pc.flat0 + pc.numel],
                out=self._delta_parts[pc.shard][pc.s0 : pc.s0 + pc.numel],
            )
        self._clock += 1
        slot = self._clock % 2
        wired = len(self._lanes) < self.num_shards
        delta = self._codec.encode(self._delta) if wired else None
        handles = []
        for s, (a, b) in enumerate(self._slices()):
            if s in self._lanes:
                handles.append(self._transport.push_local(s, self._rank, self._clock, slot))
            else:
                # Ray serialises each argument inside .remote(): ``_delta`` may be
                # reused as soon as this call returns.
                assert delta is not None
                handles.append(self._transport.push_pull(s, self._rank, self._clock, delta[a:b]))
        self._inflight = _InFlight(self._clock, handles, time.perf_counter())
        if previous is not None and not self._installed:
            # The previous reply came back too late for this step's forward pass. It
            # is still the freshest view of the other workers: train on it plus this
            # worker's own step, rather than drift on a purely local copy.
            self._install(previous, (self._clock - 1) % 2, plus=self._delta_parts)
        self._installed = False
        with self._lock:
            self._stats.steps = self._clock
            self._stats.clock = self._clock
            self._stats.pushes += len(handles)
            for s, nbytes in enumerate(self._slice_bytes):
                self._stats.bytes_pushed += nbytes
                self._stats.bytes_pushed_per_shard[s] += nbytes
                if s in self._remote:
                    self._stats.bytes_cross_node += nbytes
        if self._metrics is not None and self._metrics.due():
            self._metrics.export(self.snapshot())

    # --- consistency points -------------------------------------------------------
    def flush(self) -> None:
        """Waits until this worker's last update is applied on every shard."""
        if self._inflight is not None:
            replies = self._wait(self._inflight.handles, f"clock {self._inflight.clock}")
            if not self._installed:
                self._install(replies, self._inflight.clock % 2)
            self._inflight = None

    def sync(self) -> None:
        """Installs the shards' current parameters (all updates applied so far).

        Used before ``state_dict()``, so a checkpoint holds the servers' parameters,
        not this worker's possibly stale copy.
        """
        self.flush()
        # Nothing is in flight now, so either output slot is free; the next push
        # (clock + 1) will answer in the other one.
        slot = self._clock % 2
        handles = [
            self._transport.pull_local(s, self._rank, self._clock, slot)
            if s in self._lanes
            else self._transport.pull(s, self._rank, self._clock)
            for s in range(self.num_shards)
        ]
        self._install(self._wait(handles, "a parameter pull"), slot)

    def finish(self) -> None:
        """Confirms the last update and releases the workers waiting for this one."""
        if self._finished:
            return
        self._finished = True
        if self._forwards and not self._clock:
            logger.warning(
                "rank %d ran %d forward passes but no optimizer.step() on the PS model's "
                "parameters: in async/ssp mode updates reach the servers only through "
                "an optimizer's step(); nothing was sent.",
                self._rank,
                self._forwards,
            )
        self.flush()
        self._wait(
            [self._transport.finish(s, self._rank) for s in range(self.num_shards)],
            "finishing",
        )

    @property
    def shared_memory_shards(self) -> tuple[int, ...]:
        """Shards reached through shared memory, in index order."""
        return tuple(sorted(self._lanes))

    @property
    def num_shards(self) -> int:
        return len(self._bounds) - 1

    # --- helpers ------------------------------------------------------------------
    def _flatten(self, out: torch.Tensor) -> None:
        flat = [p.detach().reshape(-1) for p in self._params]
        if not self._on_gpu:
            torch.cat(flat, out=out)
        else:  # GPU parameters are staged through the host buffer
            out.copy_(torch.cat(flat))

    def _host_params(self) -> list[torch.Tensor]:
        """Flat host views of the parameters (a staged copy when they live on GPU)."""
        if not self._on_gpu:
            return [p.detach().reshape(-1) for p in self._params]
        self._flatten(self._flat)
        return [self._flat[o : o + p.numel()] for o, p in zip(self._offsets, self._params)]

    def _slices(self) -> list[tuple[int, int]]:
        return list(zip(self._bounds, self._bounds[1:]))

    def _lane_tensor(self, seg: Segment, numel: int) -> torch.Tensor:
        return torch.from_numpy(seg.view(0, self._np_dtype, numel))

    def _install(
        self, replies: list[Any], slot: int, plus: Sequence[torch.Tensor] | None = None
    ) -> None:
        """Writes the shards' replies (plus an own, unconfirmed step) into the model.

        Args:
            replies: One reply per shard.
            slot: The output segment that colocated shards answered in.
            plus: Per shard, a delta to add on top (this worker's newest step).
        """
        sources = [
            self._lane_tensor(self._lanes[s].outputs[slot], b - a)
            if arr is None
            else self._codec.decode(arr)
            for s, ((a, b), (arr, _, _)) in enumerate(zip(self._slices(), replies))
        ]
        # Contiguous CPU parameters are written in place; others (GPU, unusual
        # strides) are assembled on the host first and copied in once.
        direct = [p.is_contiguous() and not p.is_cuda for p in self._params]
        flats = [
            p.detach().view(-1) if d else torch.empty(p.numel(), dtype=p.dtype)
            for p, d in zip(self._params, direct)
        ]
        with torch.no_grad():
            for pc in self._pieces:
                dst = flats[pc.param][pc.p0 : pc.p1]
                src = sources[pc.shard][pc.s0 : pc.s0 + pc.numel]
                if plus is None:
                    dst.copy_(src)
                else:  # one pass: the shard's values plus this worker's own step
                    torch.add(src, plus[pc.shard][pc.s0 : pc.s0 + pc.numel], out=dst)
            for p, flat, d in zip(self._params, flats, direct):
                if not d:
                    p.copy_(flat.view(p.shape))
        self._stamp = min(slowest for _, _, slowest in replies)
        self._installed = True
        self._record_clocks(replies)

    def _record_clocks(self, replies: list[Any]) -> None:
        clocks = [max(cs) for cs in zip(*(c for _, c, _ in replies))]
        with self._lock:
            self._stats.clocks = clocks
            for s, nbytes in enumerate(self._slice_bytes):
                self._stats.bytes_pulled += nbytes
                if s in self._remote:
                    self._stats.bytes_cross_node += nbytes

    def _wait(self, handles: list[Any], what: str) -> list[Any]:
        try:
            return self._transport.wait(handles, self._timeout_s)
        except WaitTimeout:
            raise PSTimeoutError(
                f"rank {self._rank}: {what}: server shard(s) {list(range(self.num_shards))} "
                f"did not answer within ps_timeout_s={self._timeout_s:g}s. A worker or "
                "shard is stuck or dead; raise PSConfig.ps_timeout_s (or staleness) if "
                "workers are legitimately this slow."
            ) from None
        except Exception as e:  # noqa: BLE001 - name the operation and shard
            failed = failed_indices(self._transport.wait, handles)
            # A shard's own timeout (e.g. ssp waiting for slow workers) stays a
            # timeout, with the shard's message naming the workers it waited for.
            error = PSTimeoutError if isinstance(e, TimeoutError) else PSError
            raise error(
                f"rank {self._rank}: {what}: server shard(s) {failed or 'unknown'} failed: {e}"
            ) from e

    def snapshot(self) -> PSStats:
        """A copy of the counters, safe to read from any thread."""
        with self._lock:
            return dataclasses.replace(
                self._stats,
                bytes_pushed_per_shard=list(self._stats.bytes_pushed_per_shard),
                clocks=list(self._stats.clocks),
                skipped_steps=self.guard.skipped,
            )

    def close(self) -> None:
        """Unmaps the shared memory (nothing runs in the background)."""
        lanes, self._lanes = self._lanes, {}
        for lane in lanes.values():
            lane.close()
