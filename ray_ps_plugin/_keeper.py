"""The controller's side of replication: every shard keeps a replica while the run trains.

With ``PSConfig(shard_replicas=1)`` a thread in Ray Train's controller (where the
backend runs) looks at every shard once a second. A primary Ray declares dead is
replaced by its replica (the workers do the same when their calls fail; whoever
is first, the promotion happens once). A shard without a live replica (its replica
was promoted, died, or was dropped by its primary) gets a new one as soon as a node
can take it, away from the shard's node where there is another: the primary hands
it a snapshot of its state and every change after it, in order, before the
workers are told where to fail over to. So a run survives one loss after another,
as long as the next comes after the new replica is made.

The keeper picks the new replica's node itself, among the nodes that may take one
now, and passes over the nodes where it lately found an actor of the run dead: Ray
lists a node removed without grace as alive until its health checks run out (about
15 s by default), and a replica pinned to it would never start. A replica that
starts on its primary's node although another node was chosen is refused (killed,
and made again at the next look): a node's loss would take the shard and its only
copy together.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ray_ps_plugin._failover import Failover
from ray_ps_plugin._ray_compat import ping_actor

__all__ = ["ReplicaKeeper"]

logger = logging.getLogger(__name__)

#: Seconds between two looks at the shards.
PERIOD_S = 1.0
#: Seconds a node where the keeper found an actor of the run dead is passed over for
#: new replicas while another node can take them (longer than Ray takes to declare
#: a node removed without grace dead).
AVOID_S = 60.0


class ReplicaKeeper:
    """Promotes replicas of dead shards and makes new replicas, in a thread.

    Args:
        failover: The controller's view of who serves each shard.
        nodes: The node id of each shard's actor and of its replica, in shard order.
        start_replica: Starts a replica of a shard on the given node; does not wait
            for it.
        tell_workers: Tells every worker who serves a shard and its new replica.
        timeout_s: Bound on every call the keeper waits for.
        nodes_for_replicas: The nodes that may take a new replica now (alive, carrying
            what a shard asks for), in a stable order.
        direct: Whether a primary sends its new replica changes as frames on the
            direct path (the run's ``data_path="tcp"``).
    """

    def __init__(
        self,
        failover: Failover,
        nodes: list[tuple[str, str]],
        start_replica: Callable[[int, str], Any],
        tell_workers: Callable[[int, Any, Any], None],
        timeout_s: float,
        nodes_for_replicas: Callable[[], list[str]],
        direct: bool = False,
    ) -> None:
        self._failover = failover
        self._direct = direct
        self._nodes = list(nodes)
        self._serving = [failover.server(s) for s in range(failover.num_shards)]
        self._start_replica = start_replica
        self._tell_workers = tell_workers
        self._timeout_s = timeout_s
        self._nodes_for_replicas = nodes_for_replicas
        self._lost: dict[str, float] = {}  # node id -> when an actor was found dead there
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ps-replica-keeper", daemon=True)
        self.made: list[Any] = []  # every replica made here, for the backend to kill

    def start(self) -> None:
        self._thread.start()

    def stop(self, join_s: float = 5.0) -> None:
        """Stops the thread; the replicas it made (:attr:`made`, including one it
        may still be starting) stay for the caller to kill."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(join_s)

    def _run(self) -> None:
        while not self._stop.wait(PERIOD_S):
            for shard in range(self._failover.num_shards):
                if self._stop.is_set():
                    return
                try:
                    self.keep(shard)
                except Exception as e:  # the next look tries again
                    if self._stop.is_set():
                        return  # stopping: the backend kills what is being started
                    logger.warning("Could not keep shard %d replicated: %s", shard, e)

    def keep(self, shard: int) -> None:
        """One look at ``shard``: promote its replica if it died, replicate it anew
        if its replica is gone."""
        self._failover.take_over_if_dead(shard)
        primary = self._failover.server(shard)
        if primary is not self._serving[shard]:  # its replica was promoted
            self._serving[shard] = primary
            self._lost_on(self._nodes[shard][0])
            self._nodes[shard] = (self._nodes[shard][1], "")
        replica = self._failover.replica(shard)
        if replica is not None:
            if not _dead(replica, self._timeout_s):
                return
            self._lost_on(self._nodes[shard][1])
        where = self._choose(shard)
        if where is None:
            return  # no node can take it now; the next look tries again
        self._replicate(shard, primary, where)

    def _choose(self, shard: int) -> str | None:
        """The node for ``shard``'s new replica: another than its primary's, where
        nothing was found dead lately if such a node can take it; the primary's own
        node only when no other can (the replica then outlives the shard's process
        only). ``None``: no node can take one now."""
        now = time.monotonic()
        self._lost = {n: t for n, t in self._lost.items() if now - t < AVOID_S}
        nodes = self._nodes_for_replicas()
        primary_node = self._nodes[shard][0]
        others = [n for n in nodes if n != primary_node]
        fresh = [n for n in others if n not in self._lost]
        pick = fresh or others or [n for n in nodes if n == primary_node]
        return pick[shard % len(pick)] if pick else None

    def _replicate(self, shard: int, primary: Any, where: str) -> None:
        """Starts a replica of ``shard`` on node ``where``, has ``primary`` seed it,
        then tells the workers.

        Raises:
            RuntimeError: The replica did not start, started on its primary's node
                although ``where`` is another, or was not seeded; it is killed.
        """
        import ray

        new = self._start_replica(shard, where)
        self.made.append(new)
        primary_node = self._nodes[shard][0]
        step = "start"
        try:
            info = ray.get(new.ready.remote(), timeout=self._timeout_s)
            if info["node_id"] == primary_node and where != primary_node:
                step = "start away from its primary"
                raise RuntimeError(f"it runs on the primary's node {primary_node[:12]}")
            step = "seed"
            same_node = info["node_id"] == primary_node
            seeded = primary.add_replica.remote(new, same_node, self._direct)
            ray.get(seeded, timeout=self._timeout_s)
        except Exception as e:
            ray.kill(new, no_restart=True)
            if step == "start":  # e.g. pinned to a node Ray lists but is gone
                self._lost_on(where)
            raise RuntimeError(f"the new replica did not {step} ({e})") from e
        self._nodes[shard] = (primary_node, info["node_id"])
        self._failover.set_shard(shard, primary, new)
        self._tell_workers(shard, primary, new)
        logger.info("Shard %d has a new replica on node %s.", shard, info["node_id"][:12])

    def _lost_on(self, node: str) -> None:
        """Passes over ``node`` for new replicas for a while (from the first loss)."""
        if node:
            self._lost.setdefault(node, time.monotonic())


def _dead(actor: Any, timeout_s: float) -> bool:
    """Whether a ping finds ``actor`` dead (a slow answer is not death)."""
    import ray

    try:
        ray.get(ping_actor(actor), timeout=timeout_s)
    except ray.exceptions.ActorDiedError:
        return True
    except Exception:
        return False
    return False
