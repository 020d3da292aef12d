"""A sync shard's sparse rows: the sums it owns, and the node's rows it relays.

Each worker sends the rows its batch touched to the shards that own them (see
:mod:`ray_ps_plugin._rows`). Where the run has node relays (see
:mod:`ray_ps_plugin._sync.topology`), a worker sends the rows of another node's
shard to its own node's relay instead: the relay sums the node's workers' rows,
sends the owner one message for the node, and hands the owner's answer (the union
of every node's rows) to each of the node's workers. So the rows cross the link
once per node each way, not once per worker, as the dense chunks do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np

from ray_ps_plugin._codec import Codec
from ray_ps_plugin._errors import ShardLinkError, ShardProtocolError, ShardTimeoutError
from ray_ps_plugin._rows import RowEntry, RowSums, pack, unpack
from ray_ps_plugin._sync.topology import Topology
from ray_ps_plugin._sync.wire import WireStreams

__all__ = ["Rows", "ShardRows"]

#: Summed sparse rows, per table: ``(rows, sums)``, the sums encoded.
Rows = list[tuple[np.ndarray, np.ndarray]]


class ShardRows:
    """The sparse rows one sync shard sums, and those it relays for its node.

    Args:
        shard_index: The shard's index.
        num_workers: The run's workers (the sources until :meth:`configure`).
        timeout_s: How long rows wait for the other sources', and a relay for the
            owner's answer.
        codec: The run's encoding of values in messages.
        describe: A source in words, for error messages.
        queued: The shard's count of messages in progress (a context manager).
        streams: The shard's direct path to the other shards (a relay's), once it
            has one.
    """

    def __init__(
        self,
        shard_index: int,
        num_workers: int,
        timeout_s: float,
        codec: Codec,
        describe: Callable[[int], str],
        queued: Callable[[], AbstractContextManager[None]],
        streams: Callable[[], WireStreams | None],
    ) -> None:
        self.shard_index = shard_index
        self.timeout_s = timeout_s
        self._codec = codec
        self._describe = describe
        self._queued = queued
        self._own = RowSums(shard_index, frozenset(range(num_workers)), timeout_s, describe)
        self._relayed: frozenset[int] = frozenset()
        self._streams = streams
        self._relay_source = -1
        # By owner: the node's rows summed for another node's shard.
        self._node: dict[int, RowSums] = {}
        # The one forward of each (model, step, owner) that all the node's workers
        # await, with the workers that have not taken its answer yet.
        self._forwards: dict[tuple[int, int, int], tuple[asyncio.Future[Rows], set[int]]] = {}

    def configure(self, topology: Topology) -> None:
        """Learns who sends this shard rows and for whom it relays."""
        self._own.sources = topology.sources(self.shard_index)
        self._relayed = topology.relayed_ranks(self.shard_index)
        self._relay_source = topology.relay_source(self.shard_index)

    async def _gather(
        self, sums: RowSums, model: int, step: int, source: int, tables: list[RowEntry]
    ) -> Rows:
        """Adds one source's rows of every table to ``sums``; the summed rows, encoded."""
        with self._queued():
            results = await asyncio.gather(
                *(
                    sums.push(
                        model, step, table, source, span, indices, self._codec.decode_np(values, dt)
                    )
                    for table, span, indices, values, dt in tables
                )
            )
        return [
            (rows, self._codec.encode_np(total, dt) if self._codec.converts(dt) else total)
            for (rows, total), (*_, dt) in zip(results, tables)
        ]

    async def sum(self, model: int, step: int, source: int, tables: list[RowEntry]) -> Rows:
        """Adds a source's rows that this shard owns; every source's sum once all
        sent theirs (see :meth:`SumShard.push_rows`)."""
        return await self._gather(self._own, model, step, source, tables)

    async def relay(
        self, model: int, step: int, rank: int, owner: int, tables: list[RowEntry]
    ) -> Rows:
        """As the node's relay: adds worker ``rank``'s rows that ``owner`` (a shard of
        another node) owns; once the node's workers sent theirs, sends their sum to
        the owner once; returns the owner's answer.

        Raises:
            ShardProtocolError: If this shard does not relay for ``rank``.
            ShardTimeoutError: If the node's workers or the owner do not answer.
            ShardLinkError: If the message to the owner fails.
        """
        if rank not in self._relayed:
            raise ShardProtocolError(
                f"shard {self.shard_index}: {self._describe(rank)} sent rows of shard "
                f"{owner} to relay, but this shard relays only for {sorted(self._relayed)}."
            )
        sums = self._node.get(owner)
        if sums is None:
            sums = self._node[owner] = RowSums(
                self.shard_index, self._relayed, self.timeout_s, self._describe
            )
        node_rows = await self._gather(sums, model, step, rank, tables)
        key = (model, step, owner)
        if key not in self._forwards:
            entries = [(t, span, r, v, dt) for (t, span, *_, dt), (r, v) in zip(tables, node_rows)]
            task = asyncio.ensure_future(self._forward(model, step, owner, entries))
            self._forwards[key] = (task, set(self._relayed))
        forward, waiting = self._forwards[key]
        try:
            return await forward
        finally:
            waiting.discard(rank)
            if not waiting:
                self._forwards.pop(key, None)

    async def _forward(self, model: int, step: int, owner: int, entries: list[RowEntry]) -> Rows:
        """Sends this node's summed rows to their owner on the direct path; its answer."""
        try:
            streams = self._streams()
            if streams is None:
                raise ShardProtocolError(
                    f"shard {self.shard_index} got rows to relay to shard {owner} "
                    "but has no direct data path to it."
                )
            push = asyncio.wrap_future(
                streams.push_rows(owner, model, step, self._relay_source, pack(entries))
            )
            # Not cancelled on timeout: a half-sent frame would corrupt the stream.
            push.add_done_callback(lambda t: t.cancelled() or t.exception())
            done, _ = await asyncio.wait({push}, timeout=self.timeout_s)
            if not done:
                raise ShardTimeoutError(
                    f"shard {self.shard_index}: model {model}: step {step}: owner shard "
                    f"{owner} did not answer this node's sparse rows within {self.timeout_s:g}s."
                )
            return [(r, v) for _, _, r, v, _ in unpack(push.result())]
        except (ShardTimeoutError, ShardProtocolError):
            raise
        except Exception as e:
            raise ShardLinkError(
                f"shard {self.shard_index}: relaying sparse rows to shard {owner} failed: {e}"
            ) from e
