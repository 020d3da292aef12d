"""Ray Tune sweeps over ``strategy``, ``mode`` and ordinary hyperparameters.

Ray Train V2 runs inside Ray Tune as a *function trainable*: each trial calls a small
driver function that builds a trainer whose ``RunConfig`` forwards every report to Tune
and calls ``fit()``. :func:`make_trainable` writes that driver function for a PS/DDP
training loop, so the strategy and the consistency mode become ordinary search-space
entries::

    from ray import tune
    from ray.train import ScalingConfig
    from ray_ps_plugin.tune import make_trainable

    trainable = make_trainable(train_fn, ScalingConfig(num_workers=2))
    tuner = tune.Tuner(
        trainable,
        param_space={
            "ps_config": tune.grid_search([{"strategy": "ddp"}, {"strategy": "ps"}]),
            "lr": tune.grid_search([0.01, 0.1]),
        },
        tune_config=tune.TuneConfig(max_concurrent_trials=2),
    )

See ``docs/tune.md`` for the resource rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import ray
import ray.tune
from ray.train import RunConfig, ScalingConfig, UserCallback
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_ps_plugin._ray_compat import (
    ControllerCallback,
    WorkerGroupCallback,
    ping_actor,
    trial_storage,
    worker_placement_group,
)
from ray_ps_plugin._tune_reports import ReportsToTune
from ray_ps_plugin.config import PSConfig
from ray_ps_plugin.trainer import PSTrainer

__all__ = ["PS_CONFIG_KEY", "make_trainable", "split_trial_config"]

logger = logging.getLogger(__name__)

PS_CONFIG_KEY = "ps_config"
"""Trial-config key of an optional dict of PSConfig fields.

