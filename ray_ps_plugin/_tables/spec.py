"""What every shard and worker agrees on about a table: its shape and kind
(:class:`TableSpec`), its initial rows, and the shape of a push and its answer.

NumPy only: shard processes use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ray_ps_plugin._tables.optim import TableOptimizer

__all__ = ["INIT_BLOCK_ROWS", "PushAnswer", "PushEntry", "TableSpec", "init_rows"]

#: Rows drawn from one random stream at initialisation: the values of a row depend
#: on the seed, the table and its block of this many rows, never on the shards.
INIT_BLOCK_ROWS = 1 << 16
#: One table's update in a push: ``(table, clock, ids, grads, optimizer, hyper,
#: touched)``; ``touched``: whether the worker's backward reached the table at all
#: (its rows may all be another shard's), as a torch gradient that is not ``None``.
PushEntry = tuple[int, int, np.ndarray, np.ndarray, TableOptimizer, dict[str, float], bool]
#: What a push gets back per entry: ``(steps, ids, rows)``, the optimizer's step count
#: once the update is applied and, for a replica table, the rows that update changed
#: on this shard (table row indices, sorted) with their new values (empty otherwise).
PushAnswer = tuple[int, np.ndarray, np.ndarray]


@dataclass(frozen=True)
class TableSpec:
    """A sharded table as every shard and worker of a run sees it.

    Attributes:
        rows: Rows of the whole table.
        dim: Values per row.
        padding_idx: The row kept at zero and never updated, or ``None``.
        seed: Seed of the initial values.
        staleness: The mode's bound on clock gaps: 0 in sync (with summed
            updates), ``s`` in ssp, ``None`` in async.
        sync: Whether a clock's pushes are summed and applied together.
        replica: Whether every worker holds the whole table too (sync only): the
            shard's rows come from rank 0, and a push's answer carries the rows its
            update changed.
        seeded: Whether the shards draw the initial rows from ``seed`` (a layer
            built on the meta device); otherwise they start at zero and rank 0
            writes its layer's rows before any worker reads them.
    """

    rows: int
    dim: int
    padding_idx: int | None
    seed: int
    staleness: int | None
    sync: bool
    replica: bool = False
    seeded: bool = True


def init_rows(
    spec: TableSpec, table: int, lo: int, hi: int, out: np.ndarray | None = None
) -> np.ndarray:
    """The initial values of rows ``[lo, hi)`` of table ``table`` (into ``out`` if
    given): standard normal, as ``nn.Embedding.reset_parameters`` draws them, the
    padding row zero."""
    if out is None:
        out = np.empty((hi - lo, spec.dim), np.float32)
    first = lo - lo % INIT_BLOCK_ROWS
    for start in range(first, hi, INIT_BLOCK_ROWS):
        stop = min(start + INIT_BLOCK_ROWS, spec.rows)
        block = np.random.default_rng([spec.seed, table, start // INIT_BLOCK_ROWS])
        values = block.standard_normal((stop - start, spec.dim), dtype=np.float32)
        a, b = max(start, lo), min(stop, hi)
        out[a - lo : b - lo] = values[a - start : b - start]
    if spec.padding_idx is not None and lo <= spec.padding_idx < hi:
        out[spec.padding_idx - lo] = 0.0
    return out
