"""The one table from a consistency mode to its shard actor and its worker client.

Everything mode-specific is chosen here, once: the backend asks which actor to start
and with which arguments; the worker asks which client serves a prepared model and
whether DDP's own reducer stays in the forward pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ray_ps_plugin._client import ClientBase, ClientSetup
from ray_ps_plugin._param.client import ParamClient
from ray_ps_plugin._param.diloco_client import DilocoClient
from ray_ps_plugin._param.diloco_shard import DilocoShard
from ray_ps_plugin._param.relay import connect_round_relays
from ray_ps_plugin._param.shard import ParamShard
from ray_ps_plugin._shard import ShardBase
from ray_ps_plugin._sync.client import SumClient
from ray_ps_plugin._sync.layout import SHARD_MAX_CONCURRENCY
from ray_ps_plugin._sync.setup import connect_shards, open_direct_path
from ray_ps_plugin._sync.shard import SumShard
from ray_ps_plugin._tables.client import RealTables
from ray_ps_plugin._transport import DirectPath, Transport
from ray_ps_plugin._types import (
    Mode,
    RunSettings,
    SparseOptimizer,
    outer_learning_rate,
)
from ray_ps_plugin._wire.setup import open_streams, open_wires

__all__ = ["MODE_SPECS", "ModeSpec", "real_tables", "spec_of", "staleness_bound"]


@dataclass(frozen=True)
class ModeSpec:
    """What one consistency mode is made of.

    Attributes:
        shard_cls: The shard actor's class (wrapped with ``ray.remote`` by the backend).
        shard_args: Constructor arguments after ``(shard_index, num_workers)``.
        build_client: Builds the worker client of one prepared model.
        uses_reducer: Whether DDP's reducer runs (sync: its buckets feed the shards)
            or forward calls the module directly (async/ssp own the parameters).
        connect: Run start-up after every shard is ready, given the shard actors,
            each worker's and each shard's node id and the config; what it returns
            reaches every client as ``ClientSetup.topology``.
        max_concurrency: The shard actor's ``max_concurrency``: how many of its
            calls may be pending at once.
        direct_path: Opens a worker process's direct path to the shards, given the
            config and the start-up's topology (``None``: the mode has none).
        sparse_optimizer: Where sparse tables' optimizer runs when
            ``PSConfig.sparse_optimizer`` is ``None``: sync keeps DDP's maths (each
            worker steps its copy of the union of rows); async and ssp, whose shards
            own the parameters anyway, step the rows on the shards, so a step moves
            only the rows it touched instead of the whole table.
        tables_on_shards: Whether the mode can step sparse tables on the shards
            (diloco's workers step their own copies between rounds).
        bound: The clock gap a shard lets the fastest worker run ahead of the
            slowest, given the config (``None``: no bound).
        sums_tables: Whether a table's pushes of one clock are summed and applied
            together (sync), rather than each as it comes.
        keeps_state: Whether the shards own the run's state (parameters, and
            clocks) rather than a step's sums: then a restart of every worker takes
            the shards' state along instead of going back to a checkpoint, and
            (``replace_lost_workers``) a lost worker can be replaced alone and join
            the live shards.
        relays_chunks: Whether a node's first shard sums the node's workers' chunks
            before they cross the network (sync), so ``server_placement="auto"``
            may start one shard per node instead of one per worker.
        replicates: Whether ``PSConfig.shard_replicas`` can hold the shards' state
            twice (async, ssp: a replica replays every applied update).
        compressions: The ``PSConfig.compression`` values the mode takes: the 16-bit
            ones everywhere; a lossy one with error feedback only where what is
            sent is a change that adds up (sync's gradients, diloco's round
            changes), not async's parameters read at each worker's own moment.
        table_copies: With the tables stepped on the shards, whether every worker
            keeps its copy written from the shards' answers (sync: every step waits
            for all workers, so the copies stay equal) or looks the rows it needs
            up on the shards as a sharded table does (async, ssp).
    """

    shard_cls: type[ShardBase]
    shard_args: Callable[[RunSettings], tuple[Any, ...]]
    build_client: Callable[[ClientSetup, Transport], ClientBase]
    uses_reducer: bool
    connect: Callable[[Sequence[Any], Sequence[str], Sequence[str], RunSettings], Any] | None = None
    max_concurrency: int = 1000
    direct_path: Callable[[RunSettings, Any], DirectPath | None] | None = None
    bound: Callable[[RunSettings], int | None] = lambda cfg: None
    sums_tables: bool = False
    keeps_state: bool = True
    sparse_optimizer: SparseOptimizer = "workers"
    tables_on_shards: bool = True
    table_copies: bool = False
    relays_chunks: bool = False
    replicates: bool = False
    compressions: frozenset[str] = frozenset({"bf16", "fp16"})


_SUM = ModeSpec(
    shard_cls=SumShard,
    shard_args=lambda cfg: (cfg.ps_timeout_s, cfg.compression, cfg.topk_ratio, cfg.lowrank_rank),
    build_client=SumClient.build,
    compressions=frozenset({"bf16", "fp16", "onebit", "topk", "lowrank"}),
    uses_reducer=True,
    connect=connect_shards,
    max_concurrency=SHARD_MAX_CONCURRENCY,
    direct_path=open_direct_path,
    table_copies=True,
    relays_chunks=True,
    bound=lambda cfg: 0,
    sums_tables=True,
    keeps_state=False,
)
_ASYNC = ModeSpec(
    shard_cls=ParamShard,
    shard_args=lambda cfg: (None, cfg.ps_timeout_s, cfg.compression),
    build_client=ParamClient.build,
    uses_reducer=False,
    # The tables' pulls and pushes go as frames: a Ray call and its reply cost a
    # worker about a millisecond of CPU each on a loaded machine.
    connect=lambda servers, _workers, _shards, cfg: open_wires(servers, cfg),
    direct_path=lambda cfg, wires: wires and open_streams(wires, cfg.ps_start_timeout_s),
    # A worker has at most one push (or pull) per model in flight, so W workers with
    # M models hold at most W * M calls; Ray's default for asyncio actors (1000)
    # leaves room for the pings and stats calls besides.
    max_concurrency=1000,
    sparse_optimizer="shards",
    replicates=True,
)

_SSP = dataclasses.replace(
    _ASYNC,
    shard_args=lambda cfg: (cfg.staleness, cfg.ps_timeout_s, cfg.compression),
    bound=lambda cfg: cfg.staleness,
)


def _round_bound(cfg: RunSettings) -> int:
    """Diloco's bound, in rounds: 0 with synchronous rounds (every worker's round
    ``k`` is in before anyone's round ``k + 1`` starts), ``staleness`` with
    asynchronous ones."""
    return cfg.staleness if cfg.diloco_rounds == "async" else 0


_DILOCO = ModeSpec(
    shard_cls=DilocoShard,
    shard_args=lambda cfg: (
        _round_bound(cfg),
        cfg.ps_timeout_s,
        cfg.compression,
        cfg.outer_optimizer,
        outer_learning_rate(cfg),
        cfg.outer_momentum,
    ),
    build_client=DilocoClient.build,
    uses_reducer=False,
    connect=connect_round_relays,
    max_concurrency=_ASYNC.max_concurrency,  # the same calls as async/ssp
    compressions=frozenset({"bf16", "fp16", "int8", "int4"}),
    tables_on_shards=False,
    bound=_round_bound,
    replicates=False,
)

MODE_SPECS: dict[Mode, ModeSpec] = {
    "sync": _SUM,
    "async": _ASYNC,
    "ssp": _SSP,
    "diloco": _DILOCO,
}


def spec_of(settings: RunSettings) -> ModeSpec:
    """The spec of the run's mode: the one place a mode is looked up."""
    return MODE_SPECS[settings.mode]


def staleness_bound(settings: RunSettings) -> int | None:
    """The clock gap the run's shards allow (see :attr:`ModeSpec.bound`)."""
    return spec_of(settings).bound(settings)


def real_tables(settings: RunSettings) -> RealTables:
    """What the run makes of embedding layers with sparse gradients on a real
    device: the config's ``sparse_optimizer``, else the mode's, and with the
    optimizer on the shards, the mode's way of keeping the workers' copies."""
    spec = spec_of(settings)
    if (settings.sparse_optimizer or spec.sparse_optimizer) == "workers":
        return "workers"
    return "copies" if spec.table_copies else "lookups"
