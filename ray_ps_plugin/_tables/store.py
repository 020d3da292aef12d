"""Shard side of sharded embedding tables: rows no worker holds, and their optimizer.

A table built on the meta device (``nn.Embedding(R, D, sparse=True,
device="meta")``) exists only here: each shard holds a contiguous block of its rows
(``_rows.row_bounds``) with the optimizer state of those rows, initialised as the
layer initialises its weight (normal, mean 0, std 1; the padding row zero) from a
seed that does not depend on the number of shards. Workers pull the rows their
batch touches and push the gradients of those rows with the hyperparameters of the
user's optimizer at that step; the shard applies SGD, Adagrad or SparseAdam (lazy
Adam) to the touched rows only, with torch's formulas.

Clocks: a worker's clock on a table is the number of updates it has pushed. In
``"sync"`` a clock's update is the sum of every unfinished worker's push, applied
once all are in; a pull at clock ``c`` waits until update ``c`` is applied, so a
step's lookups see every earlier step. With a staleness bound ``s`` (``"ssp"``)
each push is applied as it comes and a pull at clock ``c`` waits until every
unfinished worker has pushed ``c - s``; ``"async"`` never waits. A push that
repeats a clock already taken is ignored (delivery is idempotent).

A *replica* table (``TableSpec.replica``: ``PSConfig(sparse_optimizer="shards")``)
is a table every worker also holds whole: the shard's rows start as rank 0's (written
by it after creation), workers never pull, and each sync push is answered with the
rows its clock changed and their new values, which the workers write into their
copies. Its rows are interleaved (shard ``s`` of ``S`` holds rows ``s, s + S, ...``)
rather than in ranges: ids numbered by frequency would put every hot row, and the
optimizer's work on them, on shard 0.

NumPy only: a sync shard process stays free of torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from ray_ps_plugin._errors import ShardProtocolError, ShardTimeoutError
from ray_ps_plugin._rows import row_bounds, sum_rows
from ray_ps_plugin._shm import SegmentHandle
from ray_ps_plugin._tables.block import TableBlock, zeroed_rows
from ray_ps_plugin._tables.optim import TableOptimizer, apply_step, new_state
from ray_ps_plugin._tables.spec import PushAnswer, PushEntry, TableSpec, init_rows

logger = logging.getLogger(__name__)

__all__ = ["TableStore"]


class TableStore:
    """The sharded tables' rows held by one shard, for every prepared model.

    Args:
        shard_index: This shard's index.
        num_workers: Workers pushing to it.
        timeout_s: Bound on every wait.
    """

    def __init__(self, shard_index: int, num_workers: int, timeout_s: float) -> None:
        self.shard_index = shard_index
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self._tables: dict[tuple[int, int], TableBlock] = {}

    # --- set-up --------------------------------------------------------------------
    def create(
        self, model: int, table: int, spec: TableSpec, num_shards: int, shared: bool = False
    ) -> tuple[int, int]:
        """Materialises this shard's rows of a table, split over ``num_shards``
        (idempotent: every worker asks); returns the row range held. ``shared``: in
        a shared-memory segment (see :meth:`segment`), where the host allows one."""
        key = (model, table)
        if spec.replica and not spec.sync:
            raise ShardProtocolError(
                f"shard {self.shard_index}: table {table} of model {model} is a replica "
                "table outside sync mode; every worker's copy would drift."
            )
        if key in self._tables:
            # A replacement worker's seed may differ: the rows exist already.
            held = self._tables[key].spec
            if dataclasses.replace(spec, seed=held.seed) != held:
                raise ShardProtocolError(
                    f"shard {self.shard_index}: table {table} of model {model} is "
                    f"described differently by two workers ({self._tables[key].spec} and "
                    f"{spec}); every worker must build the same model."
                )
            return self._tables[key].lo, self._tables[key].hi
        if spec.replica:  # interleaved rows; rank 0 writes them next
            lo, hi, stride = self.shard_index, spec.rows, num_shards
            count = len(range(lo, hi, stride))
            t = TableBlock(spec, lo, hi, self.num_workers, np.zeros((count, spec.dim), np.float32))
            t.stride, t.clocks = stride, [0] * self.num_workers
            self._tables[key] = t
            return lo, hi
        bounds = row_bounds(spec.rows, num_shards)
        lo, hi = bounds[self.shard_index], bounds[self.shard_index + 1]
        weight, segment = zeroed_rows(hi - lo, spec.dim, shared)
        if spec.seeded:
            init_rows(spec, table, lo, hi, out=weight)
        t = TableBlock(spec, lo, hi, self.num_workers, weight, segment)
        t.clocks = [0] * self.num_workers
        self._tables[key] = t
        return lo, hi

    def segment(self, model: int, table: int) -> SegmentHandle | None:
        """Where a worker of this node maps the table's rows, or ``None``."""
        t = self._table(model, table)
        return None if t.segment is None else t.segment.handle

    def _table(self, model: int, table: int) -> TableBlock:
        try:
            return self._tables[model, table]
        except KeyError:
            raise ShardProtocolError(
                f"shard {self.shard_index}: no table {table} of model {model}; the "
                "worker's model differs from the one the table was created for."
            ) from None

    def _local(self, t: TableBlock, ids: np.ndarray) -> np.ndarray:
        offset = ids.astype(np.int64) - t.lo
        if ids.size and (
            int(offset.min()) < 0
            or int(ids.max()) >= t.hi
            or (t.stride > 1 and bool((offset % t.stride).any()))
        ):
            held = f"[{t.lo}, {t.hi})" + (f" in steps of {t.stride}" if t.stride > 1 else "")
            raise ShardProtocolError(
                f"shard {self.shard_index}: rows it does not hold (it holds {held}) were "
                "sent to it."
            )
        return offset // t.stride if t.stride > 1 else offset

    # --- the step --------------------------------------------------------------------
    async def pull(
        self, model: int, table: int, rank: int, clock: int, ids: np.ndarray
    ) -> np.ndarray:
        """The rows ``ids`` (sorted, unique) once they are fresh enough for a worker
        that has pushed ``clock`` updates (see the module docstring)."""
        t = self._table(model, table)
        local = self._local(t, ids)
        spec = t.spec
        if spec.sync:
            await self._wait(t, lambda: t.applied >= clock, f"update {clock} of table {table}")
        elif spec.staleness is not None:
            need = clock - spec.staleness
            await self._wait(t, lambda: t.slowest() >= need, f"every worker at clock {need}")
        return t.weight[local]

    async def wait_bound(self, model: int, clocks: dict[int, int]) -> None:
        """Returns once each table of ``model`` in ``clocks`` here holds what a worker
        at that clock may train on (ssp: every unfinished worker has pushed ``clock
        - s``), so that worker may read its rows straight from shared memory."""
        for table, clock in clocks.items():
            t = self._table(model, table)
            if t.spec.staleness is None or t.spec.sync:
                continue
            need = clock - t.spec.staleness
            await self._wait(
                t, lambda t=t, n=need: t.slowest() >= n, f"every worker at clock {need}"
            )

    async def push(
        self,
        model: int,
        table: int,
        rank: int,
        clock: int,
        ids: np.ndarray,
        grads: np.ndarray,
        optimizer: TableOptimizer,
        hyper: dict[str, float],
        touched: bool = True,
    ) -> int:
        """One worker's gradients of its touched rows (already divided by the world
        size) for its update ``clock``; returns once it is applied (in sync: once
        every worker's push of that clock is), with the number of updates applied.
        An update counts as a step of the optimizer (bias correction, ``lr_decay``)
        when some worker's backward ``touched`` the table.

        Raises:
            ShardProtocolError: A clock out of order, rows of another shard, or an
                optimizer other than the one the table was trained with.
        """
        entry = (table, clock, ids, grads, optimizer, hyper, touched)
        ((steps, _, _),) = await self.push_many(model, rank, [entry])
        return steps

    async def push_many(
        self, model: int, rank: int, entries: Sequence[PushEntry]
    ) -> list[PushAnswer]:
        """:meth:`push` for several tables of one model at once (one optimizer step
        of a worker): every update is taken before any is waited for. Answers each
        entry with the step count and, for a replica table, the rows its clock
        changed here with their new values."""
        tables = [self._take(model, rank, *entry) for entry in entries]
        for t in {id(t): t for t in tables}.values():
            async with t.changed:
                t.changed.notify_all()
        for t, (table, clock, *_) in zip(tables, entries):
            if t.spec.sync:
                await self._wait(
                    t, lambda t=t, c=clock: t.applied >= c, f"update {clock} of table {table}"
                )
        return [self._answer(t, clock) for t, (_, clock, *_) in zip(tables, entries)]

    def _answer(self, t: TableBlock, clock: int) -> PushAnswer:
        if t.spec.replica and clock in t.changed_rows:
            ids, rows = t.changed_rows[clock]
            return t.steps, ids, rows
        return t.steps, np.empty(0, np.int64), np.empty((0, t.spec.dim), np.float32)

    def _take(
        self,
        model: int,
        rank: int,
        table: int,
        clock: int,
        ids: np.ndarray,
        grads: np.ndarray,
        optimizer: TableOptimizer,
        hyper: dict[str, float],
        touched: bool,
    ) -> TableBlock:
        """Records (sync) or applies (ssp, async) one push; a repeat is ignored."""
        t = self._table(model, table)
        local = self._local(t, ids)
        if clock <= t.clocks[rank]:
            return t  # a repeated delivery: already taken
        if clock != t.clocks[rank] + 1:
            raise ShardProtocolError(
                f"shard {self.shard_index}: rank {rank} pushed update {clock} of table "
                f"{table} after {t.clocks[rank]}."
            )
        if t.optimizer is None:
            t.optimizer = optimizer
            t.state = new_state(t.weight, optimizer)
            initial = hyper.get("initial_accumulator_value", 0.0)
            if optimizer == "adagrad" and initial:
                t.state["sum"].fill(initial)
        elif t.optimizer != optimizer:
            raise ShardProtocolError(
                f"shard {self.shard_index}: table {table} is trained with {t.optimizer} "
                f"and now got a {optimizer} step; one optimizer per table."
            )
        grads = grads.reshape(len(ids), t.spec.dim).astype(np.float32, copy=False)
        t.clocks[rank] = clock
        if t.spec.sync:
            t.pending.setdefault(clock, []).append((rank, local, grads, touched))
            t.pending_hyper[clock] = hyper
            self._apply_ready(t)
        else:
            self._apply(t, local, grads, hyper, touched)
            t.catch_up(rank)
        return t

    def _apply_ready(self, t: TableBlock) -> None:
        """Sync: applies the next clock once every unfinished worker pushed it."""
        while True:
            clock = t.applied + 1
            got = t.pending.get(clock, [])
            waiting = set(range(t.num_workers)) - t.finished - {r for r, *_ in got}
            if waiting or not got:
                return
            del t.pending[clock]
            hyper = t.pending_hyper.pop(clock)
            got.sort(key=lambda push: push[0])  # rank order: the same bits every run
            rows, summed = sum_rows([i for _, i, _, _ in got], [g for _, _, g, _ in got])
            self._apply(t, rows, summed, hyper, any(touched for *_, touched in got))
            t.applied = clock
            if t.spec.replica:
                t.changed_rows[clock] = (rows * t.stride + t.lo, t.weight[rows])
                t.changed_rows.pop(clock - 2, None)

    def _apply(
        self,
        t: TableBlock,
        rows: np.ndarray,
        grads: np.ndarray,
        hyper: dict[str, float],
        touched: bool,
    ) -> None:
        """One optimizer step on the touched ``rows`` (local indices, unique for the
        summed sync update; a worker's own rows are unique too). Without ``touched``
        (no backward reached the table) the step count stays, as torch's optimizers
        skip a parameter whose gradient is ``None``."""
        if touched:
            t.steps += 1
        padding = t.spec.padding_idx
        a, b = (0, 0) if padding is None else t.own(padding, padding + 1)
        if a < b:
            # As torch's sparse gradients: the padding row (local row a) is never touched.
            keep = rows != a
            rows, grads = rows[keep], grads[keep]
        if not len(rows):
            return
        apply_step(t.optimizer, t.weight, t.state, rows, grads, hyper, t.steps)

    async def finish(self, model: int, rank: int) -> None:
        """A worker is done: no table waits for it any more."""
        for (m, _), t in self._tables.items():
            if m == model:
                t.finished.add(rank)
                self._apply_ready(t)  # a clock may have waited only for this worker
                async with t.changed:
                    t.changed.notify_all()

    async def leave(self, rank: int) -> None:
        """A worker is gone: no table of any model waits for it (see :meth:`finish`)."""
        for model in {m for m, _ in self._tables}:
            await self.finish(model, rank)

    def admit(self, rank: int) -> None:
        """A worker replaces one that left, from the clock the one it replaces
        stopped at (it learns it when it creates the tables again); where the
        clock gap is bounded it holds no one back until it is within the bound."""
        for t in self._tables.values():
            t.finished.discard(rank)
            if t.spec.staleness is not None and not t.spec.sync:
                t.free.add(rank)
                t.catch_up(rank)

    def clock(self, model: int, table: int, rank: int) -> int:
        """The updates of ``rank`` a table has taken: where the worker goes on."""
        return self._table(model, table).clocks[rank]

    def export(self) -> list[dict[str, Any]]:
        """Every table's block, state and clocks, for a later group's shards."""
        return [{"key": key, **t.export()} for key, t in self._tables.items()]

    def import_(self, exported: list[dict[str, Any]], bounded: bool) -> None:
        """Takes the blocks :meth:`export` gave, for this group's workers."""
        for e in exported:
            self._tables[tuple(e["key"])] = TableBlock.restore(e, self.num_workers, bounded)

    async def _wait(self, t: TableBlock, ready: Any, what: str) -> None:
        async def until() -> None:
            async with t.changed:
                await t.changed.wait_for(ready)

        try:
            await asyncio.wait_for(until(), self.timeout_s)
        except asyncio.TimeoutError:
            behind = [
                r for r, c in enumerate(t.clocks) if r not in t.finished and c < max(t.clocks)
            ]
            raise ShardTimeoutError(
                f"shard {self.shard_index}: waited {self.timeout_s:g}s for {what}; "
                f"worker(s) {behind or 'none'} are behind."
            ) from None

    # --- checkpoints -------------------------------------------------------------------
    def read(self, model: int, table: int, lo: int, hi: int) -> dict[str, Any]:
        """This shard's rows among the table's rows ``[lo, hi)`` with their optimizer
        state: the first one's row (``lo``) and the step between them (``stride``)."""
        t = self._table(model, table)
        a, b = t.own(lo, hi)
        return {
            "lo": t.lo + a * t.stride,
            "stride": t.stride,
            "weight": t.weight[a:b].copy(),
            "state": {n: s[a:b].copy() for n, s in t.state.items()},
            "optimizer": t.optimizer,
            "steps": t.steps,
            "range": (t.lo, t.hi),
        }

    def write(
        self,
        model: int,
        table: int,
        lo: int,
        weight: np.ndarray,
        state: dict[str, np.ndarray],
        optimizer: TableOptimizer | None,
        steps: int | None,
    ) -> None:
        """Overwrites the table's rows from ``lo`` (``weight``'s first row) that this
        shard holds (a restore; the others are ignored). ``steps=None`` keeps the
        step count (a replica's rows sent again)."""
        t = self._table(model, table)
        a, b = t.own(lo, lo + len(weight))
        if a >= b:
            return
        if optimizer is not None and t.optimizer is None:
            t.optimizer = optimizer
            t.state = new_state(t.weight, optimizer)
        first = t.lo + a * t.stride - lo  # this shard's first row within ``weight``
        picked = slice(first, first + (b - a - 1) * t.stride + 1, t.stride)
        t.weight[a:b] = weight[picked]
        for name, values in state.items():
            if name in t.state:
                t.state[name][a:b] = values[picked]
        if steps is not None:
            t.steps = steps

    async def loaded(self, model: int, generation: int) -> None:
        """Marks a restore of every table of ``model`` as complete (rank 0)."""
        for (m, _), t in self._tables.items():
            if m == model:
                t.generation = generation
                async with t.changed:
                    t.changed.notify_all()

    async def wait_loaded(self, model: int, generation: int) -> None:
        """Waits until rank 0 completed restore ``generation`` of ``model``."""
        for (m, _), t in self._tables.items():
            if m == model:
                await self._wait(t, lambda t=t: t.generation >= generation, f"restore {generation}")

    def sizes(self) -> dict[str, int]:
        """Bytes held: rows and optimizer state, over every table."""
        weight = sum(t.weight.nbytes for t in self._tables.values())
        state = sum(s.nbytes for t in self._tables.values() for s in t.state.values())
        return {"table_bytes": weight, "table_state_bytes": state}
