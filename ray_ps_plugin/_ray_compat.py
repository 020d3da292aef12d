"""Every use of a Ray name that is not public API, in one place.

Ray Train V2 gives a backend its worker group, but the worker group's node ids,
bundle indices and placement group are internal; so are the controller callbacks
the Tune reaper plugs into, the torch backend class and context this backend extends,
and the module-global ``DistributedDataParallel`` that ``prepare_model`` reads. Each
touch below names the Ray version it was checked against. ``tests/unit/
test_ray_compat.py`` exercises every one, so a Ray release that moves a name fails
there, loudly, instead of deep inside a run.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# Checked against Ray 2.60.0: the backend class and train-function context that
# TorchConfig uses (ray/train/torch/config.py).
from ray.train.torch.config import TorchConfigContextManager, _TorchBackend

# Checked against Ray 2.60.0: Train V2's controller and worker-group callback bases
# (ray/train/v2/_internal/execution/callback.py).
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

__all__ = [
    "CHECKED_RAY_VERSION",
    "ControllerCallback",
    "TorchBackend",
    "TorchConfigContextManager",
    "WorkerGroupCallback",
    "WorkerPlace",
    "actor_table",
    "ping_actor",
    "prepare_model_modules",
    "swap_prepare_model_ddp",
    "worker_placement_group",
    "worker_places",
]

CHECKED_RAY_VERSION = "2.60.0"

TorchBackend = _TorchBackend

# Checked against Ray 2.60.0: modules whose global ``DistributedDataParallel`` is
# looked up by ``ray.train.torch.prepare_model`` at call time (V2 first, then V1).
_PREPARE_MODEL_MODULES = (
    "ray.train.v2.torch.train_loop_utils",
    "ray.train.torch.train_loop_utils",
)


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
    """The worker group's placement group, or ``None`` where it has none yet.

    Checked against Ray 2.60.0:
    ``WorkerGroup.get_worker_group_state().placement_group_handle.placement_group``;
    the state getter raises while the group is not started.
    """
    try:
        return worker_group.get_worker_group_state().placement_group_handle.placement_group
    except Exception:
        return None


def prepare_model_modules() -> list[Any]:
    """The imported modules whose ``DistributedDataParallel`` prepare_model reads."""
    mods = []
    for name in _PREPARE_MODEL_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "DistributedDataParallel"):
            mods.append(mod)
    return mods


@contextlib.contextmanager
def swap_prepare_model_ddp(cls: type) -> Iterator[None]:
    """Makes ``ray.train.torch.prepare_model`` build ``cls`` instead of DDP.

    Raises:
        RuntimeError: If no module to patch exists. Training would otherwise run
            with all-reduce while reporting parameter servers.
    """
    mods = prepare_model_modules()
    if not mods:
        raise RuntimeError(
            "ray_ps_plugin could not find the DistributedDataParallel that "
            f"ray.train.torch.prepare_model uses (looked in {_PREPARE_MODEL_MODULES}); "
            f"this Ray release moved it (checked against Ray {CHECKED_RAY_VERSION}). "
            "Use PSConfig(strategy='ddp') or a supported Ray version."
        )
    saved = [(mod, mod.DistributedDataParallel) for mod in mods]
    for mod, _ in saved:
        mod.DistributedDataParallel = cls
    try:
        yield
    finally:
        for mod, original in saved:
            mod.DistributedDataParallel = original


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
