"""A fake transport: real ShardServer objects on an in-process event loop, no Ray."""

import asyncio
import threading
from concurrent.futures import Future, TimeoutError as FutureTimeout

import numpy as np
import torch

from ray_ps_plugin._errors import WaitTimeout
from ray_ps_plugin._server import ShardServer


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


class FakeTransport:
    """Drives ShardServer coroutines directly; copies chunks as Ray's put would."""

    def __init__(self, loop: LoopThread, servers: list[ShardServer]) -> None:
        self.loop = loop
        self.servers = servers
        self.submitted: list[tuple[int, int, int, int, int]] = []

    def submit(self, shard, step, key, rank, chunk):
        self.submitted.append((shard, step, key, rank, chunk.size))
        return self.loop.run(self.servers[shard].push_pull(step, key, rank, chunk.copy()))

    def submit_local(self, shard, step, key, rank, dtype, numel):
        self.submitted.append((shard, step, key, rank, numel))
        return self.loop.run(self.servers[shard].push_local(step, key, rank, dtype, numel))

    def attach(self, shard, rank, inputs, lo, nbytes):
        return self.servers[shard].attach(rank, inputs, lo, nbytes)

    def wait(self, handles, timeout_s):
        try:
            # Copy the replies: a real Ray reply is a fresh object-store value.
            replies = [h.result(timeout=timeout_s) for h in handles]
            return [None if r is None else np.array(r) for r in replies]
        except FutureTimeout as e:
            raise WaitTimeout("fake wait timed out") from e


class FakeBucket:
    """The slice of ``torch.distributed.GradBucket`` the hook uses."""

    def __init__(self, index: int, tensor: torch.Tensor) -> None:
        self._index, self._tensor = index, tensor

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._tensor


class FakeStaleTransport:
    """Drives ParamShardServer coroutines directly, with a gate to delay replies.

    While ``hold()`` is in force, push_pull replies wait on the loop, which lets a
    test see a worker run ahead of its replies.
    """

    def __init__(self, loop: LoopThread, servers) -> None:
        self.loop = loop
        self.servers = servers
        self.calls: list[tuple] = []
        self._gate = asyncio.Event()
        self.loop.loop.call_soon_threadsafe(self._gate.set)

    def hold(self) -> None:
        self.loop.run(self._clear()).result(5)

    def release(self) -> None:
        self.loop.loop.call_soon_threadsafe(self._gate.set)

    async def _clear(self) -> None:
        self._gate.clear()

    async def _gated(self, coro):
        await self._gate.wait()
        arr, clocks, slowest = await coro
        return (None if arr is None else arr.copy()), clocks, slowest

    def init(self, shard, params):
        self.calls.append(("init", shard, params.size))
        return self.loop.run(self.servers[shard].init(params.copy()))

    def push_pull(self, shard, rank, clock, delta):
        self.calls.append(("push_pull", shard, rank, clock, delta.size))
        return self.loop.run(self._gated(self.servers[shard].push_pull(rank, clock, delta.copy())))

    def pull(self, shard, rank, clock):
        self.calls.append(("pull", shard, rank, clock))
        return self.loop.run(self._gated(self.servers[shard].pull(rank, clock)))

    def finish(self, shard, rank):
        self.calls.append(("finish", shard, rank))
        return self.loop.run(self.servers[shard].finish(rank))

    def attach(self, shard, rank, inputs, outputs):
        self.servers[shard].attach(rank, inputs, outputs)

    def push_local(self, shard, rank, clock, slot):
        self.calls.append(("push_local", shard, rank, clock, slot))
        return self.loop.run(self._gated(self.servers[shard].push_local(rank, clock, slot)))

    def pull_local(self, shard, rank, clock, slot):
        self.calls.append(("pull_local", shard, rank, clock, slot))
        return self.loop.run(self._gated(self.servers[shard].pull_local(rank, clock, slot)))

    def done(self, handles) -> bool:
        return all(h.done() for h in handles)

    def wait(self, handles, timeout_s):
        try:
            return [h.result(timeout=timeout_s) for h in handles]
        except FutureTimeout as e:
            raise WaitTimeout("fake wait timed out") from e
