"""Sync mode's sparse tables on the worker: one step's touched rows, batched per shard.

DDP hands each sparse table's gradient to the communication hook as a bucket of its
own. The hook keeps them until the step's last bucket, then sends every shard one
call with the rows of every table it owns (a call per table and shard would cost
the shards a Ray call each); the shards answer with the union of every worker's
rows and their sums, which become the tables' ``param.grad``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ray_ps_plugin._codec import Codec
from ray_ps_plugin._rows import RowEntry, pack, unpack
from ray_ps_plugin._sparse import SparseTable, assemble, sparse_params
from ray_ps_plugin._transport import DirectPath, Handle, Transport, wait_all

__all__ = ["PendingRows", "RowBatch"]


@dataclass
class PendingRows:
    """One step's sparse gradients on their way to the shards (one call per shard)."""

    step: int
    tables: list[SparseTable]
    grads: list[torch.Tensor]  # the worker's own, handed back to DDP on failure
    futures: list[torch.futures.Future[torch.Tensor]]
    handles: list[Handle[Any]]  # one call per shard, in shard order
    started: float = field(default_factory=time.perf_counter)

    @property
    def shards(self) -> list[int]:
        return list(range(len(self.handles)))

    def release(self) -> None:
        """Completes every future not completed yet with the worker's own gradient
        (DDP must never wait forever; the kept error fails the step)."""
        for fut, grad in zip(self.futures, self.grads):
            if not fut.done():
                fut.set_result(grad)


class RowBatch:
    """The sparse tables of one model and the rows of the step being collected.

    Args:
        module: The model.
        num_shards: The shards the tables' rows are split over.
        codec: The run's encoding of values in messages.
    """

    def __init__(self, module: torch.nn.Module, num_shards: int, codec: Codec) -> None:
        self._tables = {
            id(p): SparseTable(i, p, num_shards) for i, p in enumerate(sparse_params(module))
        }
        self._num_shards = num_shards
        self._codec = codec
        self._held: list[tuple[SparseTable, torch.Tensor, torch.futures.Future[torch.Tensor]]] = []

    def __bool__(self) -> bool:
        return bool(self._tables)

    def hold(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        fut: torch.futures.Future[torch.Tensor],
    ) -> None:
        """Keeps a table's gradient for this step's send."""
        self._held.append((self._tables[id(param)], grad, fut))

    def send(
        self,
        transport: Transport,
        direct: DirectPath | None,
        model_id: int,
        step: int,
        rank: int,
        world_size: int,
    ) -> tuple[PendingRows | None, list[int]]:
        """Sends the held gradients' rows, divided by the world size: one message per
        shard (with an empty pair for a table of which the worker touched none of
        the shard's rows: the shard waits for every worker's rows). A frame on the
        direct path where the run has one (a Ray call and its reply cost far more),
        else a Ray call.

        Returns:
            The pending step (``None`` if nothing was held) and the bytes sent to
            each shard.
        """
        held, self._held = self._held, []
        if not held:
            return None, []
        per_shard: list[list[RowEntry]] = [[] for _ in range(self._num_shards)]
        sent = [0] * self._num_shards
        for table, grad, _ in held:
            for shard, span, indices, values in table.split(grad, 1.0 / world_size, self._codec):
                per_shard[shard].append((table.index, span, indices, values, table.dtype_name))
                sent[shard] += indices.nbytes + values.nbytes
        handles = [
            direct.push_rows(s, model_id, step, rank, pack(per_shard[s]))
            if direct is not None and direct.reaches(s)
            else transport.call(s, "push_rows", model_id, step, rank, per_shard[s])
            for s in range(self._num_shards)
        ]
        pending = PendingRows(
            step, [t for t, _, _ in held], [g for _, g, _ in held], [f for *_, f in held], handles
        )
        return pending, sent

    def complete(
        self, transport: Transport, item: PendingRows, timeout_s: float, where: str
    ) -> tuple[list[torch.Tensor], list[int]]:
        """Waits for every shard's summed rows (within ``timeout_s``).

        Returns:
            Each held table's summed sparse gradient, and the bytes received from
            each shard.
        """
        answers = [
            [(e[2], e[3]) for e in unpack(a)] if isinstance(a, np.ndarray) else a
            for a in wait_all(transport, item.handles, item.shards, timeout_s, where)
        ]
        sums = [
            assemble(table, [a[k] for a in answers], self._codec, grad.device)
            for k, (table, grad) in enumerate(zip(item.tables, item.grads))
        ]
        received = [sum(r.nbytes + v.nbytes for r, v in a) for a in answers]
        return sums, received