A grid over such dicts sweeps (strategy, mode) *pairs*, so DDP, for which the mode
means nothing, is not run once per mode.
"""

_PS_FIELDS = frozenset(f.name for f in dataclasses.fields(PSConfig))
# Per-trial by design: a fixed strategy in ps_config_kwargs would make a typo such as
# "stratgy" in the search space fall silently into train_loop_config.
_TRIAL_ONLY_FIELDS = ("strategy", "mode")
# Set by make_trainable for every trial; see _run_config.
_RESERVED_RUN_CONFIG_KEYS = ("name",)


def split_trial_config(
    config: Mapping[str, Any], ps_config_kwargs: Mapping[str, Any] | None = None
) -> tuple[PSConfig, dict[str, Any]]:
    """Splits one trial's config into a ``PSConfig`` and the ``train_loop_config``.

    PSConfig fields are read from top-level keys with a field's name and from the
    optional dict under ``config["ps_config"]``; ``ps_config_kwargs`` gives defaults
    for the fields the trial does not set. Every other key goes to the training loop.

    Args:
        config: The trial config Tune passes to the trainable.
        ps_config_kwargs: Fixed PSConfig fields (timeouts, ``chunk_bytes``, ...)
            shared by all trials. ``strategy`` and ``mode`` are not allowed here.

    Returns:
        The validated ``PSConfig`` and the remaining keys as a new dict.

    Raises:
        ValueError: If ``strategy`` is missing, a field is set twice, a per-trial
            field is in ``ps_config_kwargs``, or PSConfig rejects a value.
        TypeError: If ``config["ps_config"]`` is not a dict, a key there is not a
            PSConfig field, or PSConfig rejects a value's type.
    """
    defaults = _check_ps_config_kwargs(ps_config_kwargs)
    loop_config = dict(config)
    nested = loop_config.pop(PS_CONFIG_KEY, {})
    if not isinstance(nested, Mapping):
        raise TypeError(
            f"Trial config key {PS_CONFIG_KEY!r} must be a dict of PSConfig fields, got "
            f"{type(nested).__name__} {nested!r}."
        )
    _check_fields(f"Trial config {PS_CONFIG_KEY!r}", nested)
    fields = dict(nested)
    for name in sorted(_PS_FIELDS & set(loop_config)):
        if name in fields:
            raise ValueError(
                f"PSConfig field {name!r} is set twice in the trial config: at the top "
                f"level and in {PS_CONFIG_KEY!r}; keep one."
            )
        fields[name] = loop_config.pop(name)
    if "strategy" not in fields:
        raise ValueError(
            "The trial config has no 'strategy': add 'strategy' (\"ddp\" or \"ps\") to "
            f"the param_space, at the top level or inside {PS_CONFIG_KEY!r}, e.g. "
            f"{PS_CONFIG_KEY!r}: tune.grid_search([{{'strategy': 'ddp'}}, "
            "{'strategy': 'ps', 'mode': 'sync'}])."
        )
    fields.setdefault("mode", "sync")
    return PSConfig(**{**defaults, **fields}), loop_config


def make_trainable(
    train_loop_per_worker: Callable[[dict[str, Any]], None],
    scaling_config: ScalingConfig,
    *,
    run_config_kwargs: Mapping[str, Any] | None = None,
    ps_config_kwargs: Mapping[str, Any] | None = None,
) -> Callable[[dict[str, Any]], None]:
    """Returns a Tune function trainable that runs one PS/DDP Train run per trial.

    Each trial builds ``PSConfig`` from its config (see :func:`split_trial_config`),
    runs ``PSTrainer(train_loop_per_worker, ...).fit()`` with the rest of the trial
    config as ``train_loop_config``, and forwards every ``ray.train.report`` to Tune
    (a reported checkpoint arrives as the ``checkpoint_path`` metric), the last one
    included: the trial ends only once Tune has taken every report of the run
    (``ray_ps_plugin._tune_reports`` says why Ray's ``TuneReportCallback`` is not
    used). A failed run raises, so Tune marks the trial failed.

    The Train run is named ``train-trial_id=<trial id>``: unique per trial and stable
    across Tune's trial retries, so a retried trial resumes the same run. Unless
    ``run_config_kwargs`` sets ``storage_path``, runs are written into the Tune
    experiment's directory, next to the trial directories.

    The trial itself only drives the run; its workers are reserved by Train. Limit
    ``tune.TuneConfig(max_concurrent_trials=...)`` so that every running trial's
    workers fit in the cluster at once (docs/tune.md).

    Args:
        train_loop_per_worker: The unchanged TorchTrainer training function.
        scaling_config: Workers of every trial's run.
        run_config_kwargs: Further ``ray.train.RunConfig`` arguments
            (``storage_path``, ``failure_config``, ``checkpoint_config``,
            ``callbacks`` — kept after the one forwarding reports). Not ``name``.
        ps_config_kwargs: PSConfig fields fixed for all trials, e.g.
            ``{"ps_timeout_s": 30}``; the trial config overrides them.

    Returns:
        A function ``trainable(config)`` to pass to ``ray.tune.Tuner``, optionally
        wrapped in ``ray.tune.with_resources``.

    Raises:
        TypeError: If ``scaling_config`` is not a ``ray.train.ScalingConfig`` or a
            kwargs mapping has an unknown key.
        ValueError: If ``run_config_kwargs`` sets ``name``, or ``ps_config_kwargs``
            sets ``strategy`` or ``mode``.
    """
    # Checked here, on the driver, so a wrong argument fails before any trial starts.
    if not callable(train_loop_per_worker):
        raise TypeError(
            f"train_loop_per_worker must be callable, got {type(train_loop_per_worker).__name__}."
        )
    if not isinstance(scaling_config, ScalingConfig):
        raise TypeError(
            "scaling_config must be a ray.train.ScalingConfig, got "
            f"{type(scaling_config).__name__}."
        )
    run_kwargs = _check_run_config_kwargs(run_config_kwargs)
    ps_defaults = _check_ps_config_kwargs(ps_config_kwargs)

    def trainable(config: dict[str, Any]) -> None:
        ps_config, loop_config = split_trial_config(config, ps_defaults)
        # Leaving the block waits until Tune has taken every report of the run, so
        # Tune's end-of-trial marker, sent when this function returns, comes last.
        with ReportsToTune() as reports:
            trainer = PSTrainer(
                train_loop_per_worker,
                train_loop_config=loop_config,
                ps_config=ps_config,
                scaling_config=scaling_config,
                run_config=_run_config(run_kwargs, reports.callback()),
            )
            trainer.fit()

    # Tune names the experiment directory and the trials after the function.
    name = getattr(train_loop_per_worker, "__name__", "train_loop")
    trainable.__name__ = trainable.__qualname__ = name
    trainable.__doc__ = f"Tune trainable: one PSTrainer run of {name} per trial."
    return trainable


def _run_config(run_kwargs: dict[str, Any], report_callback: UserCallback) -> RunConfig:
    """The RunConfig of the current trial's Train run (called inside the trial)."""
    ctx = ray.tune.get_context()
    kwargs = dict(run_kwargs)
    if "storage_path" not in kwargs:
        # Tune's storage is what the user configured for the sweep (NFS, S3, a tmp
        # dir): each Train run lands beside its trial instead of in ~/ray_results.
        kwargs.update(trial_storage(ctx))
    # First, so that user callbacks see each report once it is queued for Tune, as
    # with Ray's TuneReportCallback.
    kwargs["callbacks"] = [
        report_callback,
        *kwargs.get("callbacks", ()),
        _PlacementGroupReaperCallback(),
    ]
    # Ray's guide: the trial id in the name, no timestamp, so that a trial restarted
    # by Tune finds (storage_path, name) unchanged and resumes its Train run.
    kwargs["name"] = f"train-trial_id={ctx.get_trial_id()}"
    return RunConfig(**kwargs)


