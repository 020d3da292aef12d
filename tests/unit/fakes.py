"""A fake transport: real ShardServer objects on an in-process event loop, no Ray."""

import asyncio
import threading
from concurrent.futures import Future, TimeoutError as FutureTimeout

import numpy as np
import torch

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

    def wait(self, handles, timeout_s):
        try:
            # Copy the replies: a real Ray reply is a fresh object-store value.
            return [np.array(h.result(timeout=timeout_s)) for h in handles]
        except FutureTimeout as e:
            raise TimeoutError("fake wait timed out") from e


class FakeBucket:
    """The slice of ``torch.distributed.GradBucket`` the hook uses."""

    def __init__(self, index: int, tensor: torch.Tensor) -> None:
        self._index, self._tensor = index, tensor

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._tensor
