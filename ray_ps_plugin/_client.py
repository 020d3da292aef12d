"""What the worker clients of every mode share: set-up, checks, errors, counters.

A client serves one prepared model on one worker. The mode decides how it talks
to the shards (:mod:`ray_ps_plugin._sync.client`, :mod:`ray_ps_plugin._param.client`);
this base holds what does not depend on the mode: the NaN/Inf guard, the check that
the set of trainable parameters has not changed since ``prepare_model``, the error
kept from a failed background round, and the :class:`~ray_ps_plugin.PSStats`
counters.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from ray_ps_plugin._metrics import WorkerMetrics
from ray_ps_plugin._nonfinite import NonFiniteGuard
from ray_ps_plugin._stats import PSStats
from ray_ps_plugin._transport import Handle, Transport, wait_all
from ray_ps_plugin._types import RunSettings

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

    from ray_ps_plugin._codec import Codec

__all__ = ["ClientBase", "ClientSetup", "ModelHook", "warn_kept_live"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClientSetup:
    """Everything a client needs to know about its model, its worker and the run.

    Attributes:
        model_id: The prepared model's id on the shards: the order in which this
            worker prepared it (the same on every worker, as DDP requires).
        module: The user's model.
        params: Its trainable parameters, in ``module.parameters()`` order.
        rank: This worker's world rank.
        world_size: Number of workers.
        num_shards: Number of shards.
        settings: The run's PSConfig.
        local_shards: Shards this worker reaches through shared memory.
        remote_shards: Shards on other nodes (their traffic crosses the network).
        metrics: Exports the counters through ``ray.util.metrics``, if available.
        topology: The run's topology from the mode's start-up (sync), or ``None``.
        staleness: The clock gap the shards allow (``None``: no bound).
        joined: Whether the shards already hold the run's state (this worker
            replaces a lost one, or its group restarted): the client takes their
            parameters and clocks instead of seeding them.
    """

    model_id: int
    module: torch.nn.Module
    params: tuple[torch.Tensor, ...]
    rank: int
    world_size: int
    num_shards: int
    settings: RunSettings
    local_shards: tuple[int, ...] = ()
    remote_shards: frozenset[int] = frozenset()
    metrics: WorkerMetrics | None = None
    topology: Any = None
    staleness: int | None = None
    joined: bool = False


def _trainable_flags(module: torch.nn.Module) -> tuple[tuple[str, bool], ...]:
    return tuple((name, p.requires_grad) for name, p in module.named_parameters())


class ClientBase(abc.ABC):
    """The mode-independent half of a worker client.

    Args:
        setup: The model, its worker and the run.
        num_shards: Number of shards (sizes the per-shard counters).
        check_local: Whether the NaN/Inf guard inspects local gradients (async/ssp)
            rather than flags raised on the summed ones (sync).
    """

    #: How calls reach the shards (set by each mode's client).
    _transport: Transport

    def __init__(self, setup: ClientSetup, num_shards: int, check_local: bool) -> None:
        self.setup = setup
        self.model_id = setup.model_id
        #: The clock this worker went on from: 0, or where the shards held its rank
        #: when it joined them (see ``ClientSetup.joined``).
        self.start_clock = 0
        self.rank = setup.rank
        self.world_size = setup.world_size
        self.settings = setup.settings
        self.remote_shards = setup.remote_shards
        self.guard = NonFiniteGuard(
            setup.settings.nan_policy, setup.rank, setup.params, check_local
        )
        self._metrics = setup.metrics
        self._lock = threading.Lock()
        self._stats = PSStats(bytes_pushed_per_shard=[0] * num_shards)
        self._error: BaseException | None = None
        self._error_tb: TracebackType | None = None
        self._trainable = _trainable_flags(setup.module)

    # --- the contract with the runtime (optimizer hooks, forward, context exit) ---
    @abc.abstractmethod
    def bind(self, ddp: DistributedDataParallel) -> None:
        """Connects the client to the DDP object that wraps its model."""

    def owns(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` steps any of this model's trainable parameters."""
        return self.guard.owns(optimizer)

    @property
    @abc.abstractmethod
    def next_step(self) -> int:
        """The step (sync round or clock) the next optimizer step applies."""

    @property
    @abc.abstractmethod
    def shared_memory_shards(self) -> tuple[int, ...]:
        """Shards reached through shared memory, in index order."""

    def before_forward(self) -> None:
        """Called before each forward pass of the model."""
        self.raise_pending()

    def before_step(self) -> None:
        """Called before an optimizer that owns the model steps."""
        self.raise_pending()
        self.check_trainable()
        self.guard.before_step(self.next_step)

    def after_step(self) -> None:  # noqa: B027 - a no-op by default, not abstract
        """Called after an optimizer that owns the model stepped."""

    def flush(self) -> None:
        """Waits until this worker's updates are applied on every shard."""
        self.raise_pending()

    def peers_behind(self) -> bool:
        """Whether, on the shards, another worker has yet to reach the clock this
        one is at (sync clients keep no clocks: never)."""
        return False

    @property
    def start_step(self) -> int:
        """The optimizer step this worker went on from (``start_clock`` counts steps
        here; a mode whose clock counts something else says how many steps)."""
        return self.start_clock

    def finish(self, clean: bool = True) -> None:
        """Called once when the training function ends.

        Args:
            clean: Whether it returned (``False``: it raised, so nothing new is sent).
        """
        self.raise_pending()

    def close(self) -> None:  # noqa: B027 - a no-op by default, not abstract
        """Releases threads and shared memory (never raises)."""

    def feedback_codec(self) -> Codec | None:
        """The codec whose error feedback this model's pushes go through (``None``
        where nothing it sends is lossy)."""
        return None

    @property
    def transport(self) -> Transport:
        """How this model's calls reach the shards."""
        return self._transport

    def outer_state_dict(self) -> dict[str, Any]:
        """The state the shards keep beside the parameters (``"diloco"``'s outer
        optimizer), for a checkpoint.

        Raises:
            ValueError: This mode keeps none.
        """
        raise ValueError(
            f"mode={self.settings.mode!r} keeps no outer optimizer state on the shards; "
            "only mode='diloco' does."
        )

    def load_outer_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what :meth:`outer_state_dict` returned.

        Raises:
            ValueError: This mode keeps none.
        """
        self.outer_state_dict()  # raises the same error

    # --- shared mechanics ----------------------------------------------------------
    def fail(self, error: BaseException) -> None:
        """Keeps the first error of a background round for :meth:`raise_pending`."""
        with self._lock:
            if self._error is None:
                self._error = error
                self._error_tb = error.__traceback__

    def raise_pending(self) -> None:
        """Raises a kept error; every later call raises it again (the run is broken)."""
        with self._lock:
            error, tb = self._error, self._error_tb
        if error is not None:
            # Re-raising one object adds every raise's frames to its traceback; each
            # raise starts again from the original one.
            raise error.with_traceback(tb)

    def check_trainable(self) -> None:
        """Refuses a change of ``requires_grad`` since ``prepare_model``.

        The shards hold exactly the parameters that were trainable when the model
        was prepared; a parameter unfrozen later would train on each worker alone,
        silently out of sync.

        Raises:
            ValueError: Naming the parameter and the fix.
        """
        now = _trainable_flags(self.setup.module)
        if now == self._trainable:
            return
        changed = [n for (n, a), (_, b) in zip(self._trainable, now) if a != b] or ["(layout)"]
        raise ValueError(
            f"rank {self.rank}: parameter(s) {changed[:3]} changed requires_grad after "
            "prepare_model(); the parameter servers synchronise exactly the parameters "
            "that were trainable when the model was prepared. Set requires_grad before "
            "prepare_model(), and freeze a parameter mid-run by leaving it out of the "
            "optimizer instead, or use PSConfig(strategy='ddp')."
        )

    def _count_push(self, shard: int, nbytes: int) -> None:
        """Adds a push to the counters (the caller holds ``_lock``)."""
        self._stats.bytes_pushed += nbytes
        self._stats.bytes_pushed_per_shard[shard] += nbytes
        if shard in self.remote_shards:
            self._stats.bytes_cross_node += nbytes

    def _export_metrics(self) -> None:
        """Exports the counters to Ray's metrics when their interval is due; a
        failed export is logged, never raised into the training loop."""
        try:
            if self._metrics is not None and self._metrics.due():
                self._metrics.export(self.snapshot())
        except Exception:
            logger.debug("metrics export failed", exc_info=True)

    def snapshot(self) -> PSStats:
        """A copy of the counters, safe to read from any thread."""
        with self._lock:
            return dataclasses.replace(
                self._stats,
                bytes_pushed_per_shard=list(self._stats.bytes_pushed_per_shard),
                clocks=list(self._stats.clocks),
                skipped_steps=self.guard.skipped,
            )

    def _wait_counted(self, handles: list[Handle[Any]], what: str) -> list[Any]:
        """:meth:`_wait`, with the time blocked added to ``PSStats.wait_s``."""
        started = time.perf_counter()
        results = self._wait(handles, what)
        with self._lock:
            self._stats.wait_s += time.perf_counter() - started
        return results

    def _wait(self, handles: list[Handle[Any]], what: str) -> list[Any]:
        """The results of one call per shard, in shard order, bounded by
        ``ps_timeout_s`` (an error names the shard and ``what``)."""
        shards = list(range(len(handles)))
        return wait_all(
            self._transport,
            handles,
            shards,
            self.settings.ps_timeout_s,
            f"rank {self.rank}: model {self.model_id}: {what}",
        )


class ModelHook:
    """A module hook that calls its client back, for the module it was made for only.

    Copies of the module (``copy.deepcopy``, ``pickle``, ``torch.save``) copy their
    hooks; such a copy gets an inert hook, so it never reaches the shards, and the
    hook itself pickles.

    Args:
        module: The prepared model's module.
        callback: What to run when the hook fires for that module.
    """

    def __init__(self, module: torch.nn.Module | None, callback: Callable[[], None] | None) -> None:
        self._module = weakref.ref(module) if module is not None else None
        self._callback = callback

    def __call__(self, module: torch.nn.Module, *args: object) -> None:
        if self._callback is not None and self._module is not None and module is self._module():
            self._callback()

    def __reduce__(self) -> tuple[type[ModelHook], tuple[None, None]]:
        return (ModelHook, (None, None))


@functools.cache
def warn_kept_live(rank: int) -> None:
    """Warns once per rank that a load into a worker that joined live shards keeps
    the shards' parameters (see the clients' ``reseed``)."""
    logger.warning(
        "rank %d: load_state_dict() after joining live parameter servers keeps their "
        "parameters, which hold every update applied since the checkpoint; the loaded "
        "values are not sent to them. (On a fresh start a load seeds the servers.)",
        rank,
    )
