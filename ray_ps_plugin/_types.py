"""The choices PSConfig offers, each spelled once, and what the worker side reads.

Every tuple of valid values is derived from its ``Literal`` with ``get_args``, so a
new choice is added in exactly one place and both validation and type checking see
it.
"""

from __future__ import annotations

from typing import Literal, Protocol, get_args

__all__ = [
    "COMPRESSIONS",
    "DATA_PATHS",
    "DEFAULT_LOWRANK_RANK",
    "DEFAULT_OUTER_LR",
    "DEFAULT_TOPK_RATIO",
    "LOSSY_COMPRESSIONS",
    "MODES",
    "NAN_POLICIES",
    "OUTER_OPTIMIZERS",
    "ROUND_MODES",
    "SERVER_PLACEMENTS",
    "SPARSE_OPTIMIZERS",
    "STRATEGIES",
    "Compression",
    "DataPath",
    "Mode",
    "NanPolicy",
    "OuterOptimizer",
    "RoundMode",
    "RunSettings",
    "ServerPlacement",
    "SparseOptimizer",
    "Strategy",
    "outer_learning_rate",
]

Strategy = Literal["ddp", "ps"]
Mode = Literal["sync", "async", "ssp", "diloco"]
NanPolicy = Literal["raise", "skip", "ignore"]
Compression = Literal["bf16", "fp16", "onebit", "topk", "lowrank", "int8", "int4"]
ServerPlacement = Literal["auto", "worker", "node"]
DataPath = Literal["tcp", "object_store"]
OuterOptimizer = Literal["nesterov", "average"]
RoundMode = Literal["sync", "async"]
SparseOptimizer = Literal["workers", "shards"]

STRATEGIES: tuple[Strategy, ...] = get_args(Strategy)
MODES: tuple[Mode, ...] = get_args(Mode)
NAN_POLICIES: tuple[NanPolicy, ...] = get_args(NanPolicy)
COMPRESSIONS: tuple[Compression, ...] = get_args(Compression)
SERVER_PLACEMENTS: tuple[ServerPlacement, ...] = get_args(ServerPlacement)
DATA_PATHS: tuple[DataPath, ...] = get_args(DataPath)
OUTER_OPTIMIZERS: tuple[OuterOptimizer, ...] = get_args(OuterOptimizer)
ROUND_MODES: tuple[RoundMode, ...] = get_args(RoundMode)
SPARSE_OPTIMIZERS: tuple[SparseOptimizer, ...] = get_args(SparseOptimizer)

#: The compressions that drop information and so keep an error per sender.
LOSSY_COMPRESSIONS: frozenset[Compression] = frozenset(
    {"onebit", "topk", "lowrank", "int8", "int4"}
)

#: The fraction of each chunk's values ``compression="topk"`` sends when
#: ``PSConfig.topk_ratio`` is not given.
DEFAULT_TOPK_RATIO = 0.01

#: The rank of ``compression="lowrank"``'s factors when ``PSConfig.lowrank_rank``
#: is not given.
DEFAULT_LOWRANK_RANK = 4

#: The outer learning rate of each outer optimizer when ``PSConfig.outer_lr`` is
#: ``None``: DiLoCo's 0.7 for Nesterov momentum, 1 for plain averaging (the new
#: global parameters are then the mean of the workers' parameters: local SGD).
DEFAULT_OUTER_LR: dict[OuterOptimizer, float] = {"nesterov": 0.7, "average": 1.0}


def outer_learning_rate(settings: RunSettings) -> float:
    """``outer_lr``, or the outer optimizer's default when it is ``None``."""
    if settings.outer_lr is not None:
        return settings.outer_lr
    return DEFAULT_OUTER_LR[settings.outer_optimizer]


class RunSettings(Protocol):
    """The fields of ``PSConfig`` that the workers and shards act on.

    A structural type, so the worker side reads the config the backend hands it
    without importing ``config.py`` (which imports the worker side).
    """

    mode: Mode
    staleness: int
    chunk_bytes: int | None
    ps_timeout_s: float
    ps_start_timeout_s: float
    nan_policy: NanPolicy
    compression: Compression | None
    topk_ratio: float
    lowrank_rank: int
    shared_memory: bool
    data_path: DataPath
    node_aggregation: bool
    local_steps: int
    outer_optimizer: OuterOptimizer
    outer_lr: float | None
    outer_momentum: float
    diloco_rounds: RoundMode
    diloco_overlap: bool
    sparse_optimizer: SparseOptimizer | None
    replace_lost_workers: bool
    shard_replicas: int
