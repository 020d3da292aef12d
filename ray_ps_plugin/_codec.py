"""Wire formats between workers and shards: fp32 as is, or 16-bit compression.

With ``PSConfig(compression="bf16" | "fp16")`` every tensor that travels (gradient
chunks and sums in sync mode, deltas and parameters in async/ssp) is sent as 16-bit
values, halving the bytes. The shards decode to the model's dtype (at least fp32)
and keep their sums and master parameters in it, so rounding happens only on the
wire, never in the state.

NumPy has no bfloat16, so bf16 travels as the raw 16-bit patterns in an ``int16``
array (Ray ships NumPy arrays zero-copy) and is reinterpreted with torch.
"""

import warnings
from typing import Any

import numpy as np
import torch

from ray_ps_plugin._types import Compression

__all__ = ["Codec"]

_WIRE: dict[Compression | None, torch.dtype] = {
    None: torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


def _as_torch(arr: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        # Arrays from Ray's object store are read-only; they are only read here.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


class Codec:
    """Encodes fp32 tensors for the wire and decodes them back.

    Args:
        compression: ``None`` (fp32 on the wire), ``"fp16"`` or ``"bf16"``.
    """

    def __init__(self, compression: Compression | None) -> None:
        if compression not in _WIRE:
            raise ValueError(f"unknown compression {compression!r}")
        self.compression = compression
        self.wire_dtype = _WIRE[compression]

    @property
    def active(self) -> bool:
        return self.compression is not None

    def wire_np_dtype(self, dtype: str) -> str:
        """The NumPy dtype of a wire array carrying values of ``dtype``."""
        if self.compression == "bf16":
            return "int16"  # bf16 travels as its raw 16-bit patterns
        return "float16" if self.compression == "fp16" else dtype

    def encode(self, t: torch.Tensor) -> np.ndarray:
        """A host array of ``t`` in the wire format (a view when nothing changes)."""
        t = t.detach()
        if not self.active:
            return t.cpu().numpy()
        wire = t.to(device="cpu", dtype=self.wire_dtype)
        return wire.view(torch.int16).numpy() if self.compression == "bf16" else wire.numpy()

    def decode(self, arr: np.ndarray, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values of a wire array as ``dtype`` (the array itself when uncompressed)."""
        t = _as_torch(arr)
        if self.compression == "bf16":
            t = t.view(torch.bfloat16)
        return t.to(dtype) if self.active else t

    def encode_np(self, values: np.ndarray) -> np.ndarray:
        """Shard side: a fresh wire array of fp32 ``values`` (a copy when uncompressed)."""
        if not self.active:
            return values.copy()
        return self.encode(_as_torch(values))

    def decode_np(self, arr: np.ndarray, dtype: str = "float32") -> np.ndarray:
        """Shard side: the values of a wire array as ``dtype`` (the array itself when
        uncompressed)."""
        if not self.active:
            return arr
        return self.decode(arr, getattr(torch, dtype)).numpy()

    def __reduce__(self) -> tuple[Any, ...]:
        return (Codec, (self.compression,))
