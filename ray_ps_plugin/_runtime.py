"""The worker side of a run: what the backend installs, the clients, the hooks.

The backend installs a :class:`RunInfo` in every worker process before the training
function starts (:func:`install_run`, run on the actor's main thread; the training
thread of the same process reads it). Every model the training function prepares
gets a client (one per model, in preparation order: the model's id on the shards).
Process-wide optimizer hooks route each optimizer step to the clients of the models
whose parameters that optimizer holds: the user's optimizer is created after
``prepare_model`` and never passes through the plugin.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ray_ps_plugin._client import ClientBase, ClientSetup
from ray_ps_plugin._feedback_state import Senders, load_feedback, save_feedback
from ray_ps_plugin._metrics import WorkerMetrics
from ray_ps_plugin._modes import staleness_bound
from ray_ps_plugin._stats import PSStats
from ray_ps_plugin._tables.checkpoint import load_tables, save_tables
from ray_ps_plugin._tables.client import ShardedTables
from ray_ps_plugin._torch_compat import ddp_ignored
from ray_ps_plugin._transport import Transport
from ray_ps_plugin._types import Mode, RunSettings

__all__ = [
    "PSContext",
    "RunInfo",
    "current_run",
    "get_ps_context",
    "install_run",
    "uninstall_run",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunInfo:
    """What the backend hands every worker.

    Attributes:
        settings: The run's PSConfig.
        servers: Actor handles of the shards, in shard order.
        server_node_ids: Node id of each shard.
        topology: What the mode's start-up found (sync: who relays for whom and
            the shards' direct paths; async/ssp: their direct paths).
        joined: Whether the shards already hold the run's state when this worker
            starts: it replaces a lost worker, or its whole group restarted while
            the shards' state was kept. Its models then take the shards'
            parameters and go on from the clocks the shards hold for its rank.
        replicas: Each shard's replica (``PSConfig.shard_replicas``), in shard
            order, or empty.
        replica_node_ids: Node id of each replica.
    """

    settings: RunSettings
    servers: Sequence[Any]
    server_node_ids: Sequence[str]
    topology: Any = None
    joined: bool = False
    replicas: Sequence[Any] = ()
    replica_node_ids: Sequence[str] = ()


@dataclass(frozen=True)
class PSContext:
    """What ``get_ps_context()`` returns inside a PS training function.

    Attributes:
        mode: "sync", "async", "ssp" or "diloco".
        num_servers: Number of server shards.
        server_node_ids: The node id of each shard, in shard order.
        world_rank: This worker's rank.
        world_size: Number of workers.
        shared_memory_shards: The shards this worker reaches through shared memory
            (those on its node, unless ``shared_memory=False`` or the host cannot);
            the others are reached through Ray's object store. Empty before
            ``prepare_model``.
        num_models: Models prepared so far by this worker (each has its own keys,
            clocks and counters on the shards).
        replica_node_ids: The node id of each shard's replica, in shard order
            (``PSConfig.shard_replicas=1``), else empty.
    """

    mode: Mode
    num_servers: int
    server_node_ids: tuple[str, ...]
    world_rank: int
    world_size: int
    shared_memory_shards: tuple[int, ...] = ()
    num_models: int = 0
    replica_node_ids: tuple[str, ...] = ()

    @property
    def start_step(self) -> int:
        """The step the most recently prepared model goes on from: 0 on a fresh
        start; where the shards held this rank when it joined them (it replaces a
        lost worker, or its group restarted: async, ssp and diloco keep the
        shards' state), so a loop can move its data ahead instead of repeating it."""
        return _CLIENTS[-1].start_step if _CLIENTS else 0

    @property
    def stats(self) -> PSStats:
        """Counters of the most recently prepared model (zero before ``prepare_model``)."""
        if not _CLIENTS:
            return PSStats(bytes_pushed_per_shard=[0] * self.num_servers)
        return _CLIENTS[-1].snapshot()

    def model_stats(self) -> list[PSStats]:
        """Counters of every prepared model, in the order they were prepared."""
        return [c.snapshot() for c in _CLIENTS]

    def flush(self) -> None:
        """Waits until this worker's updates are applied on every shard (async/ssp).

        Applies to every prepared model. In sync mode every step is already complete
        when ``backward()`` returns, so this returns at once. For a final checkpoint
        holding every worker's last update, call ``flush()`` on all workers, then
        ``ray.train.collective.barrier()``, then save ``model.module.state_dict()`` on
        rank 0.

        Raises:
            PSTimeoutError: If a shard does not confirm within ``ps_timeout_s``.
        """
        for client in _CLIENTS:
            client.flush()
        for tables in _TABLES:
            tables.flush()

    def table_stats(self) -> dict[str, int]:
        """Sharded tables' traffic from this worker, over every prepared model:
        ``bytes_pulled`` (ids sent and rows received by lookups), ``bytes_pushed``
        (row ids and gradients sent) and ``pushes`` (calls)."""
        total = {"bytes_pulled": 0, "bytes_pushed": 0, "pushes": 0}
        for tables in _TABLES:
            for key, value in tables.stats.items():
                total[key] += value
        return total

    def save_tables(self, path: str | os.PathLike[str]) -> None:
        """Writes every sharded embedding table (a layer built on the meta device)
        under ``path``, one shard's rows at a time, with the optimizer's state:
        no worker ever holds a whole table. Only rank 0 writes; call it on every
        worker (each confirms its own last update first), into the directory of the
        checkpoint rank 0 reports. In async/ssp, ``flush()`` and a barrier on every
        worker first make the saved rows hold every worker's last update.

        Raises:
            PSTimeoutError: If a shard does not answer within ``ps_timeout_s``.
        """
        for tables in _TABLES:
            tables.flush()
            if tables.rank == 0:
                save_tables(tables, Path(path))

    def load_tables(self, path: str | os.PathLike[str]) -> None:
        """Restores what :meth:`save_tables` wrote, onto any number of shards; call it
        on every worker after ``prepare_model`` (rank 0 sends the rows, every worker
        waits until they are in place).

        Raises:
            ValueError: If a saved table does not fit the model's.
            PSTimeoutError: If a shard does not answer within ``ps_timeout_s``.
        """
        for tables in _TABLES:
            load_tables(tables, Path(path))

    def outer_state_dict(self) -> list[dict[str, Any]]:
        """``mode="diloco"``: the outer optimizer's state of every prepared model
        (its momentum lives on the shards, not in the model's ``state_dict()``), to
        save beside the model in a checkpoint.

        Raises:
            ValueError: In another mode (none keeps such a state).
            PSTimeoutError: If a shard does not answer within ``ps_timeout_s``.
        """
        return [client.outer_state_dict() for client in _CLIENTS]

    def load_outer_state_dict(self, states: Sequence[dict[str, Any]]) -> None:
        """Restores what :meth:`outer_state_dict` returned, one entry per model in
        preparation order; call it on every worker right after ``prepare_model``.

        Raises:
            ValueError: In another mode, or if the states do not fit the models.
        """
        if len(states) != len(_CLIENTS):
            raise ValueError(
                f"load_outer_state_dict() got {len(states)} model state(s) for "
                f"{len(_CLIENTS)} prepared model(s); prepare every model first."
            )
        for client, state in zip(_CLIENTS, states):
            client.load_outer_state_dict(state)

    def save_compression_state(self, path: str | os.PathLike[str]) -> None:
        """With a lossy ``compression``: writes what every sender has not sent yet
        (each chunk's error, and ``"lowrank"``'s learnt factors) under ``path``, so
        a resumed run sends it from its second step on (its first step's errors start
        empty, as at every start: DDP rebuilds its buckets after it); otherwise nothing.
        Call it on every worker, into the directory of the checkpoint each of them
        reports: every worker writes its own file and rank 0 the shards' (Ray Train
        merges what every worker reports into one checkpoint).

        Raises:
            PSTimeoutError: If a shard does not answer within ``ps_timeout_s``.
        """
        codecs = _feedback_codecs()
        if codecs:
            self.flush()
            save_feedback(Path(path), codecs, self._feedback_senders())

    def load_compression_state(self, path: str | os.PathLike[str]) -> None:
        """Restores what :meth:`save_compression_state` wrote; call it on every worker
        after ``prepare_model``, before the first step (every worker then waits for
        the others). A state saved by a run of another world size, shard count or
        compression is left out with a warning, and so is a worker's file missing
        from the checkpoint: those errors start empty.

        Raises:
            PSTimeoutError: If a shard does not answer within ``ps_timeout_s``.
        """
        codecs = _feedback_codecs()
        if codecs:
            load_feedback(Path(path), codecs, self._feedback_senders())
            if self.world_size > 1:
                import ray.train.collective

                # A node relay could forward its first round with errors that rank
                # 0's load then replaces.
                ray.train.collective.barrier()

    def _feedback_senders(self) -> Senders:
        timeout_s = current_run().settings.ps_timeout_s
        transport = _CLIENTS[0].transport
        return Senders(self.world_rank, self.world_size, transport, self.num_servers, timeout_s)


def _feedback_codecs() -> list[Any]:
    """The lossy codec of every prepared model, in order (``None`` for a model with
    nothing lossy); empty when no model has one."""
    codecs = [c.feedback_codec() for c in _CLIENTS]
    return codecs if any(c is not None for c in codecs) else []


# --- per-process registry -----------------------------------------------------------
_RUN: RunInfo | None = None
_CLIENTS: list[ClientBase] = []
_TABLES: list[ShardedTables] = []  # the prepared models' sharded tables, if any
_TRANSPORT: Transport | None = None  # see shared_transport


def install_run(info: RunInfo) -> None:
    """Called by the backend on every worker before training starts."""
    global _RUN
    _RUN = info


def uninstall_run() -> None:
    """Called by the backend on shutdown: stops communication threads."""
    global _RUN
    _RUN = None
    close_clients()


def current_run() -> RunInfo:
    """The run installed in this worker.

    Raises:
        RuntimeError: Outside a PS run (e.g. a PS model built by hand).
    """
    if _RUN is None:
        raise RuntimeError(
            "PSDistributedDataParallel needs a running PS backend; use it through "
            "PSTrainer or TorchTrainer(torch_config=PSConfig(strategy='ps'))."
        )
    return _RUN


def get_ps_context() -> PSContext | None:
    """Describes this run's parameter servers, from inside the training function.

    Returns:
        A :class:`PSContext` with the servers' count, node ids and mode, and live
        statistics of this worker (``.stats``); ``None`` when the run does not use the
        parameter-server strategy (``strategy="ddp"`` or a plain ``TorchTrainer``).
    """
    if _RUN is None:
        return None
    import ray.train

    ctx = ray.train.get_context()
    return PSContext(
        mode=_RUN.settings.mode,
        num_servers=len(_RUN.servers),
        server_node_ids=tuple(_RUN.server_node_ids),
        world_rank=ctx.get_world_rank(),
        world_size=ctx.get_world_size(),
        shared_memory_shards=_CLIENTS[-1].shared_memory_shards if _CLIENTS else (),
        num_models=len(_CLIENTS),
        replica_node_ids=tuple(_RUN.replica_node_ids),
    )


def client_setup(module: torch.nn.Module, info: RunInfo) -> ClientSetup:
    """Describes a model being prepared on this worker, for its client."""
    import ray
    import ray.train

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    node = ray.get_runtime_context().get_node_id()
    local = tuple(i for i, n in enumerate(info.server_node_ids) if n == node)
    ignored = ddp_ignored(module)
    return ClientSetup(
        model_id=len(_CLIENTS),
        module=module,
        # A sharded table's weight stays on the meta device: its rows are the
        # shards' (see _tables.client), not the client's; neither are the weights
        # DDP leaves alone (tables stepped on the shards, and the user's own).
        params=tuple(
            p
            for n, p in module.named_parameters()
            if p.requires_grad and not p.is_meta and n not in ignored
        ),
        rank=rank,
        world_size=ctx.get_world_size(),
        num_shards=len(info.servers),
        settings=info.settings,
        # Shards of this node are reached through shared memory unless turned off.
        local_shards=local if info.settings.shared_memory else (),
        remote_shards=frozenset(i for i, n in enumerate(info.server_node_ids) if n != node),
        metrics=_worker_metrics(info.settings.mode, rank, len(_CLIENTS)),
        topology=info.topology,
        staleness=staleness_bound(info.settings),
        joined=info.joined,
    )


def module_attached(module: torch.nn.Module) -> bool:
    """Whether a client of this worker already serves ``module``."""
    return any(c.setup.module is module for c in _CLIENTS)


def register(client: ClientBase) -> None:
    """Adds a prepared model's client; its optimizer steps now reach it."""
    _CLIENTS.append(client)


def register_tables(tables: ShardedTables) -> None:
    """Adds a prepared model's sharded tables; the optimizer steps that hold their
    weights now push their rows."""
    _TABLES.append(tables)


def _worker_metrics(mode: str, rank: int, model: int) -> WorkerMetrics | None:
    try:
        import ray.train

        run = ray.train.get_context().get_experiment_name()
        return WorkerMetrics({"run": run, "mode": mode, "rank": str(rank), "model": str(model)})
    except Exception:
        logger.debug("no metrics export", exc_info=True)
        return None


def owners(optimizer: torch.optim.Optimizer) -> tuple[list[ClientBase], list[ShardedTables]]:
    """The clients and table sets whose parameters ``optimizer`` steps."""
    return [c for c in _CLIENTS if c.owns(optimizer)], [t for t in _TABLES if t.owns(optimizer)]


# --- end of the training function --------------------------------------------------
def used_models() -> int:
    """Models prepared so far in this worker."""
    return len(_CLIENTS)


def finish_clients(raising: bool) -> None:
    """Confirms every model's last update before the loop's end counts.

    Without this an async/ssp worker could return while its final push is still in
    flight, and the update would be lost silently. After a failure in the user's
    code the original error matters more, so a second one is only logged.
    """
    finishing: list[Callable[[], None]] = [
        functools.partial(c.finish, clean=raising) for c in _CLIENTS
    ] + [t.finish for t in _TABLES]
    for finish in finishing:
        try:
            finish()
        except Exception:
            if raising:
                raise
            logger.warning("Could not confirm the last update after a failure.", exc_info=True)


def close_clients() -> None:
    """Closes every client, then the transport they shared."""
    global _TRANSPORT
    while _CLIENTS:
        _CLIENTS.pop().close()
    while _TABLES:
        _TABLES.pop().close()
    transport, _TRANSPORT = _TRANSPORT, None
    if transport is not None:
        transport.close()


def shared_transport(open_transport: Callable[[], Transport]) -> Transport:
    """This process's transport to the shards (opened on first use by
    ``open_transport``), shared by every model it prepares until the clients are
    closed: one direct-path connection per shard, whatever the number of models."""
    global _TRANSPORT
    if _TRANSPORT is None:
        _TRANSPORT = open_transport()
    return _TRANSPORT


def set_shard(shard: int, primary: Any, replica: Any) -> None:
    """Called by the controller when it gave ``shard`` a new replica (its actor is
    ``primary`` now, perhaps a promoted replica): this worker's calls go there."""
    if _TRANSPORT is not None:
        _TRANSPORT.set_shard(shard, primary, replica)
