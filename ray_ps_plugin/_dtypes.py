"""How model dtypes are held in NumPy arrays, which have no bfloat16.

Shards, shared memory and Ray's object store see tensors as NumPy arrays. float16,
float32 and float64 map one to one. bfloat16 is held as its raw 16-bit patterns in an
``int16`` array (Ray ships it zero-copy, shared memory holds it as is, torch views it
back as ``torch.bfloat16`` without a copy); wherever a shard computes with such
values it widens them to float32 first. No other part of the package uses ``int16``,
so an ``int16`` array always means bfloat16 patterns.

Widening bfloat16 to float32 is exact and as fast in NumPy as in torch, so a sync
shard of a bf16 model imports torch only to round its sums back (see
:class:`~ray_ps_plugin._codec.Codec`).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "BF16_BITS",
    "MODEL_DTYPES",
    "bf16_to_f32",
    "model_dtype",
    "storage",
    "widened",
]

#: The floating dtypes a model's parameters may have, by name. The order is part of
#: the direct path's frame format (a frame names its dtype by index).
MODEL_DTYPES = ("float16", "float32", "float64", "bfloat16")

#: The NumPy dtype that holds bfloat16 values as bit patterns.
BF16_BITS = np.dtype(np.int16)


def storage(dtype: str) -> np.dtype:
    """The NumPy dtype holding values of the model dtype ``dtype``."""
    return BF16_BITS if dtype == "bfloat16" else np.dtype(dtype)


def model_dtype(held: np.ndarray) -> str:
    """The model dtype whose values the array ``held`` holds (the inverse of :func:`storage`)."""
    return "bfloat16" if held.dtype == BF16_BITS else held.dtype.name


def widened(dtype: str) -> str:
    """The dtype in which shards compute with values of ``dtype`` (sums, updates)."""
    return "float32" if dtype == "bfloat16" else dtype


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """The float32 values of bfloat16 patterns (exact: bfloat16 is float32's top half)."""
    wide = bits.view(np.uint16).astype(np.uint32) << 16
    return wide.view(np.float32)
