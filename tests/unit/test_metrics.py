"""Metrics export: names, tags, byte rate, rate limit, shard queue depth."""

import time

from ray_ps_plugin._metrics import ShardMetrics, WorkerMetrics
from ray_ps_plugin._stats import PSStats


class FakeGauge:
    def __init__(self, name, description, tag_keys):
        self.name, self.tag_keys, self.samples = name, tag_keys, []

    def set(self, value, tags=None):
        assert set(tags) == set(self.tag_keys)
        self.samples.append((value, dict(tags)))


def _factory(store):
    def make(name, description, tag_keys):
        store[name] = FakeGauge(name, description, tag_keys)
        return store[name]

    return make


def test_worker_stats_are_published_with_tags_and_a_byte_rate():
    gauges = {}
    m = WorkerMetrics({"mode": "async", "rank": "1"}, interval_s=0.0, factory=_factory(gauges))
    assert m.due()
    m.export(PSStats(steps=3, bytes_pushed=100, bytes_pulled=100, staleness_max=2))
    time.sleep(0.05)
    m.export(PSStats(steps=4, bytes_pushed=200, bytes_pulled=200, staleness_max=2))
    assert gauges["ray_ps_steps"].samples[-1] == (4.0, {"mode": "async", "rank": "1"})
    assert gauges["ray_ps_staleness_max"].samples[-1][0] == 2.0
    rate = gauges["ray_ps_bytes_per_s"].samples[-1][0]
    assert 0 < rate <= 200 / 0.05
    assert all(name.startswith("ray_ps_") for name in gauges)


def test_exports_are_rate_limited():
    m = WorkerMetrics({"mode": "sync", "rank": "0"}, interval_s=60.0, factory=_factory({}))
    m.export(PSStats())
    assert not m.due()


def test_shard_queue_depth_goes_up_and_down():
    gauges = {}
    q = ShardMetrics(2, interval_s=0.0, factory=_factory(gauges))
    q.enter()
    q.enter()
    q.leave()
    samples = gauges["ray_ps_shard_queue_depth"].samples
    assert [v for v, _ in samples] == [1, 2, 1] and samples[0][1] == {"shard": "2"}


def test_shard_queue_depth_is_sampled_at_a_bounded_rate_and_shows_an_empty_queue_at_once():
    gauges, now = {}, [0.0]
    q = ShardMetrics(0, interval_s=0.1, factory=_factory(gauges), clock=lambda: now[0])
    q.enter()  # sampled: the first
    q.enter()
    q.leave()  # within the interval: not sampled
    now[0] = 0.2
    q.enter()  # 2 waiting, sampled
    q.leave()
    q.leave()  # empty: sampled at once
    q.enter()
    q.leave()  # already shown empty, within the interval
    assert [v for v, _ in gauges["ray_ps_shard_queue_depth"].samples] == [1, 2, 0]
