"""Which shard relays a node's workers (BytePS's node-level aggregation, in every mode
that sums on the way: sync's chunks and rows, diloco's synchronous rounds).

A node with two or more workers and a shard of its own sums its workers'
contributions on its first shard before they cross the network; one worker alone
gains nothing from a relay (it would only add a hop).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from typing import TypeVar

__all__ = ["relay_shards"]

Node = TypeVar("Node", bound=Hashable)


def relay_shards(worker_nodes: Sequence[Node], shard_nodes: Sequence[Node]) -> dict[Node, int]:
    """The relay shard of each node that has one: its first shard, where the node
    has at least two workers.

    Args:
        worker_nodes: Each worker's node, by rank.
        shard_nodes: Each shard's node, by shard index.
    """
    workers = Counter(worker_nodes)
    first: dict[Node, int] = {}
    for shard, node in enumerate(shard_nodes):
        first.setdefault(node, shard)
    return {node: shard for node, shard in first.items() if workers[node] >= 2}
