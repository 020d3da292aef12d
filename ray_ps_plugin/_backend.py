"""``PSBackend``: the shards' lives inside Ray Train's controller (start, place, stop).

Ray Train instantiates the backend ``PSConfig.backend_cls`` names inside its
controller actor; ``on_start`` runs once the workers' placement group and actors
exist, before the user's function starts, and ``on_shutdown`` before the group is
torn down. The controller owns the shard actors, so they die with it.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import ray
from ray.train.backend import BackendConfig
from ray.train.torch import TorchConfig
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from ray_ps_plugin import _runtime
from ray_ps_plugin._modes import spec_of
from ray_ps_plugin._ray_compat import TorchBackend, worker_placement_group, worker_places
from ray_ps_plugin._types import RunSettings, ServerPlacement

__all__ = ["BackendSettings", "PSBackend", "shard_placements"]

logger = logging.getLogger(__name__)


class BackendSettings(RunSettings, Protocol):
    """What the backend reads of ``PSConfig`` besides what the workers read."""

    num_servers: int | None
    server_placement: ServerPlacement


def _per_node(worker_group: Any, cfg: BackendSettings) -> bool:
    """Whether the run gets one shard per node (see ``PSConfig.server_placement``)."""
    if cfg.server_placement != "auto":
        return cfg.server_placement == "node"
    if cfg.num_servers is not None or not spec_of(cfg).relays_chunks:
        return False
    if cfg.data_path != "tcp" or not cfg.node_aggregation:
        return False  # without relays, per-node shards would only concentrate the work
    nodes = [p.node_id for p in worker_places(worker_group)]
    return len(set(nodes)) > 1 and len(set(nodes)) < len(nodes)


def shard_placements(worker_group: Any, num_servers: int | None, per_node: bool) -> list[Any]:
    """One scheduling strategy per shard: shard i goes where worker i % W lives.

    With ``per_node`` there is one shard per node, with the node's lowest-rank worker.
    ``num_servers=None`` means one per worker.

    The shard is put *inside* its worker's placement-group bundle with ``num_cpus=0``
    so it is reserved and released together with the workers and never competes with
    other trials for CPUs. Without an explicit strategy an actor created by the
    controller inside a Tune trial would be captured into the trial's group.
    """
    places = worker_places(worker_group)
    if per_node:
        first: dict[str, Any] = {}
        for p in places:
            first.setdefault(p.node_id, p)
        places = list(first.values())
        num_servers = len(places)
    num_servers = num_servers or len(places)
    pg = worker_placement_group(worker_group)
    strategies: list[Any] = []
    for i in range(num_servers):
        place = places[i % len(places)]
        if pg is not None and place.bundle_index is not None:
            strategies.append(
                PlacementGroupSchedulingStrategy(
                    placement_group=pg,
                    placement_group_bundle_index=place.bundle_index,
                    placement_group_capture_child_tasks=False,
                )
            )
        else:
            strategies.append(NodeAffinitySchedulingStrategy(place.node_id, soft=False))
    return strategies


class PSBackend(TorchBackend):
    """Torch backend plus the parameter-server shards of one run.

    Runs inside Ray Train's controller actor. The controller owns the shard actors,
    so they die with it even when Tune aborts a trial without calling
    ``on_shutdown``.
    """

    def __init__(self) -> None:
        super().__init__()
        self._servers: list[Any] = []

    def on_start(self, worker_group: Any, backend_config: BackendConfig) -> None:
        cfg = _settings(backend_config)
        assert isinstance(backend_config, TorchConfig)  # _settings checked it
        try:
            # The torch process group stays: DDP's constructor broadcasts rank 0's
            # parameters and buffers through it so all workers start identical.
            super().on_start(worker_group, backend_config)
            self._start_servers(worker_group, cfg)
        except BaseException:
            # Ray calls no on_shutdown when on_start raises: undo here.
            self._stop_servers()
            pg = worker_placement_group(worker_group)
            if pg is not None:
                try:
                    ray.util.remove_placement_group(pg)
                except Exception as e:
                    logger.warning("Could not remove the worker placement group: %s", e)
            raise

    def shard_class(self, cfg: BackendSettings) -> type:
        """The shard class of ``cfg.mode`` (tests substitute instrumented ones)."""
        return spec_of(cfg).shard_cls

    def _start_servers(self, worker_group: Any, cfg: BackendSettings) -> None:
        num_workers = len(worker_group)
        placements = shard_placements(
            worker_group, cfg.num_servers, per_node=_per_node(worker_group, cfg)
        )
        spec = spec_of(cfg)
        actor_cls: Any = ray.remote(self.shard_class(cfg))
        args = spec.shard_args(cfg)
        for i, strategy in enumerate(placements):
            self._servers.append(
                actor_cls.options(
                    num_cpus=0,
                    scheduling_strategy=strategy,
                    max_restarts=0,
                    max_concurrency=spec.max_concurrency,
                ).remote(i, num_workers, *args)
            )
        try:
            ready = ray.get(
                [s.ready.remote() for s in self._servers], timeout=cfg.ps_start_timeout_s
            )
        except ray.exceptions.GetTimeoutError as e:
            raise TimeoutError(
                f"{len(placements)} parameter-server shard(s) did not start within "
                f"ps_start_timeout_s={cfg.ps_start_timeout_s:g}s."
            ) from e
        server_nodes = [r["node_id"] for r in ready]
        worker_nodes = [p.node_id for p in worker_places(worker_group)]
        connect = spec.connect
        info = _runtime.RunInfo(
            settings=cfg,
            servers=list(self._servers),
            server_node_ids=server_nodes,
            topology=connect(self._servers, worker_nodes, server_nodes, cfg) if connect else None,
        )
        ray.get(worker_group.execute_async(_runtime.install_run, info), timeout=cfg.ps_timeout_s)
        logger.info(
            "Started %d parameter-server shard(s) for %d workers.", len(placements), num_workers
        )

    def on_shutdown(self, worker_group: Any, backend_config: BackendConfig) -> None:
        cfg = _settings(backend_config)
        try:
            ray.get(
                worker_group.execute_async(_runtime.uninstall_run),
                timeout=cfg.ps_timeout_s,
            )
        except Exception as e:
            logger.warning("Could not reach every worker on shutdown: %s", e)
        finally:
            self._stop_servers()
            super().on_shutdown(worker_group, backend_config)

    def _stop_servers(self) -> None:
        # ray.kill returns at once (no wait to bound); the actors' bundles are
        # released with the workers' placement group.
        servers, self._servers = self._servers, []
        for s in servers:
            ray.kill(s, no_restart=True)


def _settings(backend_config: BackendConfig) -> BackendSettings:
    """The run's PSConfig (which satisfies :class:`BackendSettings`)."""
    if not isinstance(backend_config, TorchConfig) or not hasattr(
        backend_config, "server_placement"
    ):
        raise TypeError(
            f"PSBackend needs a PSConfig, got {type(backend_config).__name__}: pass "
            "torch_config=PSConfig(...) to TorchTrainer, or use PSTrainer."
        )
    return backend_config  # type: ignore[return-value]
