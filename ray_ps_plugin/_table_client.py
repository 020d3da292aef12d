"""Worker side of sharded embedding tables: lookups and updates of rows no worker holds.

An ``nn.Embedding`` or ``nn.EmbeddingBag`` built with ``sparse=True`` on the meta
device (TorchRec's idiom for a table too large for one process) is materialised on
the shards only (:mod:`ray_ps_plugin._table_store`). ``prepare_model`` keeps its
weight out of DDP and out of ``.to()``, and gives the layer a forward that:

1. takes the batch's unique ids and pulls only those rows from the shards that own
   them (one call per shard; in sync a pull waits for every earlier step's update);
2. computes the layer's output from them, as the layer would from the whole table;
3. keeps the gradient of those rows when backward reaches them.

At the user's ``optimizer.step()`` of the optimizer holding the table's weight, the
kept gradients (every backward since the last step, summed per row) go to the
shards with that optimizer's hyperparameters as they are at that step, so learning
rate schedulers keep working. The shards apply SGD, Adagrad or SparseAdam; any
other optimizer is refused at its first step, before anything is applied.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ray_ps_plugin._errors import PSError
from ray_ps_plugin._rows import row_bounds
from ray_ps_plugin._table_layers import Layer, is_sharded, meta_tables, optimizer_step_spec
from ray_ps_plugin._table_store import PushEntry, TableSpec
from ray_ps_plugin._transport import Transport, wait_all
from ray_ps_plugin._types import RunSettings, staleness_bound

__all__ = ["ShardedTables", "TableRef"]

logger = logging.getLogger(__name__)

#: Rows per call when a checkpoint reads or writes a table: a worker holds at most
#: this many rows of one table at a time (64 MiB of fp32 rows of 64 values).
_SLICE_ROWS = 1 << 18


@dataclasses.dataclass(frozen=True)
class TableRef:
    """What a sharded layer holds to find its table (copies of the model share it)."""

    model: int
    index: int


#: The live tables of this process, by :class:`TableRef`.
_LIVE: dict[TableRef, _Table] = {}


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


def _live(ref: TableRef) -> _Table:
    table = _LIVE.get(ref)
    if table is None:
        raise RuntimeError(
            "This embedding layer's rows live on the parameter servers of a run that is "
            "over (or in another process). Restore them into a run with "
            "get_ps_context().load_tables(), or save them with save_tables() while "
            "the run lasts."
        )
    return table


class _Table:
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
        self.bounds = np.asarray(row_bounds(spec.rows, num_shards))
        self._owner = tables
        self.clock = 0  # updates this worker has pushed
        self.held: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rows, their grads)

    def _split(self, ids: np.ndarray) -> Iterator[tuple[int, slice]]:
        """``(shard, slice of ids)`` for each shard owning some of the sorted ``ids``."""
        cuts = np.searchsorted(ids, self.bounds)
        for s in range(len(self.bounds) - 1):
            if cuts[s] < cuts[s + 1]:
                yield s, slice(int(cuts[s]), int(cuts[s + 1]))

    def pull(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows ``ids`` (sorted, unique) as fresh as the mode asks."""
        owner = self._owner
        host = ids.cpu().numpy()
        parts = list(self._split(host))
        handles = [
            owner.transport.call(
                s, "table_pull", self.ref.model, self.ref.index, owner.rank, self.clock, host[sl]
            )
            for s, sl in parts
        ]
        got = owner.wait(handles, [s for s, _ in parts], f"pulling rows of {self.name!r}")
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
        touched = bool(self.held)
        ids, summed = self._summed()
        grads = (summed / self._owner.world_size).numpy()
        ids_np = ids.numpy()
        cuts = np.searchsorted(ids_np, self.bounds)
        self.clock += 1
        return [
            (self.ref.index, self.clock, ids_np[a:b], grads[a:b], kind, hyper, touched)
            for a, b in itertools.pairwise(cuts)
        ]

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


