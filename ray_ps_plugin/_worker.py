"""Worker side: what runs inside each Ray Train worker process.

One synchronous step, top to bottom:

1. ``loss.backward()`` fills DDP's gradient buckets; as each bucket becomes ready
   DDP calls :meth:`PSClient.hook` on the autograd thread.
2. The hook divides the bucket by the world size (as DDP's all-reduce hook does),
   cuts it into chunks with :class:`~ray_ps_plugin._layout.StreamLayout` and submits
   one non-blocking ``push_pull`` per chunk to the chunk's shard. Backward carries on
   computing the next buckets while the chunks travel: communication overlaps
   backward.
3. A per-worker communication thread waits (with a timeout) for the shards' sums
   and writes them back into the bucket, completing the future DDP holds.
4. At the end of backward DDP waits for every bucket's future and copies the summed
   buckets into ``param.grad``; the user's optimizer then steps locally, exactly as
   under DDP.

The backend installs a :class:`RunInfo` in every worker process before the training
function starts (:func:`install_run`); the training function's context
(:class:`PSTrainFuncContext`) makes ``ray.train.torch.prepare_model`` build a
:class:`PSDistributedDataParallel` from it.
"""

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ray_ps_plugin._codec import Codec
from ray_ps_plugin._errors import PSError, PSTimeoutError, WaitTimeout, failed_indices
from ray_ps_plugin._layout import Piece, StreamLayout
from ray_ps_plugin._metrics import WorkerMetrics
from ray_ps_plugin._nonfinite import NonFiniteGuard, all_finite
from ray_ps_plugin import _shm as shm
from ray_ps_plugin._shm import Segment, SegmentHandle
from ray_ps_plugin._stale import RayStaleTransport, StaleClient, open_stale_lanes, split_bounds
from ray_ps_plugin._stats import PSStats

if TYPE_CHECKING:
    from ray_ps_plugin.config import PSConfig

__all__ = [
    "PSContext",
    "PSDistributedDataParallel",
    "PSError",
    "PSStats",
    "PSTimeoutError",
    "RunInfo",
    "get_ps_context",
]


@dataclass(frozen=True)
class RunInfo:
    """What the backend hands every worker: the servers of this run and the config.

    Attributes:
        servers: Actor handles of the shards, in shard order.
        server_node_ids: Node id of each shard.
        mode: Consistency mode ("sync", "async" or "ssp").
        chunk_bytes: Largest chunk per message.
        timeout_s: Bound on every wait for a shard.
        staleness: The ssp bound; ``None`` in the other modes.
        nan_policy: What a step with NaN/Inf gradients does.
        compression: Wire format: ``None`` (fp32), ``"bf16"`` or ``"fp16"``.
        shared_memory: Whether workers reach the shards of their node through
            shared memory instead of the object store.
    """

    servers: Sequence[Any]
    server_node_ids: Sequence[str]
    mode: str
    chunk_bytes: int
    timeout_s: float
    staleness: int | None = None
    nan_policy: str = "raise"
    compression: str | None = None
    shared_memory: bool = True


@dataclass(frozen=True)
class PSContext:
    """What ``get_ps_context()`` returns inside a PS training function.

    Attributes:
        mode: "sync", "async" or "ssp".
        num_servers: Number of server shards.
        server_node_ids: The node id of each shard, in shard order.
        world_rank: This worker's rank.
        world_size: Number of workers.
        shared_memory_shards: The shards this worker reaches through shared memory
            (those on its node, unless ``shared_memory=False`` or the host cannot);
            the others are reached through Ray's object store. Empty before
            ``prepare_model``.
    """

    mode: str
    num_servers: int
    server_node_ids: tuple[str, ...]
    world_rank: int
    world_size: int
    shared_memory_shards: tuple[int, ...] = ()
    _client: "PSClient | StaleClient | None" = dataclasses.field(
        default=None, repr=False, compare=False
    )

    @property
    def stats(self) -> PSStats:
        """A snapshot of this worker's counters (zero before ``prepare_model``)."""
        if self._client is None:
            return PSStats(bytes_pushed_per_shard=[0] * self.num_servers)
        return self._client.snapshot()

    def flush(self) -> None:
        """Waits until this worker's updates are applied on every shard (async/ssp).

        In sync mode every step is already complete when ``backward()`` returns, so
        this returns at once. For a final checkpoint holding every worker's last
        update, call ``flush()`` on all workers, then ``ray.train.collective.barrier()``,
        then save ``model.module.state_dict()`` on rank 0.

        Raises:
            PSTimeoutError: If a shard does not confirm within ``ps_timeout_s``.
        """
        if isinstance(self._client, StaleClient):
            self._client.flush()


