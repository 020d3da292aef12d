"""The shards' optimizers for sharded tables: torch's sparse steps on touched rows.

SGD, Adagrad and SparseAdam (lazy Adam) as torch applies them to a sparse gradient:
only the rows in the gradient change, in their weight and in their state; the step
count (SparseAdam's bias correction, Adagrad's ``lr_decay``) is the table's. NumPy
only, on float32 rows.
"""

from __future__ import annotations

import math
import mmap
from typing import Literal

import numpy as np

__all__ = ["OPTIMIZERS", "STATE_NAMES", "TableOptimizer", "apply_step", "new_state"]

TableOptimizer = Literal["sgd", "adagrad", "sparse_adam"]
OPTIMIZERS: tuple[TableOptimizer, ...] = ("sgd", "adagrad", "sparse_adam")
#: The state arrays each optimizer keeps per row, as torch names them.
STATE_NAMES: dict[TableOptimizer, tuple[str, ...]] = {
    "sgd": (),
    "adagrad": ("sum",),
    "sparse_adam": ("exp_avg", "exp_avg_sq"),
}


def new_state(weight: np.ndarray, optimizer: TableOptimizer) -> dict[str, np.ndarray]:
    """Zeroed state arrays for the rows of ``weight``, in memory the kernel maps on
    first touch: only the pages of rows trained so far cost memory (SparseAdam's
    two arrays would otherwise triple a shard's footprint at its first step)."""
    return {n: _lazy_zeros(weight.shape, weight.dtype) for n in STATE_NAMES[optimizer]}


def _lazy_zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zeroed array whose pages are mapped when first written, in 4 KiB pages.

    Not ``np.zeros``: NumPy asks for transparent huge pages on large arrays, and then
    the first touch of one row maps and zeroes 2 MiB: steps slow down and the shard
    soon holds most of the state arrays.
    """
    nbytes = max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize)
    mapping = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(mapping, dtype, count=int(np.prod(shape))).reshape(shape)


def apply_step(
    optimizer: TableOptimizer | None,
    weight: np.ndarray,
    state: dict[str, np.ndarray],
    rows: np.ndarray,
    grads: np.ndarray,
    hyper: dict[str, float],
    step: int,
) -> None:
    """One step on ``rows`` (unique local indices) with their gradients ``grads``;
    ``step`` is the step count including this one."""
    lr = hyper["lr"]
    if hyper.get("maximize"):
        grads = -grads
    if optimizer == "sgd":
        weight[rows] -= lr * grads
    elif optimizer == "adagrad":
        clr = lr / (1 + (step - 1) * hyper.get("lr_decay", 0.0))
        acc = state["sum"]
        acc[rows] += grads * grads
        weight[rows] -= clr * grads / (np.sqrt(acc[rows]) + hyper["eps"])
    elif optimizer == "sparse_adam":  # as torch's SparseAdam
        beta1, beta2, eps = hyper["beta1"], hyper["beta2"], hyper["eps"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m_old, v_old = m[rows], v[rows]  # one gather each: the rows are scattered
        m_rows = m_old + (grads - m_old) * (1 - beta1)
        v_rows = v_old + (grads * grads - v_old) * (1 - beta2)
        m[rows], v[rows] = m_rows, v_rows
        step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
        weight[rows] -= step_size * m_rows / (np.sqrt(v_rows) + eps)
    else:
        raise ValueError(f"unknown table optimizer {optimizer!r}")
