"""Every use of a Ray name that is not public API, in one place.

Ray Train V2 gives a backend its worker group, but the worker group's node ids,
bundle indices and placement group are internal; so are the controller callbacks
the Tune reaper plugs into, and the torch backend class and context this backend
extends. (Which DDP a training function builds is decided on torch's public class,
in ``_ddp.py``, with no Ray name involved.) Each touch below names the Ray version
it was checked against. ``tests/unit/
test_ray_compat.py`` exercises every one, so a Ray release that moves a name fails
there, loudly, instead of deep inside a run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Checked against Ray 2.60.0: the backend class and train-function context that
# TorchConfig uses (ray/train/torch/config.py).
from ray.train.torch.config import TorchConfigContextManager, _TorchBackend

# Checked against Ray 2.60.0: Train V2's controller and worker-group callback bases
# (ray/train/v2/_internal/execution/callback.py).
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

# Checked against Ray 2.60.0: a backend with ``has_replica_groups`` gets ``on_start`` and
# ``on_shutdown`` with one replaced ``ReplicaGroup`` (ray/train/v2/_internal/execution/
# worker_group/execution_group.py) as well as with the whole ``WorkerGroup``.
from ray.train.v2._internal.execution.worker_group import ReplicaGroup

__all__ = [
    "CHECKED_RAY_VERSION",
    "ControllerCallback",
    "TorchBackend",
    "TorchConfigContextManager",
    "WorkerGroupCallback",
    "WorkerPlace",
    "actor_table",
    "ended_cleanly",
    "group_ranks",
    "is_replica_group",
    "kill_workers",
    "ping_actor",
    "redo_reset_reports",
    "trial_storage",
    "worker_placement_group",
    "worker_places",
]

CHECKED_RAY_VERSION = "2.60.0"

logger = logging.getLogger(__name__)

# A report is gone through again once per barrier reset, i.e. per replacement; more
# in a row means something else is wrong, and Ray Train's own skip then stands.
_MAX_REDOS = 8

TorchBackend = _TorchBackend


@dataclass(frozen=True)
class WorkerPlace:
    """Where one worker of a Train worker group runs.

    Attributes:
        node_id: The worker's Ray node id.
        bundle_index: Its bundle in the worker group's placement group, if known.
    """

    node_id: str
    bundle_index: int | None


def worker_places(worker_group: Any) -> list[WorkerPlace]:
    """Node and bundle of every worker, in world-rank order.

    Checked against Ray 2.60.0: ``WorkerGroup.get_workers()`` returns ``Worker``s
    with ``metadata.node_id`` and ``placement_group_bundle_index``.
    """
    return [
        WorkerPlace(w.metadata.node_id, getattr(w, "placement_group_bundle_index", None))
        for w in worker_group.get_workers()
    ]


def worker_placement_group(worker_group: Any) -> Any | None:
    """The worker group's placement group, or ``None`` while it is not started.

    Checked against Ray 2.60.0: ``WorkerGroup.has_started()`` and
    ``WorkerGroup.get_worker_group_state().placement_group_handle.placement_group``
    (the state getter raises while the group is not started).
    """
    if not worker_group.has_started():
        return None
    return worker_group.get_worker_group_state().placement_group_handle.placement_group


def trial_storage(tune_context: Any) -> dict[str, Any]:
    """The Tune experiment's ``storage_path`` and ``storage_filesystem``.

    Checked against Ray 2.60.0: ``TuneContext.get_storage()`` (a DeveloperAPI)
    returns a ``StorageContext`` with ``experiment_fs_path`` and
    ``storage_filesystem``.
    """
    storage = tune_context.get_storage()
    return {
        "storage_path": storage.experiment_fs_path,
        "storage_filesystem": storage.storage_filesystem,
    }


def ping_actor(handle: Any) -> Any:
    """An ObjectRef that resolves once the actor answers (``__ray_ready__``).

    Checked against Ray 2.60.0: every actor handle has ``__ray_ready__``.
    """
    return handle.__ray_ready__.remote()


def actor_table() -> list[dict[str, Any]]:
    """Every actor the GCS knows, as dicts (no dashboard needed).

    Checked against Ray 2.60.0: ``ray._private.state.actors()``; keys
    ``ActorClassName``, ``State``, ``Address``, ``OwnerAddress``.
    """
    import ray._private.state

    return list(ray._private.state.actors().values())


def is_replica_group(group: Any) -> bool:
    """Whether a backend hook got one replaced replica group, not the worker group."""
    return isinstance(group, ReplicaGroup)


def group_ranks(group: Any) -> list[int]:
    """The world ranks of a worker or replica group's workers.

    Checked against Ray 2.60.0: ``Worker.distributed_context.world_rank``.
    """
    return [w.distributed_context.world_rank for w in group.get_workers()]


def kill_workers(group: Any) -> None:
    """Kills every worker process of a worker group (Ray Train then restarts them).

    Checked against Ray 2.60.0: ``Worker.actor``, the worker's actor handle.
    """
    import ray

    for w in group.get_workers():
        ray.kill(w.actor, no_restart=True)


def ended_cleanly(worker_group: Any) -> bool:
    """Whether every worker's training function returned without an error (the
    run is over), as the controller's latest poll saw it.

    Checked against Ray 2.60.0: ``WorkerGroup.get_latest_poll_status()`` returns a
    ``WorkerGroupPollStatus`` with ``finished`` and ``errors``.
    """
    status = worker_group.get_latest_poll_status()
    return status is not None and bool(status.finished) and not status.errors


def redo_reset_reports(redo: Callable[[], bool]) -> None:
    """Makes this worker's ``ray.train.report`` go through again a report Ray Train
    skipped because a replica group's replacement reset the report barrier, when
    ``redo()`` says another worker will still make that report.

    Otherwise the workers' reports fall out of step: the survivor's next report
    meets the replacement's repeat of the skipped one, and at the end one worker
    waits at a report no one else makes.

    Checked against Ray 2.60.0: ``TrainContext.report`` (ray/train/v2/_internal/
    execution/context.py) catches ``SynchronizationBarrierResetError``, logs
    "Skipping this report", puts ``report_call_index`` back and returns;
    ``ray.train.report`` calls ``report`` on the worker's ``get_train_context()``,
    whose instance attribute shadows the method.
    """
    from ray.train.v2._internal.execution.context import get_train_context

    try:
        ctx = get_train_context()
    except RuntimeError:  # not in a Ray Train worker: there are no reports
        return
    if getattr(ctx, "_ps_redoes_reports", False):
        return
    original = ctx.report

    def report(*args: Any, **kwargs: Any) -> Any:
        result = None
        for _ in range(_MAX_REDOS):
            before = ctx.report_call_index
            result = original(*args, **kwargs)
            if ctx.report_call_index != before or not redo():
                return result
            logger.warning(
                "A lost worker's replacement reset this report's barrier; it will make "
                "this report again, so this worker goes through it again and waits for it."
            )
        return result

    # setattr: instance attributes Ray's class does not declare.
    setattr(ctx, "report", report)  # noqa: B010
    setattr(ctx, "_ps_redoes_reports", True)  # noqa: B010
