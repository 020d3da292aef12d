"""A table's rows moved whole between a worker and the shards, one slice at a time.

:func:`write_rows` sends rows, with their optimizer state, to every shard holding
some of them: rank 0's copy of a replica or looked-up table, or a checkpoint's file
on a restore. :func:`read_rows` gathers rows back from those shards (checkpoints,
``optimizer.state_dict()``, a worker's copy refreshed). Either way each call carries
one slice of rows, so no process holds a whole table it does not already hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ray_ps_plugin._tables.optim import TableOptimizer
from ray_ps_plugin._tables.table import Table
from ray_ps_plugin._torch_compat import version_counter

if TYPE_CHECKING:
    from ray_ps_plugin._tables.client import ShardedTables

__all__ = ["read_rows", "send_copy", "write_rows"]


def write_rows(
    tables: ShardedTables,
    t: Table,
    lo: int,
    weight: np.ndarray,
    state: dict[str, np.ndarray],
    optimizer: TableOptimizer | None,
    steps: int | None,
) -> None:
    """Overwrites rows ``[lo, lo + len(weight))`` of ``t`` on every shard holding
    some of them (each keeps its own); ``steps=None`` keeps the shards' step count."""
    shards = t.holding(lo, lo + len(weight))
    args = (tables.model_id, t.ref.index, lo, weight, state, optimizer, steps)
    calls = [tables.transport.call(s, "table_write", *args) for s in shards]
    tables.wait(calls, shards, f"writing rows {lo}.. of {t.name!r}")


def send_copy(
    tables: ShardedTables,
    t: Table,
    state: dict[str, torch.Tensor] | None = None,
    optimizer: TableOptimizer | None = None,
    steps: int | None = None,
) -> None:
    """Rank 0 writes its copy of ``t``'s weight to the shards, slice by slice: with
    ``state``, ``optimizer`` and ``steps`` (what ``load_state_dict`` gave the user's
    optimizer) also the optimizer's, else their optimizer state and step count stay.
    Every rank then counts its copy as the shards'."""
    if tables.rank == 0:
        weight = t.weight.detach()
        for a, b in t.slices():
            part = {n: v[a:b].detach().cpu().numpy() for n, v in (state or {}).items()}
            write_rows(tables, t, a, weight[a:b].cpu().numpy(), part, optimizer, steps)
    t.version = version_counter(t.weight)


def read_rows(
    tables: ShardedTables, t: Table, lo: int, hi: int
) -> tuple[np.ndarray, dict[str, np.ndarray], TableOptimizer | None, int]:
    """Rows ``[lo, hi)`` of ``t`` with their optimizer state, from every shard
    holding some of them (each answers its rows and the step between them), with
    the optimizer's name and step count."""
    weight = np.empty((hi - lo, t.spec.dim), np.float32)
    state: dict[str, np.ndarray] = {}
    optimizer, steps = None, 0
    shards = t.holding(lo, hi)
    calls = [
        tables.transport.call(s, "table_read", tables.model_id, t.ref.index, lo, hi) for s in shards
    ]
    for part in tables.wait(calls, shards, f"reading rows of {t.name!r}"):
        n, first = len(part["weight"]), part["lo"] - lo
        picked = slice(first, first + (n - 1) * part["stride"] + 1, part["stride"])
        weight[picked] = part["weight"]
        for name, values in part["state"].items():
            state.setdefault(name, np.zeros_like(weight))[picked] = values
        optimizer, steps = part["optimizer"] or optimizer, max(steps, part["steps"])
    return weight, state, optimizer, steps
