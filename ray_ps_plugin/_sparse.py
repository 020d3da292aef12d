"""Worker side of sparse embedding tables: which parameters they are, and their rows.

DDP gives each parameter of an ``nn.Embedding`` / ``nn.EmbeddingBag`` built with
``sparse=True`` a bucket of its own and hands the communication hook its gradient as
a sparse COO tensor; the tensor the hook returns becomes ``param.grad``. Such a
gradient travels as its touched rows only (see :mod:`ray_ps_plugin._rows` for the
split of rows across the shards).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ray_ps_plugin._codec import Codec, as_torch
from ray_ps_plugin._torch_compat import ddp_ignored

__all__ = ["SparseTable", "assemble", "sparse_params"]


def sparse_params(module: torch.nn.Module) -> list[torch.Tensor]:
    """The trainable parameters whose gradients are sparse, in ``parameters()`` order.

    The same test as DDP's: the weight of an ``nn.Embedding`` or ``nn.EmbeddingBag``
    whose ``sparse`` is true.
    """
    found: dict[int, torch.Tensor] = {}
    for m in module.modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse:
            for p in m.parameters(recurse=False):
                # A table on the meta device lives on the shards (_tables.client).
                if p.requires_grad and not p.is_meta:
                    found[id(p)] = p
    # What DDP leaves alone is not synchronised here either (tables stepped on the
    # shards: _tables.client).
    ignored = ddp_ignored(module)
    return [p for n, p in module.named_parameters() if id(p) in found and n not in ignored]


class SparseTable:
    """One sparse table of a model: its index, its size and its split by rows.

    Row ``r`` belongs to shard ``r % num_shards`` (see :mod:`ray_ps_plugin._rows`).

    Args:
        index: The table's index among the model's sparse tables (the same on every
            worker, as ``parameters()`` order is).
        param: The table's weight.
        num_shards: The shards its rows are split over.
    """

    def __init__(self, index: int, param: torch.Tensor, num_shards: int) -> None:
        self.index = index
        self.shape = tuple(param.shape)
        self.dtype = param.dtype
        self.num_shards = num_shards

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def split_key(self) -> tuple[int, int]:
        """``(rows, shards)``: what every worker's split must agree on."""
        return (self.shape[0], self.num_shards)

    def split(
        self, grad: torch.Tensor, scale: float, codec: Codec
    ) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """The touched rows of a sparse gradient, scaled and encoded, shard by shard.

        Returns:
            ``(shard, indices, values)`` for every shard, the indices sorted; an empty
            pair of arrays where the gradient touches none of the shard's rows (the
            shard still waits for every worker).
        """
        g = grad.coalesce()
        indices = g.indices()[0].cpu().numpy()
        values = g.values() * scale
        if self.num_shards == 1:
            return [(0, indices, codec.encode(values))]
        owner = indices % self.num_shards
        # A stable sort by owner keeps each shard's rows sorted.
        order = np.argsort(owner, kind="stable")
        cuts = np.searchsorted(owner[order], np.arange(self.num_shards + 1))
        indices = indices[order]
        values = values[as_torch(order).to(values.device)]
        return [
            (s, indices[lo:hi], codec.encode(values[lo:hi]))
            for s, (lo, hi) in enumerate(zip(cuts[:-1].tolist(), cuts[1:].tolist()))
        ]


def assemble(
    table: SparseTable,
    answers: Sequence[tuple[np.ndarray, np.ndarray]],
    codec: Codec,
    device: torch.device,
) -> torch.Tensor:
    """The summed sparse gradient from every shard's ``(rows, sums)``, coalesced.

    The shards' rows are disjoint (each row has one owner) and each answer sorted;
    one sort merges them.
    """
    rows = np.concatenate([r for r, _ in answers])
    row_shape = table.shape[1:]
    parts = [codec.decode(v.reshape(-1, *row_shape), table.dtype) for _, v in answers]
    values = torch.cat(parts) if parts else torch.empty((0, *row_shape), dtype=table.dtype)
    if len(answers) > 1:
        order = np.argsort(rows, kind="stable")
        rows, values = rows[order], values[as_torch(order)]
    return torch.sparse_coo_tensor(
        as_torch(rows)[None].clone(),
        values,
        table.shape,
        device=device,
        # Sorted above and unique by construction; saying so spares torch the check.
        check_invariants=False,
        is_coalesced=True,
    )
