"""The optimizer state of tables whose optimizer runs on the shards, in torch's form.

The user's optimizer never steps such a table's weight, so it keeps no state for it
while training: :func:`state_from_shards` (an ``optimizer.state_dict()`` post-hook)
reads the shards' state into the state dict as torch's optimizer would hold it, and
:func:`take_state` hands a state that ``optimizer.load_state_dict`` put there to the
shards at the next step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ray_ps_plugin._tables.layers import optimizer_step_spec
from ray_ps_plugin._tables.optim import STATE_NAMES, TableOptimizer
from ray_ps_plugin._tables.table import Table
from ray_ps_plugin._tables.transfer import read_rows, send_copy

if TYPE_CHECKING:
    from ray_ps_plugin._tables.client import ShardedTables

__all__ = ["state_from_shards", "take_state", "torch_state"]


def take_state(
    tables: ShardedTables, optimizer: torch.optim.Optimizer, group: dict[str, Any], t: Table
) -> None:
    """Optimizer state on a replica's weight can only come from
    ``optimizer.load_state_dict`` (the optimizer never steps the weight): rank 0
    sends it to the shards with its copy of the rows, and every rank drops it,
    as the shards now hold it. A state before any step (Adagrad makes its zeros
    at construction) is dropped: the shards make their own."""
    entry = optimizer.state.pop(t.weight, None)
    if not entry or not int(entry.get("step", 0)):
        return
    if t.looked_up:  # its copy is not current: the state goes with the shards' rows
        tables.refresh(t)
    name, _ = optimizer_step_spec(optimizer, group, t.name)
    missing = [n for n in STATE_NAMES[name] if not torch.is_tensor(entry.get(n))]
    if missing:
        raise ValueError(
            f"{type(optimizer).__name__}.load_state_dict gave the table {t.name!r} a "
            f"state without {missing}: load the state_dict of the same optimizer "
            "class that saved it."
        )
    state = {n: entry[n] for n in STATE_NAMES[name]}
    send_copy(tables, t, state, name, int(entry["step"]))


def state_from_shards(
    tables: ShardedTables, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> dict[str, Any]:
    """``optimizer.state_dict()`` holds its replica tables' state as torch's
    optimizer would, read from the shards by this rank alone (often rank 0 is
    the only one writing a checkpoint), one slice of rows at a time."""
    params = (p for g in optimizer.param_groups for p in g["params"])
    index = {id(p): i for i, p in enumerate(params)}  # torch's numbering
    for t in tables.real:
        i = index.get(id(t.weight))
        if i is None or optimizer.state.get(t.weight):  # loaded, not yet sent
            continue
        entry = torch_state(tables, t)
        if entry:
            state_dict["state"][i] = entry
    return state_dict


def torch_state(tables: ShardedTables, t: Table) -> dict[str, Any]:
    """The shards' optimizer state of ``t`` in the form torch's optimizer keeps
    it (empty before the first step)."""
    tables.flush()
    arrays: dict[str, np.ndarray] = {}
    optimizer: TableOptimizer | None = None
    steps = 0
    for a, b in t.slices():
        _, part, name, count = read_rows(tables, t, a, b)
        optimizer, steps = name or optimizer, max(steps, count)
        for n, values in part.items():
            arrays.setdefault(n, np.zeros((t.spec.rows, t.spec.dim), np.float32))[a:b] = values
    if optimizer is None or not steps:
        return {}
    entry: dict[str, Any] = {n: torch.from_numpy(arrays[n]) for n in STATE_NAMES[optimizer]}
    if optimizer == "sparse_adam":
        entry["step"] = steps  # SparseAdam counts in an int, Adagrad in a tensor
    elif optimizer == "adagrad":
        entry["step"] = torch.tensor(float(steps))
    else:
        entry["momentum_buffer"] = None
    return entry
