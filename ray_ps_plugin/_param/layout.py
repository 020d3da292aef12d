"""How the async/ssp modes lay a model's parameters out over the shards.

The trainable parameters, flattened in ``module.parameters()`` order (the same on
every worker), form one vector; shard ``s`` owns the contiguous elements
``[bounds[s], bounds[s + 1])``. A parameter that straddles a boundary is cut into
pieces, so deltas and installs run per (parameter, shard) piece without a flat
intermediate copy.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ParamPiece", "pieces", "single_dtype", "split_bounds"]


def split_bounds(numel: int, num_shards: int) -> list[int]:
    """Element offsets cutting ``numel`` elements into near-equal contiguous slices."""
    return [numel * i // num_shards for i in range(num_shards + 1)]


@dataclass(frozen=True)
class ParamPiece:
    """The part of one parameter that lies in one shard's slice."""

    param: int  # index of the parameter
    p0: int  # first element inside the (flattened) parameter
    p1: int  # one past the last
    shard: int
    s0: int  # first element inside the shard's slice
    flat0: int  # first element in the flattened parameter vector

    @property
    def numel(self) -> int:
        return self.p1 - self.p0


def pieces(numels: Sequence[int], bounds: Sequence[int]) -> list[ParamPiece]:
    """Cuts parameters of ``numels`` elements at the shard ``bounds`` (flat offsets)."""
    out = []
    offset = 0
    for i, n in enumerate(numels):
        for s, (a, b) in enumerate(itertools.pairwise(bounds)):
            lo, hi = max(offset, a), min(offset + n, b)
            if lo < hi:
                out.append(ParamPiece(i, lo - offset, hi - offset, s, lo - a, lo))
        offset += n
    return out


def single_dtype(params: Sequence[torch.Tensor]) -> torch.dtype:
    """The one floating dtype of ``params``.

    Raises:
        TypeError: If the trainable parameters mix dtypes or are not floating.
    """
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
        raise TypeError(
            "The async and ssp modes keep the trainable parameters in one flat "
            f"buffer per shard and need a single floating dtype; this model has "
            f"{sorted(str(d) for d in dtypes) or 'no trainable parameters'}. Cast "
            "the model (e.g. model.float()) or use mode='sync'."
        )
    return next(iter(dtypes))
