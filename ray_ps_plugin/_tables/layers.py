"""Which layers are tables trained on the shards, and what they and their optimizers may be.

A sharded table is an ``nn.Embedding`` or ``nn.EmbeddingBag`` whose weight is on the
meta device (see :mod:`ray_ps_plugin._tables.client`). A replica table is one with
sparse gradients on a real device under ``PSConfig(sparse_optimizer="shards")``:
every worker holds it, the shards step it. This module finds both, keeps a sharded
table's weight out of ``Module.to()``, and refuses, with the fix, the layers and
optimizer settings the shards cannot train.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ray_ps_plugin._tables.optim import TableOptimizer
from ray_ps_plugin._types import Mode

__all__ = [
    "Layer",
    "check_tables",
    "is_sharded",
    "meta_table_names",
    "meta_tables",
    "optimizer_step_spec",
    "replica_table_names",
    "replica_tables",
    "skipped_in_apply",
    "sparse_add_rounds_once",
]

_TABLE_TYPES = (torch.nn.Embedding, torch.nn.EmbeddingBag)
Layer = torch.nn.Embedding | torch.nn.EmbeddingBag


def _is_meta_table(m: torch.nn.Module) -> bool:
    return isinstance(m, _TABLE_TYPES) and m.weight.is_meta


def is_sharded(m: torch.nn.Module) -> bool:
    """Whether ``prepare_model`` already made ``m`` a sharded layer (it then holds a
    reference to its table)."""
    return getattr(m, "_ps_table", None) is not None


def meta_tables(module: torch.nn.Module) -> list[tuple[str, Layer]]:
    """``(name, layer)`` of every embedding layer whose weight is on the meta device."""
    return [
        (n, m)
        for n, m in module.named_modules()
        if isinstance(m, _TABLE_TYPES) and m.weight.is_meta
    ]


def meta_table_names(module: torch.nn.Module) -> list[str]:
    """The qualified names of those layers' weights (what DDP must ignore)."""
    return [f"{n}.weight" if n else "weight" for n, _ in meta_tables(module)]


def skipped_in_apply(m: torch.nn.Module) -> list[str]:
    """For ``Module.to()``: a meta table's weight stays where it is (on the shards)."""
    if not _is_meta_table(m):
        return []
    return ["weight"] if "weight" in dict(m.named_parameters(recurse=False)) else []


def replica_tables(module: torch.nn.Module) -> list[tuple[str, Layer]]:
    """``(name, layer)`` of every embedding layer with sparse gradients whose trainable
    weight is on a real device: what ``sparse_optimizer="shards"`` steps on the shards."""
    return [
        (n, m)
        for n, m in module.named_modules()
        if isinstance(m, _TABLE_TYPES)
        and m.sparse
        and not m.weight.is_meta
        and m.weight.requires_grad
    ]


def replica_table_names(module: torch.nn.Module) -> list[str]:
    """The qualified names of those layers' weights (what DDP must ignore).

    Raises:
        ValueError: For a layer the shards cannot step, naming it and the fix.
    """
    names = []
    for name, m in replica_tables(module):
        where = (
            f"The embedding layer {name or type(module).__name__!r} has sparse gradients "
            "and PSConfig(sparse_optimizer='shards') steps it on the shards"
        )
        if m.max_norm is not None:
            raise ValueError(
                f"{where}, but max_norm={m.max_norm} renormalises rows of each worker's "
                "copy inside forward, which the shards' rows would not follow. Drop "
                "max_norm, or use sparse_optimizer='workers'."
            )
        if m.weight.dtype != torch.float32:
            raise ValueError(
                f"{where}, which keep float32 rows; its weight is {m.weight.dtype}. Build "
                "it in float32, or use sparse_optimizer='workers' (which trains "
                "16-bit tables)."
            )
        names.append(f"{name}.weight" if name else "weight")
    return names


