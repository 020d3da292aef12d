"""Backend hooks: start, place and stop the server shards; hand them to the workers.

Runs inside Ray Train's controller actor. The controller owns the shard actors, so
they die with it even when Tune aborts a trial without calling ``on_shutdown``.
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray.train.torch.config import _TorchBackend
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from ray_ps_plugin import _worker
from ray_ps_plugin._param_server import ParamShardServer
from ray_ps_plugin._server import ShardServer
from ray_ps_plugin.config import PSConfig

logger = logging.getLogger(__name__)

# Shards are asyncio actors: one event-loop thread, many pushes waiting at once.
# Sync mode sums gradients; async and ssp own the parameters.
_SumShard = ray.remote(ShardServer)
_ParamShard = ray.remote(ParamShardServer)


def _shard_actor(cfg: PSConfig, shard: int, num_workers: int) -> tuple[Any, tuple[Any, ...]]:
    """The actor class of ``cfg.mode`` and its constructor arguments."""
    if cfg.mode == "sync":
        return _SumShard, (shard, num_workers, cfg.ps_timeout_s, cfg.compression)
    staleness = cfg.staleness if cfg.mode == "ssp" else None
    return _ParamShard, (shard, num_workers, staleness, cfg.ps_timeout_s, cfg.compression)


def _placements(worker_group: Any, num_servers: int | None, per_node: bool) -> list[Any]:
    """One scheduling strategy per shard: shard i goes where worker i % W lives.

    With ``per_node`` there is one shard per node, with the node's lowest-rank worker.
    ``num_servers=None`` means one per worker.

    The shard is put *inside* its worker's placement-group bundle with ``num_cpus=0``
    so it is reserved and released together with the workers and never competes with
    other trials for CPUs. Without an explicit strategy an actor created by the
    controller inside a Tune trial would be captured into the trial's group.
    """
    workers = list(worker_group.get_workers())
    if per_node:
        first: dict[str, Any] = {}
        for w in workers:
            first.setdefault(w.metadata.node_id, w)
        workers = list(first.values())
        num_servers = len(workers)
    num_servers = num_servers or len(workers)
    pg = None
    try:
        pg = worker_group.get_worker_group_state().placement_group_handle.placement_group
    except AttributeError:  # pragma: no cover - V1 worker groups have no such state
        pass
    strategies = []
    for i in range(num_servers):
        w = workers[i % len(workers)]
        if pg is not None and w.placement_group_bundle_index is not None:
            strategies.append(
                PlacementGroupSchedulingStrategy(
                    placement_group=pg,
                    placement_group_bundle_index=w.placement_group_bundle_index,
                    placement_group_capture_child_tasks=False,
                )
            )
        else:
            strategies.append(NodeAffinitySchedulingStrategy(w.metadata.node_id, soft=False))
    return strategies


class PSBackend(_TorchBackend):
    """Torch backend plus the parameter-server shards of one run."""

    def __init__(self) -> None:
        super().__init__()
        self._servers: list[Any] = []

    def on_start(self, worker_group: Any, backend_config: PSConfig) -> None:
        try:
            # The torch process group stays: DDP's constructor broadcasts rank 0's
            # parameters and buffers through it so all workers start identical.
            super().on_start(worker_group, backend_config)
            self._start_servers(worker_group, backend_config)
        except BaseException:
            # Ray calls no on_shutdown when on_start raises (BRIEF §3): undo here.
            self._stop_servers()
            _remove_placement_group(worker_group)
            raise

    def _start_servers(self, worker_group: Any, cfg: PSConfig) -> None:
        num_workers = len(worker_group)
        placements = _placements(
            worker_group, cfg.num_servers, per_node=cfg.server_placement == "node"
        )
        num_servers = len(placements)
        for i, strategy in enumerate(placements):
            actor_cls, args = _shard_actor(cfg, i, num_workers)
            self._servers.append(
                actor_cls.options(
                    num_cpus=0,
                    scheduling_strategy=strategy,
                    name=None,
                    max_restarts=0,
                    max_concurrency=_worker.SHARD_MAX_CONCURRENCY,
                ).remote(*args)
            )
        try:
            ready = ray.get(
                [s.ready.remote() for s in self._servers], timeout=cfg.ps_start_timeout_s
            )
        except ray.exceptions.GetTimeoutError as e:
            raise TimeoutError(
                f"{num_servers} parameter-server shard(s) did not start within "
                f"ps_start_timeout_s={cfg.ps_start_timeout_s:g}s."
            ) from e
        info = _worker.RunInfo(
            servers=list(self._servers),
            server_node_ids=[r["node_id"] for r in ready],
            mode=cfg.mode,
            chunk_bytes=cfg.chunk_bytes,
            timeout_s=cfg.ps_timeout_s,
            staleness=cfg.staleness if cfg.mode == "ssp" else None,
            nan_policy=cfg.nan_policy,
            compression=cfg.compression,
            shared_memory=cfg.shared_memory,
        )
        ray.get(worker_group.execute_async(_worker.install_run, info), timeout=cfg.ps_timeout_s)
        logger.info("Started %d parameter-server shard(s) for %d workers.", num_servers, num_workers)

    def on_shutdown(self, worker_group: Any, backend_config: PSConfig) -> None:
        try:
            ray.get(
                worker_group.execute_async(_worker.uninstall_run),
                timeout=backend_config.ps_timeout_s,
            )
        except Exception as e:  # noqa: BLE001 - dead workers must not keep shards alive
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


def _remove_placement_group(worker_group: Any) -> None:
    try:
        pg = worker_group.get_worker_group_state().placement_group_handle.placement_group
    except Exception:  # noqa: BLE001 - nothing was reserved yet
        return
    try:
        ray.util.remove_placement_group(pg)
    except Exception as e:  # noqa: BLE001
        logger.warning("Could not remove the worker placement group: %s", e)
