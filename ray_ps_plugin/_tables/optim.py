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

__all__ = [
    "OPTIMIZERS",
    "STATE_NAMES",
    "TableOptimizer",
    "apply_step",
    "fused_axpy",
    "new_state",
]

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


def fused_axpy(alpha: float, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``y + alpha * x`` in float32 rounded once, as a fused multiply-add computes it.

    torch adds a sparse gradient into a dense weight with BLAS's ``axpy``, which
    fuses the multiply and the add on the CPUs it is built for (and CUDA's kernels
    do too); NumPy rounds the product first. A last-bit difference in one row is
    enough for two runs to part: a ReLU input that rounds to the other side of zero
    changes a whole sample's backward (DLRM's SGD recipe departed from DDP by 2e-5
    in one step that way). The product of two float32 values is exact in float64;
    the float64 sum is rounded to odd (its last bit set when it is inexact), which
    makes the rounding to float32 that of the exact value (Boldo and Melquiond:
    53 bits >= 24 + 2).
    """
    a = np.float64(np.float32(alpha))
    p = a * x.astype(np.float64)
    y64 = y.astype(np.float64)
    s = p + y64
    back = s - p  # Knuth's TwoSum: err is what the float64 sum dropped, exactly
    err = (p - (s - back)) + (y64 - back)
    even = (s.view(np.int64) & 1) == 0
    nudge = (err != 0) & even
    if nudge.any():
        s[nudge] = np.nextafter(s[nudge], np.where(err[nudge] > 0, np.inf, -np.inf))
    return s.astype(np.float32)


def _add(weight: np.ndarray, rows: np.ndarray, alpha: float, x: np.ndarray, fused: bool) -> None:
    """``weight[rows] += alpha * x`` as torch's ``weight.add_(sparse, alpha=alpha)``."""
    if fused:
        weight[rows] = fused_axpy(alpha, x, weight[rows])
    else:
        weight[rows] += alpha * x


#: Square roots of Adagrad's and SparseAdam's denominators. NumPy's are correctly
#: rounded; torch's vectorised CPU kernel is off by one bit in about 0.7% of
#: values, so these two optimizers agree with torch's to that rounding, not bit for
#: bit (tests swap torch's in to check that nothing else differs).
_sqrt = np.sqrt


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
    ``step`` is the step count including this one.

    Each formula keeps torch's order of operations, so a row's new value has the
    bits torch's optimizer gives it (Adagrad and SparseAdam: but for torch's
    square roots, see ``_sqrt``); ``hyper["fused"]`` (0 or 1) says whether the
    worker's torch rounds ``weight.add_(sparse, alpha=a)`` once (the default) or
    twice."""
    lr = hyper["lr"]
    fused = bool(hyper.get("fused", 1.0))
    if hyper.get("maximize"):
        grads = -grads
    if optimizer == "sgd":
        _add(weight, rows, -lr, grads, fused)
    elif optimizer == "adagrad":
        clr = lr / (1 + (step - 1) * hyper.get("lr_decay", 0.0))
        acc = state["sum"]
        acc[rows] += grads * grads
        _add(weight, rows, -clr, grads / (_sqrt(acc[rows]) + hyper["eps"]), fused)
    elif optimizer == "sparse_adam":  # as torch's SparseAdam
        beta1, beta2, eps = hyper["beta1"], hyper["beta2"], hyper["eps"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m_old, v_old = m[rows], v[rows]  # one gather each: the rows are scattered
        m_rows = m_old + (grads - m_old) * (1 - beta1)
        v_rows = v_old + (grads * grads - v_old) * (1 - beta2)
        m[rows], v[rows] = m_rows, v_rows
        step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
        # torch adds the step with alpha 1: one rounding of the sum, as NumPy's.
        weight[rows] += -step_size * (m_rows / (_sqrt(v_rows) + eps))
    else:
        raise ValueError(f"unknown table optimizer {optimizer!r}")
