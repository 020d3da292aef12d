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
    "MODES",
    "NAN_POLICIES",
    "SERVER_PLACEMENTS",
    "STRATEGIES",
    "Compression",
    "DataPath",
    "Mode",
    "NanPolicy",
    "RunSettings",
    "ServerPlacement",
    "Strategy",
    "staleness_bound",
]

Strategy = Literal["ddp", "ps"]
Mode = Literal["sync", "async", "ssp"]
NanPolicy = Literal["raise", "skip", "ignore"]
Compression = Literal["bf16", "fp16"]
ServerPlacement = Literal["auto", "worker", "node"]
DataPath = Literal["tcp", "object_store"]

STRATEGIES: tuple[Strategy, ...] = get_args(Strategy)
MODES: tuple[Mode, ...] = get_args(Mode)
NAN_POLICIES: tuple[NanPolicy, ...] = get_args(NanPolicy)
COMPRESSIONS: tuple[Compression, ...] = get_args(Compression)
SERVER_PLACEMENTS: tuple[ServerPlacement, ...] = get_args(ServerPlacement)
DATA_PATHS: tuple[DataPath, ...] = get_args(DataPath)


def staleness_bound(settings: RunSettings) -> int | None:
    """The ssp bound on clock gaps, or ``None`` (no bound) outside ``mode="ssp"``."""
    return settings.staleness if settings.mode == "ssp" else None


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
    shared_memory: bool
    data_path: DataPath
    node_aggregation: bool
