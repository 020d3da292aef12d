"""A worker's loss in the modes whose shards own the state (async, ssp, diloco).

The digits loop of tests/integration/workerloss.py, 2 workers, rank 1's process
SIGKILLed at step 140 of 300, ``FailureConfig(max_failures=2)``, no checkpoint
reported mid-run: Ray Train replaces rank 1 alone (replica groups) while rank 0 goes
on in its process, and the replacement joins the live shards at the step the lost
worker reached. A restart of every worker keeps the shards' state too.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest
import ray
import torch
from ray.train import FailureConfig, RunConfig, ScalingConfig

from ray_ps_plugin import PSConfig, PSTrainer
from tests.integration import faults, loops, workerloss

pytestmark = pytest.mark.usefixtures("ray_cluster")

STEPS, KILL_STEP = 300, 140
#: Pretend work per step: the survivor's 160 steps after the kill take longer than
#: a replacement's start (a few seconds), as real steps would.
SLEEP_S = 0.04
SCALING = ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5})
MODES = {
    "async": {"mode": "async", "replace_lost_workers": True},
    "ssp": {"mode": "ssp", "staleness": 4, "replace_lost_workers": True},
    "diloco": {"mode": "diloco", "local_steps": 16, "replace_lost_workers": True},
}
#: Diloco's survivor paces its steps until the replacement joins (160 of them
#: outlast ``FIRST_STEP_S``); async's and ssp's replacement start at the lost
#: worker's step whenever they join.
PACE = {"diloco": {"pace_until_replaced_s": 0.25}}
#: Longest time the surviving worker may take no step (on 2 cores the
#: replacement's start competes for them), and the replacement's first step.
MAX_GAP_S, FIRST_STEP_S = 5.0, 30.0
#: Accuracy below the uninterrupted run's: async runs differ by arrival order alone
#: (one run of each; 540 test digits, a point is 5 of them). Diloco's rounds go on
#: with one worker's change until the replacement joins (6 s of this 15 s run) and
#: the lost worker's round is lost: 4 points here. The benchmark
#: (benchmarks/worker_loss.py) measures the mean over rounds, as DDP's beside it.
ACCURACY_SLACK = {"async": 0.02, "ssp": 0.02, "diloco": 0.05}


def _fit(tmp: Path, name: str, cfg: PSConfig, **config: object):
    out = tmp / name
    out.mkdir()
    result = PSTrainer(
        workerloss.timeline_loop,
        train_loop_config={"steps": STEPS, "out_dir": str(out), "sleep_s": SLEEP_S, **config},
        ps_config=cfg,
        scaling_config=SCALING,
        run_config=RunConfig(
            storage_path=str(tmp / "storage"), name=name, failure_config=FailureConfig(2)
        ),
    ).fit()
    return result, out


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster, tmp_path_factory):
    """Test accuracy of each mode's run without a failure."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    return {
        mode: workerloss.accuracy(_fit(tmp, mode, PSConfig(**MODES[mode]))[0]) for mode in MODES
    }


@pytest.mark.parametrize("mode", list(MODES))
def test_a_killed_worker_is_replaced_alone_while_the_other_never_stops(
    tmp_path, uninterrupted, mode
):
    result, out = _fit(
        tmp_path,
        mode,
        PSConfig(**MODES[mode]),
        kill_rank=1,
        kill_step=KILL_STEP,
        **PACE.get(mode, {}),
    )
    timelines = workerloss.read_timelines(out)
    killed = float((out / "killed").read_text())
    survivor, lost = timelines[0], timelines[1]
    # The survivor ran in one process throughout, every step once.
    assert len({r["pid"] for r in survivor}) == 1
    assert [r["step"] for r in survivor] == list(range(STEPS))
    times = [r["t"] for r in survivor]
    assert max(b - a for a, b in itertools.pairwise(times)) <= MAX_GAP_S
    # The replacement went on where the lost worker was (diloco: at the round the
    # others are in, from its first step: the lost worker's round is lost), within
    # 30 s, to the end.
    pids = list(dict.fromkeys(r["pid"] for r in lost))
    assert len(pids) == 2
    replaced = [r["step"] for r in lost if r["pid"] == pids[1]]
    if mode == "diloco":
        assert replaced[0] % 16 == 0 and KILL_STEP // 16 * 16 <= replaced[0] < STEPS
    else:
        assert replaced[0] == KILL_STEP
    assert replaced == list(range(replaced[0], STEPS))
    first = next(r["t"] for r in lost if r["pid"] == pids[1])
    assert first - killed <= FIRST_STEP_S
    assert workerloss.accuracy(result) >= uninterrupted[mode] - ACCURACY_SLACK[mode]
    assert loops.wait_until(lambda: loops.live_shards() == 0)