def check_tables(module: torch.nn.Module, on_shards: bool, mode: Mode) -> None:
    """Refuses, before DDP's constructor communicates, meta tables that cannot work
    (``on_shards``: whether ``mode`` can train tables on the shards at all).

    Raises:
        ValueError: Naming the layer and the fix.
    """
    for name, m in meta_tables(module):
        where = f"The embedding layer {name or type(module).__name__!r} is on the meta device"
        if not on_shards:
            raise ValueError(
                f"{where} (a sharded table), which mode={mode!r} cannot train: its workers "
                "take local steps on their own copy of every parameter. Use mode='sync', "
                "'async' or 'ssp', or build the table on a real device."
            )
        if type(m) not in _TABLE_TYPES and not is_sharded(m):
            raise ValueError(
                f"{where}, but its class {type(m).__qualname__} subclasses "
                f"{type(m).__mro__[1].__qualname__}: a sharded table replaces the layer's "
                "forward, which would drop the subclass's. Build a plain nn.Embedding or "
                "nn.EmbeddingBag on the meta device."
            )
        if not m.sparse:
            raise ValueError(
                f"{where} with sparse=False. A table that no worker holds is trained row "
                "by row on the shards: build it with sparse=True (and train it with "
                "SparseAdam, SGD or Adagrad)."
            )
        if m.max_norm is not None:
            raise ValueError(
                f"{where} with max_norm={m.max_norm}: max_norm renormalises rows of the "
                "weight inside forward, which lives on the shards. Drop max_norm (clip "
                "the gradients, or renormalise the output instead)."
            )
        dtype = m.weight.dtype
        if dtype != torch.float32:
            raise ValueError(
                f"{where} with dtype {dtype}; sharded tables are float32. "
                "Build it with dtype=torch.float32."
            )


@functools.cache
def sparse_add_rounds_once(device: str, dim: int) -> bool:
    """Whether ``weight.add_(sparse_grad, alpha=a)`` on ``device`` rounds
    ``weight + a * grad`` once (a fused multiply-add, as BLAS's ``axpy`` does where
    torch is built with MKL or OpenBLAS) for rows of ``dim`` values: SGD and Adagrad
    step sparse gradients that way, and the shards must round as the workers'
    torch would. Probed with values whose product needs one bit more than float32
    holds (``a * a - 1`` is ``2**-11 + 2**-24`` exactly, ``2**-11`` once rounded)."""
    a = 1 + 2**-12
    weight = torch.full((1, dim), -1.0, device=device)
    index = torch.zeros(1, 1, dtype=torch.int64, device=device)
    values = torch.full((1, dim), a, device=device)
    grad = torch.sparse_coo_tensor(index, values, (1, dim), check_invariants=False)
    weight.add_(grad, alpha=a)
    return bool((weight == 2**-11 + 2**-24).all())


def optimizer_step_spec(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], table: str
) -> tuple[TableOptimizer, dict[str, float]]:
    """What the shards apply for a table in ``group`` of ``optimizer`` this step.

    Raises:
        ValueError: For an optimizer (or an option) the shards do not apply.
    """
    fix = (
        f"The table {table!r}, trained on the shards, is stepped by "
        f"{type(optimizer).__name__}; the "
        "shards apply SparseAdam, SGD (no momentum, no weight decay) or Adagrad (no "
        "weight decay) to its rows. Give the table an optimizer of its own, e.g. "
        "torch.optim.SparseAdam([layer.weight]), and keep yours for the other parameters."
    )
    lr = float(group["lr"])
    maximize = float(bool(group.get("maximize", False)))
    if isinstance(optimizer, torch.optim.SparseAdam):
        beta1, beta2 = group["betas"]
        hyper = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": group["eps"]}
        return "sparse_adam", {**hyper, "maximize": maximize}
    if isinstance(optimizer, torch.optim.SGD):
        if group["momentum"] or group["weight_decay"]:
            raise ValueError(
                fix + f" (this SGD has momentum={group['momentum']}, "
                f"weight_decay={group['weight_decay']})."
            )
        return "sgd", {"lr": lr, "maximize": maximize}
    if isinstance(optimizer, torch.optim.Adagrad):
        if group["weight_decay"]:
            raise ValueError(fix + f" (this Adagrad has weight_decay={group['weight_decay']}).")
        hyper = {
            "lr": lr,
            "lr_decay": group["lr_decay"],
            "eps": group["eps"],
            "initial_accumulator_value": group["initial_accumulator_value"],
        }
        return "adagrad", {**hyper, "maximize": maximize}
    raise ValueError(fix)
