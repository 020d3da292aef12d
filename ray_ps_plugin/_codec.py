"""Wire formats between workers and shards: fp32 as is, or 16-bit compression.

With ``PSConfig(compression="bf16" | "fp16")`` every tensor that travels (gradient
chunks and sums in sync mode, deltas and parameters in async/ssp) is sent as 16-bit
values, halving the bytes. The shards decode to the model's dtype (at least fp32)
and keep their sums and master parameters in it, so rounding happens only on the
wire, never in the state.

NumPy has no bfloat16, so bf16 travels as the raw 16-bit patterns in an ``int16``
array (Ray ships NumPy arrays zero-copy) and is reinterpreted with torch.

torch is imported only where values are converted: a sync shard without
compression never converts, and importing torch would take most of its start-up.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from ray_ps_plugin._types import Compression

if TYPE_CHECKING:
    import torch

__all__ = ["Codec", "as_torch"]

_WIRE: dict[Compression | None, str] = {None: "float32", "fp16": "float16", "bf16": "bfloat16"}


def as_torch(arr: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``arr``'s memory (read-only arrays from Ray included)."""
    import torch

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

    @property
    def wire_dtype(self) -> torch.dtype:
        """The torch dtype of values on the wire."""
        import torch

        return getattr(torch, _WIRE[self.compression])

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
        import torch

        wire = t.to(device="cpu", dtype=self.wire_dtype)
        return wire.view(torch.int16).numpy() if self.compression == "bf16" else wire.numpy()

    def decode(self, arr: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The values of a wire array as ``dtype`` (fp32 by default; the array itself
        when uncompressed)."""
        import torch

        t = as_torch(arr)
        if self.compression == "bf16":
            t = t.view(torch.bfloat16)
        return t.to(dtype or torch.float32) if self.active else t

    def encode_np(self, values: np.ndarray) -> np.ndarray:
        """Shard side: a fresh wire array of fp32 ``values`` (a copy when uncompressed)."""
        if not self.active:
            return values.copy()
        return self.encode(as_torch(values))

    def decode_np(self, arr: np.ndarray, dtype: str = "float32") -> np.ndarray:
        """Shard side: the values of a wire array as ``dtype`` (the array itself when
        uncompressed)."""
        if not self.active:
            return arr
        import torch

        return self.decode(arr, getattr(torch, dtype)).numpy()

    def __reduce__(self) -> tuple[Any, ...]:
        return (Codec, (self.compression,))
