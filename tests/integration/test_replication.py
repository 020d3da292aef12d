"""Every shard's state held twice (``PSConfig(shard_replicas=1)``): a shard's process,
or the whole node its primary runs on, is killed mid-run in async, and training goes
on with its replica, without a restart (``max_failures=0``: any restart would fail
the run), losing no update (the probe model's weight is exact) and training as well
as an uninterrupted run (digits accuracy)."""

import json
import os
import signal
import threading

import pytest
import torch
from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError

from ray_ps_plugin import PSConfig, PSTrainer
from tests.integration import loops, replication
from tests.integration.conftest import WORKER_RESOURCE

pytestmark = pytest.mark.usefixtures("ray_cluster")

STEPS = 240
KILL_STEP = 80
SLEEP_S = 0.02
#: Resource of the two server nodes this module adds (no other test asks for it).
REPLICATED = "ps_replicated"


def _fit(storage, name, scaling, second_kill_step=None, loop=replication.two_models_loop, **ps):
    ps = {"mode": "async"} | ps
    return PSTrainer(
        loop,
        train_loop_config={
            "steps": STEPS,
            "kill_step": KILL_STEP,
            "second_kill_step": second_kill_step,
            "sleep_s": SLEEP_S,
            "out_dir": str(storage),
        },
        ps_config=PSConfig(shard_replicas=1, ps_timeout_s=60, **ps),
        scaling_config=scaling,
        run_config=RunConfig(storage_path=str(storage), name=name, failure_config=FailureConfig(0)),
    ).fit()


def _kill_when_named(marker, kill) -> threading.Thread:
    """A thread that waits for the loop to name shard 0's primary, then kills it."""

    def run() -> None:
        if loops.wait_until(marker.exists, timeout_s=240):
            kill(json.loads(marker.read_text()))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _assert_no_update_lost(state) -> None:
    expected = torch.full((1, replication.PROBE_SIZE), -STEPS * replication.PROBE_LR)
    assert torch.equal(state["probe"], expected), state["probe"][0, :4]


def _no_leaks() -> None:
    assert loops.wait_until(lambda: loops.live_shards() == 0)
    assert loops.wait_until(lambda: loops.live_placement_groups() == 0)


def _shard_0_killed(tmp_path, name, **fit):
    """A run on one node (shards in the workers' bundles, each replica in the other
    worker's bundle) in which shard 0's process is SIGKILLed once the loop names it;
    the run's final state."""
    marker = tmp_path / "kill_marker"
    thread = _kill_when_named(marker, lambda victim: os.kill(victim["pid"], signal.SIGKILL))
    result = _fit(
        tmp_path, name, ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}), **fit
    )
    thread.join(10)
    assert marker.exists()
    return result, replication.final_state(result)


def test_a_killed_shard_process_is_replaced_by_its_replica_without_a_restart(tmp_path):
    """Both workers on one node. Shard 0's process is SIGKILLed; the workers' next
    calls find it dead and go on with its replica."""
    _, state = _shard_0_killed(tmp_path, "process")
    _assert_no_update_lost(state)
    assert state["accuracy"] > 0.9
    _no_leaks()


def test_a_lightning_loop_in_ssp_goes_on_with_the_replica_of_a_killed_shard(tmp_path):
    """A loop this project did not write: Lightning's Trainer under Ray's recipe, in
    ssp. Shard 0's process is SIGKILLed at step 80; Lightning never sees it: no
    restart, every update applied once, and the digits learnt."""
    pytest.importorskip("pytorch_lightning")
    result, state = _shard_0_killed(
        tmp_path, "lightning", loop=replication.lightning_loop, mode="ssp", staleness=2
    )
    assert result.metrics["moved"]  # the kill landed mid-run and rank 0 failed over
    _assert_no_update_lost(state)
    assert state["accuracy"] > 0.9
    _no_leaks()


def test_a_failing_run_with_replicas_leaves_no_shard_or_replica(tmp_path):
    with pytest.raises(TrainingFailedError, match="user code failed on purpose"):
        PSTrainer(
            loops.failing_loop,
            train_loop_config={},
            ps_config=PSConfig(mode="async", shard_replicas=1),
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
            run_config=RunConfig(
                storage_path=str(tmp_path), name="fail", failure_config=FailureConfig(0)
            ),
        ).fit()
    _no_leaks()


@pytest.fixture(scope="module")
def server_nodes(ray_cluster):
    """Three fresh nodes carrying ``REPLICATED`` (two shards, their replicas, and
    room for new replicas once one node is lost). Removed at the end."""
    nodes = [ray_cluster.add_node(num_cpus=1, resources={REPLICATED: 2}) for _ in range(3)]
    ray_cluster.wait_for_nodes()
    yield ray_cluster, nodes
    for node in nodes:
        if node in ray_cluster.worker_nodes:  # not those the test removed
            ray_cluster.remove_node(node)


#: Both workers on the worker node (conftest); the shards on the two server nodes.
ON_WORKER_NODE = ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5, WORKER_RESOURCE: 1})
SERVERS = {"server_resources": {REPLICATED: 1}, "num_servers": 2}


@pytest.fixture(scope="module")
def uninterrupted(server_nodes, tmp_path_factory):
    path = tmp_path_factory.mktemp("uninterrupted")
    return replication.final_state(_fit(path, "uninterrupted", ON_WORKER_NODE, **SERVERS))


def test_two_server_nodes_lost_one_after_the_other_cost_no_update_and_no_restart(
    server_nodes, uninterrupted, tmp_path
):
    """Three server nodes, two shards, each replica away from its shard. Shard 0's
    primary's node is removed at step 80: shard 0 goes on with its replica, and the
    controller makes it a new replica (on a node still there). At step 160 the node
    of shard 0's first replica goes too (shard 0's promoted replica, and whatever
    else it held): shard 0 fails over to its new replica. The run ends without a
    restart, every update applied once, within 1 point of the uninterrupted run's
    accuracy."""
    cluster, _ = server_nodes
    killed: list[str] = []

    def remove(node_id: str) -> None:
        for node in list(cluster.worker_nodes):
            if node.node_id == node_id:
                cluster.remove_node(node, allow_graceful=False)
                killed.append(node_id)

    def losses() -> None:
        first = tmp_path / "kill_marker"
        if not loops.wait_until(first.exists, timeout_s=240):
            return
        remove(json.loads(first.read_text())["node_id"])
        second = tmp_path / "kill_marker_2"
        if loops.wait_until(second.exists, timeout_s=240):
            remove(json.loads(second.read_text())["node_id"])

    errors: list[BaseException] = []

    def run() -> None:
        try:
            losses()
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    result = _fit(tmp_path, "nodes_lost", ON_WORKER_NODE, second_kill_step=160, **SERVERS)
    thread.join(10)
    assert not errors, errors
    assert len(killed) == 2, killed
    state = replication.final_state(result)
    _assert_no_update_lost(state)
    _assert_no_update_lost(uninterrupted)
    assert abs(state["accuracy"] - uninterrupted["accuracy"]) <= 0.01 + 1e-9
    _no_leaks()
