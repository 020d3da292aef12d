"""DiLoCo's node-level aggregation: one message per node, shard and round across nodes.

In synchronous rounds every worker's change counts only through the round's mean,
so the workers of a node can sum their changes before they cross the network. A
node with several workers and a shard of its own gets a *relay*: its first shard.
Each worker of the node hands the relay its change for every other node's shard (a
Ray call on the node: the object store's shared memory, no network); once every
worker of the node still training has, the relay sends each of those shards one
sum, naming the ranks in it (:meth:`DilocoShard.push_pull_many`), and hands every
worker of the node the answer. Across the link a round then costs one change and
one answer per node and shard instead of one per worker and shard.

Asynchronous rounds do not relay: waiting for the node's slowest worker is what
they exist to avoid.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ray_ps_plugin._relays import relay_shards
from ray_ps_plugin._types import RunSettings

__all__ = ["RelayGroup", "RoundRelays", "connect_round_relays"]


@dataclass(frozen=True)
class RoundRelays:
    """Who relays whose rounds (the DiLoCo mode's start-up result).

    Attributes:
        relay_of_rank: Per rank, the shard of its node that relays its changes for
            other nodes' shards, or ``None`` (a node with one worker or no shard).
    """

    relay_of_rank: tuple[int | None, ...]


def connect_round_relays(
    servers: Sequence[Any],
    worker_nodes: Sequence[str],
    shard_nodes: Sequence[str],
    settings: RunSettings,
) -> RoundRelays | None:
    """Picks each node's relay and hands it the shards and the node's workers.

    ``None`` (no relay) unless ``node_aggregation`` is on, rounds are synchronous,
    the run spans several nodes and some node has two workers and a shard.

    Raises:
        TimeoutError: If a relay does not answer within ``ps_start_timeout_s``.
    """
    import ray

    if not settings.node_aggregation or settings.diloco_rounds != "sync":
        return None
    if len(set(worker_nodes) | set(shard_nodes)) < 2:
        return None
    relays = relay_shards(worker_nodes, shard_nodes)
    relay_of_rank = tuple(relays.get(node) for node in worker_nodes)
    ranks: dict[int, list[int]] = {}
    for rank, relay in enumerate(relay_of_rank):
        if relay is not None:
            ranks.setdefault(relay, []).append(rank)
    if not ranks:
        return None
    calls = [servers[s].configure_relay.remote(list(servers), r) for s, r in ranks.items()]
    try:
        ray.get(calls, timeout=settings.ps_start_timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        raise TimeoutError(
            "the DiLoCo shards did not take their relays within "
            f"ps_start_timeout_s={settings.ps_start_timeout_s:g}s."
        ) from e
    return RoundRelays(relay_of_rank)


@dataclass
class RelayGroup:
    """One round's changes of a node's workers for one other node's shard.

    Attributes:
        total: The fp32 sum of the changes received so far.
        ranks: The workers whose change is in ``total``.
        answer: Set once the owner answered (or failed).
        forward: The task sending the sum to the owner, once started (held here
            because the event loop keeps only a weak reference to a task).
    """

    total: torch.Tensor | None = None
    ranks: list[int] = field(default_factory=list)
    answer: asyncio.Future[Any] | None = None
    forward: asyncio.Task[None] | None = None

    def add(self, rank: int, change: torch.Tensor) -> None:
        """Adds one worker's change (a retried delivery counts once)."""
        if rank in self.ranks:
            return
        self.ranks.append(rank)
        if self.total is None:
            self.total = change.to(torch.float32, copy=True)
        else:
            self.total.add_(change)

    async def wait(self, timeout_s: float) -> Any:
        """The owner's answer; raises ``asyncio.TimeoutError`` after ``timeout_s`` (the
        shield keeps one waiter's timeout from cancelling the others' answer)."""
        assert self.answer is not None
        return await asyncio.wait_for(asyncio.shield(self.answer), timeout_s)
