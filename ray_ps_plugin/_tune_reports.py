"""Every Train report of a ``make_trainable`` trial handed to Tune before the trial ends.

Why not Ray's ``TuneReportCallback`` (checked against Ray 2.60.0): it puts each report
on a Ray queue that Tune's session drains on the trial actor's *main* thread, polling
it and the session's own result queue in turn, 0.2 s each
(``_TrainSession._get_result_from_queues`` in ``ray/train/_internal/session.py``). When
the trainable function returns, Tune's function runner puts its end marker
(``RESULT_DUPLICATE``, ``ray/tune/trainable/function_trainable.py``) on that result
queue, and nothing orders it after a report still waiting on the Ray queue. If
``fit()`` returns within one polling turn of the run's last report, as it can when a
loaded machine delays the queue's reply to the main thread, Tune reads the marker first
and ends the trial with its previous result: for a run that reports once,
``Result.metrics == {}``, though the run itself reported and checkpointed. Had the main
thread taken the report just after the marker, its put into the full result queue would
block for good: the trial hangs.

Here each report travels to the trial on a queue of its own (one slot, so Train waits
for Tune as it does with ``TuneReportCallback``) and a thread of the trial hands it to
Tune with ``ray.tune.report``, the path of any function trainable's own reports.
``ray.tune.report`` returns only once Tune has taken the result, and the trial leaves
:class:`ReportsToTune` only when that thread has passed on everything queued before
``fit()`` returned, so the end marker comes after the last report.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

import ray.tune
from ray.train import UserCallback
from ray.util.queue import Full, Queue

__all__ = ["CHECKPOINT_PATH_KEY", "ForwardReports", "ReportsToTune"]

logger = logging.getLogger(__name__)

CHECKPOINT_PATH_KEY = "checkpoint_path"
"""The metric that carries a reported checkpoint's path: the name Ray's own
TuneReportCallback gives it, so results read the same as with Ray's integration."""

# How often the trial re-checks, while handing over the end of the run, that the thread
# forwarding reports to Tune is still there to take it (see ReportsToTune.close).
_END_PUT_POLL_S = 1.0


class ReportsToTune:
    """Forwards a trial's Train reports to Tune, every one before the trial ends.

    Use as a context manager around ``fit()``: leaving it waits until Tune has taken
    every report the run made (see the module's docstring for why).

    Args:
        reports: The queue between the Train controller and the trial; by default a
            ``ray.util.queue.Queue`` of one slot, on no CPU. Tests pass a local one.
        report: Hands one result to Tune; ``ray.tune.report`` by default.
    """

    def __init__(
        self,
        reports: Any | None = None,
        report: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self._reports = reports if reports is not None else Queue(1, actor_options={"num_cpus": 0})
        self._report = report if report is not None else ray.tune.report
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._forward, name="ray_ps_plugin-tune-reports", daemon=True
        )

    def callback(self) -> ForwardReports:
        """The Train callback that puts the run's reports on this forwarder's queue."""
        return ForwardReports(self._reports)

    def __enter__(self) -> ReportsToTune:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
        # A failed fit() is the trial's error; a forwarding error is raised only when
        # fit() succeeded. SystemExit is how Tune stops a trial while it reports:
        # passed on, it ends this trial the same way.
        if exc_type is None and self._error is not None:
            raise self._error

    def close(self) -> None:
        """Waits until every queued report was handed to Tune, then frees the queue."""
        # fit() has returned or raised, so the controller is done: every after_report
        # finished its put, and the end marker (None) queues behind the last report.
        while self._thread.is_alive():
            try:
                self._reports.put(None, timeout=_END_PUT_POLL_S)
                break
            except Full:
                continue  # the thread has not taken the last report yet: is it alive?
        self._thread.join()
        try:
            self._reports.shutdown(force=True)
        except Exception as e:
            logger.debug("Report queue not shut down: %s", e)

    def _forward(self) -> None:
        try:
            while (item := self._reports.get()) is not None:
                self._report(item)
        except BaseException as e:
            # Includes the SystemExit with which ray.tune.report ends a stopped trial.
            self._error = e


class ForwardReports(UserCallback):
    """Train callback, run in the controller: queues each report for the trial.

    Args:
        reports: The queue that the trial's :class:`ReportsToTune` drains.
    """

    def __init__(self, reports: Any) -> None:
        self._reports = reports

    def after_report(
        self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any
    ) -> None:
        # Rank 0's metrics, like TuneReportCallback. The checkpoint is already in the
        # run's storage: Tune gets its path, so that it does not copy the files again.
        item = dict(metrics[0])
        if checkpoint is not None:
            item[CHECKPOINT_PATH_KEY] = checkpoint.path
        # Blocks while the trial still holds an earlier report: the run goes on once
        # Tune has taken it, as with TuneReportCallback.
        self._reports.put(item)