def _check_run_config_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    kwargs = dict(kwargs or {})
    for key in _RESERVED_RUN_CONFIG_KEYS:
        if key in kwargs:
            raise ValueError(
                f"run_config_kwargs must not set {key!r}: each trial's run is named "
                "'train-trial_id=<trial id>' so names are unique and a restarted trial "
                "resumes its own run. Name the sweep with ray.tune.RunConfig(name=...)."
            )
    valid = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = sorted(set(kwargs) - valid)
    if unknown:
        raise TypeError(f"run_config_kwargs has unknown RunConfig field(s) {unknown}.")
    return kwargs


def _check_ps_config_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    kwargs = dict(kwargs or {})
    for key in _TRIAL_ONLY_FIELDS:
        if key in kwargs:
            raise ValueError(
                f"ps_config_kwargs must not set {key!r}: it is chosen per trial; put "
                f"{key!r} in the Tune param_space (top level or inside {PS_CONFIG_KEY!r})."
            )
    _check_fields("ps_config_kwargs", kwargs)
    return kwargs


def _check_fields(where: str, keys: Mapping[str, Any]) -> None:
    unknown = sorted(set(keys) - _PS_FIELDS)
    if unknown:
        raise TypeError(
            f"{where} has key(s) {unknown} that are not PSConfig fields; valid fields: "
            f"{sorted(_PS_FIELDS)}."
        )


class _PlacementGroupReaperCallback(ControllerCallback, WorkerGroupCallback):
    """Removes the run's worker placement group if its controller dies unannounced.

    Why: Tune stops a trial (ASHA, max_t, a stopper) by ending the trial actor, which
    owns the Train controller, so the controller dies without shutting its worker
    group down. The shards go with it (the controller owns them), but a placement
    group created by an actor lives until the *job* ends. Ray Train 2.60 removes it
    with a PlacementGroupCleaner that asks the State API whether the controller
    lives; that API needs the Ray dashboard, absent with ``ray[train,tune]`` alone or
    ``include_dashboard=False``. There every stopped trial kept its workers' CPUs
    reserved and a long ASHA sweep starved. This reaper asks the controller itself.

    Runs inside the controller (an internal Train callback, the extension point Ray
    leaves for such workarounds: RunConfig passes non-user callbacks through).
    """

    def __init__(self) -> None:
        self._reaper: Any = None

    def after_controller_start(self, train_run_context: Any) -> None:
        runtime = ray.get_runtime_context()
        # Detached so it outlives the controller; an explicit strategy so it is not
        # captured into the trial's placement group, which Tune removes on stop.
        self._reaper = _Reaper.options(  # type: ignore[attr-defined]
            lifetime="detached",
            num_cpus=0,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(runtime.get_node_id(), soft=True),
        ).remote(runtime.current_actor)
        self._reaper.run.remote()

    def after_worker_group_start(self, worker_group: Any) -> None:
        pg = worker_placement_group(worker_group)
        if self._reaper is not None and pg is not None:
            self._reaper.watch.remote(pg)

    async def before_controller_shutdown(self) -> None:
        # A clean end: Train has removed the group; the reaper just leaves.
        if self._reaper is not None:
            self._reaper.stop.remote()


@ray.remote
class _Reaper:
    """Detached watcher of one Train controller (asyncio actor, one per run)."""

    _PING_INTERVAL_S = 1.0

    def __init__(self, controller: Any) -> None:
        self._controller = controller
        self._groups: list[Any] = []
        self._stopped = asyncio.Event()

    async def watch(self, placement_group: Any) -> None:
        self._groups.append(placement_group)

    async def stop(self) -> None:
        self._stopped.set()

    async def run(self) -> None:
        try:
            await self._watch()
        finally:
            # Whatever ended the loop, this detached actor must not outlive it.
            ray.actor.exit_actor()

    async def _watch(self) -> None:
        while not self._stopped.is_set():
            try:
                # Deliberately no timeout: a busy controller is alive, and treating a
                # slow answer as death would free the placement group of a live run.
                # Death itself is reported promptly as RayActorError.
                await ping_actor(self._controller)
            except ray.exceptions.ActorUnavailableError:
                pass  # transient (e.g. a network blip); keep asking
            except ray.exceptions.RayActorError:
                for pg in self._groups:
                    try:
                        ray.util.remove_placement_group(pg)
                    except Exception as e:
                        logger.debug("Placement group %s not removed: %s", pg.id, e)
                return
            except Exception:
                logger.warning("Reaper: unexpected error pinging the controller.", exc_info=True)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), self._PING_INTERVAL_S)
