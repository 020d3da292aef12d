"""Sync mode's sparse tables on the worker: one step's touched rows, batched per shard.

DDP hands each sparse table's gradient to the communication hook as a bucket of its
own. The hook keeps them until the step's last bucket, then sends every shard one
call with the rows of every table it owns (a call per table and shard would cost
the shards a Ray call each); the shards answer with the union of every worker's
rows and their sums, which become the tables' ``param.grad``. Where the worker's
node relays (:mod:`ray_ps_plugin._sync.topology`), the rows of other nodes' shards go
to the relay instead, which sends the owner the node's sum
(:mod:`ray_ps_plugin._sync.row_relay`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ray_ps_plugin._codec import Codec
from ray_ps_plugin._errors import PSError
from ray_ps_plugin._rows import RowEntry, pack, unpack
from ray_ps_plugin._sparse import SparseTable, assemble, sparse_params
from ray_ps_plugin._sync.topology import Route
from ray_ps_plugin._transport import DirectPath, Handle, Transport, wait_all

__all__ = ["PendingRows", "RowBatch"]


@dataclass
class PendingRows:
    """One step's sparse gradients on their way to the shards (one call per shard)."""

    step: int
    tables: list[SparseTable]
    grads: list[torch.Tensor]  # the worker's own, handed back to DDP on failure
    futures: list[torch.futures.Future[torch.Tensor]]
    handles: list[Handle[Any]]  # one call per owner shard, in shard order
    targets: list[int]  # the shard each call went to (the owner, or the node's relay)
    started: float = field(default_factory=time.perf_counter)

    @property
    def shards(self) -> list[int]:
        return self.targets

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
        routes: Where this worker sends each owner shard's rows (the run's
            topology); ``None``: to the owner.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        num_shards: int,
        codec: Codec,
        routes: Sequence[Route] | None = None,
    ) -> None:
        self._tables = {
            id(p): SparseTable(i, p, num_shards) for i, p in enumerate(sparse_params(module))
        }
        self._num_shards = num_shards
        self._codec = codec
        self._targets = [s if routes is None else routes[s].target for s in range(num_shards)]
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
        owner shard (with an empty pair for a table of which the worker touched none
        of the shard's rows: the shard waits for every worker's rows), to the owner
        or to the node's relay. A frame on the direct path where the run has one (a
        Ray call and its reply cost far more), else a Ray call.

        Returns:
            The pending step (``None`` if nothing was held) and the bytes sent to
            each shard (by the shard they went to).

        Raises:
            PSError: If rows must go through a relay and the run has no direct path.
        """
        held, self._held = self._held, []
        if not held:
            return None, []
        per_shard: list[list[RowEntry]] = [[] for _ in range(self._num_shards)]
        sent = [0] * self._num_shards
        for table, grad, _ in held:
            for shard, indices, values in table.split(grad, 1.0 / world_size, self._codec):
                per_shard[shard].append(
                    (table.index, table.split_key, indices, values, table.dtype_name)
                )
                sent[self._targets[shard]] += indices.nbytes + values.nbytes
        handles: list[Handle[Any]] = []
        for s, target in enumerate(self._targets):
            if target != s:
                if direct is None or not direct.reaches(target):
                    raise PSError(
                        f"rank {rank}: sparse rows for shard {s} must go through this "
                        f"node's relay (shard {target}), which has no direct path."
                    )
                payload = pack(per_shard[s])
                handles.append(direct.push_rows(target, model_id, step, rank, payload, s))
            elif direct is not None and direct.reaches(s):
                handles.append(direct.push_rows(s, model_id, step, rank, pack(per_shard[s])))
            else:
                handles.append(transport.call(s, "push_rows", model_id, step, rank, per_shard[s]))
        pending = PendingRows(
            step,
            [t for t, _, _ in held],
            [g for _, g, _ in held],
            [f for *_, f in held],
            handles,
            list(self._targets),
        )
        return pending, sent

    def complete(
        self, transport: Transport, item: PendingRows, timeout_s: float, where: str
    ) -> tuple[list[torch.Tensor], list[int]]:
        """Waits for every shard's summed rows (within ``timeout_s``).

        Returns:
            Each held table's summed sparse gradient, and the bytes received from
            each shard (by the shard they came from: the owner, or the relay).
        """
        answers = [
            [(e[2], e[3]) for e in unpack(a)] if isinstance(a, np.ndarray) else a
            for a in wait_all(transport, item.handles, item.shards, timeout_s, where)
        ]
        sums = [
            assemble(table, [a[k] for a in answers], self._codec, grad.device)
            for k, (table, grad) in enumerate(zip(item.tables, item.grads))
        ]
        received = [0] * self._num_shards
        for target, a in zip(item.targets, answers):
            received[target] += sum(r.nbytes + v.nbytes for r, v in a)
        return sums, received
