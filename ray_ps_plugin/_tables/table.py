"""One table on one worker: the layer whose forward looks rows up on the shards, and
what it holds between a backward and the step.

See :mod:`ray_ps_plugin._tables.client` for the kinds of tables and how a step
sends them.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from ray_ps_plugin._rows import row_bounds
from ray_ps_plugin._tables.layers import (
    Layer,
    optimizer_step_spec,
    sparse_add_rounds_once,
)
from ray_ps_plugin._tables.spec import PushEntry, TableSpec
from ray_ps_plugin._torch_compat import version_counter

if TYPE_CHECKING:
    from ray_ps_plugin._tables.client import ShardedTables

__all__ = ["SLICE_ROWS", "Table", "TableRef", "attach_layer", "detach"]

#: Rows per call when a whole table goes to or from the shards (a checkpoint, a
#: replica's first rows): a worker holds at most this many rows of one table at a
#: time (64 MiB of fp32 rows of 64 values).
SLICE_ROWS = 1 << 18


@dataclasses.dataclass(frozen=True)
class TableRef:
    """What a sharded layer holds to find its table (copies of the model share it)."""

    model: int
    index: int


#: The live tables of this process, by :class:`TableRef`.
_LIVE: dict[TableRef, Table] = {}


class _ShardedEmbedding(torch.nn.Embedding):
    """An ``nn.Embedding`` whose rows live on the shards."""

    _ps_table: TableRef

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _live(self._ps_table).lookup(self, input)


class _ShardedBag(torch.nn.EmbeddingBag):
    """An ``nn.EmbeddingBag`` whose rows live on the shards."""

    _ps_table: TableRef

    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return _live(self._ps_table).lookup(self, input, offsets, per_sample_weights)


def _live(ref: TableRef) -> Table:
    table = _LIVE.get(ref)
    if table is None:
        raise RuntimeError(
            "This embedding layer's rows live on the parameter servers of a run that is "
            "over (or in another process). Restore them into a run with "
            "get_ps_context().load_tables(), or save them with save_tables() while "
            "the run lasts."
        )
    return table


class Table:
    """One sharded table of one prepared model on this worker."""

    def __init__(
        self,
        ref: TableRef,
        name: str,
        layer: Layer,
        spec: TableSpec,
        num_shards: int,
        tables: ShardedTables,
    ) -> None:
        self.ref = ref
        self.name = name
        self.weight = layer.weight
        self.spec = spec
        # Rows on a real device, from the user's layer (rank 0's seed the shards),
        # not drawn by the shards for a layer built on the meta device.
        self.real = not self.weight.is_meta
        # Whether forward looks the batch's rows up on the shards (sharded and
        # looked-up tables) rather than reading the worker's copy (replicas).
        self.looked_up = not spec.replica
        self.bounds = np.asarray(row_bounds(spec.rows, num_shards))
        self._owner = tables
        self.clock = 0  # updates this worker has pushed
        self.held: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rows, their grads)
        # This node's shards whose rows are read from their shared memory:
        # (first row, the rows), by shard.
        self.local: dict[int, tuple[int, np.ndarray]] = {}
        # A replica's weight version once the shards' rows were last written into
        # it: any other change (load_state_dict, say) is sent to the shards.
        self.version = version_counter(self.weight)

    def _split(self, ids: np.ndarray) -> Iterator[tuple[int, slice]]:
        """``(shard, slice of ids)`` for each shard owning some of the sorted ``ids``."""
        cuts = np.searchsorted(ids, self.bounds)
        for s in range(len(self.bounds) - 1):
            if cuts[s] < cuts[s + 1]:
                yield s, slice(int(cuts[s]), int(cuts[s + 1]))

    def pull(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows ``ids`` (sorted, unique) as fresh as the mode asks: read from the
        shared memory of this node's shards, pulled by message from the others."""
        owner = self._owner
        host = ids.cpu().numpy()
        parts = list(self._split(host))
        if self.local and self.spec.sync:
            # This worker's last update is applied once its push returns, and in
            # sync only after every worker's: the rows read next hold every step.
            owner.flush()
        elif self.local and self.spec.staleness is not None:
            # ssp: once per step, the node's shards confirm the bound for every
            # table; then this node's rows are read from shared memory.
            owner.await_bound()
        by_message = [(s, sl) for s, sl in parts if s not in self.local]
        handles = [owner.call_pull(s, self.ref.index, self.clock, host[sl]) for s, sl in by_message]
        pulled = owner.wait(handles, [s for s, _ in by_message], f"pulling rows of {self.name!r}")
        answers = {
            s: a.view(np.float32).reshape(-1, self.spec.dim) if a.dtype == np.uint8 else a
            for (s, _), a in zip(by_message, pulled)
        }
        got = [
            self.local[s][1][host[sl] - self.local[s][0]] if s in self.local else answers[s]
            for s, sl in parts
        ]
        rows = np.concatenate(got) if got else np.empty((0, self.spec.dim), np.float32)
        owner.count(pulled=rows.nbytes + host.nbytes)
        return torch.from_numpy(rows).to(ids.device)

    def lookup(
        self,
        layer: Layer,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer's output, computed from the batch's rows only."""
        self._owner.raise_pending()
        uniq, inverse = torch.unique(input.reshape(-1), sorted=True, return_inverse=True)
        if uniq.numel() and (int(uniq[0]) < 0 or int(uniq[-1]) >= self.spec.rows):
            raise IndexError(
                f"{self.name!r}: ids must lie in [0, {self.spec.rows}); got "
                f"{int(uniq[0])}..{int(uniq[-1])}."
            )
        rows = self.pull(uniq)
        if torch.is_grad_enabled() and self.weight.requires_grad:
            rows.requires_grad_(True)
            rows.register_hook(lambda grad, uniq=uniq: self._hold(uniq, grad))
        padding = None
        if layer.padding_idx is not None:
            hit = (uniq == layer.padding_idx).nonzero()
            padding = int(hit[0, 0]) if len(hit) else None
        local = inverse.reshape(input.shape)
        if isinstance(layer, torch.nn.EmbeddingBag):
            return F.embedding_bag(
                local,
                rows,
                offsets,
                scale_grad_by_freq=layer.scale_grad_by_freq,
                mode=layer.mode,
                per_sample_weights=per_sample_weights,
                include_last_offset=layer.include_last_offset,
                padding_idx=padding,
            )
        return F.embedding(local, rows, padding, scale_grad_by_freq=layer.scale_grad_by_freq)

    def _hold(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        self.held.append((ids, grad.detach()))

    def step(self, optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> list[PushEntry]:
        """This step's update for each shard: the row gradients kept since the last
        step (summed per row, divided by the world size as DDP's average does) with
        the step's hyperparameters. Every shard gets one, empty or not: in sync each
        waits for every worker."""
        kind, hyper = optimizer_step_spec(optimizer, group, self.name)
        device = "cpu" if self.weight.is_meta else self.weight.device.type
        hyper["fused"] = float(sparse_add_rounds_once(device, self.spec.dim))
        if self.spec.replica:
            touched, ids, mean = self._replica_grad()
        else:
            touched = bool(self.held)
            ids, summed = self._summed()
            mean = summed / self._owner.world_size
        grads = mean.numpy()
        ids_np = ids.numpy()
        self.clock += 1
        if self.spec.replica:  # interleaved rows: shard s holds rows s, s + S, ...
            owner = ids_np % self._owner.num_shards
            parts = [owner == s for s in range(self._owner.num_shards)]
            return [
                (self.ref.index, self.clock, ids_np[m], grads[m], kind, hyper, touched)
                for m in parts
            ]
        cuts = np.searchsorted(ids_np, self.bounds)
        return [
            (self.ref.index, self.clock, ids_np[a:b], grads[a:b], kind, hyper, touched)
            for a, b in itertools.pairwise(cuts)
        ]

    def holding(self, lo: int, hi: int) -> list[int]:
        """The shards holding some of the rows ``[lo, hi)`` (every shard, for a
        replica's interleaved rows)."""
        if self.spec.replica:
            return list(range(len(self.bounds) - 1))
        return [
            s
            for s in range(len(self.bounds) - 1)
            if self.bounds[s] < hi and lo < self.bounds[s + 1]
        ]

    def slices(self) -> Iterator[tuple[int, int]]:
        """The table's rows as ``[a, b)`` runs of at most ``SLICE_ROWS``: how a whole
        table goes to or from the shards without a worker holding more at a time."""
        for a in range(0, self.spec.rows, SLICE_ROWS):
            yield a, min(a + SLICE_ROWS, self.spec.rows)

    def _replica_grad(self) -> tuple[bool, torch.Tensor, torch.Tensor]:
        """A replica's gradient divided by the world size as ``(touched, rows,
        values)``, taken out of ``weight.grad`` so that the user's optimizer skips
        the weight. Divided before it is coalesced, as DDP's reducer divides the
        gradient that Gloo's sparse all-reduce then coalesces: an embedding bag's
        gradient repeats a row once per lookup, and ``a / 3 + b / 3`` is not always
        ``(a + b) / 3`` in float32.

        Raises:
            ValueError: If the gradient is dense (the weight is used outside its
                layer, e.g. tied to an output projection).
        """
        grad, self.weight.grad = self.weight.grad, None
        if grad is None:
            return False, torch.empty(0, dtype=torch.int64), torch.empty(0, self.spec.dim)
        if not grad.is_sparse:
            raise ValueError(
                f"The gradient of {self.name!r} is dense, so the weight is used outside "
                "its sparse embedding layer (tied to another layer?): the shards step "
                "only rows. Use PSConfig(sparse_optimizer='workers') for this model."
            )
        g = (grad / self._owner.world_size).coalesce()
        return True, g.indices()[0].cpu(), g.values().float().cpu()

    def write_rows(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Writes rows the shards changed into a replica's weight."""
        w = self.weight
        if not len(ids):
            pass
        elif w.device.type == "cpu":
            # Through NumPy, which keeps the GIL: a torch op lets it go and must
            # take it back from the run's communication threads. On the recsys bed
            # py-spy saw a worker spend far longer in one index_copy_ per shard and
            # table than those copies take on their own.
            w.detach().numpy()[ids] = rows
        else:
            index = torch.from_numpy(np.array(ids, np.int64)).to(w.device)
            values = torch.from_numpy(np.array(rows, np.float32)).to(w.device)
            with torch.no_grad():
                w.index_copy_(0, index, values)
        self.version = version_counter(w)

    def _summed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every kept gradient since the last step, summed per row (rows sorted)."""
        held, self.held = self.held, []
        if not held:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, self.spec.dim)
        ids = torch.cat([i.cpu() for i, _ in held])
        grads = torch.cat([g.float().cpu() for _, g in held])
        rows, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        summed = torch.zeros(len(rows), self.spec.dim).index_add_(0, inverse, grads)
        return rows, summed


def attach_layer(layer: Layer, table: Table) -> None:
    """Makes ``layer``'s forward look its rows up through ``table`` (the layer keeps
    only a :class:`TableRef`, so copies of the model find the same table)."""
    layer.__class__ = _ShardedBag if isinstance(layer, torch.nn.EmbeddingBag) else _ShardedEmbedding
    layer._ps_table = table.ref  # type: ignore[assignment]
    _LIVE[table.ref] = table


def detach(table: Table) -> None:
    """The run is over for ``table``: its layer's forward now says so."""
    _LIVE.pop(table.ref, None)
    table.local.clear()
