"""Checkpoints of sharded embedding tables, one shard's slice at a time.

:func:`save_tables` (rank 0) reads the rows with their optimizer state in slices
(from every shard holding some of a slice) and writes one ``.npz`` file per slice,
so a worker never holds a whole table; :func:`load_tables` sends each file's rows
to every shard holding some of them, so a restore works onto any number of shards,
whether a table's rows are split in ranges or interleaved. Layout under the
checkpoint's folder: ``model<M>/table<T>/table.json`` (shape, optimizer, step
count) and ``rows<first row>.npz`` (``weight`` and the optimizer's state arrays).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ray_ps_plugin._tables.client import ShardedTables
from ray_ps_plugin._tables.table import Table
from ray_ps_plugin._tables.transfer import read_rows, write_rows

__all__ = ["load_tables", "save_tables"]


def save_tables(tables: ShardedTables, path: Path) -> None:
    """Writes every table of the model under ``path``, one slice of rows at a time."""
    tables.flush()
    for t in tables.tables:
        folder = path / f"model{tables.model_id}" / f"table{t.ref.index}"
        folder.mkdir(parents=True, exist_ok=True)
        meta: dict[str, Any] = {"rows": t.spec.rows, "dim": t.spec.dim, "name": t.name}
        for a, b in t.slices():
            weight, state, optimizer, steps = read_rows(tables, t, a, b)
            arrays: dict[str, Any] = {"weight": weight, **state}
            np.savez(folder / f"rows{a:012d}.npz", **arrays)
            meta.update(optimizer=optimizer, steps=steps)
        (folder / "table.json").write_text(json.dumps(meta))


def load_tables(tables: ShardedTables, path: Path) -> None:
    """Restores what :func:`save_tables` wrote (rank 0 sends, every rank waits),
    onto any number of shards."""

    def write() -> None:
        for t in tables.tables:
            _load_table(tables, t, path / f"model{tables.model_id}" / f"table{t.ref.index}")

    tables.publish(write)
    for t in tables.replicas:
        tables.refresh(t)


def _load_table(tables: ShardedTables, t: Table, folder: Path) -> None:
    meta = json.loads((folder / "table.json").read_text())
    if (meta["rows"], meta["dim"]) != (t.spec.rows, t.spec.dim):
        raise ValueError(
            f"{folder} holds a table of {meta['rows']} x {meta['dim']}, but "
            f"{t.name!r} is {t.spec.rows} x {t.spec.dim}: a checkpoint of another model."
        )
    for file in sorted(folder.glob("rows*.npz")):
        lo = int(file.stem.removeprefix("rows"))
        with np.load(file) as data:
            weight = data["weight"]
            state = {k: data[k] for k in data.files if k != "weight"}
        write_rows(tables, t, lo, weight, state, meta["optimizer"], meta["steps"])
