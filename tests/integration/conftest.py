"""One real local Ray cluster per pytest process (``make test`` runs two, each taking
whole files), for all the integration tests that process runs."""

import os

# Ray Train waits for the controller's poll on every report; 2 s by default.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
# Ray Train polls Ray for node drains (preemption notices) every 5 s by default.
os.environ.setdefault("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "0.5")
# Each run starts one more actor to watch for those drains; only the preemption
# test reads them, and it turns the watcher on for its own run (the driver's
# setting reaches that run's controller when fit() starts it).
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Ray Train waits up to 30 s by default for the workers to destroy their torch
# process group at shutdown, all of it when a worker hangs or is cut off; a healthy
# worker takes milliseconds. (The raylets this session starts inherit these.)
os.environ.setdefault("TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S", "5")
# An elastic restart may first ask for more workers than the cluster still holds
# (Ray's autoscaling coordinator refreshes its view of the nodes every 20 s); the
# start then waits this long (60 s by default) before Ray Train asks for fewer.
os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "30")

import pytest
import ray
from ray import cloudpickle
from ray.cluster_utils import Cluster

from tests.integration import (
    compat_loops,
    digits,
    dlrm,
    faults,
    frameworks,
    loops,
    replication,
    tables,
    workerloss,
)

# Workers cannot import the tests package; ship the loops by value.
cloudpickle.register_pickle_by_value(loops)
cloudpickle.register_pickle_by_value(digits)
cloudpickle.register_pickle_by_value(faults)
cloudpickle.register_pickle_by_value(frameworks)
cloudpickle.register_pickle_by_value(compat_loops)
cloudpickle.register_pickle_by_value(tables)
cloudpickle.register_pickle_by_value(dlrm)
cloudpickle.register_pickle_by_value(workerloss)
cloudpickle.register_pickle_by_value(replication)


#: A custom resource of the head node only (the "server node"), and one of the
#: other node only (the "worker node").
SERVER_RESOURCE, WORKER_RESOURCE = "ps_server", "trainer"


@pytest.fixture(scope="session")
def ray_cluster():
    """Two simulated nodes (two raylets, two object stores) on this machine.

    Logical CPUs: workers ask for fractions, so 2 + 2 keeps two runs schedulable on a
    2-core machine without oversubscribing real work. Runs with PACK placement stay
    on one node; test_multinode spreads workers over both. On a GPU machine the
    two nodes report the same GPUs (named explicitly: Ray's own detection is not
    relied on), so test_gpu can place one worker per node even with one device.
    Custom resources make one node a server node and the other a worker node, for
    runs that ask for them (shards on nodes of their own).
    """
    import torch

    gpus = torch.cuda.device_count()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "num_gpus": gpus,
            "include_dashboard": False,
            "object_store_memory": 300 * 1024 * 1024,
            "resources": {SERVER_RESOURCE: 4},
        },
    )
    cluster.add_node(
        num_cpus=2,
        num_gpus=gpus,
        object_store_memory=300 * 1024 * 1024,
        resources={WORKER_RESOURCE: 4},
    )
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="session")
def equivalence_ddp(ray_cluster, tmp_path_factory):
    """``loops.equivalence_loop`` under ``PSConfig(strategy="ddp")`` on 2 workers: the
    DDP reference of test_sync and test_multinode. DDP's maths does not depend on
    where the workers sit (a sum of two gradients is the same in either order), so
    one run serves both."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    from ray_ps_plugin import PSConfig, PSTrainer

    return PSTrainer(
        loops.equivalence_loop,
        train_loop_config={"steps": loops.EQUIVALENCE_STEPS},
        ps_config=PSConfig(strategy="ddp"),
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(
            storage_path=str(tmp_path_factory.mktemp("equivalence_ddp")),
            name="ddp",
            failure_config=FailureConfig(0),
        ),
    ).fit()


@pytest.fixture
def storage(tmp_path):
    return str(tmp_path / "ray_results")
