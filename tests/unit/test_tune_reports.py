"""Tune helper: a trial hands Tune every report of its Train run before it ends.

``ReportsToTune`` with a local one-slot queue in place of the Ray queue and a fake
``ray.tune.report``; a thread stands for the Train controller calling the callback.
"""

import queue
import threading
import time
from types import SimpleNamespace

import pytest
from ray.util.queue import Empty, Full

from ray_ps_plugin._tune_reports import ReportsToTune


class LocalQueue:
    """``ray.util.queue.Queue``'s interface on a local one-slot queue."""

    def __init__(self):
        self._q = queue.Queue(maxsize=1)
        self.shut_down = False

    def put(self, item, block=True, timeout=None):
        try:
            self._q.put(item, block, timeout)
        except queue.Full:
            raise Full from None

    def get(self, block=True, timeout=None):
        try:
            return self._q.get(block, timeout)
        except queue.Empty:
            raise Empty from None

    def shutdown(self, force=False):
        self.shut_down = True


class SlowTune:
    """``ray.tune.report`` when Tune takes a while to ask for the next result."""

    def __init__(self, delay_s=0.2, fail_on=None):
        self.delay_s, self.fail_on = delay_s, fail_on
        self.taken = []

    def __call__(self, metrics):
        if self.fail_on is not None and metrics["i"] == self.fail_on[0]:
            raise self.fail_on[1]
        time.sleep(self.delay_s)
        self.taken.append(metrics)


def _controller(callback, n, checkpoint_on_last=True):
    """A Train run reporting ``n`` times from 2 workers; returns when the last
    after_report has returned, as fit() does."""

    def run():
        for i in range(n):
            ckpt = (
                SimpleNamespace(path=f"/runs/ckpt_{i}")
                if checkpoint_on_last and i == n - 1
                else None
            )
            callback.after_report(None, [{"i": i, "rank": 0}, {"i": i, "rank": 1}], ckpt)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_every_report_is_with_tune_before_the_trial_ends():
    """The last report is put right before fit() returns and Tune is slow to take
    results: leaving the block still waits until Tune has it (rank 0's metrics, the
    checkpoint as its path)."""
    reports, tune = LocalQueue(), SlowTune()
    with ReportsToTune(reports, tune) as forwarder:
        _controller(forwarder.callback(), 3).join()  # fit() returns at once
    assert tune.taken == [
        {"i": 0, "rank": 0},
        {"i": 1, "rank": 0},
        {"i": 2, "rank": 0, "checkpoint_path": "/runs/ckpt_2"},
    ]
    assert reports.shut_down


def test_a_failed_fit_still_hands_over_earlier_reports_then_fails_the_trial():
    reports, tune = LocalQueue(), SlowTune()
    with pytest.raises(RuntimeError, match="workers failed"), ReportsToTune(reports, tune) as f:
        _controller(f.callback(), 2, checkpoint_on_last=False).join()
        raise RuntimeError("workers failed")
    assert [m["i"] for m in tune.taken] == [0, 1]


def test_a_forwarding_error_fails_the_trial():
    tune = SlowTune(fail_on=(0, ValueError("not a metric")))
    with pytest.raises(ValueError, match="not a metric"), ReportsToTune(LocalQueue(), tune) as f:
        _controller(f.callback(), 1).join()


def test_a_trial_stopped_by_tune_ends_as_tune_ends_it():
    """Tune stops a trial by raising SystemExit in the thread that reports. The trial
    then ends the same way, and does not wait for a report nobody will take."""
    reports = LocalQueue()
    tune = SlowTune(fail_on=(0, SystemExit(0)))
    start = time.monotonic()
    with pytest.raises(SystemExit), ReportsToTune(reports, tune) as f:
        # The second report fills the slot after the forwarder is gone.
        _controller(f.callback(), 2).join()
    assert time.monotonic() - start < 5
    assert tune.taken == []