@pytest.mark.parametrize("kill_step", [KILL_STEP, 149])
def test_with_checkpoints_every_50_steps_no_update_is_lost(tmp_path, kill_step):
    """The same kill in async with a checkpoint reported every 50 steps: the run
    finishes, and each worker's 300 updates are on the shards once (the clock each
    rank last saw for every rank). Killed at step 149, the survivor is already
    waiting at the report of step 150 when the replacement resets the barrier: it
    goes through that report again, which the replacement makes too (else their
    reports fall out of step and the last one waits for ever)."""
    _, out = _fit(
        tmp_path, "every50", PSConfig(**MODES["async"]), kill_rank=1, kill_step=kill_step, every=50
    )
    seen = [json.loads(p.read_text())["clocks"] for p in sorted(out.glob("clocks_rank*.json"))]
    assert [max(c[r] for c in seen) for r in range(2)] == [STEPS, STEPS]
    timelines = workerloss.read_timelines(out)
    assert [r["step"] for r in timelines[0]] == list(range(STEPS))


def test_after_a_restart_of_every_worker_they_start_from_the_shards_not_the_checkpoint(
    tmp_path,
):
    """Every worker raises at step 20 (a checkpoint was reported at 10), so Ray Train
    restarts them all (``replace_lost_workers=False``): the new shards take the state
    the old ones held, and each restarted worker's first parameters are those, not
    the checkpoint's; its loop goes on from step 20."""
    cfg = workerloss.RecordingConfig(mode="async", kept_dir=str(tmp_path))
    _, out = _fit(tmp_path, "restart", cfg, raise_step=20, every=10, wait_for_all_firsts=True)
    kept = torch.load(tmp_path / "kept_params.pt", weights_only=True)
    restarted = [torch.load(p, weights_only=True) for p in sorted(out.glob("first_*.pt"))]
    restarted = [r for r in restarted if r["start"]]
    assert len(restarted) == 2 and all(r["start"] == 20 for r in restarted)
    for r in restarted:
        torch.testing.assert_close(r["params"], kept, rtol=0, atol=0)
    checkpoint = sorted((tmp_path / "storage" / "restart").glob("checkpoint_*"))[0]
    saved = torch.load(checkpoint / "state.pt", weights_only=True)["model"]
    flat = torch.cat([v.reshape(-1) for v in saved.values()])
    assert (flat - kept).abs().max() > 1e-4


def _until_elastic_runs_see_the_new_nodes() -> None:
    """An elastic run sizes itself by Ray's autoscaling coordinator, which refreshes
    its view of the nodes every 20 s once it exists (an earlier elastic run made
    it): without this wait a second run would start with one worker."""
    names = ray.util.list_named_actors(all_namespaces=True)
    if any(a["name"] == "AutoscalingCoordinator" for a in names):
        time.sleep(21)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_elastic_run_goes_on_with_one_worker_when_a_nodes_resources_go(
    ray_cluster, tmp_path, mode
):
    """``num_workers=(1, 2)`` on two fresh nodes that hold one worker each: rank 1's
    node is removed at step 12 and Ray Train restarts the run with the one worker
    the remaining resources hold, from the last checkpoint (the removed node took
    a shard with it); it finishes, and nothing is left."""
    marker_dir = tmp_path / "markers"
    marker_dir.mkdir()
    with loops.a_node_goes(ray_cluster, marker_dir, "node_to_remove") as removed:
        _until_elastic_runs_see_the_new_nodes()
        result = PSTrainer(
            faults.resumable_loop,
            train_loop_config={
                "steps": 30,
                "every": 5,
                "marker_dir": str(marker_dir),
                "lose_node_rank": 1,
                "lose_node_step": 12,
            },
            ps_config=PSConfig(mode=mode, ps_timeout_s=20),
            scaling_config=ScalingConfig(
                num_workers=(1, 2),
                resources_per_worker={"CPU": 0.5, "slot": 2},
                placement_strategy="SPREAD",
            ),
            run_config=RunConfig(
                storage_path=str(tmp_path / "storage"),
                name=f"elastic-{mode}",
                failure_config=FailureConfig(max_failures=2),
            ),
        ).fit()
    assert len(removed) == 1
    m = result.metrics
    assert m["step"] == 30 and 0 < m["start"] <= 12
    assert m["world_size"] == 1
    assert loops.wait_until(lambda: loops.live_shards() == 0)
    assert loops.wait_until(lambda: loops.live_placement_groups() == 0)
