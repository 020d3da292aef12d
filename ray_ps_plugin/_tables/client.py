"""Worker side of sharded embedding tables: lookups and updates of rows no worker holds.

An ``nn.Embedding`` or ``nn.EmbeddingBag`` built with ``sparse=True`` on the meta
device (TorchRec's idiom for a table too large for one process) is materialised on
the shards only (:mod:`ray_ps_plugin._tables.store`). ``prepare_model`` keeps its
weight out of DDP and out of ``.to()``, and gives the layer a forward that:

1. takes the batch's unique ids and pulls only those rows from the shards that own
   them (read from the shared memory of this node's shards; one message per other
   shard, a frame on the direct path where the run has one; in sync a pull waits
   for every earlier step's update);
2. computes the layer's output from them, as the layer would from the whole table;
3. keeps the gradient of those rows when backward reaches them.

At the user's ``optimizer.step()`` of the optimizer holding the table's weight, the
kept gradients (every backward since the last step, summed per row) go to the
shards with that optimizer's hyperparameters as they are at that step, so learning
rate schedulers keep working. The shards apply SGD, Adagrad or SparseAdam; any
other optimizer is refused at its first step, before anything is applied.

A *replica* table (``PSConfig(sparse_optimizer="shards")``, sync only) is an
embedding layer with sparse gradients that every worker holds whole, as under DDP,
but whose optimizer runs on the shards: DDP leaves its weight alone, forward is the
layer's own, and at the step its gradient (``weight.grad``, taken away so the user's
optimizer skips the weight) goes to the shards like a sharded table's; the answer
holds the rows that step changed, with their new values, which the worker writes
into its copy before ``optimizer.step()`` returns. Every worker thus does the
optimizer's work on no row at all, the shards each on the rows they own, once. The
user's optimizer keeps no state for the weight: its ``state_dict()`` reads the
shards' in torch's form, and a state its ``load_state_dict()`` put there goes to the
shards at the next step.

A *looked-up* table (``sparse_optimizer="shards"`` in async and ssp) is such a layer
whose rows the shards own as they own a sharded table's: rank 0's copy seeds them,
forward looks up the batch's rows on the shards (fresh as the mode asks), and the
step pushes their gradients. The worker's weight is not kept current while training
(no step waits for every worker, so copies written from answers would drift); it
takes the shards' rows whenever ``state_dict()`` reads it, and rows loaded into it
(``load_state_dict``) go to the shards at once.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from ray_ps_plugin._errors import PSError
from ray_ps_plugin._rows import row_bounds
from ray_ps_plugin._shm import Segment, SegmentHandle
from ray_ps_plugin._tables.frames import pack_pull, pack_push, unpack_push_answer
from ray_ps_plugin._tables.layers import (
    Layer,
    is_sharded,
    meta_tables,
    optimizer_step_spec,
    replica_tables,
    sparse_add_rounds_once,
)
from ray_ps_plugin._tables.optim import STATE_NAMES, TableOptimizer
from ray_ps_plugin._tables.store import PushEntry, TableSpec
from ray_ps_plugin._torch_compat import version_counter
from ray_ps_plugin._transport import Handle, Transport, wait_all
from ray_ps_plugin._types import RunSettings, staleness_bound

__all__ = ["RealTables", "ShardedTables", "Table", "TableRef"]

#: What becomes of embedding layers with sparse gradients on a real device:
#: ``"workers"``: nothing (the workers' optimizers step them); ``"copies"``: the
#: shards step them and every worker's copy takes their answers (sync);
#: ``"lookups"``: the shards own their rows and forward looks them up (async, ssp).
RealTables = Literal["workers", "copies", "lookups"]

logger = logging.getLogger(__name__)

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
        local_shards: Shards of this worker's node reached through shared memory:
            the worker reads their rows there (in ssp once they confirmed the
            staleness bound, see :meth:`await_bound`).
        real_tables: What becomes of embedding layers with sparse gradients on a
            real device (see :data:`RealTables`).
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
        local_shards: Sequence[int] = (),
        real_tables: RealTables = "workers",
    ) -> None:
        self.model_id = model_id
        self.transport = transport
        self.settings = settings
        self.rank = rank
        self.world_size = world_size
        self.num_shards = num_shards
        self.stats = {"bytes_pulled": 0, "bytes_pushed": 0, "pushes": 0}
        self._error: BaseException | None = None
        self.generation = 0  # restores of the tables so far (load_tables)
        # ssp: the tables' clocks the node's shards last confirmed fresh enough for.
        self._bound_clocks: dict[int, int] = {}
        # The last step's push, one call per shard, with the tables it holds.
        self._inflight: list[tuple[Handle[Any], list[Table]]] = []
        self.tables: list[Table] = []
        staleness = 0 if settings.mode == "sync" else staleness_bound(settings)
        # A layer already sharded (the same module wrapped again, as a second
        # Lightning fit does in sync) keeps its table and the rows it learnt.
        new = [(n, m) for n, m in meta_tables(module) if not is_sharded(m)]
        real = (
            [(n, m) for n, m in replica_tables(module) if not is_sharded(m)]
            if real_tables != "workers"
            else []
        )
        for index, (name, layer) in enumerate(new + real):
            spec = TableSpec(
                rows=layer.num_embeddings,
                dim=layer.embedding_dim,
                padding_idx=layer.padding_idx,
                seed=seed,
                staleness=staleness,
                sync=settings.mode == "sync",
                replica=index >= len(new) and real_tables == "copies",
                seeded=index < len(new),
            )
            table = Table(TableRef(model_id, index), name, layer, spec, num_shards, self)
            self.tables.append(table)
        self._hooked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        shared = set(local_shards)
        pairs = [(t, s) for t in self.tables for s in range(num_shards)]
        handles = [
            transport.call(
                s,
                "table_create",
                model_id,
                t.ref.index,
                t.spec,
                num_shards,
                s in shared and t.looked_up,  # a replica is never pulled
            )
            for t, s in pairs
        ]
        created = self.wait(handles, [s for _, s in pairs], "creating tables")
        self._segments: list[Segment] = []
        for (t, s), (lo, hi, handle) in zip(pairs, created):
            if handle is not None:
                self._map_rows(t, s, lo, hi, handle)
        for t, (_, layer) in zip(self.tables, new + real):
            if not t.looked_up:
                continue
            layer.__class__ = (
                _ShardedBag if isinstance(layer, torch.nn.EmbeddingBag) else (_ShardedEmbedding)
            )
            layer._ps_table = t.ref  # type: ignore[assignment]
            _LIVE[t.ref] = t
            if t.real:  # checkpoints read the shards' rows, a load sends its own
                layer.register_state_dict_pre_hook(lambda *_, t=t: self.refresh(t))
                layer.register_load_state_dict_post_hook(lambda *_, t=t: self._reload(t))
        self._weights = {id(t.weight): t for t in self.tables}
        for t in self.replicas:
            # Every worker's copy is rank 0's, as DDP's constructor would make it
            # (it leaves the weight alone here).
            if torch.distributed.is_initialized() and self.world_size > 1:
                torch.distributed.broadcast(t.weight.data, src=0)
        if self.real:
            self.publish(self._send_real)

    @property
    def replicas(self) -> list[Table]:
        """The replica tables (held by every worker, stepped on the shards)."""
        return [t for t in self.tables if t.spec.replica]

    @property
    def real(self) -> list[Table]:
        """The tables whose rows come from a real layer (replicas, looked-up)."""
        return [t for t in self.tables if t.real]

    def _send_real(self) -> None:
        for t in self.real:
            self.send_replica(t)

    def publish(self, write: Callable[[], None]) -> None:
        """Rank 0 runs ``write`` (rows to the shards), then every rank waits until
        the shards hold them: no worker looks up or pushes against rows that are
        about to be replaced."""
        self.flush()
        self.generation += 1
        shards = list(range(self.num_shards))
        if self.rank == 0:
            write()
            calls = [
                self.transport.call(s, "table_loaded", self.model_id, self.generation)
                for s in shards
            ]
            self.wait(calls, shards, "publishing table rows")
        calls = [
            self.transport.call(s, "table_wait_loaded", self.model_id, self.generation)
            for s in shards
        ]
        self.wait(calls, shards, "waiting for rank 0's table rows")

    def refresh(self, t: Table) -> None:
        """A worker's copy of ``t`` takes the shards' rows, slice by slice."""
        self.flush()
        for a, b in t.slices():
            t.write_rows(np.arange(a, b), self.read_rows(t, a, b)[0])

    def _reload(self, t: Table) -> None:
        """Rows just loaded into a looked-up table's weight go to the shards (rank
        0's; every rank waits), as the loaded dense parameters do."""
        if version_counter(t.weight) != t.version:
            self.publish(lambda: self.send_replica(t))

    def send_replica(
        self,
        t: Table,
        state: dict[str, torch.Tensor] | None = None,
        optimizer: TableOptimizer | None = None,
        steps: int | None = None,
    ) -> None:
        """Rank 0 writes its copy of a replica table to the shards, one slice per
        call: with ``state``, ``optimizer`` and ``steps`` (what ``load_state_dict``
        gave the user's optimizer) also the optimizer's, else their optimizer state
        and step count stay. Every rank then counts its copy as the shards'."""
        if self.rank == 0:
            weight = t.weight.detach()
            for a, b in t.slices():
                rows = weight[a:b].cpu().numpy()  # every shard keeps its own of them
                part = {n: v[a:b].detach().cpu().numpy() for n, v in (state or {}).items()}
                shards = t.holding(a, b)
                args = (self.model_id, t.ref.index, a, rows, part, optimizer, steps)
                calls = [self.transport.call(s, "table_write", *args) for s in shards]
                self.wait(calls, shards, f"sending the rows of {t.name!r}")
        t.version = version_counter(t.weight)

    def read_rows(
        self, t: Table, lo: int, hi: int
    ) -> tuple[np.ndarray, dict[str, np.ndarray], TableOptimizer | None, int]:
        """Rows ``[lo, hi)`` of ``t`` with their optimizer state, from every shard
        holding some of them (each answers its rows and the step between them),
        with the optimizer's name and step count."""
        weight = np.empty((hi - lo, t.spec.dim), np.float32)
        state: dict[str, np.ndarray] = {}
        optimizer, steps = None, 0
        shards = t.holding(lo, hi)
        calls = [
            self.transport.call(s, "table_read", self.model_id, t.ref.index, lo, hi) for s in shards
        ]
        for part in self.wait(calls, shards, f"reading rows of {t.name!r}"):
            n, first = len(part["weight"]), part["lo"] - lo
            picked = slice(first, first + (n - 1) * part["stride"] + 1, part["stride"])
            weight[picked] = part["weight"]
            for name, values in part["state"].items():
                state.setdefault(name, np.zeros_like(weight))[picked] = values
            optimizer, steps = part["optimizer"] or optimizer, max(steps, part["steps"])
        return weight, state, optimizer, steps

    def _map_rows(self, t: Table, shard: int, lo: int, hi: int, handle: SegmentHandle) -> None:
        """Maps a shard's rows of ``t`` for reading (by message where that fails)."""
        try:
            segment = Segment.open(handle)
        except OSError as e:
            logger.warning(
                "rank %d: rows of %r on shard %d are pulled by message (%s).",
                self.rank,
                t.name,
                shard,
                e,
            )
            return
        self._segments.append(segment)
        rows = segment.view(0, "float32", (hi - lo) * t.spec.dim).reshape(hi - lo, t.spec.dim)
        t.local[shard] = (lo, rows)

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
        # One step in flight: a shard applies a worker's updates in clock order.
        self.flush()
        for table, group in stepped:
            if table.real:
                self._take_state(optimizer, group, table)
            if table.spec.replica and version_counter(table.weight) != table.version:
                self._resend(table)
        if any(t.real for t, _ in stepped) and optimizer not in self._hooked:
            self._hooked.add(optimizer)
            optimizer.register_state_dict_post_hook(self._state_from_shards)
        per_shard: list[list[PushEntry]] = [[] for _ in range(self.num_shards)]
        for table, group in stepped:
            for s, entry in enumerate(table.step(optimizer, group)):
                per_shard[s].append(entry)
        pushed_tables = [t for t, _ in stepped]
        self._inflight = [
            (self._call_push(s, entries), pushed_tables) for s, entries in enumerate(per_shard)
        ]
        pushed = sum(e[2].nbytes + e[3].nbytes for entries in per_shard for e in entries)
        self.count(pushed=pushed, pushes=len(self._inflight))

    def after_step(self) -> None:
        """After ``optimizer.step()``: a replica's copy takes the rows the shards
        changed, so the weight is current when the step returns (a sharded table's
        update stays in flight until the next lookup)."""
        if self.replicas:
            self.flush()

    def _resend(self, t: Table) -> None:
        """A replica's weight changed outside the steps (``load_state_dict``, an
        in-place edit): the shards take rank 0's copy, as the workers' copies came
        from rank 0's at the start."""
        if self.rank == 0:
            logger.info(
                "The weight of %r changed outside optimizer.step() (load_state_dict?): "
                "rank 0 sends it to the shards, whole.",
                t.name,
            )
        self.send_replica(t)

    def _take_state(
        self, optimizer: torch.optim.Optimizer, group: dict[str, Any], t: Table
    ) -> None:
        """Optimizer state on a replica's weight can only come from
        ``optimizer.load_state_dict`` (the optimizer never steps the weight): rank 0
        sends it to the shards with its copy of the rows, and every rank drops it,
        as the shards now hold it. A state before any step (Adagrad makes its zeros
        at construction) is dropped: the shards make their own."""
        entry = optimizer.state.pop(t.weight, None)
        if not entry or not int(entry.get("step", 0)):
            return
        if t.looked_up:  # its copy is not current: the state goes with the shards' rows
            self.refresh(t)
        name, _ = optimizer_step_spec(optimizer, group, t.name)
        missing = [n for n in STATE_NAMES[name] if not torch.is_tensor(entry.get(n))]
        if missing:
            raise ValueError(
                f"{type(optimizer).__name__}.load_state_dict gave the table {t.name!r} a "
                f"state without {missing}: load the state_dict of the same optimizer "
                "class that saved it."
            )
        state = {n: entry[n] for n in STATE_NAMES[name]}
        self.send_replica(t, state, name, int(entry["step"]))

    def _state_from_shards(
        self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> dict[str, Any]:
        """``optimizer.state_dict()`` holds its replica tables' state as torch's
        optimizer would, read from the shards by this rank alone (often rank 0 is
        the only one writing a checkpoint), one slice of rows at a time."""
        params = (p for g in optimizer.param_groups for p in g["params"])
        index = {id(p): i for i, p in enumerate(params)}  # torch's numbering
        for t in self.real:
            i = index.get(id(t.weight))
            if i is None or optimizer.state.get(t.weight):  # loaded, not yet sent
                continue
            entry = self._torch_state(t)
            if entry:
                state_dict["state"][i] = entry
        return state_dict

    def _torch_state(self, t: Table) -> dict[str, Any]:
        """The shards' optimizer state of ``t`` in the form torch's optimizer keeps
        it (empty before the first step)."""
        self.flush()
        arrays: dict[str, np.ndarray] = {}
        optimizer: TableOptimizer | None = None
        steps = 0
        for a, b in t.slices():
            _, part, name, count = self.read_rows(t, a, b)
            optimizer, steps = name or optimizer, max(steps, count)
            for n, values in part.items():
                arrays.setdefault(n, np.zeros((t.spec.rows, t.spec.dim), np.float32))[a:b] = values
        if optimizer is None or not steps:
            return {}
        entry: dict[str, Any] = {n: torch.from_numpy(arrays[n]) for n in STATE_NAMES[optimizer]}
        if optimizer == "sparse_adam":
            entry["step"] = steps  # SparseAdam counts in an int, Adagrad in a tensor
        elif optimizer == "adagrad":
            entry["step"] = torch.tensor(float(steps))
        else:
            entry["momentum_buffer"] = None
        return entry

    def await_bound(self) -> None:
        """ssp: waits until this node's shards hold every table's rows as fresh as
        this worker may train on at its clocks (one call per shard and step)."""
        clocks = {t.ref.index: t.clock for t in self.tables if t.local}
        if clocks == self._bound_clocks:
            return
        shards = sorted({s for t in self.tables for s in t.local})
        direct = self.transport.direct
        handles = [
            direct.table_wait(s, self.model_id, self.rank, clocks)
            if direct is not None and direct.reaches(s)
            else self.transport.call(s, "table_wait", self.model_id, self.rank, clocks)
            for s in shards
        ]
        self.wait(handles, shards, "waiting for the other workers' updates (ssp)")
        self._bound_clocks = clocks

    def call_pull(self, shard: int, table: int, clock: int, ids: np.ndarray) -> Handle[Any]:
        """Asks ``shard`` for rows ``ids`` of ``table``: a frame on the direct path
        where the run has one (across nodes a Ray call's arguments and reply go
        through the object store), else a Ray call. Answers as bytes or as rows."""
        direct = self.transport.direct
        if direct is not None and direct.reaches(shard):
            return direct.table_pull(shard, self.model_id, self.rank, pack_pull(table, clock, ids))
        return self.transport.call(shard, "table_pull", self.model_id, table, self.rank, clock, ids)

    def _call_push(self, shard: int, entries: list[PushEntry]) -> Handle[Any]:
        """Sends ``shard`` this worker's step on its rows, by the same path as pulls."""
        direct = self.transport.direct
        if direct is not None and direct.reaches(shard):
            return direct.table_push(shard, self.model_id, self.rank, pack_push(entries))
        return self.transport.call(shard, "table_push", self.model_id, self.rank, entries)

    def wait(self, handles: Sequence[Handle[Any]], shards: Sequence[int], what: str) -> list[Any]:
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
        """Waits until this worker's last update of every table is applied; a
        replica's copy takes the rows it changed."""
        inflight, self._inflight = self._inflight, []
        if not inflight:
            return
        answers = self.wait(
            [h for h, _ in inflight], list(range(len(inflight))), "updating the tables"
        )
        changed: dict[int, tuple[Table, list[np.ndarray], list[np.ndarray]]] = {}
        for (_, tables), answer in zip(inflight, answers):
            for table, (_, ids, rows) in zip(tables, unpack_push_answer(answer)):
                if table.spec.replica:
                    _, all_ids, all_rows = changed.setdefault(id(table), (table, [], []))
                    all_ids.append(ids)
                    all_rows.append(rows)
                    self.count(pulled=ids.nbytes + rows.nbytes)
        for table, all_ids, all_rows in changed.values():  # one write per table
            table.write_rows(np.concatenate(all_ids), np.concatenate(all_rows))

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
            t.local.clear()
        segments, self._segments = self._segments, []
        for segment in segments:
            segment.close()
