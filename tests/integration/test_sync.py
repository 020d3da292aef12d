"""Sync PS on a real local Ray cluster: DDP maths, drop-in, balance, lifecycle."""

import time

import pytest
import ray
import torch
from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
from ray.train.torch import TorchTrainer

from ray_ps_plugin import PSConfig, PSTimeoutError, PSTrainer
from tests.integration import loops

pytestmark = pytest.mark.usefixtures("ray_cluster")

SCALING = ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5})
STEPS = loops.EQUIVALENCE_STEPS


def _fit(trainer_cls, storage, name, loop=loops.equivalence_loop, config=None, **kwargs):
    trainer = trainer_cls(
        loop,
        train_loop_config=config or {"steps": STEPS},
        scaling_config=SCALING,
        run_config=RunConfig(storage_path=storage, name=name, failure_config=FailureConfig(0)),
        **kwargs,
    )
    return trainer.fit()


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory, equivalence_ddp):
    """The same loop under stock DDP, strategy='ddp', strategy='ps' and PSConfig in TorchTrainer."""
    storage = str(tmp_path_factory.mktemp("sync"))
    return {
        "stock": _fit(TorchTrainer, storage, "stock"),
        "ddp": equivalence_ddp,
        "ps": _fit(PSTrainer, storage, "ps", ps_config=PSConfig(strategy="ps", chunk_bytes=4096)),
        "ps_torch_config": _fit(
            TorchTrainer, storage, "ps_tc", torch_config=PSConfig(strategy="ps", num_servers=3)
        ),
    }


def test_strategy_ddp_is_stock_torch_trainer(runs):
    assert _max_diff(loops.load_state(runs["stock"]), loops.load_state(runs["ddp"])) == 0.0
    assert runs["ddp"].metrics["has_ps_context"] is False


@pytest.mark.parametrize("name", ["ps", "ps_torch_config"])
def test_sync_ps_ends_with_ddp_parameters(runs, name):
    ddp, ps = loops.load_state(runs["ddp"]), loops.load_state(runs[name])
    assert runs[name].metrics["updates"] == STEPS
    assert runs[name].metrics["is_ddp_instance"] is True
    # Frozen weights identical, BatchNorm buffers included in the comparison.
    assert torch.equal(ddp["frozen.weight"], ps["frozen.weight"])
    assert "bn.running_mean" in ps
    assert _max_diff(ddp, ps) <= 1e-5
    # It trained: parameters moved away from the initial state (same seed ⇒ same init).
    torch.manual_seed(0)
    init = loops.Net().state_dict()
    assert _max_diff(init, ps) > 1e-2


def test_ps_context_reports_servers_bytes_and_balance(runs):
    m = runs["ps"].metrics
    assert m["has_ps_context"] and m["ps_mode"] == "sync" and m["ps_num_servers"] == 2
    assert m["ps_server_nodes"][0] == m["worker_node"]  # shard 0 sits with rank 0
    assert m["ps_steps"] == STEPS  # one sync round per optimizer step; no_sync rounds skipped
    assert m["ps_bytes_pushed"] == STEPS * m["trainable_bytes"] == m["ps_bytes_pulled"]
    per_shard = m["ps_per_shard"]
    share = m["ps_bytes_pushed"] / len(per_shard)
    assert max(abs(b - share) for b in per_shard) <= 4096  # within one chunk (4096 B)

    m3 = runs["ps_torch_config"].metrics
    assert m3["ps_num_servers"] == 3 and len(m3["ps_per_shard"]) == 3
    share3 = m3["ps_bytes_pushed"] / 3
    assert max(abs(b - share3) for b in m3["ps_per_shard"]) <= 4 * 1024 * 1024


def test_no_server_or_placement_group_outlives_a_successful_fit(runs):
    assert loops.wait_until(lambda: loops.live_shards() == 0)
    assert loops.wait_until(lambda: loops.live_placement_groups() == 0)


def test_failing_user_function_leaves_nothing_behind(storage):
    with pytest.raises(TrainingFailedError, match="user code failed on purpose"):
        _fit(PSTrainer, storage, "fail", loop=loops.failing_loop, ps_config=PSConfig())
    assert loops.wait_until(lambda: loops.live_shards() == 0)
    assert loops.wait_until(lambda: loops.live_placement_groups() == 0)
    assert loops.wait_until(lambda: ray.available_resources().get("CPU") == 4.0)


def test_a_stalled_worker_fails_in_bounded_time_naming_shard_and_step(storage):
    t0 = time.monotonic()
    with pytest.raises(TrainingFailedError, match=r"step 3: server shard\(s\) \[0, 1\]") as info:
        _fit(
            PSTrainer,
            storage,
            "stall",
            loop=loops.slow_rank_loop,
            config={"stall_s": 60},
            ps_config=PSConfig(ps_timeout_s=3),
        )
    # The worker's error is the plugin's own timeout, message intact (no
    # "Unable to cast ... to Tensor" from torch's future machinery).
    errors = loops.worker_errors(info.value)
    assert any(isinstance(e, PSTimeoutError) for e in errors), errors
    assert all("Unable to cast" not in str(e) for e in errors)
    # Failing takes ps_timeout_s plus Ray Train's shutdown (~15 s here); waiting for
    # the stalled worker would take the full 60 s stall.
    assert time.monotonic() - t0 < 45
    assert loops.wait_until(lambda: loops.live_shards() == 0)


def test_failure_in_on_start_leaks_no_actor_or_placement_group(storage):
    with pytest.raises(TrainingFailedError, match="injected on_start failure"):
        _fit(
            PSTrainer,
            storage,
            "onstart",
            loop=loops.failing_loop,
            ps_config=loops.FailingStartConfig(),
        )
    assert loops.wait_until(lambda: loops.live_shards() == 0)
    assert loops.wait_until(lambda: loops.live_placement_groups() == 0)
    assert loops.wait_until(lambda: ray.available_resources().get("CPU") == 4.0)
