"""Two simulated nodes: shards colocated with their workers, cross-node bytes
counted, and sync PS still equal to DDP when the workers sit on different nodes —
on the direct TCP path, through the object store, and with two workers per node
summing on their node's relay first (a sparse table's rows too); DiLoCo's rounds
through the same node's shard. Shards on a node of their own (a custom resource
of the head node only, see conftest) while the workers sit on the other one."""

import math
import time

import pytest
import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError

from ray_ps_plugin import PSConfig, PSTrainer
from tests.integration import loops
from tests.integration.conftest import SERVER_RESOURCE, WORKER_RESOURCE

pytestmark = pytest.mark.usefixtures("ray_cluster")

# One worker per node: STRICT_SPREAD puts the two bundles on different nodes.
SPREAD = ScalingConfig(
    num_workers=2, resources_per_worker={"CPU": 0.5}, placement_strategy="STRICT_SPREAD"
)


def _fit(storage, name, scaling=SPREAD, steps=loops.EQUIVALENCE_STEPS, sparse=False, **ps):
    return PSTrainer(
        loops.equivalence_loop,
        train_loop_config={"steps": steps, "sparse": sparse},
        ps_config=PSConfig(**ps),
        scaling_config=scaling,
        run_config=RunConfig(storage_path=storage, name=name, failure_config=FailureConfig(0)),
    ).fit()


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory, equivalence_ddp):
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    storage = str(tmp_path_factory.mktemp("multinode"))
    # Four workers, two per node.
    four = ScalingConfig(
        num_workers=4, resources_per_worker={"CPU": 0.5}, placement_strategy="SPREAD"
    )
    return {
        # DDP across nodes computes what it does on one (see equivalence_ddp).
        "ddp": equivalence_ddp,
        "ps": _fit(storage, "ps", strategy="ps", chunk_bytes=4096),
        "store": _fit(storage, "store", strategy="ps", chunk_bytes=4096, data_path="object_store"),
        # With a sparse table beside, whose rows the relays sum too.
        "ddp4": _fit(storage, "ddp4", steps=4, scaling=four, sparse=True, strategy="ddp"),
        # server_placement="auto": one shard per node, which relays its two workers.
        "per_node": _fit(storage, "per_node", steps=4, scaling=four, sparse=True, chunk_bytes=4096),
        # DiLoCo, a round every 2 steps: each node's shard relays its workers' rounds.
        "diloco": _fit(storage, "diloco", steps=4, scaling=four, mode="diloco", local_steps=2),
        # Both workers on the worker node, both shards on the server node.
        "servers": _fit(
            storage,
            "servers",
            scaling=ScalingConfig(
                num_workers=2, resources_per_worker={"CPU": 0.5, WORKER_RESOURCE: 1}
            ),
            server_resources={SERVER_RESOURCE: 1},
        ),
    }


def test_each_shard_runs_on_its_workers_node(runs):
    m = runs["ps"].metrics
    nodes = m["ps_server_nodes"]
    assert len(set(nodes)) == 2  # the workers are on two nodes, so are the shards
    assert nodes[0] == m["worker_node"]  # shard 0 sits with rank 0


def test_shards_of_the_workers_node_are_reached_through_shared_memory(runs):
    m = runs["ps"].metrics
    local = [i for i, n in enumerate(m["ps_server_nodes"]) if n == m["worker_node"]]
    assert local == [0]  # the shard on the other node goes through the object store
    assert m["ps_shared_memory_shards"] == local


def test_one_shard_per_node_when_nodes_have_several_workers(runs):
    m = runs["per_node"].metrics
    assert m["ps_num_servers"] == 2 and len(set(m["ps_server_nodes"])) == 2
    assert m["worker_node"] in m["ps_server_nodes"]


def test_two_workers_per_node_sum_on_their_node_first(runs):
    m = runs["per_node"].metrics
    # Rank 0 hands every dense chunk to its node's shard through shared memory, and
    # its sparse rows for the other node's shard to the same shard (the relay) by a
    # frame: the relay alone sends the node's sums across, so rank 0 sends nothing
    # across itself.
    home = m["ps_server_nodes"].index(m["worker_node"])
    assert m["ps_shared_memory_shards"] == [home]
    assert m["ps_per_shard"][home] > 0
    assert m["ps_per_shard"][1 - home] == 0 and m["ps_cross_node"] == 0
    ddp, ps = loops.load_state(runs["ddp4"]), loops.load_state(runs["per_node"])
    assert max((ddp[k].double() - ps[k].double()).abs().max().item() for k in ddp) <= 1e-5


def test_diloco_rounds_cross_nodes_through_the_nodes_relay(runs):
    """Rank 0 hands its change for the other node's shard to its own node's shard
    (the relay), which alone sends the node's sum across: rank 0 counts no byte
    across nodes. (That a relay's rounds are the rounds without one is
    tests/unit/test_diloco.py's.)"""
    m = runs["diloco"].metrics
    home = m["ps_server_nodes"].index(m["worker_node"])
    assert m["ps_mode"] == "diloco" and m["ps_steps"] == 4
    assert m["ps_per_shard"][1 - home] > 0  # the other node's slice went to the relay
    assert m["ps_cross_node"] == 0
    assert math.isfinite(m["loss"])


def test_with_server_resources_every_shard_runs_on_the_node_carrying_them(runs):
    m = runs["servers"].metrics
    server_node = _node_with(SERVER_RESOURCE)
    assert m["ps_num_servers"] == 2 and m["ps_server_nodes"] == [server_node] * 2
    assert m["worker_node"] == _node_with(WORKER_RESOURCE)  # no worker's node holds one
    assert m["ps_shared_memory_shards"] == []
    assert m["ps_cross_node"] > 0  # every byte went to the other node
    ddp, ps = loops.load_state(runs["ddp"]), loops.load_state(runs["servers"])
    assert max((ddp[k].double() - ps[k].double()).abs().max().item() for k in ddp) <= 1e-5


def test_server_resources_no_node_carries_fail_the_start_in_bounded_time_naming_them(
    tmp_path,
):
    started = time.monotonic()
    with pytest.raises(TrainingFailedError, match="ps_nowhere") as info:
        _fit(
            str(tmp_path),
            "nowhere",
            scaling=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
            server_resources={"ps_nowhere": 1},
            ps_start_timeout_s=3,
        )
    assert "No live node carries the resource(s) ['ps_nowhere']" in str(info.value)
    assert time.monotonic() - started < 60
    assert loops.wait_until(lambda: loops.live_shards() == 0)
    assert loops.wait_until(lambda: loops.live_placement_groups() == 0)


def _node_with(resource: str) -> str:
    (node,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"]]
    return node


def test_cross_node_bytes_are_counted(runs):
    m = runs["ps"].metrics
    # Rank 0 pushes shard 1's share to the other node and gets as much back.
    assert m["ps_cross_node"] == 2 * m["ps_per_shard"][1] > 0


@pytest.mark.parametrize("run", ["ps", "store"])
def test_sync_ps_equals_ddp_across_nodes(runs, run):
    """On the direct TCP path (default) and through the object store."""
    ddp, ps = loops.load_state(runs["ddp"]), loops.load_state(runs[run])
    assert max((ddp[k].double() - ps[k].double()).abs().max().item() for k in ddp) <= 1e-5
    assert runs[run].metrics["ps_cross_node"] > 0


def test_no_shard_left_on_any_node(runs):
    assert loops.wait_until(lambda: loops.live_shards() == 0)
    assert loops.wait_until(lambda: loops.live_placement_groups() == 0)
