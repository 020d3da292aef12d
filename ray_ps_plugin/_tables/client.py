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
import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch

from ray_ps_plugin._errors import PSError
from ray_ps_plugin._shm import Segment, SegmentHandle
from ray_ps_plugin._tables.frames import pack_pull, pack_push, unpack_push_answer
from ray_ps_plugin._tables.layers import (
    Layer,
    is_sharded,
    meta_tables,
    optimizer_step_spec,
    replica_tables,
)
from ray_ps_plugin._tables.spec import PushEntry, TableSpec
from ray_ps_plugin._tables.state import state_from_shards, take_state
from ray_ps_plugin._tables.table import Table, TableRef, attach_layer, detach
from ray_ps_plugin._tables.transfer import read_rows, send_copy
from ray_ps_plugin._torch_compat import version_counter
from ray_ps_plugin._transport import Handle, Transport, wait_all
from ray_ps_plugin._types import RunSettings

__all__ = ["RealTables", "ShardedTables", "TableMode"]

#: What becomes of embedding layers with sparse gradients on a real device:
#: ``"workers"``: nothing (the workers' optimizers step them); ``"copies"``: the
#: shards step them and every worker's copy takes their answers (sync);
#: ``"lookups"``: the shards own their rows and forward looks them up (async, ssp).
RealTables = Literal["workers", "copies", "lookups"]


@dataclasses.dataclass(frozen=True)
class TableMode:
    """How the run's mode treats tables (decided by the mode's spec).

    Attributes:
        sync: Whether a clock's pushes are summed and applied together.
        staleness: The clock gap the shards allow (``None``: no bound).
        real: What becomes of sparse layers on a real device.
    """

    sync: bool
    staleness: int | None
    real: RealTables = "workers"


logger = logging.getLogger(__name__)


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
        mode: How the run's mode treats tables.
        joined: Whether this worker joins shards that already hold the tables (it
            replaces a lost worker, or its group restarted): it neither seeds nor
            sends rows, and goes on from the clocks the shards hold for its rank.
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
        mode: TableMode,
        local_shards: Sequence[int] = (),
        joined: bool = False,
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
        self._hooked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._segments: list[Segment] = []
        # A layer already sharded (the same module wrapped again, as a second
        # Lightning fit does in sync) keeps its table and the rows it learnt.
        new = [(n, m) for n, m in meta_tables(module) if not is_sharded(m)]
        real = (
            [(n, m) for n, m in replica_tables(module) if not is_sharded(m)]
            if mode.real != "workers"
            else []
        )
        for index, (name, layer) in enumerate(new + real):
            spec = TableSpec(
                rows=layer.num_embeddings,
                dim=layer.embedding_dim,
                padding_idx=layer.padding_idx,
                seed=seed,
                staleness=mode.staleness,
                sync=mode.sync,
                replica=index >= len(new) and mode.real == "copies",
                seeded=index < len(new),
            )
            table = Table(TableRef(model_id, index), name, layer, spec, num_shards, self)
            self.tables.append(table)
        self._create(set(local_shards))
        for t, (_, layer) in zip(self.tables, new + real):
            if t.looked_up:
                self._look_up(t, layer)
        self._weights = {id(t.weight): t for t in self.tables}
        for t in self.replicas:
            # Every worker's copy is rank 0's, as DDP's constructor would make it
            # (it leaves the weight alone here).
            if torch.distributed.is_initialized() and self.world_size > 1:
                torch.distributed.broadcast(t.weight.data, src=0)
        if self.real and not joined:  # a worker joining live shards takes their rows
            self.publish(self._send_real)

    def _create(self, shared: set[int]) -> None:
        """Has every shard make its rows of every table; maps those of this node's
        shards (``shared``) and takes the clock each table is at for this rank (0, or
        where a worker this one replaces stopped)."""
        pairs = [(t, s) for t in self.tables for s in range(self.num_shards)]
        handles = [
            self.transport.call(
                s,
                "table_create",
                self.model_id,
                t.ref.index,
                t.spec,
                self.num_shards,
                s in shared and t.looked_up,  # a replica is never pulled
                self.rank,
            )
            for t, s in pairs
        ]
        created = self.wait(handles, [s for _, s in pairs], "creating tables")
        # A worker that died mid-push may have reached some shards and not others:
        # going on from the lowest clock re-sends that update where it is missing
        # (the shards that took it ignore the repeat).
        clocks: dict[int, int] = {}
        for (t, s), (lo, hi, handle, clock) in zip(pairs, created):
            clocks[t.ref.index] = min(clocks.get(t.ref.index, clock), clock)
            if handle is not None:
                self._map_rows(t, s, lo, hi, handle)
        for t in self.tables:
            t.clock = clocks.get(t.ref.index, t.clock)

    def _look_up(self, t: Table, layer: Layer) -> None:
        """Gives ``layer`` a forward that looks its rows up through ``t``; a real
        layer's checkpoints read the shards' rows and a load sends its own."""
        attach_layer(layer, t)
        if t.real:
            layer.register_state_dict_pre_hook(lambda *_, t=t: self.refresh(t))
            layer.register_load_state_dict_post_hook(lambda *_, t=t: self._reload(t))

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
            send_copy(self, t)

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
            t.write_rows(np.arange(a, b), read_rows(self, t, a, b)[0])

    def _reload(self, t: Table) -> None:
        """Rows just loaded into a looked-up table's weight go to the shards (rank
        0's; every rank waits), as the loaded dense parameters do."""
        if version_counter(t.weight) != t.version:
            self.publish(lambda: send_copy(self, t))

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
                take_state(self, optimizer, group, table)
            if table.spec.replica and version_counter(table.weight) != table.version:
                self._resend(table)
        if any(t.real for t, _ in stepped) and optimizer not in self._hooked:
            self._hooked.add(optimizer)
            optimizer.register_state_dict_post_hook(functools.partial(state_from_shards, self))
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
        send_copy(self, t)

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
            detach(t)
        segments, self._segments = self._segments, []
        for segment in segments:
            segment.close()