class ShardedTables:
    """The sharded tables of one prepared model on one worker.

    Args:
        model_id: The prepared model's id on the shards.
        module: The user's model (its meta tables become sharded layers).
        transport: How calls reach the shards.
        settings: The run's PSConfig.
        rank: This worker's rank.
        world_size: Number of workers.
        num_shards: Number of shards the rows are split over.
        seed: Seed of the initial values, the same on every worker.
    """

    def __init__(
        self,
        model_id: int,
        module: torch.nn.Module,
        transport: Transport,
        settings: RunSettings,
        rank: int,
        world_size: int,
        num_shards: int,
        seed: int,
    ) -> None:
        self.model_id = model_id
        self.transport = transport
        self.settings = settings
        self.rank = rank
        self.world_size = world_size
        self.num_shards = num_shards
        self.stats = {"bytes_pulled": 0, "bytes_pushed": 0, "pushes": 0}
        self._error: BaseException | None = None
        self._generation = 0
        self._inflight: list[Any] = []  # the last step's push, one call per shard
        self.tables: list[_Table] = []
        staleness = 0 if settings.mode == "sync" else staleness_bound(settings)
        # A layer already sharded (the same module wrapped again, as a second
        # Lightning fit does in sync) keeps its table and the rows it learnt.
        new = [(n, m) for n, m in meta_tables(module) if not is_sharded(m)]
        for index, (name, layer) in enumerate(new):
            spec = TableSpec(
                rows=layer.num_embeddings,
                dim=layer.embedding_dim,
                padding_idx=layer.padding_idx,
                seed=seed,
                staleness=staleness,
                sync=settings.mode == "sync",
            )
            table = _Table(TableRef(model_id, index), name, layer, spec, num_shards, self)
            self.tables.append(table)
        handles = [
            transport.call(s, "table_create", model_id, t.ref.index, t.spec, num_shards)
            for t in self.tables
            for s in range(num_shards)
        ]
        self.wait(handles, [s for _ in self.tables for s in range(num_shards)], "creating tables")
        for t, (_, layer) in zip(self.tables, new):
            layer.__class__ = (
                _ShardedBag if isinstance(layer, torch.nn.EmbeddingBag) else (_ShardedEmbedding)
            )
            layer._ps_table = t.ref  # type: ignore[assignment]
            _LIVE[t.ref] = t
        self._weights = {id(t.weight): t for t in self.tables}

    # --- the step -------------------------------------------------------------------
    def owns(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` holds one of these tables' weights."""
        return any(id(p) in self._weights for g in optimizer.param_groups for p in g["params"])

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Pushes the tables that ``optimizer`` steps (before it changes anything):
        one call per shard for all of them."""
        self.raise_pending()
        stepped = [
            (self._weights[id(p)], group)
            for group in optimizer.param_groups
            for p in group["params"]
            if id(p) in self._weights
        ]
        for table, group in stepped:  # every refusal before any table changes
            optimizer_step_spec(optimizer, group, table.name)
        per_shard: list[list[PushEntry]] = [[] for _ in range(self.num_shards)]
        for table, group in stepped:
            for s, entry in enumerate(table.step(optimizer, group)):
                per_shard[s].append(entry)
        # One step in flight: a shard applies a worker's updates in clock order.
        self.flush()
        self._inflight = [
            self.transport.call(s, "table_push", self.model_id, self.rank, entries)
            for s, entries in enumerate(per_shard)
        ]
        pushed = sum(e[2].nbytes + e[3].nbytes for entries in per_shard for e in entries)
        self.count(pushed=pushed, pushes=len(self._inflight))

    def wait(self, handles: Sequence[Any], shards: Sequence[int], what: str) -> list[Any]:
        try:
            return wait_all(
                self.transport,
                handles,
                shards,
                self.settings.ps_timeout_s,
                f"rank {self.rank}: model {self.model_id}: {what}",
            )
        except PSError as e:
            self._error = e
            raise

    def raise_pending(self) -> None:
        if self._error is not None:
            raise self._error

    def count(self, pulled: int = 0, pushed: int = 0, pushes: int = 0) -> None:
        self.stats["bytes_pulled"] += pulled
        self.stats["bytes_pushed"] += pushed
        self.stats["pushes"] += pushes

    def flush(self) -> None:
        """Waits until this worker's last update of every table is applied."""
        inflight, self._inflight = self._inflight, []
        if inflight:
            self.wait(inflight, list(range(len(inflight))), "updating the sharded tables")

    def finish(self) -> None:
        """Confirms the last updates; the shards stop waiting for this worker."""
        self.flush()
        handles = [
            self.transport.call(s, "table_finish", self.model_id, self.rank)
            for s in range(self.num_shards)
        ]
        self.wait(handles, list(range(self.num_shards)), "finishing")

    def close(self) -> None:
        for t in self.tables:
            _LIVE.pop(t.ref, None)

    # --- checkpoints ------------------------------------------------------------------
    def save(self, path: Path) -> None:
        """Writes every table of the model under ``path``, one shard's slice at a time."""
        self.flush()
        for t in self.tables:
            folder = path / f"model{self.model_id}" / f"table{t.ref.index}"
            folder.mkdir(parents=True, exist_ok=True)
            meta: dict[str, Any] = {"rows": t.spec.rows, "dim": t.spec.dim, "name": t.name}
            for s in range(self.num_shards):
                lo, hi = int(t.bounds[s]), int(t.bounds[s + 1])
                for a in range(lo, hi, _SLICE_ROWS):
                    b = min(a + _SLICE_ROWS, hi)
                    call = self.transport.call(s, "table_read", self.model_id, t.ref.index, a, b)
                    (part,) = self.wait([call], [s], f"reading rows of {t.name!r}")
                    np.savez(folder / f"rows{a:012d}.npz", weight=part["weight"], **part["state"])
                    meta.update(optimizer=part["optimizer"], steps=part["steps"])
            (folder / "table.json").write_text(json.dumps(meta))

    def load(self, path: Path) -> None:
        """Restores what :meth:`save` wrote (rank 0 sends, every rank waits), onto
        any number of shards."""
        self.flush()
        self._generation += 1
        if self.rank == 0:
            for t in self.tables:
                self._load_table(t, path / f"model{self.model_id}" / f"table{t.ref.index}")
            calls = [
                self.transport.call(s, "table_loaded", self.model_id, self._generation)
                for s in range(self.num_shards)
            ]
            self.wait(calls, list(range(self.num_shards)), "restoring tables")
        calls = [
            self.transport.call(s, "table_wait_loaded", self.model_id, self._generation)
            for s in range(self.num_shards)
        ]
        self.wait(calls, list(range(self.num_shards)), "waiting for the tables' restore")

    def _load_table(self, t: _Table, folder: Path) -> None:
        meta = json.loads((folder / "table.json").read_text())
        if (meta["rows"], meta["dim"]) != (t.spec.rows, t.spec.dim):
            raise ValueError(
                f"{folder} holds a table of {meta['rows']} x {meta['dim']}, but "
                f"{t.name!r} is {t.spec.rows} x {t.spec.dim}: a checkpoint of another model."
            )
        for file in sorted(folder.glob("rows*.npz")):
            lo = int(file.stem.removeprefix("rows"))
            with np.load(file) as data:
                weight = data["weight"]
                state = {k: data[k] for k in data.files if k != "weight"}
            hi = lo + len(weight)
            shards = [
                s for s in range(self.num_shards) if t.bounds[s] < hi and lo < t.bounds[s + 1]
            ]
            calls = [
                self.transport.call(
                    s,
                    "table_write",
                    self.model_id,
                    t.ref.index,
                    lo,
                    weight,
                    state,
                    meta["optimizer"],
                    meta["steps"],
                )
                for s in shards
            ]
            self.wait(calls, shards, f"restoring rows of {t.name!r}")
