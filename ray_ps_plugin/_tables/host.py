"""A shard's side of the tables: the actor methods workers call on their rows.

Mixed into every shard kind (:class:`TableHost` is a :class:`ShardBase`): a
:class:`~ray_ps_plugin._tables.store.TableStore` holds the rows, these methods check
the caller's ids, count bytes and hand each call on. :meth:`TableHost.table_frame`
answers the same pulls and pushes arriving as frames on the direct path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ray_ps_plugin._shard import ShardBase
from ray_ps_plugin._shm import SegmentHandle
from ray_ps_plugin._tables.frames import pack_push_answer, unpack_pull, unpack_push
from ray_ps_plugin._tables.optim import TableOptimizer
from ray_ps_plugin._tables.spec import PushAnswer, PushEntry, TableSpec
from ray_ps_plugin._tables.store import TableStore
from ray_ps_plugin._wire.frames import TABLE_PULL, TABLE_PUSH, TABLE_WAIT, Frame

__all__ = ["TableHost"]


class TableHost(ShardBase):
    """A shard that holds rows of embedding tables (every mode but diloco).

    Args:
        shard_index: This shard's index, used in error messages.
        num_workers: Number of workers it serves.
        timeout_s: Bound on every wait inside the shard.
    """

    def __init__(self, shard_index: int, num_workers: int, timeout_s: float) -> None:
        super().__init__(shard_index, num_workers, timeout_s)
        self._tables = TableStore(shard_index, num_workers, timeout_s)

    def stats(self) -> dict[str, Any]:
        """:meth:`ShardBase.stats` and the bytes of table rows and state held."""
        return {**super().stats(), **self._tables.sizes()}

    async def _on_frame(self, frame: Frame, payload: np.ndarray) -> np.ndarray:
        answer = await self.table_frame(frame, payload)
        return answer if answer is not None else await super()._on_frame(frame, payload)

    async def table_frame(self, frame: Frame, payload: np.ndarray) -> np.ndarray | None:
        """Answers a table's pull or push that came as a frame (``None``: the frame
        is of another kind)."""
        if frame.kind == TABLE_PULL:
            table, clock, ids = unpack_pull(payload)
            rows = await self.table_pull(frame.model, table, frame.source, clock, ids)
            return np.ascontiguousarray(rows, np.float32).view(np.uint8).reshape(-1)
        if frame.kind == TABLE_PUSH:
            pushed = await self.table_push(frame.model, frame.source, unpack_push(payload))
            return pack_push_answer(pushed)
        if frame.kind == TABLE_WAIT:
            pairs = payload.view("<i8").reshape(-1, 2).tolist()
            await self.table_wait(frame.model, frame.source, dict(pairs))
            return np.empty(0, np.uint8)
        return None

    def table_create(
        self,
        model: int,
        table: int,
        spec: TableSpec,
        num_shards: int,
        shared: bool = False,
        rank: int = 0,
    ) -> tuple[int, int, SegmentHandle | None, int]:
        """Materialises this shard's rows of a table (idempotent); returns their
        range, with ``shared`` the segment workers of this node read them from, and
        the updates of ``rank`` the table has taken (where a replacement goes on)."""
        self._check(model, rank)
        lo, hi = self._tables.create(model, table, spec, num_shards, shared)
        return lo, hi, self._tables.segment(model, table), self._tables.clock(model, table, rank)

    async def table_pull(
        self, model: int, table: int, rank: int, clock: int, ids: np.ndarray
    ) -> np.ndarray:
        self._check(model, rank)
        with self._queued():
            rows = await self._tables.pull(model, table, rank, clock, ids)
        self._bytes_in += ids.nbytes
        self._bytes_out += rows.nbytes
        return rows

    async def table_push(
        self, model: int, rank: int, entries: Sequence[PushEntry]
    ) -> list[PushAnswer]:
        """One worker's optimizer step on every sharded table of a model it holds
        rows of here (see ``TableStore.push_many``)."""
        self._check(model, rank)
        self._bytes_in += sum(e[2].nbytes + e[3].nbytes for e in entries)
        self._pushes += 1
        with self._queued():
            answers = await self._tables.push_many(model, rank, entries)
        self._bytes_out += sum(ids.nbytes + rows.nbytes for _, ids, rows in answers)
        return answers

    async def table_wait(self, model: int, rank: int, clocks: dict[int, int]) -> None:
        """See ``TableStore.wait_bound`` (``clocks``: by table)."""
        self._check(model, rank)
        with self._queued():
            await self._tables.wait_bound(model, clocks)

    async def table_finish(self, model: int, rank: int) -> None:
        self._check(model, rank)
        await self._tables.finish(model, rank)

    def table_read(self, model: int, table: int, lo: int, hi: int) -> dict[str, Any]:
        self._check(model, None)
        return self._tables.read(model, table, lo, hi)

    def table_write(
        self,
        model: int,
        table: int,
        lo: int,
        weight: np.ndarray,
        state: dict[str, np.ndarray],
        optimizer: TableOptimizer | None,
        steps: int | None,
    ) -> None:
        self._check(model, None)
        self._tables.write(model, table, lo, weight, state, optimizer, steps)

    async def table_loaded(self, model: int, generation: int) -> None:
        self._check(model, None)
        await self._tables.loaded(model, generation)

    async def table_wait_loaded(self, model: int, generation: int) -> None:
        self._check(model, None)
        await self._tables.wait_loaded(model, generation)
