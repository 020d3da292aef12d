"""The GPU path: NCCL process group, CUDA buckets staged through host memory.

Needs two GPUs in the test cluster; skipped otherwise (and on CI). Run with
``pytest -m gpu tests/integration/test_gpu.py`` on a GPU machine. The test cluster
has two simulated nodes: on a machine with one GPU each node reports it, the two
workers land on different nodes and share the device. NCCL refuses two ranks on one
device, so the process group is then Gloo (which takes CUDA tensors); the plugin's
CUDA buckets, staged through host memory, are the same either way.
"""

import pytest
import ray
import torch
from ray.train import FailureConfig, RunConfig, ScalingConfig

from ray_ps_plugin import PSConfig, PSTrainer
from tests.integration import digits, loops

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("ray_cluster")]


@pytest.fixture(scope="module")
def gpu_scaling(ray_cluster):
    if ray.cluster_resources().get("GPU", 0) < 2:
        pytest.skip("needs 2 GPUs in the Ray cluster")
    return ScalingConfig(num_workers=2, use_gpu=True)


def _fit(storage, name, loop, config, scaling, **ps):
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    return PSTrainer(
        loop,
        train_loop_config=config,
        ps_config=PSConfig(backend=backend, **ps),
        scaling_config=scaling,
        run_config=RunConfig(storage_path=storage, name=name, failure_config=FailureConfig(0)),
    ).fit()


def test_sync_ps_on_gpus_equals_ddp(gpu_scaling, storage):
    ddp = _fit(
        storage, "gpu_ddp", loops.equivalence_loop, {"steps": 20}, gpu_scaling, strategy="ddp"
    )
    ps = _fit(storage, "gpu_ps", loops.equivalence_loop, {"steps": 20}, gpu_scaling)
    a, b = loops.load_state(ddp), loops.load_state(ps)
    assert max((a[k].double().cpu() - b[k].double().cpu()).abs().max().item() for k in a) <= 1e-5


# The CPU tests' digits run (test_modes): 95 steps per worker, StepLR halving every 40.
DIGITS = {"epochs": 5, "lr": 0.05, "optimizer": "sgd", "lr_step": 40}


@pytest.fixture(scope="module")
def ddp_digits(gpu_scaling, tmp_path_factory):
    storage = str(tmp_path_factory.mktemp("gpu_ddp_digits"))
    return _fit(storage, "gpu_ddp_digits", digits.digits_loop, DIGITS, gpu_scaling, strategy="ddp")


# The bounds are the CPU tests' (test_modes): async against sync within 2 points
# (updates interleave differently every run), 16-bit sync within 1.
@pytest.mark.parametrize(
    ("ps", "points"),
    [({"mode": "async"}, 0.02), ({"mode": "sync", "compression": "bf16"}, 0.01)],
)
def test_other_modes_train_on_gpus(gpu_scaling, ddp_digits, storage, ps, points):
    result = _fit(storage, f"gpu_{ps['mode']}", digits.digits_loop, DIGITS, gpu_scaling, **ps)
    reference = ddp_digits.metrics["accuracy"]
    assert result.metrics["accuracy"] >= reference - points, (result.metrics, reference)
