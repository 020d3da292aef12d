"""Every Ray-internal name the plugin relies on still exists where _ray_compat says.

A Ray release that moves one of them fails here, by name, rather than inside a run.
"""

import dataclasses
import inspect

import ray

from ray_ps_plugin import _ray_compat


def test_checked_against_the_installed_ray():
    assert ray.__version__ == _ray_compat.CHECKED_RAY_VERSION, (
        "Ray changed: re-check every touch in ray_ps_plugin/_ray_compat.py, then bump "
        "CHECKED_RAY_VERSION"
    )


def test_torch_backend_hooks_exist():
    for hook in ("on_start", "on_shutdown", "on_training_start"):
        assert callable(getattr(_ray_compat.TorchBackend, hook))
    assert inspect.isclass(_ray_compat.TorchConfigContextManager)


def test_callback_bases_have_the_hooks_the_reaper_overrides():
    assert callable(_ray_compat.ControllerCallback.after_controller_start)
    assert callable(_ray_compat.ControllerCallback.before_controller_shutdown)
    assert callable(_ray_compat.WorkerGroupCallback.after_worker_group_start)


def test_worker_group_exposes_nodes_bundles_and_placement_group():
    from ray.train.v2._internal.execution.worker_group.state import WorkerGroupState
    from ray.train.v2._internal.execution.worker_group.worker import ActorMetadata, Worker
    from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup

    assert {"metadata", "placement_group_bundle_index"} <= {
        f.name for f in dataclasses.fields(Worker)
    }
    assert "node_id" in {f.name for f in dataclasses.fields(ActorMetadata)}
    assert callable(WorkerGroup.get_workers) and callable(WorkerGroup.get_worker_group_state)
    assert callable(WorkerGroup.has_started)
    assert "placement_group_handle" in {f.name for f in dataclasses.fields(WorkerGroupState)}


def test_places_and_placement_group_read_a_worker_group():
    class _Meta:
        node_id = "node-a"

    class _Worker:
        metadata = _Meta()
        placement_group_bundle_index = 3

    class _Group:
        def get_workers(self):
            return [_Worker()]

        def has_started(self):
            return False

        def get_worker_group_state(self):
            raise ValueError("not started")

    assert _ray_compat.worker_places(_Group()) == [_ray_compat.WorkerPlace("node-a", 3)]
    assert _ray_compat.worker_placement_group(_Group()) is None


def test_tune_context_exposes_the_experiment_storage():
    import inspect

    import ray.tune
    from ray.train._internal.storage import StorageContext

    assert callable(ray.tune.TuneContext.get_storage)
    assert isinstance(inspect.getattr_static(StorageContext, "experiment_fs_path"), property)
    assert "storage_filesystem" in inspect.signature(StorageContext.__init__).parameters

    class _Storage:
        experiment_fs_path, storage_filesystem = "/sweeps/exp", "fs"

    class _Ctx:
        def get_storage(self):
            return _Storage()

    assert _ray_compat.trial_storage(_Ctx()) == {
        "storage_path": "/sweeps/exp",
        "storage_filesystem": "fs",
    }


def test_actor_table_is_available():
    import ray._private.state

    assert callable(ray._private.state.actors)


def test_a_report_skipped_on_a_barrier_reset_is_what_the_wrapper_detects():
    # Ray Train skips a report whose barrier a replacement reset and puts its index
    # back: the wrapper tells a skip from a report by that index alone.
    from ray.train.v2._internal.execution.context import TrainContext

    source = inspect.getsource(TrainContext.report)
    assert "SynchronizationBarrierResetError" in source
    assert "self.report_call_index -= 1" in source


class _Context:
    """A train context whose reports the barrier resets ``resets`` times first."""

    def __init__(self, resets: int) -> None:
        self.report_call_index = 0
        self.resets = resets
        self.calls = []

    def report(self, metrics, checkpoint=None):
        self.calls.append(metrics)
        self.report_call_index += 1
        if self.resets:  # skipped: the index goes back
            self.resets -= 1
            self.report_call_index -= 1


def _wrapped(monkeypatch, context, redo):
    from ray.train.v2._internal.execution import context as ray_context

    monkeypatch.setattr(ray_context, "get_train_context", lambda: context)
    _ray_compat.redo_reset_reports(redo)
    _ray_compat.redo_reset_reports(redo)  # a second model wraps nothing more


def test_a_skipped_report_is_made_again_when_another_worker_will_make_it(monkeypatch):
    ctx = _Context(resets=1)
    _wrapped(monkeypatch, ctx, lambda: True)
    ctx.report({"step": 150})
    ctx.report({"step": 200})
    assert ctx.calls == [{"step": 150}, {"step": 150}, {"step": 200}]
    assert ctx.report_call_index == 2


def test_a_skipped_report_stays_skipped_when_no_one_will_make_it(monkeypatch):
    ctx = _Context(resets=1)
    _wrapped(monkeypatch, ctx, lambda: False)
    ctx.report({"step": 150})
    assert ctx.calls == [{"step": 150}] and ctx.report_call_index == 0


def test_reports_go_through_again_a_bounded_number_of_times(monkeypatch):
    ctx = _Context(resets=100)
    _wrapped(monkeypatch, ctx, lambda: True)
    ctx.report({"step": 150})
    assert len(ctx.calls) == _ray_compat._MAX_REDOS
