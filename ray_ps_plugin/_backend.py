"""``PSBackend``: the shards' lives inside Ray Train's controller (start, place, stop).

Ray Train instantiates the backend ``PSConfig.backend_cls`` names inside its
controller actor; ``on_start`` runs once the workers' placement group and actors
exist, before the user's function starts, and ``on_shutdown`` before the group is
torn down. The controller owns the shard actors, so they die with it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import ray
from ray.train.backend import BackendConfig
from ray.train.torch import TorchConfig

from ray_ps_plugin import _runtime
from ray_ps_plugin._failover import Failover
from ray_ps_plugin._keeper import ReplicaKeeper
from ray_ps_plugin._modes import spec_of
from ray_ps_plugin._placement import (
    BackendSettings,
    nodes_for_replicas,
    place_replicas,
    place_shards,
    replica_on,
    unplaced_shards_message,
)
from ray_ps_plugin._ray_compat import (
    TorchBackend,
    ended_cleanly,
    group_ranks,
    is_replica_group,
    kill_workers,
    worker_placement_group,
    worker_places,
)

__all__ = ["PSBackend", "PSKeepingBackend"]

logger = logging.getLogger(__name__)


class PSBackend(TorchBackend):
    """Torch backend plus the parameter-server shards of one run.

    Runs inside Ray Train's controller actor. The controller owns the shard actors,
    so they die with it even when Tune aborts a trial without calling
    ``on_shutdown``. Where the mode's shards own the run's state (async, ssp,
    diloco: :class:`PSKeepingBackend`), a worker's loss costs its process alone, and
    a restart of the whole group takes the shards' state along.
    """

    def __init__(self) -> None:
        super().__init__()
        self._servers: list[Any] = []
        self._replicas: list[Any] = []  # PSConfig.shard_replicas: each shard's replica
        # Made with the shards: the backend is pickled to the controller first.
        self._failover: Failover | None = None
        self._keeper: ReplicaKeeper | None = None
        self._made: list[Any] = []  # replicas the keepers made, killed with the shards
        self._info: _runtime.RunInfo | None = None
        # After a stop that is not the run's end: each shard's exported state (object
        # refs owned by this controller), for the next group's shards.
        self._exported: list[Any] | None = None
        self._group: Any = None  # the whole worker group, from its last full start

    def on_start(self, worker_group: Any, backend_config: BackendConfig) -> None:
        cfg = _settings(backend_config)
        assert isinstance(backend_config, TorchConfig)  # _settings checked it
        if is_replica_group(worker_group):
            self._admit(worker_group, backend_config, cfg)
            return
        try:
            # The torch process group stays: DDP's constructor broadcasts rank 0's
            # parameters and buffers through it so all workers start identical.
            super().on_start(worker_group, backend_config)
            self._group = worker_group
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
        exported, self._exported = self._exported, None
        # A restart keeps the shards' count (and so each shard's slice): the
        # workers' number may have changed (an elastic resize).
        placements = place_shards(worker_group, cfg, len(exported) if exported else None)
        spec = spec_of(cfg)
        self._servers.extend(self._start_shards(placements, num_workers, cfg))
        server_nodes = self._ready(self._servers, cfg)
        replica_nodes: list[str] = []
        if cfg.shard_replicas:
            where = place_replicas(worker_group, cfg, server_nodes)
            self._replicas = self._start_shards(where, num_workers, cfg)
            replica_nodes = self._ready(self._replicas, cfg)
        self._failover = Failover(self._servers, self._replicas, cfg.ps_timeout_s)
        if exported:  # a replica takes the same state as its primary
            calls = [
                shard.import_state.remote(e)
                for shards in (self._servers, self._replicas)
                for shard, e in zip(shards, exported)
            ]
            _bounded(calls, cfg.ps_timeout_s, "the shards did not take the kept state")
        direct = cfg.data_path == "tcp"  # a primary's changes reach its replica as frames
        if self._replicas:
            calls = [
                s.set_replica.remote(r, node == replica_node, direct)
                for s, r, node, replica_node in zip(
                    self._servers, self._replicas, server_nodes, replica_nodes
                )
            ]
            _bounded(calls, cfg.ps_timeout_s, "the shards did not take their replicas")
        worker_nodes = [p.node_id for p in worker_places(worker_group)]
        connect = spec.connect
        self._info = _runtime.RunInfo(
            settings=cfg,
            servers=list(self._servers),
            server_node_ids=server_nodes,
            topology=connect(self._servers, worker_nodes, server_nodes, cfg) if connect else None,
            joined=bool(exported),
            replicas=list(self._replicas),
            replica_node_ids=replica_nodes,
        )
        install = worker_group.execute_async(_runtime.install_run, self._info)
        ray.get(install, timeout=cfg.ps_timeout_s)
        if self._replicas:
            self._keeper = ReplicaKeeper(
                self._failover,
                list(zip(server_nodes, replica_nodes)),
                functools.partial(self._replica_on, worker_group, cfg),
                self._tell_workers,
                cfg.ps_timeout_s,
                functools.partial(nodes_for_replicas, worker_group, cfg),
                direct=direct,
            )
            self._keeper.start()
        logger.info(
            "Started %d parameter-server shard(s) for %d workers%s.",
            len(placements),
            num_workers,
            ", with the state the previous ones held" if exported else "",
        )

    def _start_shards(
        self,
        placements: list[Any],
        num_workers: int,
        cfg: BackendSettings,
        first: int = 0,
    ) -> list[Any]:
        """Starts one shard actor of the run's mode per placement, shard ``first``
        onwards (not waiting)."""
        spec = spec_of(cfg)
        actor_cls: Any = ray.remote(self.shard_class(cfg))
        args = spec.shard_args(cfg)
        return [
            actor_cls.options(
                **placement.options(),
                max_restarts=0,
                max_concurrency=spec.max_concurrency,
            ).remote(first + i, num_workers, *args)
            for i, placement in enumerate(placements)
        ]

    def _replica_on(self, worker_group: Any, cfg: BackendSettings, shard: int, node: str) -> Any:
        """Starts a new replica of ``shard`` on ``node`` (the ReplicaKeeper chose it)."""
        placement = replica_on(worker_group, cfg, node, shard)
        return self._start_shards([placement], len(worker_group), cfg, first=shard)[0]

    def _tell_workers(self, shard: int, primary: Any, replica: Any) -> None:
        """Every worker's calls to ``shard`` go to ``primary``, failing over to
        ``replica`` (a worker that cannot be reached learns it when it is replaced)."""
        refs = self._group.execute_async(_runtime.set_shard, shard, primary, replica)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=30)
        for ref in ready:
            try:
                ray.get(ref, timeout=0)
            except Exception as e:
                logger.warning("A worker did not take shard %d's new replica: %s", shard, e)

    def _ready(self, shards: list[Any], cfg: BackendSettings) -> list[str]:
        """Waits (bounded) until ``shards`` are up; returns their node ids.

        Raises:
            TimeoutError: Naming the resources no node could give them.
        """
        try:
            ready = _bounded(
                [s.ready.remote() for s in shards],
                cfg.ps_start_timeout_s,
                f"{len(shards)} parameter-server shard(s) did not start",
            )
        except TimeoutError as e:
            raise TimeoutError(f"{e}{unplaced_shards_message(cfg.server_resources)}") from e
        return [r["node_id"] for r in ready]

    def _promote_lost(self) -> None:
        """Where a shard is dead and has a replica, the replica serves from now on
        (the workers promote it too, when their calls fail)."""
        failover = self._failover
        if failover is None:
            return
        for i in range(failover.num_shards):
            try:
                failover.take_over_if_dead(i)
            except Exception as e:
                logger.warning("Could not promote the replica of shard %d: %s", i, e)

    def on_shutdown(self, worker_group: Any, backend_config: BackendConfig) -> None:
        cfg = _settings(backend_config)
        if is_replica_group(worker_group):
            self._release(worker_group, backend_config, cfg)
            return
        # No new replica while the shards' state is exported and they stop.
        self._made += self._stop_keeper()
        try:
            ray.get(
                worker_group.execute_async(_runtime.uninstall_run),
                timeout=cfg.ps_timeout_s,
            )
        except Exception as e:
            logger.warning("Could not reach every worker on shutdown: %s", e)
        finally:
            # A lone worker trains without DDP (Ray Train wraps only groups of two
            # or more), so its shards hold nothing newer than what it checkpointed:
            # keeping them would roll the next group back past its training.
            if (
                spec_of(cfg).keeps_state
                and len(worker_group) > 1
                and not ended_cleanly(worker_group)
            ):
                self._export(cfg)
            self._stop_servers()
            super().on_shutdown(worker_group, backend_config)

    def _export(self, cfg: BackendSettings) -> None:
        """Keeps the shards' state for the group Ray Train starts next (a failure
        every worker saw, an elastic resize): the shards die with the old group's
        placement group, their state lives on as objects this controller owns."""
        self._promote_lost()
        refs = [s.export_state.remote() for s in self._servers]
        try:
            ray.wait(refs, num_returns=len(refs), timeout=cfg.ps_timeout_s)
            ray.get(refs, timeout=0)  # raises if a shard was already lost
        except Exception as e:
            logger.warning(
                "The parameter servers' state could not be kept (%s): the next workers "
                "start from the last checkpoint.",
                e,
            )
            return
        self._exported = refs

    def _admit(self, group: Any, backend_config: TorchConfig, cfg: BackendSettings) -> None:
        """A replica group replaced a lost worker: the shards wait for its rank again
        and the new worker joins them (its own torch process group: the others'
        still includes the dead one, and the modes that replace workers alone use
        no collective while training)."""
        super().on_start(group, backend_config)
        ranks = group_ranks(group)
        self._promote_lost()
        calls = [s.admit.remote(r) for s in self._servers for r in ranks]
        try:
            _bounded(calls, cfg.ps_timeout_s, f"the shards did not admit rank(s) {ranks}")
        except Exception as e:
            # A lost shard took its part of the state with it: only a restart of
            # every worker, from the last checkpoint, can go on.
            logger.error(
                "A parameter-server shard is lost (%s): every worker restarts, from the "
                "last checkpoint.",
                e,
            )
            kill_workers(self._group)
            return
        assert self._info is not None
        failover = self._failover
        replicas = [failover.replica(i) for i in range(failover.num_shards)] if failover else []
        info = dataclasses.replace(
            self._info, joined=True, servers=list(self._servers), replicas=replicas
        )
        ray.get(group.execute_async(_runtime.install_run, info), timeout=cfg.ps_timeout_s)
        logger.info("Rank(s) %s joined the live parameter-server shards.", ranks)

    def _release(self, group: Any, backend_config: BackendConfig, cfg: BackendSettings) -> None:
        """A replica group's worker was lost: no shard waits for its rank any more,
        while the other workers go on."""
        ranks = group_ranks(group)
        self._promote_lost()
        calls = [s.leave.remote(r) for s in self._servers for r in ranks]
        try:
            _bounded(calls, cfg.ps_timeout_s, f"the shards did not let rank(s) {ranks} go")
        except Exception as e:
            logger.warning("%s", e)
        try:
            super().on_shutdown(group, backend_config)
        except Exception as e:  # the worker is dead; its process group goes with it
            logger.debug("shutting down rank(s) %s: %s", ranks, e)

    def _stop_keeper(self) -> list[Any]:
        """Stops the replica keeper (bounded); returns the replicas it made."""
        keeper, self._keeper = self._keeper, None
        if keeper is None:
            return []
        keeper.stop()
        return keeper.made

    def _stop_servers(self) -> None:
        # ray.kill returns at once (no wait to bound); the actors' bundles are
        # released with the workers' placement group.
        self._made += self._stop_keeper()
        servers, self._servers = self._servers + self._replicas + self._made, []
        self._made = []
        self._replicas = []
        for s in servers:
            ray.kill(s, no_restart=True)


class PSKeepingBackend(PSBackend):
    """The backend of modes whose shards own the run's state (async, ssp, diloco),
    with ``replace_lost_workers``: with Ray Train's replica groups of one worker
    each, a failed worker is replaced alone while the others go on, and joins the
    live shards."""

    has_replica_groups = True


def _bounded(refs: list[Any], timeout_s: float, what: str) -> list[Any]:
    """``ray.get(refs)`` within ``timeout_s``.

    Raises:
        TimeoutError: Saying ``what`` and the bound.
    """
    try:
        return list(ray.get(refs, timeout=timeout_s))
    except ray.exceptions.GetTimeoutError as e:
        raise TimeoutError(f"{what} within {timeout_s:g}s.") from e


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
