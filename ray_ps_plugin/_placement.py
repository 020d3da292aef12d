"""Where the shards run: in the workers' bundles, or on nodes of their own.

By default shard ``i`` lives in the placement-group bundle of worker ``i % W`` (or
one shard per node, with the node's lowest-rank worker), with no CPU of its own: it
is reserved and released with the workers and never competes with another trial.
With ``PSConfig.server_resources`` each shard asks for those Ray resources instead
and Ray spreads the shards over the nodes that carry them (CPU nodes beside GPU
workers, as BytePS runs its summation servers): a worker node's loss then costs no
shard. Either way the placement is explicit: an actor the controller starts with no
strategy inside a Tune trial would be captured into the trial's group.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import ray
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from ray_ps_plugin._modes import spec_of
from ray_ps_plugin._ray_compat import worker_placement_group, worker_places
from ray_ps_plugin._types import RunSettings, ServerPlacement

__all__ = [
    "BackendSettings",
    "ShardPlacement",
    "nodes_for_replicas",
    "place_replicas",
    "place_shards",
    "replica_on",
    "unplaced_shards_message",
]


class BackendSettings(RunSettings, Protocol):
    """What the backend reads of ``PSConfig`` besides what the workers read."""

    num_servers: int | None
    server_placement: ServerPlacement
    server_resources: dict[str, float] | None
    shard_replicas: int


@dataclass(frozen=True)
class ShardPlacement:
    """Where one shard actor goes and what it reserves there.

    Attributes:
        strategy: Its Ray scheduling strategy.
        num_cpus: CPUs it reserves (0 inside a worker's bundle).
        resources: Custom resources it reserves.
    """

    strategy: Any
    num_cpus: float = 0
    resources: dict[str, float] = field(default_factory=dict)

    def options(self) -> dict[str, Any]:
        """The placement's part of the actor's ``.options()``."""
        return {
            "scheduling_strategy": self.strategy,
            "num_cpus": self.num_cpus,
            "resources": dict(self.resources),
        }


def place_shards(
    worker_group: Any, cfg: BackendSettings, num_servers: int | None = None
) -> list[ShardPlacement]:
    """One placement per shard for this run (``num_servers``, where given, is the
    count a restart keeps; otherwise ``cfg`` decides)."""
    if cfg.server_resources:
        count = num_servers or cfg.num_servers or len(worker_places(worker_group))
        return _on_server_nodes(cfg.server_resources, count)
    per_node = num_servers is None and _per_node(worker_group, cfg)
    return _in_worker_bundles(worker_group, num_servers or cfg.num_servers, per_node)


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


def _in_worker_bundles(
    worker_group: Any, num_servers: int | None, per_node: bool
) -> list[ShardPlacement]:
    """Shard ``i`` where worker ``i % W`` lives (with ``per_node`` one shard per
    node, with the node's lowest-rank worker; ``num_servers=None``: one per worker),
    inside that worker's bundle."""
    places = worker_places(worker_group)
    if per_node:
        first: dict[str, Any] = {}
        for p in places:
            first.setdefault(p.node_id, p)
        places = list(first.values())
        num_servers = len(places)
    num_servers = num_servers or len(places)
    pg = worker_placement_group(worker_group)
    placements: list[ShardPlacement] = []
    for i in range(num_servers):
        place = places[i % len(places)]
        if pg is not None and place.bundle_index is not None:
            strategy: Any = PlacementGroupSchedulingStrategy(
                placement_group=pg,
                placement_group_bundle_index=place.bundle_index,
                placement_group_capture_child_tasks=False,
            )
        else:
            strategy = NodeAffinitySchedulingStrategy(place.node_id, soft=False)
        placements.append(ShardPlacement(strategy))
    return placements


def _on_server_nodes(resources: Mapping[str, float], count: int) -> list[ShardPlacement]:
    """``count`` shards asking for ``resources``, spread over the nodes carrying them
    (Ray's SPREAD strategy; an autoscaler may add such nodes while they wait)."""
    cpus, custom = _asked(resources)
    return [ShardPlacement("SPREAD", cpus, custom) for _ in range(count)]


def place_replicas(
    worker_group: Any, cfg: BackendSettings, shard_nodes: list[str]
) -> list[ShardPlacement]:
    """One placement per shard's replica, on another node than the shard's where
    there is one: another node carrying ``server_resources``, or else the bundle of
    the next worker on another node (the same node, in the next worker's bundle,
    when all share one: the replica then outlives the shard's process only)."""
    if cfg.server_resources:
        carrying = nodes_for_replicas(worker_group, cfg)
        placements = []
        for i, node in enumerate(shard_nodes):
            others = [n for n in carrying if n != node] or [node]
            placements.append(replica_on(worker_group, cfg, others[i % len(others)], i))
        return placements
    bundles = _in_worker_bundles(worker_group, None, False)
    nodes = [p.node_id for p in worker_places(worker_group)]
    out = []
    for i, node in enumerate(shard_nodes):
        order = [(i + 1 + k) % len(nodes) for k in range(len(nodes))]
        elsewhere = [w for w in order if nodes[w] != node]
        out.append(bundles[(elsewhere or order)[0]])
    return out


def nodes_for_replicas(worker_group: Any, cfg: BackendSettings) -> list[str]:
    """The nodes that may take a new replica now, in a stable order: the nodes Ray
    lists alive that carry ``server_resources``, or else the workers' nodes."""
    if cfg.server_resources:
        return _carrying(_asked(cfg.server_resources)[1])
    return list(dict.fromkeys(p.node_id for p in worker_places(worker_group)))


def replica_on(worker_group: Any, cfg: BackendSettings, node: str, shard: int) -> ShardPlacement:
    """A placement on ``node`` for ``shard``'s replica: pinned there (hard affinity:
    a replica never drifts onto another node) asking for ``server_resources``, or
    else in the bundle of a worker there, the first after worker ``shard % W``.

    Raises:
        ValueError: Without ``server_resources``, when no worker runs on ``node``.
    """
    if cfg.server_resources:
        cpus, custom = _asked(cfg.server_resources)
        return ShardPlacement(NodeAffinitySchedulingStrategy(node, soft=False), cpus, custom)
    bundles = _in_worker_bundles(worker_group, None, False)
    nodes = [p.node_id for p in worker_places(worker_group)]
    for k in range(len(nodes)):
        w = (shard + 1 + k) % len(nodes)
        if nodes[w] == node:
            return bundles[w]
    raise ValueError(f"no worker runs on node {node}")


def _asked(resources: Mapping[str, float]) -> tuple[float, dict[str, float]]:
    """The CPUs and the custom resources a shard on a server node asks for."""
    custom = {k: float(v) for k, v in resources.items() if k != "CPU"}
    return float(resources.get("CPU", 0)), custom


def _carrying(custom: Mapping[str, float]) -> list[str]:
    """The ids of the live nodes that carry every resource in ``custom``."""
    return [
        n["NodeID"]
        for n in ray.nodes()
        if n.get("Alive") and all(n.get("Resources", {}).get(k, 0) > 0 for k in custom)
    ]


def unplaced_shards_message(resources: Mapping[str, float] | None) -> str:
    """Why shards may not have started, in words: for shards on nodes of their own,
    which nodes carry the resources they ask for."""
    if not resources:
        return ""
    wanted = json.dumps(dict(resources))
    custom = [k for k in resources if k != "CPU"]
    carrying = [n[:12] for n in _carrying(dict.fromkeys(custom, 1.0))]
    if not carrying:
        return (
            f" No live node carries the resource(s) {custom} that "
            f"PSConfig.server_resources={wanted} asks for: start server nodes with "
            f"`ray start --resources='{json.dumps(dict.fromkeys(custom, 4))}'` (or give a "
            "KubeRay worker group these custom resources), or drop server_resources."
        )
    return (
        f" Nodes {carrying} carry {custom}, but not enough of "
        f"server_resources={wanted} per shard is free there (other runs' shards may "
        "hold it): give those nodes more units, or ask each shard for less."
    )
