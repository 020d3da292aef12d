"""Who sends each chunk where in sync mode: nodes, relays, and the direct path.

The shards own contiguous ranges of the gradient stream
(:class:`~ray_ps_plugin._sync.layout.StreamLayout`). Without aggregation every
worker pushes each chunk to the shard that owns it. That puts ``k`` copies of the
same range on a node's link when ``k`` workers share the node.

With node-level aggregation (BytePS's idea, applied between nodes), the lowest-index
shard of a node with several workers is that node's *relay*: the node's workers push
the chunks owned by shards of *other* nodes to it through shared memory; once all of
them have, it sends **one** partial sum to the owner and hands the owner's answer to
all of them. The owner then counts one *source* per relaying node instead of ``k``
workers. A node's link carries ``2 (N - 1) / N`` model sizes per step instead of a
ring's ``2 (Nk - 1) / (Nk)``.

Sources are numbered: ``0 .. W-1`` are workers pushing for themselves, ``W + m`` is
the relay of node ``m``. This module is pure data, shared by the backend (which
builds it), the shards and the workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_ps_plugin._relays import relay_shards

__all__ = ["Route", "Topology"]


@dataclass(frozen=True)
class Route:
    """Where one worker sends the chunks of one owner shard.

    Attributes:
        target: The shard the worker pushes to (the owner, or its node's relay).
        direct: Whether ``target`` is on another node (then the chunk crosses the
            network from the worker itself).
    """

    target: int
    direct: bool


@dataclass(frozen=True)
class Topology:
    """Where the workers and shards of a sync run live, and who relays for whom.

    Attributes:
        worker_nodes: Node index of each worker, by rank.
        shard_nodes: Node index of each shard, by shard index.
        aggregate: Whether nodes with several workers aggregate through a relay.
        addresses: ``(host, port)`` of each shard's direct path, or ``None``
            per shard where it has none (then cross-node chunks travel through the
            object store). On one node only sparse rows use it.
        token: The run's secret for the direct path (empty without one).
    """

    worker_nodes: tuple[int, ...]
    shard_nodes: tuple[int, ...]
    aggregate: bool = True
    addresses: tuple[tuple[str, int] | None, ...] = ()
    token: bytes = field(default=b"", repr=False)
    _relays: dict[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.worker_nodes or not self.shard_nodes:
            raise ValueError("a topology needs at least one worker and one shard")
        if self.addresses and len(self.addresses) != len(self.shard_nodes):
            raise ValueError("addresses must name one address (or None) per shard")
        relays = relay_shards(self.worker_nodes, self.shard_nodes) if self.aggregate else {}
        object.__setattr__(self, "_relays", relays)

    @property
    def num_workers(self) -> int:
        return len(self.worker_nodes)

    @property
    def spans_nodes(self) -> bool:
        """Whether the run's workers and shards live on more than one node."""
        return len(set(self.worker_nodes) | set(self.shard_nodes)) > 1

    @property
    def dense_direct(self) -> bool:
        """Whether dense chunks cross nodes on the direct path, which cuts the
        stream for it. On one node the chunks go through shared memory, cut as
        measured for it; only their notices (and sparse rows) take the path."""
        return bool(self.addresses) and self.spans_nodes

    @property
    def has_relays(self) -> bool:
        """Whether any node of the run relays."""
        return bool(self._relays)

    def relay_of(self, node: int) -> int | None:
        """The shard relaying for ``node``'s workers, if the node has one."""
        return self._relays.get(node)

    def route(self, rank: int, owner: int) -> Route:
        """Where worker ``rank`` pushes the chunks that shard ``owner`` sums."""
        node = self.worker_nodes[rank]
        if self.shard_nodes[owner] == node:
            return Route(owner, direct=False)
        relay = self._relays.get(node)
        if relay is not None:
            return Route(relay, direct=False)
        return Route(owner, direct=True)

    def sources(self, owner: int) -> frozenset[int]:
        """Every source whose push completes one of ``owner``'s chunks."""
        home = self.shard_nodes[owner]
        found = set()
        for rank, node in enumerate(self.worker_nodes):
            if node != home and node in self._relays:
                found.add(self.num_workers + node)
            else:
                found.add(rank)
        return frozenset(found)

    def relayed_ranks(self, relay: int) -> frozenset[int]:
        """The workers whose chunks for other nodes' shards ``relay`` sums first."""
        node = self.shard_nodes[relay]
        if self._relays.get(node) != relay:
            return frozenset()
        return frozenset(r for r, n in enumerate(self.worker_nodes) if n == node)

    def relay_source(self, relay: int) -> int:
        """The source id under which ``relay`` pushes its node's partial sums."""
        return self.num_workers + self.shard_nodes[relay]

    def describe(self, source: int) -> str:
        """A source id in words, for error messages."""
        if source < self.num_workers:
            return f"worker {source}"
        return f"the relay of node {source - self.num_workers}"
