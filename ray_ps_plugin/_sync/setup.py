"""Run start-up for sync mode: the shards' data paths and who relays for whom.

Called by the backend once every shard answered ``ready``; what it returns travels
to every worker with the rest of the run's description.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ray_ps_plugin._sync.topology import Topology
from ray_ps_plugin._types import RunSettings
from ray_ps_plugin._wire.setup import Wires, open_streams, open_wires
from ray_ps_plugin._wire.streams import WireStreams

__all__ = ["connect_shards", "open_direct_path"]


def _index(node_ids: Sequence[str], order: dict[str, int]) -> tuple[int, ...]:
    return tuple(order.setdefault(n, len(order)) for n in node_ids)


def connect_shards(
    servers: Sequence[Any],
    worker_nodes: Sequence[str],
    shard_nodes: Sequence[str],
    settings: RunSettings,
) -> Topology:
    """Opens each shard's direct path (if asked for) and hands every shard the
    run's topology.

    Args:
        servers: The shard actors, in shard order.
        worker_nodes: Node id of each worker, by rank.
        shard_nodes: Node id of each shard.
        settings: The run's PSConfig.

    Raises:
        TimeoutError: If a shard does not answer within ``ps_start_timeout_s``.
    """
    import ray

    order: dict[str, int] = {}
    workers, shards = _index(worker_nodes, order), _index(shard_nodes, order)
    # Opened on one node too, where only sparse rows use it: a frame on an open
    # socket costs less than a Ray call and its reply.
    wires = open_wires(servers, settings)
    topology = Topology(
        worker_nodes=workers,
        shard_nodes=shards,
        # A relay's partial sum goes out on the direct path: without it, the
        # extra hop through the object store would cost more than it saves.
        aggregate=settings.node_aggregation and bool(wires.addresses) and len(order) > 1,
        addresses=wires.addresses,
        token=wires.token,
    )
    timeout = settings.ps_start_timeout_s
    try:
        ray.get([s.configure.remote(topology) for s in servers], timeout=timeout)
    except ray.exceptions.GetTimeoutError as e:
        raise TimeoutError(
            f"the parameter-server shards did not take the run's topology within "
            f"ps_start_timeout_s={timeout:g}s."
        ) from e
    return topology


def open_direct_path(settings: RunSettings, topology: Topology | None) -> WireStreams | None:
    """A worker process's direct path to the shards, when the run has one."""
    if topology is None:
        return None
    return open_streams(Wires(topology.addresses, topology.token), settings.ps_start_timeout_s)
