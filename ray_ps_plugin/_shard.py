"""What every shard actor has: identity, the workers it serves, checks, counters.

Both shard kinds (sync summation, async/ssp parameters) are asyncio actors: all
their coroutines run on one event-loop thread, so state is updated serially without
locks (Ray's actor-based parameter-server pattern), while thousands of calls may
wait at once without holding a thread each. They are plain classes here, wrapped
with ``ray.remote`` by the backend, so unit tests can drive them on an event loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ray_ps_plugin._dtypes import MODEL_DTYPES
from ray_ps_plugin._errors import ShardProtocolError
from ray_ps_plugin._metrics import ShardMetrics
from ray_ps_plugin._shm import SegmentHandle
from ray_ps_plugin._table_optim import TableOptimizer
from ray_ps_plugin._table_store import PushAnswer, PushEntry, TableSpec, TableStore

__all__ = ["MAX_MODELS", "ShardBase"]

logger = logging.getLogger(__name__)

# Prepared models per worker process that one run may have (each has its own keys,
# clocks and segments on every shard).
MAX_MODELS = 1024


class ShardBase:
    """Identity, argument checks and counters shared by every shard actor.

    Args:
        shard_index: This shard's index, used in error messages.
        num_workers: Number of workers it serves.
        timeout_s: Bound on every wait inside the shard.
    """

    def __init__(self, shard_index: int, num_workers: int, timeout_s: float) -> None:
        self.shard_index = shard_index
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self._bytes_in = 0
        self._bytes_out = 0
        self._pushes = 0
        self._duplicates = 0
        self._started = time.time()
        self._metrics: ShardMetrics | None = None
        self._tables = TableStore(shard_index, num_workers, timeout_s)

    def ready(self) -> dict[str, Any]:
        """Answers once the actor is up; tells where it runs; starts its metrics."""
        import ray

        try:
            self._metrics = ShardMetrics(self.shard_index)
        except Exception:
            logger.debug("shard %d: no metrics", self.shard_index, exc_info=True)
        return {
            "shard": self.shard_index,
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
        }

    def _check(self, model: object, rank: object | None, dtype: object = "float32") -> None:
        """Refuses caller-supplied ids a worker of this run cannot send.

        A negative rank would silently index another worker's clock; an unknown
        dtype would reinterpret shared memory as anything. ``rank=None``: the caller
        checks the sender another way.

        Raises:
            ShardProtocolError: Naming the bad argument.
        """
        checks = [("model", model, MAX_MODELS)]
        if rank is not None:
            checks.append(("rank", rank, self.num_workers))
        for name, value, bound in checks:
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < bound:
                raise ShardProtocolError(
                    f"shard {self.shard_index}: {name} {value!r} is not an int in [0, {bound})."
                )
        if dtype not in MODEL_DTYPES:
            raise ShardProtocolError(
                f"shard {self.shard_index}: dtype {dtype!r} is not one of {list(MODEL_DTYPES)}."
            )

    @contextlib.contextmanager
    def _queued(self) -> Iterator[None]:
        """Counts a call as waiting on this shard for as long as it runs."""
        if self._metrics is not None:
            self._metrics.enter()
        try:
            yield
        finally:
            if self._metrics is not None:
                self._metrics.leave()

    def stats(self) -> dict[str, Any]:
        """Counters since start: bytes in/out, pushes, duplicate pushes ignored, and
        the bytes of sharded tables held."""
        return {
            "shard": self.shard_index,
            "bytes_in": self._bytes_in,
            "bytes_out": self._bytes_out,
            "pushes": self._pushes,
            "duplicates": self._duplicates,
            "uptime_s": time.time() - self._started,
            **self._tables.sizes(),
        }

    # --- sharded tables (every mode but diloco; see _table_store) ---------------------
    def table_create(
        self, model: int, table: int, spec: TableSpec, num_shards: int, shared: bool = False
    ) -> tuple[int, int, SegmentHandle | None]:
        """Materialises this shard's rows of a table; returns their range and, with
        ``shared``, the segment workers of this node read them from."""
        self._check(model, None)
        lo, hi = self._tables.create(model, table, spec, num_shards, shared)
        return lo, hi, self._tables.segment(model, table)

    async def table_pull(
        self, model: int, table: int, rank: int, clock: int, ids: np.ndarray
    ) -> np.ndarray:
        self._check(model, rank)
        with self._queued():
            rows = await self._tables.pull(model, table, rank, clock, ids)
        self._bytes_in += ids.nbytes
        self._bytes_out += rows.nbytes
        return rows

    async def table_push(
        self, model: int, rank: int, entries: Sequence[PushEntry]
    ) -> list[PushAnswer]:
        """One worker's optimizer step on every sharded table of a model it holds
        rows of here (see ``TableStore.push_many``)."""
        self._check(model, rank)
        self._bytes_in += sum(e[2].nbytes + e[3].nbytes for e in entries)
        self._pushes += 1
        with self._queued():
            answers = await self._tables.push_many(model, rank, entries)
        self._bytes_out += sum(ids.nbytes + rows.nbytes for _, ids, rows in answers)
        return answers

    async def table_finish(self, model: int, rank: int) -> None:
        self._check(model, rank)
        await self._tables.finish(model, rank)

    def table_read(self, model: int, table: int, lo: int, hi: int) -> dict[str, Any]:
        self._check(model, None)
        return self._tables.read(model, table, lo, hi)

    def table_write(
        self,
        model: int,
        table: int,
        lo: int,
        weight: np.ndarray,
        state: dict[str, np.ndarray],
        optimizer: TableOptimizer | None,
        steps: int | None,
    ) -> None:
        self._check(model, None)
        self._tables.write(model, table, lo, weight, state, optimizer, steps)

    async def table_loaded(self, model: int, generation: int) -> None:
        self._check(model, None)
        await self._tables.loaded(model, generation)

    async def table_wait_loaded(self, model: int, generation: int) -> None:
        self._check(model, None)
        await self._tables.wait_loaded(model, generation)
