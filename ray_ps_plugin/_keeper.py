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
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ray_ps_plugin._failover import Failover
from ray_ps_plugin._ray_compat import ping_actor

__all__ = ["ReplicaKeeper"]

logger = logging.getLogger(__name__)

#: Seconds between two looks at the shards.
PERIOD_S = 1.0


class ReplicaKeeper:
    """Promotes replicas of dead shards and makes new replicas, in a thread.

    Args:
        failover: The controller's view of who serves each shard.
        nodes: The node id of each shard's actor and of its replica, in shard order.
        start_replica: Starts a replica for a shard away from the given node
            (``None``: no node can take one now); does not wait for it.
        tell_workers: Tells every worker who serves a shard and its new replica.
        timeout_s: Bound on every call the keeper waits for.
    """

    def __init__(
        self,
        failover: Failover,
        nodes: list[tuple[str, str]],
        start_replica: Callable[[int, str], Any],
        tell_workers: Callable[[int, Any, Any], None],
        timeout_s: float,
    ) -> None:
        self._failover = failover
        self._nodes = list(nodes)
        self._serving = [failover.server(s) for s in range(failover.num_shards)]
        self._start_replica = start_replica
        self._tell_workers = tell_workers
        self._timeout_s = timeout_s
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
                    logger.warning("Could not keep shard %d replicated: %s", shard, e)

    def keep(self, shard: int) -> None:
        """One look at ``shard``: promote its replica if it died, replicate it anew
        if its replica is gone."""
        import ray

        self._failover.take_over_if_dead(shard)
        primary = self._failover.server(shard)
        if primary is not self._serving[shard]:  # its replica was promoted
            self._serving[shard] = primary
            self._nodes[shard] = (self._nodes[shard][1], "")
        replica = self._failover.replica(shard)
        if replica is not None and not _dead(replica, self._timeout_s):
            return
        new = self._start_replica(shard, self._nodes[shard][0])
        if new is None:
            return  # no node can take it now; the next look tries again
        self.made.append(new)
        step = "start"
        try:
            info = ray.get(new.ready.remote(), timeout=self._timeout_s)
            step = "seed"
            ray.get(primary.add_replica.remote(new), timeout=self._timeout_s)
        except Exception as e:
            ray.kill(new, no_restart=True)
            raise RuntimeError(f"the new replica did not {step} ({e})") from e
        self._nodes[shard] = (self._nodes[shard][0], info["node_id"])
        self._failover.set_shard(shard, primary, new)
        self._tell_workers(shard, primary, new)
        logger.info("Shard %d has a new replica on node %s.", shard, info["node_id"][:12])


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
