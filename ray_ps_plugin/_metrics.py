"""Export of the plugin's live statistics through ``ray.util.metrics``.

Ray ships these to its metrics agent, so they appear in the Ray dashboard and in
Prometheus next to Ray Train's own metrics (on clusters started with the dashboard /
metrics agent; elsewhere recording is harmless). Workers publish their
:class:`~ray_ps_plugin._stats.PSStats` at most once per ``interval_s``; shards publish
how many calls are waiting on them (their queue depth).

All metric names start with ``ray_ps_``; tags say which run, rank or shard.
"""

import time
from collections.abc import Callable
from typing import Any

from ray_ps_plugin._stats import PSStats

__all__ = ["ShardMetrics", "WorkerMetrics", "gauge_factory"]

GaugeFactory = Callable[[str, str, tuple[str, ...]], Any]

# (metric name, description, how to read it from PSStats)
_WORKER_GAUGES: tuple[tuple[str, str, Callable[[PSStats], float]], ...] = (
    (
        "ray_ps_steps",
        "Synchronisation rounds (sync) or updates pushed (async/ssp).",
        lambda s: s.steps,
    ),
    ("ray_ps_bytes_pushed", "Bytes this worker sent to the shards.", lambda s: s.bytes_pushed),
    (
        "ray_ps_bytes_pulled",
        "Bytes this worker received from the shards.",
        lambda s: s.bytes_pulled,
    ),
    (
        "ray_ps_bytes_cross_node",
        "Bytes exchanged with shards on other nodes.",
        lambda s: s.bytes_cross_node,
    ),
    (
        "ray_ps_push_pull_latency_s",
        "Latest bucket round trip (sync mode).",
        lambda s: s.last_sync_s,
    ),
    ("ray_ps_staleness_max", "Largest clock gap seen (async/ssp).", lambda s: s.staleness_max),
    ("ray_ps_staleness_mean", "Mean clock gap seen (async/ssp).", lambda s: s.staleness_mean),
    ("ray_ps_wait_s", "Seconds blocked waiting for the shards (async/ssp).", lambda s: s.wait_s),
    ("ray_ps_skipped_steps", "Steps dropped for NaN/Inf gradients.", lambda s: s.skipped_steps),
)


def gauge_factory(name: str, description: str, tag_keys: tuple[str, ...]) -> Any:
    """Creates a ``ray.util.metrics.Gauge`` (the real factory)."""
    from ray.util.metrics import Gauge

    return Gauge(name, description=description, tag_keys=tag_keys)


class WorkerMetrics:
    """Publishes one worker's counters, plus bytes per second, at a bounded rate.

    Args:
        tags: Tags of every sample (``mode``, ``rank``).
        interval_s: Least time between two exports; the hot path only compares
            clocks in between.
        factory: Creates a gauge; tests pass a fake.
    """

    def __init__(
        self,
        tags: dict[str, str],
        interval_s: float = 1.0,
        factory: GaugeFactory = gauge_factory,
    ) -> None:
        keys = tuple(tags)
        self._tags = tags
        self._interval_s = interval_s
        self._gauges = [(factory(n, d, keys), read) for n, d, read in _WORKER_GAUGES]
        self._rate = factory(
            "ray_ps_bytes_per_s", "Bytes pushed plus pulled per second, this worker.", keys
        )
        self._last_t = time.monotonic()
        self._last_bytes = 0
        self._next = 0.0

    def due(self) -> bool:
        """Whether an export is due (cheap; call before taking a stats snapshot)."""
        return time.monotonic() >= self._next

    def export(self, stats: PSStats) -> None:
        """Sets every gauge from ``stats`` and the byte rate since the last export."""
        now = time.monotonic()
        for gauge, read in self._gauges:
            gauge.set(float(read(stats)), tags=self._tags)
        moved = stats.bytes_pushed + stats.bytes_pulled
        if now > self._last_t:
            self._rate.set((moved - self._last_bytes) / (now - self._last_t), tags=self._tags)
        self._last_t, self._last_bytes = now, moved
        self._next = now + self._interval_s


class ShardMetrics:
    """Publishes a shard's queue depth: calls that arrived and have not answered.

    Every call enters and leaves, and a Ray gauge costs a shard tens of microseconds
    per sample, several times a step: the depth goes out at most every
    ``interval_s``, and at once when the queue empties, so an idle shard never
    shows a stale depth.

    Args:
        shard_index: Tag of the samples.
        interval_s: Least time between two samples while calls wait.
        factory: Creates a gauge; tests pass a fake.
        clock: Seconds, monotonic; tests pass a fake.
    """

    def __init__(
        self,
        shard_index: int,
        interval_s: float = 0.1,
        factory: GaugeFactory = gauge_factory,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tags = {"shard": str(shard_index)}
        self._depth = factory(
            "ray_ps_shard_queue_depth", "Calls waiting on a parameter-server shard.", ("shard",)
        )
        self._interval_s = interval_s
        self._clock = clock
        self._next = 0.0
        self._shown = 0
        self.waiting = 0

    def enter(self) -> None:
        self.waiting += 1
        self._publish()

    def leave(self) -> None:
        self.waiting -= 1
        self._publish()

    def _publish(self) -> None:
        now = self._clock()
        if now >= self._next or (self.waiting == 0 and self._shown != 0):
            self._depth.set(self.waiting, tags=self._tags)
            self._shown = self.waiting
            self._next = now + self._interval_s
