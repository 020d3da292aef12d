"""A fake transport: real shard objects on an in-process event loop, no Ray."""

import asyncio
import inspect
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import torch

from ray_ps_plugin._client import ClientSetup
from ray_ps_plugin._modes import staleness_bound
from ray_ps_plugin._param.reply import Reply
from ray_ps_plugin._param.shard import ParamShard
from ray_ps_plugin._transport import wait_handles
from ray_ps_plugin._wire.frames import (
    LOCAL,
    PARAM_KEY,
    PARAM_LOCAL,
    PUSH,
    ROWS,
    ROWS_KEY,
    TABLE_KEY,
    TABLE_PULL,
    TABLE_PUSH,
    TABLE_WAIT,
    Frame,
    pack_local,
    relayed_rows_key,
)
from ray_ps_plugin._wire.streams import RemoteError


class LoopThread:
    """An asyncio loop on a daemon thread, standing in for the actor's event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        async def cancel_pending() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(cancel_pending()).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


def _copy(value):
    """What Ray's serialisation does to an argument or a reply: a fresh copy."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, Reply):
        return Reply(_copy(value.params) if value.params is not None else None, *value[1:])
    if isinstance(value, (list, tuple)):  # e.g. the sparse rows of several tables
        return type(value)(_copy(v) for v in value)
    return value


class FakeDirect:
    """The direct TCP path without sockets: each frame goes to the real shard's
    frame handler on the fake loop, and the answer comes back as the bytes a socket
    would carry (``uint8``, received into ``into`` when it fits), or as
    ``RemoteError`` when the shard refuses the frame, as ``WireStreams`` does."""

    def __init__(self, loop: LoopThread, servers) -> None:
        self.loop = loop
        self.servers = servers
        self.frames: list[tuple[int, int, int]] = []  # (shard, kind, source)
        self._table_frames = itertools.count()

    def reaches(self, shard: int) -> bool:
        return True

    def push(self, shard, model, step, key, source, dtype, payload, into=None) -> Future:
        frame = Frame(PUSH, dtype, model, step, key, source, payload.nbytes)
        return self._send(shard, frame, payload.reshape(-1).view(np.uint8).copy(), into)

    def push_local(self, shard, model, step, source, dtype, chunks) -> Future:
        payload = pack_local(chunks)
        frame = Frame(LOCAL, dtype, model, step, chunks[0][0], source, payload.nbytes)
        return self._send(shard, frame, payload, None)

    def push_rows(self, shard, model, step, source, payload, owner=None) -> Future:
        key = ROWS_KEY if owner is None else relayed_rows_key(owner)
        frame = Frame(ROWS, "float32", model, step, key, source, payload.nbytes)
        return self._send(shard, frame, payload.copy(), None)

    def table_pull(self, shard, model, source, payload) -> Future:
        return self._table(shard, TABLE_PULL, model, source, payload)

    def table_wait(self, shard, model, source, clocks) -> Future:
        payload = np.array(sorted(clocks.items()), "<i8").reshape(-1).view(np.uint8)
        return self._table(shard, TABLE_WAIT, model, source, payload)

    def param_local(self, shard, model, source, clock, slot) -> Future:
        payload = np.array([slot], "<i8").view(np.uint8)
        frame = Frame(PARAM_LOCAL, "float32", model, clock, PARAM_KEY, source, payload.nbytes)
        return self._send(shard, frame, payload, None)

    def table_push(self, shard, model, source, payload) -> Future:
        return self._table(shard, TABLE_PUSH, model, source, payload)

    def _table(self, shard, kind, model, source, payload) -> Future:
        step = next(self._table_frames)
        frame = Frame(kind, "float32", model, step, TABLE_KEY, source, payload.nbytes)
        return self._send(shard, frame, payload.copy(), None)

    def _send(self, shard, frame, payload, into) -> Future:
        self.frames.append((shard, frame.kind, frame.source))

        async def deliver():
            try:
                out = await self.servers[shard]._on_frame(frame, payload)
            except Exception as e:  # the shard's ERROR frame
                raise RemoteError(str(e)) from None
            data = np.frombuffer(out.tobytes(), np.uint8)
            if into is not None and into.nbytes == data.nbytes:
                landed = into.reshape(-1).view(np.uint8)
                landed[:] = data
                return landed
            return data.copy()

        return self.loop.run(deliver())

    def close(self, timeout_s: float = 5.0) -> None:
        pass


