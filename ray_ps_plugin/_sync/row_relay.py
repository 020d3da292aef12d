"""A node relay's sums of sparse rows: one message per owner shard and step across nodes.

Without it each worker sends every other node's shard its own rows and receives the
union back: a node of ``k`` workers puts ``k`` copies of the union on its link. With
node-level aggregation (:mod:`ray_ps_plugin._sync.topology`) the node's workers send
the rows of the other nodes' shards to their relay; once all of them have, the relay
sums them per row (in rank order, as an owner does), sends the owner one message,
and hands its answer, the bytes as they came, to every one of them. The owner counts
the relay as one source.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from ray_ps_plugin._codec import Codec
from ray_ps_plugin._errors import ShardProtocolError, ShardTimeoutError
from ray_ps_plugin._rows import RowEntry, pack, sum_rows
from ray_ps_plugin._wire.streams import await_answer, relay_failure

__all__ = ["Forward", "RowRelay"]

#: Sends a packed message of summed rows to an owner shard ``(owner, model, step,
#: payload)`` and returns its packed answer; bounded by the caller.
Forward = Callable[[int, int, int, np.ndarray], Awaitable[np.ndarray]]


@dataclass
class _Gather:
    """One owner's rows of one step on the relay, until every local worker sent them."""

    entries: dict[int, list[RowEntry]] = field(default_factory=dict)  # by rank
    answered: set[int] = field(default_factory=set)
    answer: np.ndarray | None = None
    error: Exception | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


class RowRelay:
    """Sums a node's workers' rows for other nodes' shards and forwards them (runs on
    the relay shard's event loop).

    Args:
        shard_index: The relay's shard index (error messages).
        ranks: The workers it relays for.
        codec: The run's encoding of values in messages.
        timeout_s: How long a worker's rows wait for the node's others and the owner.
        forward: Sends the node's sum to an owner (see :data:`Forward`).
    """

    def __init__(
        self,
        shard_index: int,
        ranks: frozenset[int],
        codec: Codec,
        timeout_s: float,
        forward: Forward,
    ) -> None:
        self.shard_index = shard_index
        self.ranks = ranks
        self._codec = codec
        self.timeout_s = timeout_s
        self._forward = forward
        self._rounds: dict[tuple[int, int, int], _Gather] = {}

    async def push(
        self, model: int, step: int, owner: int, rank: int, entries: list[RowEntry]
    ) -> np.ndarray:
        """Adds one worker's rows for ``owner``; returns the owner's packed answer (the
        union of every worker's rows and their sums) once the node's sum went there.

        Raises:
            ShardProtocolError: If the worker is not one this shard relays for, or the
                node's workers sent different tables.
            ShardTimeoutError: If the node's other workers or the owner do not answer
                within the timeout.
            ShardLinkError: If the owner cannot be reached.
        """
        where = f"shard {self.shard_index}: model {model}: step {step}, rows for shard {owner}"
        if rank not in self.ranks:
            raise ShardProtocolError(
                f"{where}: worker {rank} is not one this shard relays for "
                f"({sorted(self.ranks)}); the workers disagree on the topology."
            )
        key = (model, step, owner)
        gather = self._rounds.setdefault(key, _Gather())
        if rank not in gather.entries:
            gather.entries[rank] = entries
            if len(gather.entries) == len(self.ranks):
                await self._send(where, model, step, owner, gather)
        try:
            await asyncio.wait_for(gather.done.wait(), self.timeout_s)
        except asyncio.TimeoutError:
            self._rounds.pop(key, None)
            missing = sorted(self.ranks - set(gather.entries))
            waited = f"worker(s) {missing}" if missing else f"shard {owner}"
            raise ShardTimeoutError(
                f"{where} waited {self.timeout_s:g}s for {waited}; a worker is stuck, dead "
                "or its model differs. Raise PSConfig.ps_timeout_s if steps are slow."
            ) from None
        gather.answered.add(rank)
        if len(gather.answered) == len(self.ranks):
            self._rounds.pop(key, None)
        if gather.error is not None:
            raise gather.error
        assert gather.answer is not None
        return gather.answer

    def _node_sum(self, where: str, gather: _Gather) -> np.ndarray:
        """The packed per-row sums of the node's workers' rows, table by table."""
        ranks = sorted(gather.entries)
        first = gather.entries[ranks[0]]
        tables = [(e[0], e[1], e[4]) for e in first]
        for r in ranks[1:]:
            if [(e[0], e[1], e[4]) for e in gather.entries[r]] != tables:
                raise ShardProtocolError(
                    f"{where}: workers {ranks[0]} and {r} sent rows of different sparse "
                    "tables (or split them differently); their models differ."
                )
        out: list[RowEntry] = []
        for k, (table, split, dtype) in enumerate(tables):
            rows, sums = sum_rows(
                [gather.entries[r][k][2] for r in ranks],
                [self._codec.decode_np(gather.entries[r][k][3], dtype) for r in ranks],
            )
            out.append((table, split, rows, self._codec.as_sent_np(sums, dtype), dtype))
        return pack(out)

    async def _send(self, where: str, model: int, step: int, owner: int, gather: _Gather) -> None:
        """Forwards the node's sum; leaves the answer, or the error, for every waiter."""
        try:
            payload = self._node_sum(where, gather)
            gather.answer = await await_answer(
                asyncio.ensure_future(self._forward(owner, model, step, payload)),
                self.timeout_s,
                f"{where}: shard {owner} did not answer this node's rows within "
                f"{self.timeout_s:g}s.",
            )
        except Exception as e:
            gather.error = relay_failure(e, f"{where}: relaying to shard {owner}")
        finally:
            gather.done.set()
