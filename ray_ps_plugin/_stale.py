"""Worker side of the asynchronous and bounded-staleness modes.

One step of a worker, top to bottom:

1. ``model(x)``: before the forward pass the worker installs the newest parameters
   the shards have sent, if they are already back; it blocks only when the
   staleness bound demands fresher ones (``"ssp"``), never in ``"async"``.
2. ``loss.backward()`` and ``optimizer.step()`` run locally, unchanged: the user's
   optimizer (momentum, Adam state, learning-rate schedule) steps the worker's copy.
3. Right after ``optimizer.step()`` a global optimizer hook flattens the
   parameters, takes the difference to the parameters the step started from (the
   *delta*) and sends each shard its slice in one non-blocking ``push_pull`` that
   also brings back the shard's current parameters. They travel while the user's
   loop loads the next batch; step 1 of the next iteration picks them up.

At most one round trip per worker is in flight: the next push first waits for the
previous one (with a timeout), so a fast worker cannot queue unbounded work on the
shards and every update is confirmed before the one after it is sent.
"""

import dataclasses
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

    def done(self, handles: list[Any]) -> bool:
        """Whether every handle's result is available, without waiting."""
        ...

    def wait(self, handles: list[Any], timeout_s: float) -> list[Any]:
        """Waits for all results; raises ``WaitTimeout`` after ``timeout_s``."""
        ...


class RayStaleTransport:
    """Calls ``ParamShardServer`` actors through Ray."""

    def __init__(self, servers: Sequence[Any]) -> None:
        self._servers = list(servers)

    def init(self, shard: int, params: np.ndarray) -> Any:
        return self._servers[shard].init.remote(params)

    def push_pull(self, shard: int, rank: int, clock: int, delta: np.ndarray) -> Any:
        return self._servers[shard].push_pull.remote(rank, clock, delta)

    def pull(self, shard: int, rank: int, clock: int) -> Any:
        return self._servers[shard].pull.remote(rank, clock)

    def finish(self, shard: int, rank: int) -> Any:
        return self._servers[shard].finish.remote(rank)

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
    ) -> None:
        self._metrics = metrics
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
        # Two host buffers swap roles every step: the parameters the step started
        # from (``_base``) and the parameters after the optimizer stepped.
        self._base = torch.empty(numel, dtype=dtype)
        self._flat = torch.empty(numel, dtype=dtype)
        self._delta = torch.empty(numel, dtype=dtype)
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
        self._flatten(self._base)

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
    def before_forward(self) -> None:
        """Installs the newest reply if it is back, or waits when ssp demands it."""
        self._forwards += 1
        if self._inflight is not None and not self._installed:
            must_wait = self._staleness is not None and self._stamp < self._clock - self._staleness
            if must_wait or self._transport.done(self._inflight.handles):
                started = time.perf_counter()
                replies = self._wait(self._inflight.handles, f"clock {self._inflight.clock}")
                self._install(replies)
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
        self._flatten(self._flat)
        torch.sub(self._flat, self._base, out=self._delta)
        previous = None
        if self._inflight is not None:
            # The shards apply a worker's updates in clock order; Ray does not order
            # calls to an asyncio actor, so the previous push must be confirmed first.
            started = time.perf_counter()
            previous = self._wait(self._inflight.handles, f"clock {self._inflight.clock}")
            with self._lock:
                self._stats.wait_s += time.perf_counter() - started
        self._clock += 1
        delta = self._codec.encode(self._delta)
        # Ray serialises each argument inside .remote(): ``_delta`` may be reused
        # as soon as these calls return.
        handles = [
            self._transport.push_pull(s, self._rank, self._clock, delta[a:b])
            for s, (a, b) in enumerate(self._slices())
        ]
        self._inflight = _InFlight(self._clock, handles, time.perf_counter())
        if previous is not None and not self._installed:
            # The previous reply came back too late for this step's forward pass. It
            # is still the freshest view of the other workers: train on it plus this
            # worker's own step, rather than drift on a purely local copy.
            self._install(previous, plus=self._delta)
        else:
            self._base, self._flat = self._flat, self._base
        self._installed = False
        with self._lock:
            self._stats.steps = self._clock
            self._stats.clock = self._clock
            self._stats.pushes += len(handles)
            self._stats.bytes_pushed += delta.nbytes
            for s, (a, b) in enumerate(self._slices()):
                self._stats.bytes_pushed_per_shard[s] += (b - a) * delta.itemsize
                if s in self._remote:
                    self._stats.bytes_cross_node += (b - a) * delta.itemsize
        if self._metrics is not None and self._metrics.due():
            self._metrics.export(self.snapshot())

    # --- consistency points -------------------------------------------------------
    def flush(self) -> None:
        """Waits until this worker's last update is applied on every shard."""
        if self._inflight is not None:
            replies = self._wait(self._inflight.handles, f"clock {self._inflight.clock}")
            if not self._installed:
                self._install(replies)
            self._inflight = None

    def sync(self) -> None:
        """Installs the shards' current parameters (all updates applied so far).

        Used before ``state_dict()``, so a checkpoint holds the servers' parameters,
        not this worker's possibly stale copy.
        """
        self.flush()
        handles = [self._transport.pull(s, self._rank, self._clock) for s in range(self.num_shards)]
        self._install(self._wait(handles, "a parameter pull"))

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
    def num_shards(self) -> int:
        return len(self._bounds) - 1

    # --- helpers ------------------------------------------------------------------
    def _flatten(self, out: torch.Tensor) -> None:
        flat = [p.detach().reshape(-1) for p in self._params]
        if all(not p.is_cuda for p in self._params):
            torch.cat(flat, out=out)
        else:  # GPU parameters are staged through the host buffer
            out.copy_(torch.cat(flat))

    def _slices(self) -> list[tuple[int, int]]:
        return list(zip(self._bounds, self._bounds[1:]))

    def _install(self, replies: list[Any], plus: torch.Tensor | None = None) -> None:
        """Writes the shards' replies (plus an own, unconfirmed step) into the model."""
        for (a, b), (arr, _, _) in zip(self._slices(), replies):
            self._base[a:b].copy_(self._codec.decode(arr))
        if plus is not None:
            self._base.add_(plus)
        offset = 0
        with torch.no_grad():
            for p in self._params:
                n = p.numel()
                p.copy_(self._base[offset : offset + n].view_as(p))
                offset += n
        self._stamp = min(slowest for _, _, slowest in replies)
        self._installed = True
        self._record_clocks(replies)

    def _record_clocks(self, replies: list[Any]) -> None:
        clocks = [max(cs) for cs in zip(*(c for _, c, _ in replies))]
        with self._lock:
            self._stats.clocks = clocks
            self._stats.bytes_pulled += sum(arr.nbytes for arr, _, _ in replies)
            self._stats.bytes_cross_node += sum(
                arr.nbytes for s, (arr, _, _) in enumerate(replies) if s in self._remote
            )

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
        """Nothing runs in the background; kept for the common client interface."""