class FakeTransport:
    """Drives shard coroutines directly, copying data as Ray would.

    ``hold()`` delays every reply until ``release()``, so a test can see a worker run
    ahead of its replies. ``silent_shards`` are reported as not answering pings.
    """

    def __init__(self, loop: LoopThread, servers) -> None:
        self.loop = loop
        self.servers = servers
        self.direct: FakeDirect | None = None  # set for a run with the direct path
        self.calls: list[tuple] = []
        self.silent_shards: set[int] = set()
        self.held: dict = {}
        self._gate = asyncio.Event()
        self.loop.loop.call_soon_threadsafe(self._gate.set)

    def hold_replies(self) -> None:
        self.loop.run(self._clear()).result(5)

    def release_replies(self) -> None:
        self.loop.loop.call_soon_threadsafe(self._gate.set)

    async def _clear(self) -> None:
        self._gate.clear()

    async def _gated(self, coro):
        result = await coro
        await self._gate.wait()
        return _copy(result)

    def call(self, shard, method, *args):
        self.calls.append(
            (method, shard, *[a.size if isinstance(a, np.ndarray) else a for a in args])
        )
        fn = getattr(self.servers[shard], method)
        args = [_copy(a) for a in args]
        # A plain method (``stats``) runs on the shard's loop too, as in a Ray actor.
        coro = fn(*args) if inspect.iscoroutinefunction(fn) else _call_on_loop(fn, args)
        return self.loop.run(self._gated(coro))

    def attach(self, shard, model, rank, inputs, lo, nbytes):
        return self.servers[shard].attach(model, rank, inputs, lo, nbytes)

    def wait(self, handles, timeout_s):
        return wait_handles(handles, timeout_s)

    def silent(self, shards, timeout_s):
        return [s for s in shards if s in self.silent_shards]

    def guard(self, shard, handle, resend):
        return handle

    def moved(self, shard):
        return False

    def set_shard(self, shard, primary, replica):
        self.servers[shard] = primary

    def replica(self, shard):
        return None

    def hold(self, shard, key, call):
        self.held[(shard, key)] = call

    def close(self) -> None:
        pass

    def pushes(self):
        return [c for c in self.calls if c[0] in ("push_pull", "push_local")]


async def _call_on_loop(fn, args):
    return fn(*args)


class FakeBucket:
    """The slice of ``torch.distributed.GradBucket`` the hook uses."""

    def __init__(self, index: int, tensor: torch.Tensor, params=(), last=False) -> None:
        self._index, self._tensor, self._params, self._last = index, tensor, list(params), last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._tensor

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def is_last(self) -> bool:
        return self._last


class Settings:
    """A stand-in for PSConfig (the RunSettings protocol)."""

    def __init__(
        self,
        mode="sync",
        staleness=0,
        chunk_bytes=1 << 24,
        ps_timeout_s=5.0,
        nan_policy="raise",
        compression=None,
        topk_ratio=0.01,
        lowrank_rank=4,
        shared_memory=True,
        local_steps=32,
        outer_optimizer="nesterov",
        outer_lr=None,
        outer_momentum=0.9,
        diloco_rounds="sync",
        diloco_overlap=False,
        sparse_optimizer=None,
        replace_lost_workers=False,
        shard_replicas=0,
    ):
        self.mode, self.staleness, self.chunk_bytes = mode, staleness, chunk_bytes
        self.ps_timeout_s, self.nan_policy = ps_timeout_s, nan_policy
        self.compression, self.shared_memory = compression, shared_memory
        self.topk_ratio, self.lowrank_rank = topk_ratio, lowrank_rank
        self.local_steps, self.outer_optimizer = local_steps, outer_optimizer
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.diloco_rounds, self.diloco_overlap = diloco_rounds, diloco_overlap
        self.sparse_optimizer = sparse_optimizer
        self.replace_lost_workers = replace_lost_workers
        self.shard_replicas = shard_replicas


def setup_for(
    module,
    rank,
    world,
    num_shards,
    settings,
    local=(),
    remote=frozenset(),
    model_id=0,
    topology=None,
):
    """A ClientSetup for ``module`` as the runtime would build it."""
    return ClientSetup(
        model_id=model_id,
        module=module,
        params=tuple(p for p in module.parameters() if p.requires_grad),
        rank=rank,
        world_size=world,
        num_shards=num_shards,
        settings=settings,
        local_shards=tuple(local),
        remote_shards=frozenset(remote),
        topology=topology,
        staleness=staleness_bound(settings),
    )


def started_clients(client_cls, models, num_shards, settings, transport, shared=False) -> list:
    """One started ``client_cls`` a model (rank = its place in ``models``), as each
    worker's runtime builds it; ``shared``: every worker reaches every shard through
    shared memory."""
    world = len(models)
    local = range(num_shards) if shared else ()
    clients = [
        client_cls.build(setup_for(m, r, world, num_shards, settings, local=local), transport)
        for r, m in enumerate(models)
    ]
    for c in clients:
        c._start()
    return clients


def in_threads(target: Callable[[int], object], count: int, timeout_s: float = 30.0) -> None:
    """Calls ``target(i)`` for each ``i`` below ``count``, each in a thread of its own,
    and joins them (each join bounded by ``timeout_s``). All start before any is
    joined: the workers of one step wait on each other's pushes."""
    threads = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)


class LoggedParamShard(ParamShard):
    """A ParamShard that logs every read (rank, reader's clock, slowest clock)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reads: list[tuple[int, int, int]] = []

    def record_read(self, rank: int, clock: int, slowest: int) -> None:
        self.reads.append((rank, clock, slowest))
