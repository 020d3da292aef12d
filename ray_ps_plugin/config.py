"""``PSConfig``: the one flag that switches a TorchTrainer loop between DDP and PS."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from ray.train.torch.config import TorchConfig, TorchConfigContextManager, _TorchBackend

from ray_ps_plugin._codec import COMPRESSIONS
from ray_ps_plugin._nonfinite import NAN_POLICIES

__all__ = ["PSConfig", "STRATEGIES", "MODES", "NAN_POLICIES", "COMPRESSIONS", "SERVER_PLACEMENTS"]

STRATEGIES = ("ddp", "ps")
MODES = ("sync", "async", "ssp")
SERVER_PLACEMENTS = ("worker", "node")


@dataclass
class PSConfig(TorchConfig):
    """Configuration of the parameter-server strategy for Ray Train.

    A drop-in replacement for ``ray.train.torch.TorchConfig``: with
    ``strategy="ddp"`` it *is* a TorchConfig (same backend, same behaviour); with
    ``strategy="ps"`` gradients are synchronised through server shard actors
    colocated with the workers instead of an all-reduce. The training loop does not
    change.

    Args:
        strategy: ``"ps"`` (parameter servers) or ``"ddp"`` (stock all-reduce).
        mode: ``"sync"`` (same maths as DDP), ``"async"`` or ``"ssp"``.
        staleness: Largest clock gap between fastest and slowest worker in
            ``"ssp"`` mode; must stay 0 in the other modes.
        num_servers: Number of server shards. ``None`` starts one per worker, each on
            its worker's node. More shards than workers are placed round-robin on the
            workers' bundles.
        chunk_bytes: Largest message a worker sends to one shard. Gradients are cut
            into chunks of at most this many bytes, so big buckets reach several
            shards and several messages can be in flight at once. The default
            (16 MiB) is the measured optimum on a 2-core node, where every extra
            message costs more than the pipelining it buys (see docs/benchmarks.md).
        ps_timeout_s: Bound, in seconds, on every wait for a server shard during
            training (a push waiting for the other workers, a worker waiting for a
            sum) and on handing the servers to the workers and taking them back. A
            timeout raises an error naming the shard and the step.
        ps_start_timeout_s: Bound, in seconds, on starting the server shards (a new
            actor process can take several seconds on a busy node).
        nan_policy: What a step whose gradients hold NaN or Inf does: ``"raise"``
            (fail with an error naming rank and step), ``"skip"`` (the optimizer
            step is dropped, with a warning) or ``"ignore"`` (no check, like DDP).
        compression: ``None`` (fp32 on the wire), ``"bf16"`` or ``"fp16"``: what
            workers and shards send each other as 16-bit values, halving the bytes.
            Shards keep fp32 sums and fp32 master parameters. Compression applies to
            traffic through Ray's object store; shared memory carries full precision.
        shared_memory: Whether a worker exchanges data with the shards of its own
            node through shared memory (only a small control message per chunk goes
            through Ray), as BytePS does within a machine. Shards on other nodes are
            always reached through Ray's object store. Turn it off to force every
            byte through the object store (e.g. to compare the two).
        server_placement: ``"worker"`` (one shard per worker, in its bundle; or
            ``num_servers`` shards round-robin over the workers) or ``"node"`` (one
            shard per node, in the bundle of that node's lowest-rank worker).
        backend: Torch process-group backend (see TorchConfig). The PS strategy still
            starts one, because DDP's constructor broadcasts rank 0's initial
            parameters and buffers through it.
        init_method: See TorchConfig.
        timeout_s: Process-group timeout in seconds (see TorchConfig).

    Raises:
        ValueError: If a field is out of range or names an unknown strategy or mode.
        TypeError: If a field has the wrong type.
    """

    strategy: str = "ps"
    mode: str = "sync"
    staleness: int = 0
    num_servers: int | None = None
    chunk_bytes: int = 16 * 1024 * 1024
    ps_timeout_s: float = 120.0
    ps_start_timeout_s: float = 120.0
    nan_policy: str = "raise"
    compression: str | None = None
    server_placement: str = "worker"
    shared_memory: bool = True

    def __post_init__(self) -> None:
        _check_choice("strategy", self.strategy, STRATEGIES)
        _check_choice("mode", self.mode, MODES)
        _check_int("staleness", self.staleness, minimum=0)
        if self.staleness and self.mode != "ssp":
            raise ValueError(
                f"PSConfig.staleness={self.staleness} only applies to mode='ssp' "
                f"(got mode={self.mode!r}); set mode='ssp' or staleness=0."
            )
        if self.num_servers is not None:
            _check_int("num_servers", self.num_servers, minimum=1)
        _check_int("chunk_bytes", self.chunk_bytes, minimum=1024)
        _check_seconds("ps_timeout_s", self.ps_timeout_s)
        _check_seconds("ps_start_timeout_s", self.ps_start_timeout_s)
        _check_choice("nan_policy", self.nan_policy, NAN_POLICIES)
        if self.compression is not None:
            _check_choice("compression", self.compression, COMPRESSIONS)
        _check_choice("server_placement", self.server_placement, SERVER_PLACEMENTS)
        if not isinstance(self.shared_memory, bool):
            raise TypeError(
                f"PSConfig.shared_memory must be True or False, got "
                f"{type(self.shared_memory).__name__} {self.shared_memory!r}."
            )
        if self.server_placement == "node" and self.num_servers is not None:
            raise ValueError(
                f"PSConfig.server_placement='node' starts one shard per node and cannot "
                f"be combined with num_servers={self.num_servers}; drop one of them."
            )

    @property
    def backend_cls(self) -> type[_TorchBackend]:
        if self.strategy == "ddp":
            return _TorchBackend
        from ray_ps_plugin._backend import PSBackend

        return PSBackend

    @property
    def train_func_context(self) -> Any:
        if self.strategy == "ddp":
            return TorchConfigContextManager
        from ray_ps_plugin._worker import PSTrainFuncContext

        return functools.partial(PSTrainFuncContext, self, TorchConfigContextManager)

    def to_dict(self) -> dict[str, Any]:
        return {
            **super().to_dict(),
            "strategy": self.strategy,
            "mode": self.mode,
            "staleness": self.staleness,
            "num_servers": self.num_servers,
            "chunk_bytes": self.chunk_bytes,
            "ps_timeout_s": self.ps_timeout_s,
            "ps_start_timeout_s": self.ps_start_timeout_s,
            "nan_policy": self.nan_policy,
            "compression": self.compression,
            "server_placement": self.server_placement,
            "shared_memory": self.shared_memory,
        }


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str):
        raise TypeError(
            f"PSConfig.{name} must be a string, one of {choices}; got "
            f"{type(value).__name__} {value!r}."
        )
    if value not in choices:
        raise ValueError(f"PSConfig.{name}={value!r} is unknown; use one of {choices}.")


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"PSConfig.{name} must be an int, got {type(value).__name__} {value!r}."
        )
    if value < minimum:
        raise ValueError(f"PSConfig.{name} must be >= {minimum}, got {value}.")


def _check_seconds(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"PSConfig.{name} must be a number of seconds, got "
            f"{type(value).__name__} {value!r}."
        )
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(
            f"PSConfig.{name} must be a finite number of seconds > 0, got {value!r}; "
            "every wait on a server needs a bound."
        )
