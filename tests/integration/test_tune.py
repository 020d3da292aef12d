"""Tune sweeps over strategies: metrics, checkpoints, isolation, early-stop cleanup.

Resources on the session cluster (4 logical CPUs): a trial reserves Tune's default
1 CPU for its driver plus 2 workers x 0.5 CPU for its Train run, 2 CPUs in all; the
shards reserve nothing (num_cpus=0, inside the workers' bundles). So
max_concurrent_trials=2 lets exactly two trials run together with no starvation.
"""

import os
import time

import pytest
import ray
from ray import tune
from ray.train import ScalingConfig

from ray_ps_plugin.tune import make_trainable
from tests.integration import loops

SCALING = ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5})
# Trial driver (Tune's default 1 CPU) + its workers; shards add nothing.
CPUS_PER_TRIAL = 1 + SCALING.num_workers * SCALING.resources_per_worker["CPU"]
PS_TIMEOUTS = {"ps_timeout_s": 30.0, "ps_start_timeout_s": 30.0}


def _tuner(storage: str, name: str, param_space: dict, **tune_config) -> tune.Tuner:
    trainable = make_trainable(loops.tune_loop, SCALING, ps_config_kwargs=PS_TIMEOUTS)
    tune_config.setdefault("max_concurrent_trials", int(4 // CPUS_PER_TRIAL))
    return tune.Tuner(
        trainable,
        param_space=param_space,
        tune_config=tune.TuneConfig(**tune_config),
        run_config=tune.RunConfig(storage_path=storage, name=name, verbose=0),
    )


@pytest.fixture(scope="module")
def sweep(ray_cluster, tmp_path_factory):
    """ddp/ps x two learning rates; Tune runs the two PS trials first, together."""
    storage = str(tmp_path_factory.mktemp("tune") / "ray_results")
    rendezvous = tmp_path_factory.mktemp("rendezvous")
    start = time.monotonic()
    results = _tuner(
        storage,
        "sweep",
        {
            "ps_config": tune.grid_search(
                [{"strategy": "ps", "mode": "sync"}, {"strategy": "ddp"}]
            ),
            "lr": tune.grid_search([0.05, 0.1]),
            "iterations": 3,
            "expect_live_shards": 4,
            "rendezvous_dir": str(rendezvous),
        },
    ).fit()
    return results, time.monotonic() - start, storage


def test_every_trial_reports_metrics_and_a_checkpoint(sweep):
    results, elapsed, storage = sweep
    assert len(results) == 4 and not results.errors
    seen = set()
    for r in results:
        strategy = r.config["ps_config"]["strategy"]
        seen.add((strategy, r.config["lr"]))
        assert r.metrics["training_iteration"] == 3
        # TuneReportCallback forwards Train's checkpoint as a path metric.
        path = r.metrics["checkpoint_path"]
        assert os.path.exists(os.path.join(path, "model.pt")), path
        # The Train run lives beside the trials, in the Tune experiment's directory.
        assert path.startswith(os.path.join(storage, "sweep", "train-trial_id="))
        assert ("ps_num_servers" in r.metrics) == (strategy == "ps")
    assert seen == {(s, lr) for s in ("ddp", "ps") for lr in (0.05, 0.1)}
    print(f"4-trial sweep: {elapsed:.1f}s")


def test_concurrent_trials_each_own_their_shards(sweep):
    results, _, _ = sweep
    ps = [r.metrics for r in results if r.config["ps_config"]["strategy"] == "ps"]
    assert len(ps) == 2
    # Read from the actor table by each PS trial once its shards ran: every live
    # controller owned exactly its own two shards (0 for a DDP run), none was orphaned,
    # and at least one snapshot caught both PS trials' shards alive at once.
    owned = [[c for c in m["shards_per_controller"] if c] for m in ps]
    assert [2, 2] in owned, owned
    for m, counts in zip(ps, owned):
        assert set(counts) == {2} and m["orphan_shards"] == 0, m
        assert m["ps_num_servers"] == 2
        assert m["ps_server_nodes"] == [m["worker_node"]] * 2
        # Every backward went through this run's shards (3 steps, no lost rounds).
        assert m["ps_steps"] == 3 and m["ps_bytes_pushed"] > 0


def test_nothing_outlives_the_sweep(sweep):
    assert loops.wait_until(lambda: loops.live_shards() == 0)
    assert loops.wait_until(lambda: loops.live_placement_groups() == 0)
    assert loops.wait_until(lambda: loops.live_reapers() == 0)


def test_the_last_report_reaches_tune_when_tune_reads_reports_late(ray_cluster, storage):
    """CI once ended a trial with ``Result.metrics == {}`` though its run had reported:
    with Ray's TuneReportCallback, Tune polls the run's reports and the trainable's end
    in turn, and a loaded machine let the end overtake the last report. Here Tune's
    session reads that callback's queue late every time (a run reporting once loses
    its report to that race, deterministically); make_trainable does not send reports
    through it, so the run's last report reaches Tune."""
    trainable = loops.with_late_tune_report_replies(
        make_trainable(loops.tune_loop, SCALING, ps_config_kwargs=PS_TIMEOUTS)
    )
    results = tune.Tuner(
        trainable,
        param_space={"strategy": "ddp", "lr": 0.05, "iterations": 1},
        run_config=tune.RunConfig(storage_path=storage, name="late", verbose=0),
    ).fit()
    assert not results.errors, results.errors
    m = results[0].metrics
    assert m["training_iteration"] == 1 and "loss" in m, m
    assert os.path.exists(os.path.join(m["checkpoint_path"], "model.pt")), m


def test_asha_stopped_trials_leave_no_shard_or_placement_group(ray_cluster, storage):
    # One trial at a time, better one first: the second scores below the cutoff of
    # rung 1 (iteration 1 of 6) and ASHA stops it while its workers still train.
    scheduler = tune.schedulers.ASHAScheduler(
        metric="score", mode="max", max_t=6, grace_period=1, reduction_factor=2
    )
    results = _tuner(
        storage,
        "asha",
        {
            # Async with replicas: a stopped trial takes its shards' replicas along too.
            "strategy": "ps",
            "mode": "async",
            "shard_replicas": 1,
            "quality": tune.grid_search([2.0, 1.0]),
            "lr": 0.05,
            "iterations": 6,
            "report_sleep_s": 0.3,
        },
        scheduler=scheduler,
        max_concurrent_trials=1,
    ).fit()
    assert not results.errors
    iterations = {r.config["quality"]: r.metrics["training_iteration"] for r in results}
    assert iterations == {2.0: 6, 1.0: 1}, iterations
    # The stopped controllers took their shards and replicas along (both count as
    # shards); the reapers removed the worker
    # placement groups that Ray Train's own cleaner cannot see without a dashboard.
    assert loops.wait_until(lambda: loops.live_shards() == 0)
    assert loops.wait_until(lambda: loops.live_placement_groups() == 0)
    assert loops.wait_until(lambda: ray.available_resources().get("CPU") == 4.0)
    assert loops.wait_until(lambda: loops.live_reapers() == 0)
