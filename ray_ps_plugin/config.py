"""``PSConfig``, the one flag that switches a TorchTrainer loop between DDP and PS.

As in Ray's own ``ray/train/torch/config.py``, the config names its backend: Ray
Train instantiates ``backend_cls`` (:class:`~ray_ps_plugin._backend.PSBackend`, which
starts, places and stops the server shards) inside its controller actor and wraps
the user's training function in ``train_func_context`` on every worker.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

from ray.train.torch import TorchConfig

from ray_ps_plugin._backend import PSBackend, PSKeepingBackend
from ray_ps_plugin._ddp import PSTrainFuncContext
from ray_ps_plugin._modes import MODE_SPECS
from ray_ps_plugin._ray_compat import TorchBackend, TorchConfigContextManager
from ray_ps_plugin._types import (
    COMPRESSIONS,
    DATA_PATHS,
    DEFAULT_LOWRANK_RANK,
    DEFAULT_TOPK_RATIO,
    MODES,
    NAN_POLICIES,
    OUTER_OPTIMIZERS,
    ROUND_MODES,
    SERVER_PLACEMENTS,
    SPARSE_OPTIMIZERS,
    STRATEGIES,
    Compression,
    DataPath,
    Mode,
    NanPolicy,
    OuterOptimizer,
    RoundMode,
    ServerPlacement,
    SparseOptimizer,
    Strategy,
)

__all__ = ["PSConfig"]


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
        mode: ``"sync"`` (same maths as DDP), ``"async"``, ``"ssp"`` or
            ``"diloco"`` (local steps with an outer optimizer on the shards).
        staleness: Largest clock gap between fastest and slowest worker in
            ``"ssp"`` mode, and largest round gap with
            ``mode="diloco", diloco_rounds="async"`` (at least 1 there); must stay
            0 otherwise.
        num_servers: Number of server shards. ``None`` starts one per worker, each on
            its worker's node. More shards than workers are placed round-robin on the
            workers' bundles.
        chunk_bytes: Largest message a worker sends to one shard (sync mode).
            Gradients are cut into chunks of at most this many bytes, so big
            buckets reach several shards and several messages can be in flight at
            once. ``None`` (the default) picks it per run: 16 MiB when no chunk
            crosses nodes on the direct TCP path (one node, or
            ``data_path="object_store"``), where each message costs a Ray call;
            1 MiB when chunks do cross on the direct path, where a frame is cheap and
            small chunks let sums and answers flow while later chunks still travel
            (raised if a shard would hold too many chunks at once).
        ps_timeout_s: Bound, in seconds, on every wait for a server shard during
            training (a push waiting for the other workers, a worker waiting for a
            sum) and on handing the servers to the workers and taking them back. A
            timeout raises an error naming the shard and the step.
        ps_start_timeout_s: Bound, in seconds, on starting the server shards (a new
            actor process can take several seconds on a busy node).
        nan_policy: What a step whose gradients hold NaN or Inf does: ``"raise"``
            (fail with an error naming rank and step), ``"skip"`` (the optimizer
            step is dropped, with a warning) or ``"ignore"`` (no check, like DDP).
        compression: ``None`` (values travel in the model's dtype), ``"bf16"`` or
            ``"fp16"``: what workers and shards send each other between nodes as
            16-bit values, halving the bytes. Shards keep their sums and
            master parameters in the model's dtype (at least fp32); shared memory
            carries full precision. Sync mode also takes two lossy encodings for
            slow links, each with error feedback (what a sender's encoding drops
            is added to what it sends next, by the worker for its pushes and by
            the shard for its sums): ``"onebit"`` (a sign bit per value and a
            scale per 128 values: 25.6x fewer bytes than fp32), ``"topk"``
            (the ``topk_ratio`` largest values of each chunk with their indices)
            and ``"lowrank"`` (each chunk as a matrix of about sqrt(n) x sqrt(n),
            sent as two factors of rank ``lowrank_rank``, PowerSGD's power
            iteration warm-started from the chunk's previous factor).
            Diloco takes ``"int8"`` and ``"int4"``: each round's change as 8- or
            4-bit levels with error feedback across rounds, the replies as bf16.
            The lossy ones take fp32 models; sparse rows then travel as fp32. See
            docs/compression.md for which to pick.
        topk_ratio: The fraction of each chunk's values ``compression="topk"``
            sends (8 bytes each: index and value), in (0, 1].
        lowrank_rank: The rank of ``compression="lowrank"``'s factors (an int >=
            1): a chunk of n values sends about ``2 * lowrank_rank * sqrt(n)``
            floats.
        shared_memory: Whether a worker exchanges data with the shards of its own
            node through shared memory, as BytePS does within a machine: only a
            notice naming what was written travels separately (sync: one per bucket
            and shard; async/ssp: one per step and shard; a frame on the direct TCP
            path where the run has one, else a Ray call). Turn it off to force every
            byte of a node's own shards through the object store (e.g. to compare).
        server_placement: ``"auto"`` (the default): one shard per node when a sync
            run spans several nodes and some node has several workers (its shard
            relays the node's partial sums; docs/benchmarks.md compares it with one
            shard per worker), otherwise one shard per worker. ``"worker"``: one shard
            per worker, in its bundle (or ``num_servers`` shards round-robin over the
            workers). ``"node"``: one shard per node, in the bundle of that node's
            lowest-rank worker. ``num_servers`` set means ``"worker"`` placement.
        server_resources: Ray resources each shard asks for, e.g.
            ``{"ps_server": 1}``: the shards then run only on nodes that carry them
            (``ray start --resources='{"ps_server": 4}'``, or a KubeRay worker group
            with that custom resource), spread over those nodes and outside the
            workers' placement group, so a worker node's loss costs no shard (see
            docs/deployment.md). ``num_servers`` of them (``None``: one per worker).
            A ``"CPU"`` entry is each shard's CPUs (0 otherwise). Workers reach them
            over the network: sync chunks on the direct TCP path, other calls by
            Ray call; no node relays. If no node can take them, start-up fails
            after ``ps_start_timeout_s`` with a message naming the resource.
            ``None`` (the default): shards live in the workers' bundles, as
            ``server_placement`` says.
        data_path: ``"tcp"`` (each shard listens on a TCP port of its node's
            address, opened when the run starts; the fast path) or
            ``"object_store"`` (everything as Ray actor-call arguments and results;
            use it where the nodes allow only Ray's own ports). With ``"tcp"``
            sync chunks cross nodes as frames; in every mode but diloco the
            notices to a node's own shards and the tables' rows take it too, also
            on one node. Async/ssp updates to other nodes' shards go by Ray call.
        node_aggregation: Whether, in sync mode, the workers of a node with several
            workers first sum their gradients (dense chunks and sparse rows) on that
            node's first shard, which then sends one partial sum per node across the
            network (needs ``data_path="tcp"`` and a shard on the node; ignored
            otherwise). In
            ``"diloco"`` with synchronous rounds the same shard sums the node's
            round changes for other nodes' shards and sends each one message (by
            Ray call; needs a shard on the node).
        local_steps: ``"diloco"``: optimizer steps each worker takes on its own copy
            between two rounds with the shards (H). Every round sends the change
            since the last global parameters and installs the new ones.
        outer_optimizer: ``"diloco"``: how the shards turn the workers' changes
            into the next global parameters: ``"nesterov"`` (SGD with Nesterov
            momentum on the averaged pseudo-gradient, as DiLoCo) or ``"average"``
            (the scaled mean change: local SGD when ``outer_lr`` is 1).
        outer_lr: ``"diloco"``: the outer learning rate; ``None`` is 0.7 for
            ``"nesterov"`` and 1.0 for ``"average"``.
        outer_momentum: ``"diloco"`` with ``"nesterov"``: the outer momentum (0.9).
        diloco_rounds: ``"diloco"``: ``"sync"`` (every worker's round k is applied
            before anyone's round k + 1 starts) or ``"async"`` (each worker's change
            is applied as it arrives, with the momentum delayed to every W-th
            arrival; ``staleness`` bounds how many rounds a worker may run ahead).
        diloco_overlap: ``"diloco"``: whether a round's transfer overlaps the next
            round's local steps (one round of delay: the answer is installed at the
            end of the next round, plus the local progress since). Hides the
            transfer; changes the maths, so off by default.
        replace_lost_workers: ``"async"``, ``"ssp"``, ``"diloco"``, whose shards own
            the run's state: ``True`` replaces a lost worker alone while the others
            go on (Ray Train's replica groups of one worker each). The replacement
            takes the shards' parameters and must go on from the step
            ``get_ps_context().start_step`` names, making the same
            ``ray.train.report``/collective calls from there as the others: Ray
            Train pairs every worker's reports, and a loop that restarts from its
            checkpoint's step instead makes more of them than the others and
            waits for them at its last one. (A survivor waiting at a report when
            the replacement starts, which Ray Train then skips, goes through it
            again when the replacement will make it: see
            docs/fault-tolerance.md.) ``False`` (default) restarts every
            worker, as under DDP, which any loop survives. Either way the shards'
            state is kept over the restart: the workers start from it, and a
            checkpoint loaded then does not roll it back. Ignored in ``"sync"``,
            which restarts every worker from its checkpoint, as DDP.
        shard_replicas: ``1`` holds every shard's state twice (``"async"`` and
            ``"ssp"``): a replica shard on another node (the next worker's node,
            or another node carrying ``server_resources``; the same node where
            there is no other) replays every update its primary applies; a
            worker keeps each update until the replica holds it (the primary
            confirms it with its answer to the next push). When a primary dies,
            the workers go on with its replica, losing no update and restarting
            nothing. Sharded embedding tables are not
            replicated (refused). ``0`` (default): one copy, as before.
        sparse_optimizer: Where the optimizer of sparse embedding tables
            (``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True`` on a real
            device) runs. ``"workers"``: each worker's optimizer steps its own copy
            of the table (sync: as under DDP, the shards answer every worker with
            the union of touched rows, summed; async/ssp: the table is one more
            parameter whose whole change is pushed each step). ``"shards"``: the
            shards apply the table's optimizer (SparseAdam, SGD or Adagrad, with the
            user optimizer's hyperparameters at that step) to the rows a step
            touched, and the optimizer's state for the table lives on them
            (``optimizer.state_dict()`` / ``load_state_dict()`` read it from and send
            it back to them). In sync each shard steps the rows it owns once, for
            all workers, and answers with their new values, which every worker
            writes into its copy; in async and ssp each worker's forward looks up
            the rows of its batch on the shards, as a sharded table does, so a step
            moves only touched rows. ``None`` (the default): ``"workers"`` in sync
            (DDP's maths, bit for bit) and diloco, ``"shards"`` in async and ssp.
            ``"shards"`` is refused with ``mode="diloco"``.
        backend: Torch process-group backend (see TorchConfig). The PS strategy still
            starts one, because DDP's constructor broadcasts rank 0's initial
            parameters and buffers through it.
        init_method: See TorchConfig.
        timeout_s: Process-group timeout in seconds (see TorchConfig).

    Raises:
        ValueError: If a field is out of range or names an unknown strategy or mode.
        TypeError: If a field has the wrong type.
    """

    strategy: Strategy = "ps"
    mode: Mode = "sync"
    staleness: int = 0
    num_servers: int | None = None
    chunk_bytes: int | None = None
    ps_timeout_s: float = 120.0
    ps_start_timeout_s: float = 120.0
    nan_policy: NanPolicy = "raise"
    compression: Compression | None = None
    topk_ratio: float = DEFAULT_TOPK_RATIO
    lowrank_rank: int = DEFAULT_LOWRANK_RANK
    server_placement: ServerPlacement = "auto"
    server_resources: dict[str, float] | None = None
    shared_memory: bool = True
    data_path: DataPath = "tcp"
    node_aggregation: bool = True
    local_steps: int = 32
    outer_optimizer: OuterOptimizer = "nesterov"
    outer_lr: float | None = None
    outer_momentum: float = 0.9
    diloco_rounds: RoundMode = "sync"
    diloco_overlap: bool = False
    replace_lost_workers: bool = False
    shard_replicas: int = 0
    sparse_optimizer: SparseOptimizer | None = None

    def __post_init__(self) -> None:
        _check_choice("strategy", self.strategy, STRATEGIES)
        _check_choice("mode", self.mode, MODES)
        _check_int("staleness", self.staleness, minimum=0)
        self._check_diloco()
        if self.num_servers is not None:
            _check_int("num_servers", self.num_servers, minimum=1)
        if self.chunk_bytes is not None:
            _check_int("chunk_bytes", self.chunk_bytes, minimum=1024)
        _check_seconds("ps_timeout_s", self.ps_timeout_s)
        _check_seconds("ps_start_timeout_s", self.ps_start_timeout_s)
        _check_choice("nan_policy", self.nan_policy, NAN_POLICIES)
        self._check_compression()
        _check_choice("server_placement", self.server_placement, SERVER_PLACEMENTS)
        _check_choice("data_path", self.data_path, DATA_PATHS)
        for name in ("shared_memory", "node_aggregation", "diloco_overlap", "replace_lost_workers"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(
                    f"PSConfig.{name} must be True or False, got {type(value).__name__} {value!r}."
                )
        if self.sparse_optimizer is not None:
            _check_choice("sparse_optimizer", self.sparse_optimizer, SPARSE_OPTIMIZERS)
        if self.sparse_optimizer == "shards" and not MODE_SPECS[self.mode].tables_on_shards:
            raise ValueError(
                f"PSConfig.sparse_optimizer='shards' does not apply to mode={self.mode!r}: "
                "its workers take local steps on their own copy of every parameter "
                "between rounds. Use sparse_optimizer=None or 'workers' there, or "
                "mode='sync', 'async' or 'ssp'."
            )
        if self.server_resources is not None:
            self._check_server_resources()
        self._check_replicas()
        if self.server_placement == "node" and self.num_servers is not None:
            raise ValueError(
                f"PSConfig.server_placement='node' starts one shard per node and cannot "
                f"be combined with num_servers={self.num_servers}; drop one of them."
            )

    def _check_server_resources(self) -> None:
        resources = self.server_resources
        if not isinstance(resources, dict) or not resources:
            raise TypeError(
                "PSConfig.server_resources must be a non-empty dict of Ray resource "
                f'names to amounts, e.g. {{"ps_server": 1}}; got {resources!r}.'
            )
        for name, amount in resources.items():
            if not isinstance(name, str) or not name:
                raise TypeError(
                    f"PSConfig.server_resources: resource names are strings, got {name!r}."
                )
            _check_positive(f"server_resources[{name!r}]", amount)
        if "GPU" in resources:
            raise ValueError(
                "PSConfig.server_resources asks each shard for GPUs: shards sum and "
                "update on CPUs. Name a custom resource of the server nodes instead, "
                'e.g. {"ps_server": 1}.'
            )
        if self.server_placement != "auto":
            raise ValueError(
                f"PSConfig.server_placement={self.server_placement!r} places shards in "
                "the workers' bundles and cannot be combined with server_resources, "
                "which places them on the nodes carrying those resources; drop one."
            )

    def _check_compression(self) -> None:
        _check_positive("topk_ratio", self.topk_ratio)
        if self.topk_ratio > 1:
            raise ValueError(
                f"PSConfig.topk_ratio is the fraction of values compression='topk' sends, "
                f"in (0, 1]; got {self.topk_ratio!r}."
            )
        _check_int("lowrank_rank", self.lowrank_rank, minimum=1)
        if self.compression is None:
            return
        _check_choice("compression", self.compression, COMPRESSIONS)
        spec = MODE_SPECS[self.mode]
        if self.compression not in spec.compressions:
            takes = [m for m, s in MODE_SPECS.items() if self.compression in s.compressions]
            raise ValueError(
                f"PSConfig.compression={self.compression!r} does not apply to "
                f"mode={self.mode!r}, which takes {sorted(spec.compressions)}; "
                f"{self.compression!r} is for the modes {takes}."
            )

    def _check_replicas(self) -> None:
        _check_int("shard_replicas", self.shard_replicas, minimum=0)
        if self.shard_replicas > 1:
            raise ValueError(
                f"PSConfig.shard_replicas={self.shard_replicas}: one replica per shard "
                "is supported (1), or none (0)."
            )
        if self.shard_replicas and not MODE_SPECS[self.mode].replicates:
            replicated = [m for m, spec in MODE_SPECS.items() if spec.replicates]
            raise ValueError(
                f"PSConfig.shard_replicas=1 does not apply to mode={self.mode!r}: "
                f"replicas hold the state of the modes {replicated}. Use one of them, "
                "or shard_replicas=0."
            )

    def _check_diloco(self) -> None:
        """Checks the DiLoCo fields, and that none is set outside ``mode="diloco"``
        (a field that would be silently ignored is a mistake worth naming)."""
        _check_int("local_steps", self.local_steps, minimum=1)
        _check_choice("outer_optimizer", self.outer_optimizer, OUTER_OPTIMIZERS)
        _check_choice("diloco_rounds", self.diloco_rounds, ROUND_MODES)
        if self.outer_lr is not None:
            _check_positive("outer_lr", self.outer_lr)
        _check_number("outer_momentum", self.outer_momentum)
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(
                f"PSConfig.outer_momentum must be in [0, 1), got {self.outer_momentum!r}."
            )
        stale_rounds = self.mode == "diloco" and self.diloco_rounds == "async"
        if self.staleness and self.mode != "ssp" and not stale_rounds:
            raise ValueError(
                f"PSConfig.staleness={self.staleness} only applies to mode='ssp' and to "
                f"mode='diloco' with diloco_rounds='async' (got mode={self.mode!r}); "
                "set one of them or staleness=0."
            )
        if stale_rounds and not self.staleness:
            raise ValueError(
                "PSConfig(mode='diloco', diloco_rounds='async') needs staleness >= 1: the "
                "most rounds a worker may run ahead of the slowest one (staleness=0 "
                "would make every round wait for all workers: diloco_rounds='sync')."
            )
        if self.mode == "diloco":
            return
        defaults = {f.name: f.default for f in dataclasses.fields(PSConfig)}
        for name in _DILOCO_FIELDS:
            if getattr(self, name) != defaults[name]:
                raise ValueError(
                    f"PSConfig.{name}={getattr(self, name)!r} only applies to "
                    f"mode='diloco' (got mode={self.mode!r}); set mode='diloco' or "
                    f"leave {name} at its default."
                )

    @property
    def backend_cls(self) -> type[TorchBackend]:
        if self.strategy == "ddp":
            return TorchBackend
        replaces = MODE_SPECS[self.mode].keeps_state and self.replace_lost_workers
        return PSKeepingBackend if replaces else PSBackend

    @property
    def train_func_context(self) -> Any:
        if self.strategy == "ddp":
            return TorchConfigContextManager
        return functools.partial(PSTrainFuncContext, TorchConfigContextManager)

    def to_dict(self) -> dict[str, Any]:
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(PSConfig)}
        return {**super().to_dict(), **own}


_DILOCO_FIELDS = (
    "local_steps",
    "outer_optimizer",
    "outer_lr",
    "outer_momentum",
    "diloco_rounds",
    "diloco_overlap",
)


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
        raise TypeError(f"PSConfig.{name} must be an int, got {type(value).__name__} {value!r}.")
    if value < minimum:
        raise ValueError(f"PSConfig.{name} must be >= {minimum}, got {value}.")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"PSConfig.{name} must be a number, got {type(value).__name__} {value!r}.")


def _check_positive(name: str, value: object) -> None:
    _check_number(name, value)
    assert isinstance(value, (int, float))
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"PSConfig.{name} must be a finite number > 0, got {value!r}.")


def _check_seconds(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"PSConfig.{name} must be a number of seconds, got {type(value).__name__} {value!r}."
        )
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(
            f"PSConfig.{name} must be a finite number of seconds > 0, got {value!r}; "
            "every wait on a server needs a bound."
        )