class Transport(Protocol):
    """How chunks reach the shards; the real one is Ray, tests may fake it."""

    def submit(self, shard: int, step: int, key: int, rank: int, chunk: np.ndarray) -> Any:
        """Starts a push of ``chunk`` and returns a handle to its result."""
        ...

    def submit_local(
        self, shard: int, step: int, key: int, rank: int, dtype: str, numel: int
    ) -> Any:
        """Starts a push of a chunk already written to shared memory."""
        ...

    def attach(
        self, shard: int, rank: int, inputs: SegmentHandle, lo: int, nbytes: int
    ) -> tuple[SegmentHandle, ...]:
        """Connects through shared memory (blocking); returns the output segments."""
        ...

    def wait(self, handles: list[Any], timeout_s: float) -> list[np.ndarray]:
        """Waits for all results; raises ``WaitTimeout`` after ``timeout_s``."""
        ...


class RayTransport:
    """Pushes chunks to shard actors through Ray's object store."""

    def __init__(self, servers: Sequence[Any], timeout_s: float) -> None:
        self._servers = list(servers)
        self._timeout_s = timeout_s

    def attach(
        self, shard: int, rank: int, inputs: SegmentHandle, lo: int, nbytes: int
    ) -> tuple[SegmentHandle, ...]:
        import ray

        call = self._servers[shard].attach.remote(rank, inputs, lo, nbytes)
        return ray.get(call, timeout=self._timeout_s)

    def submit(self, shard: int, step: int, key: int, rank: int, chunk: np.ndarray) -> Any:
        return self._servers[shard].push_pull.remote(step, key, rank, chunk)

    def submit_local(
        self, shard: int, step: int, key: int, rank: int, dtype: str, numel: int
    ) -> Any:
        return self._servers[shard].push_local.remote(step, key, rank, dtype, numel)

    def wait(self, handles: list[Any], timeout_s: float) -> list[np.ndarray]:
        import ray

        try:
            return ray.get(handles, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise WaitTimeout(str(e)) from e


def _np_dtype(t: torch.Tensor) -> str:
    """The NumPy name of a bucket's dtype (buckets are float16/32/64)."""
    return str(t.dtype).removeprefix("torch.")


@dataclass
class Lane:
    """Shared memory between this worker and one shard of its node (sync mode).

    Attributes:
        lo: Stream byte at which the segments start (the shard's first byte).
        inputs: This worker's chunks for the shard, at byte ``key - lo``.
        outputs: The shard's sums, by step parity, at byte ``key - lo``.
    """

    lo: int
    inputs: Segment
    outputs: tuple[Segment, ...]

    def close(self) -> None:
        for seg in (self.inputs, *self.outputs):
            seg.close()


def open_lanes(
    transport: "Transport", shards: Sequence[int], layout: StreamLayout, rank: int
) -> dict[int, Lane]:
    """Attaches this worker to ``shards`` (all on its node) through shared memory
    (see :func:`~ray_ps_plugin._shm.attach_each` for what happens where it cannot)."""

    def attach(s: int, created: list[Segment]) -> Lane:
        # The segment covers the shard's byte range plus slack: a chunk's last
        # element may end a few bytes past the range when the range is not aligned.
        lo, nbytes = layout.bounds[s], layout.bounds[s + 1] - layout.bounds[s] + 16
        created.append(Segment.create(nbytes))
        handles = transport.attach(s, rank, created[0].handle, lo, nbytes)
        created.extend(Segment.open(h) for h in handles)
        return Lane(lo, created[0], tuple(created[1:]))

    return shm.attach_each(shards, rank, attach)


@dataclass
class _Pending:
    step: int
    bucket: torch.Tensor
    pieces: tuple[Piece, ...]
    handles: list[Any]
    future: torch.futures.Future
    started: float


class PSClient:
    """Routes DDP's gradient buckets through the server shards.

    Args:
        transport: How chunks reach the shards.
        layout: Where each chunk goes (and so how many shards there are).
        world_rank: This worker's rank.
        world_size: Number of workers.
        timeout_s: Bound on every wait for a shard.
        guard: Applies ``nan_policy``; the comm thread flags non-finite sums to it.
        remote_shards: Shards on other nodes, whose traffic is counted as crossing.
        codec: Wire format of gradient chunks and sums (default fp32).
        metrics: Exports the counters through ``ray.util.metrics`` (optional).
        lanes: Shards of this node reached through shared memory, by shard index
            (see :func:`open_lanes`); the others are reached through the object store.
    """

    def __init__(
        self,
        transport: Transport,
        layout: StreamLayout,
        world_rank: int,
        world_size: int,
        timeout_s: float,
        guard: "NonFiniteGuard | None" = None,
        remote_shards: frozenset[int] = frozenset(),
        codec: Codec | None = None,
        metrics: "WorkerMetrics | None" = None,
        lanes: dict[int, Lane] | None = None,
    ) -> None:
        self.guard = guard
        self._lanes = dict(lanes or {})
        self._metrics = metrics
        self._codec = codec or Codec(None)
        self._remote = remote_shards
        self._transport = transport
        self._layout = layout
        self._rank = world_rank
        self._world_size = world_size
        self._timeout_s = timeout_s
        self._stream_offset = 0
        self._lock = threading.Lock()
        self._stats = PSStats(bytes_pushed_per_shard=[0] * layout.num_shards)
        self._queue: "queue.Queue[_Pending | None]" = queue.Queue()
        self._thread = threading.Thread(
            target=self._complete_loop, name=f"ps-comm-rank{world_rank}", daemon=True
        )
        self._thread.start()

    # No ``from __future__ import annotations`` in this module: DDP checks these
    # annotations at register time and rejects string annotations.
    def hook(
        self, state: object, bucket: torch.distributed.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        """DDP communication hook: push this bucket's chunks, return the sum's future."""
        buf = bucket.buffer()
        if bucket.index() == 0:
            # Buckets come in index order; index 0 opens a new synchronisation round.
            self._stream_offset = 0
            with self._lock:
                self._stats.steps += 1
        step = self._stats.steps
        pieces = self._layout.cut(self._stream_offset, buf.numel(), buf.element_size())
        self._stream_offset += buf.numel() * buf.element_size()
        remote = [p for p in pieces if p.shard not in self._lanes]
        # Workers divide by the world size before pushing, as DDP's all-reduce hook
        # does. A CPU chunk bound for shared memory is divided straight into it (one
        # pass instead of two); a GPU bucket is divided on the device and staged.
        staged = None
        if buf.is_cuda:
            buf.div_(self._world_size)
            staged = buf.cpu() if len(remote) < len(pieces) else None
        else:
            for p in remote:
                buf[p.start : p.stop].div_(self._world_size)
        # Compression encodes a 16-bit host copy for the object store only: shared
        # memory carries full precision, since no network is involved.
        host = self._codec.encode(buf) if remote else None
        handles = []
        for p in pieces:
            lane = self._lanes.get(p.shard)
            if lane is None:
                assert host is not None
                # Ray serialises each argument inside .remote(), so the bucket may be
                # reused as soon as this returns; the push goes on in the background.
                handles.append(
                    self._transport.submit(p.shard, step, p.key, self._rank, host[p.start : p.stop])
                )
                continue
            dtype = _np_dtype(buf)
            dst = torch.from_numpy(lane.inputs.view(p.key - lane.lo, dtype, p.numel))
            if staged is None:
                torch.div(buf[p.start : p.stop], self._world_size, out=dst)
            else:
                dst.copy_(staged[p.start : p.stop])
            handles.append(
                self._transport.submit_local(p.shard, step, p.key, self._rank, dtype, p.numel)
            )
        with self._lock:
            for p in pieces:
                itemsize = host.itemsize if p.shard not in self._lanes else buf.element_size()
                nbytes = p.numel * itemsize
                self._stats.bytes_pushed += nbytes
                self._stats.bytes_pushed_per_shard[p.shard] += nbytes
                if p.shard in self._remote:
                    self._stats.bytes_cross_node += nbytes
            self._stats.pushes += len(pieces)
        fut: torch.futures.Future = torch.futures.Future()
        self._queue.put(_Pending(step, buf, pieces, handles, fut, time.perf_counter()))
        return fut

    def _complete_loop(self) -> None:
        """Completes bucket futures in submission order (the order DDP waits in).

        Every failure lands on the bucket's future, never kills this thread: DDP
        waits on the future at the end of backward and would otherwise hang.
        """
        while (item := self._queue.get()) is not None:
            try:
                self._complete(item)
            except WaitTimeout:
                item.future.set_exception(
                    PSTimeoutError(
                        f"{self._where(item)} did not answer within ps_timeout_s="
                        f"{self._timeout_s:g}s. A worker or shard is stuck or dead; raise "
                        "PSConfig.ps_timeout_s if steps are legitimately slower."
                    )
                )
            except Exception as e:  # noqa: BLE001 - any failure must reach backward()
                # A shard's own timeout names the workers it waited for; keep it one.
                error = PSTimeoutError if isinstance(e, TimeoutError) else PSError
                item.future.set_exception(
                    error(f"{self._where(item, failed_only=True)} failed: {e}")
                )

    def _where(self, item: _Pending, failed_only: bool = False) -> str:
        shards = sorted({p.shard for p in item.pieces})
        if failed_only:
            # Name the shard(s) whose call failed (e.g. a dead actor), not every
            # shard of the bucket: that is where to look.
            failed = sorted(
                {item.pieces[i].shard for i in failed_indices(self._transport.wait, item.handles)}
            )
            shards = failed or shards
        return f"rank {self._rank}: step {item.step}: server shard(s) {shards}"

    def _complete(self, item: _Pending) -> None:
        results = self._transport.wait(item.handles, self._timeout_s)
        nbytes = cross = 0
        bucket = item.bucket
        for p, r in zip(item.pieces, results):
            lane = self._lanes.get(p.shard)
            if lane is not None:
                r = lane.outputs[item.step % 2].view(p.key - lane.lo, _np_dtype(bucket), p.numel)
                bucket[p.start : p.stop].copy_(torch.from_numpy(r))
            else:
                bucket[p.start : p.stop].copy_(self._codec.decode(r))
            nbytes += r.nbytes
            if p.shard in self._remote:
                cross += r.nbytes
        if (
            self.guard is not None
            and self.guard.policy != "ignore"
            and not all_finite(item.bucket)
        ):
            # Every worker holds the same sum, so every worker flags the same step.
            self.guard.flag(item.step)
        with self._lock:
            self._stats.bytes_pulled += nbytes
            self._stats.bytes_cross_node += cross
            self._stats.last_sync_s = time.perf_counter() - item.started
        item.future.set_result(item.bucket)
        if self._metrics is not None and self._metrics.due():
            self._metrics.export(self.snapshot())

    def snapshot(self) -> PSStats:
        """A copy of the counters, safe to read from the training thread."""
        with self._lock:
            return dataclasses.replace(
                self._stats,
                bytes_pushed_per_shard=list(self._stats.bytes_pushed_per_shard),
                clock=self._stats.steps,
                skipped_steps=self.guard.skipped if self.guard else 0,
            )

    @property
    def shared_memory_shards(self) -> tuple[int, ...]:
        """Shards reached through shared memory, in index order."""
        return tuple(sorted(self._lanes))

    @property
    def next_step(self) -> int:
        """The synchronisation round the optimizer is about to apply."""
        return self._stats.steps

    def close(self) -> None:
        """Stops the communication thread (waits at most ``timeout_s``)."""
        self._queue.put(None)
        self._thread.join(self._timeout_s)
        lanes, self._lanes = self._lanes, {}
        for lane in lanes.values():
            lane.close()


# Each push occupies one of the shard actor's concurrent calls until every worker has
# pushed that chunk, so a shard must admit all chunks of two steps from all workers.
SHARD_MAX_CONCURRENCY = 4096


def check_concurrency(layout: StreamLayout, world_size: int) -> None:
    """Raises if a step has more in-flight pushes per shard than a shard admits."""
    largest_share = max(b - a for a, b in zip(layout.bounds, layout.bounds[1:]))
    # Bucket boundaries add one extra cut each; +8 allows for a handful of buckets
    # falling inside one shard's range.
    chunks = -(-largest_share // layout.chunk_bytes) + 8
    if 2 * world_size * chunks > SHARD_MAX_CONCURRENCY:
        raise ValueError(
            f"PSConfig.chunk_bytes={layout.chunk_bytes} cuts each shard's "
            f"{largest_share} bytes into ~{chunks} chunks; with {world_size} workers "
            f"that exceeds the {SHARD_MAX_CONCURRENCY} pushes a shard holds at once. "
            "Raise chunk_bytes or num_servers."
        )


# --- per-process registry -----------------------------------------------------------
# Set by the backend through worker_group.execute() on the actor's main thread and
# read by the training thread of the same process.
_RUN: RunInfo | None = None
_CLIENTS: "list[PSClient | StaleClient]" = []


def install_run(info: RunInfo) -> None:
    """Called by the backend on every worker before training starts."""
    global _RUN
    _RUN = info


def uninstall_run() -> None:
    """Called by the backend on shutdown: stops communication threads."""
    global _RUN
    _RUN = None
    _close_clients()


def _close_clients() -> None:
    while _CLIENTS:
        _CLIENTS.pop().close()


def _finish_clients(raising: bool) -> None:
    """Confirms every async/ssp worker's last update before the loop's end counts.

    Without this a worker could return while its final push is still in flight,
    and the update would be lost silently. After a failure in the user's code the
    original error matters more, so a second one is only logged.
    """
    for client in _CLIENTS:
        if isinstance(client, StaleClient):
            try:
                client.finish()
            except Exception:
                if raising:
                    raise
                logging.getLogger(__name__).warning(
                    "Could not confirm the last update after a failure.", exc_info=True
                )


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
        mode=_RUN.mode,
        num_servers=len(_RUN.servers),
        server_node_ids=tuple(_RUN.server_node_ids),
        world_rank=ctx.get_world_rank(),
        world_size=ctx.get_world_size(),
        shared_memory_shards=_CLIENTS[-1].shared_memory_shards if _CLIENTS else (),
        _client=_CLIENTS[-1] if _CLIENTS else None,
    )


def _worker_metrics(mode: str, rank: int) -> "WorkerMetrics | None":
    try:
        return WorkerMetrics({"mode": mode, "rank": str(rank)})
    except Exception:  # noqa: BLE001 - metrics are optional, training is not
        logging.getLogger(__name__).debug("no metrics export", exc_info=True)
        return None


def check_supported(module: torch.nn.Module) -> None:
    """Raises early for models the parameter servers cannot synchronise.

    Raises:
        ValueError: If a layer produces sparse gradients.
        TypeError: If a trainable parameter is bfloat16 (NumPy, which carries the
            data between workers and shards, has no such dtype).
    """
    bf16 = [n for n, p in module.named_parameters() if p.requires_grad and p.dtype == torch.bfloat16]
    if bf16:
        raise TypeError(
            f"Parameter(s) {bf16[:3]}{'...' if len(bf16) > 3 else ''} are bfloat16, which "
            "the parameter-server strategy cannot carry. Keep the model in float32 (and "
            "use torch.autocast for bf16 compute, PSConfig(compression='bf16') for 16-bit "
            "traffic), or use PSConfig(strategy='ddp')."
        )
    sparse = [
        name
        for name, m in module.named_modules()
        if getattr(m, "sparse", False) is True and any(p.requires_grad for p in m.parameters())
    ]
    if sparse:
        raise ValueError(
            f"Layer(s) {sparse} produce sparse gradients, which the parameter-server "
            "strategy does not support. Build them with sparse=False, or use "
            "PSConfig(strategy='ddp')."
        )


def trainable_bytes(module: torch.nn.Module) -> int:
    """Bytes of one gradient of every parameter DDP synchronises."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


class PSDistributedDataParallel(DistributedDataParallel):
    """``DistributedDataParallel`` whose synchronisation goes through the servers.

    It *is* a ``DistributedDataParallel`` (``isinstance`` checks, ``.module``,
    ``no_sync()``); DDP's constructor still broadcasts rank 0's parameters and
    buffers, so every worker starts from identical state. Then, by mode:

    - ``"sync"``: DDP's bucketing and its overlap with backward stay; only the
      per-bucket all-reduce is replaced by a communication hook that pushes chunks
      to the shards and pulls their sum.
    - ``"async"``/``"ssp"``: DDP's gradient reduction is bypassed (forward calls
      the module directly, so DDP's reducer never arms and no collective runs); a
      :class:`~ray_ps_plugin._stale.StaleClient` installs server parameters before
      forward and pushes each optimizer step's delta. ``state_dict()`` of the
      wrapped module first pulls the shards' current parameters.
    """

    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        info = _RUN
        if info is None:
            raise RuntimeError(
                "PSDistributedDataParallel needs a running PS backend; use it through "
                "PSTrainer or TorchTrainer(torch_config=PSConfig(strategy='ps'))."
            )
        check_supported(module)
        super().__init__(module, *args, **kwargs)
        import ray
        import ray.train

        ctx = ray.train.get_context()
        rank, world = ctx.get_world_rank(), ctx.get_world_size()
        node = ray.get_runtime_context().get_node_id()
        remote = frozenset(i for i, n in enumerate(info.server_node_ids) if n != node)
        self._ps_stale: StaleClient | None = None
        params = [p for p in module.parameters() if p.requires_grad]
        # Shards of this node are reached through shared memory unless turned off.
        local = [i for i, n in enumerate(info.server_node_ids) if n == node]
        local = local if info.shared_memory else []
        _ensure_optimizer_hooks()
        if info.mode == "sync":
            layout = StreamLayout(trainable_bytes(module), len(info.servers), info.chunk_bytes)
            check_concurrency(layout, world)
            transport = RayTransport(info.servers, info.timeout_s)
            client = PSClient(
                transport=transport,
                layout=layout,
                world_rank=rank,
                world_size=world,
                timeout_s=info.timeout_s,
                guard=NonFiniteGuard(info.nan_policy, rank, params, check_local=False),
                remote_shards=remote,
                codec=Codec(info.compression),
                metrics=_worker_metrics(info.mode, rank),
                lanes=open_lanes(transport, local, layout, rank),
            )
            _CLIENTS.append(client)
            self.register_comm_hook(None, client.hook)
            return
        numel = sum(p.numel() for p in params)
        itemsize = params[0].element_size() if params else 4
        bounds = split_bounds(numel, len(info.servers))
        slice_bytes = [(b - a) * itemsize for a, b in zip(bounds, bounds[1:])]
        stale_transport = RayStaleTransport(info.servers, info.timeout_s)
        stale = StaleClient(
            transport=stale_transport,
            params=params,
            num_shards=len(info.servers),
            world_rank=rank,
            world_size=world,
            staleness=info.staleness,
            timeout_s=info.timeout_s,
            nan_policy=info.nan_policy,
            remote_shards=remote,
            codec=Codec(info.compression),
            metrics=_worker_metrics(info.mode, rank),
            lanes=open_stale_lanes(stale_transport, local, slice_bytes, rank),
        )
        _CLIENTS.append(stale)
        stale.start()
        self._ps_stale = stale
        # Checkpoints written the usual way hold the servers' parameters.
        module.register_state_dict_pre_hook(lambda *_: stale.sync())

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._ps_stale is None:
            return super().forward(*inputs, **kwargs)
        self._ps_stale.before_forward()
        return self.module(*inputs, **kwargs)


# Process-wide optimizer hooks serve every prepared model of the worker: the user's
# optimizer is created after prepare_model and never passes through us.
_OPTIMIZER_HOOKS: list[Any] = []


def _ensure_optimizer_hooks() -> None:
    if not _OPTIMIZER_HOOKS:
        _OPTIMIZER_HOOKS.append(register_optimizer_step_pre_hook(_before_optimizer_step))
        _OPTIMIZER_HOOKS.append(register_optimizer_step_post_hook(_after_optimizer_step))


def _remove_optimizer_hooks() -> None:
    while _OPTIMIZER_HOOKS:
        _OPTIMIZER_HOOKS.pop().remove()


def _before_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for client in _CLIENTS:
        if client.guard is not None and client.guard.owns(optimizer):
            client.guard.before_step(client.next_step)
            if isinstance(client, StaleClient):
                client.before_step()


def _after_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for client in _CLIENTS:
        if isinstance(client, StaleClient) and client.owns(optimizer):
            client.after_step()


def _prepare_model_modules() -> list[Any]:
    """The modules whose ``DistributedDataParallel`` global prepare_model reads."""
    import importlib

    mods = []
    for name in ("ray.train.v2.torch.train_loop_utils", "ray.train.torch.train_loop_utils"):
        try:
            mod = importlib.import_module(name)
        except ImportError:  # pragma: no cover - depends on the Ray version
            continue
        if hasattr(mod, "DistributedDataParallel"):
            mods.append(mod)
    return mods


class PSTrainFuncContext:
    """Wraps the user's training function on each worker (``train_func_context``).

    On entry it makes ``ray.train.torch.prepare_model`` wrap models in
    :class:`PSDistributedDataParallel` (prepare_model looks up
    ``DistributedDataParallel`` as a module global at call time); on exit it restores
    the original and stops the communication threads.

    Args:
        config: The run's PSConfig.
        base: The context manager TorchConfig would use (CUDA device selection).
    """

    def __init__(self, config: "PSConfig", base: Callable[[], Any]) -> None:
        self._config = config
        self._base = base()
        self._saved: list[tuple[Any, Any]] = []

    def __enter__(self) -> "PSTrainFuncContext":
        self._base.__enter__()
        for mod in _prepare_model_modules():
            self._saved.append((mod, mod.DistributedDataParallel))
            mod.DistributedDataParallel = PSDistributedDataParallel
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        for mod, original in self._saved:
            mod.DistributedDataParallel = original
        self._saved.clear()
        try:
            _finish_clients(raising=exc_type is None)
        finally:
            _remove_optimizer_hooks()
            _close_clients()
            self._base.__exit__(exc_type, exc, tb)
        return False
