"""Trains with the installed wheel, not the source tree: run from outside the checkout.

Checks that the package (driver and Ray workers alike) comes from the install, and
that a two-worker sync PS fit ends with DDP's parameters.
"""

import json
import os
import sys
import tempfile

os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")

import ray  # noqa: E402
import ray.train  # noqa: E402
import ray.train.torch  # noqa: E402
import torch  # noqa: E402
from ray.train import RunConfig, ScalingConfig  # noqa: E402

import ray_ps_plugin  # noqa: E402
from ray_ps_plugin import PSConfig, PSTrainer  # noqa: E402

INSTALLED = sys.argv[1]


def loop(config: dict) -> None:
    import ray_ps_plugin as pkg

    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(ray.train.get_context().get_world_rank())
    for _ in range(5):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    weights = [p.detach().flatten().tolist() for p in model.module.parameters()]
    if ray.train.get_context().get_world_rank() == 0:
        # Result.metrics in Train V2 holds only metrics reported with a checkpoint.
        with open(config["out"], "w") as f:
            json.dump({"module_file": pkg.__file__, "weights": weights}, f)
    ray.train.report({"done": 1})


def fit(strategy: str, storage: str) -> dict:
    out = os.path.join(storage, f"{strategy}.json")
    PSTrainer(
        loop,
        train_loop_config={"out": out},
        ps_config=PSConfig(strategy=strategy),
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(storage_path=storage, name=f"smoke-{strategy}"),
    ).fit()
    with open(out) as f:
        return json.load(f)


def main() -> None:
    assert ray_ps_plugin.__file__.startswith(INSTALLED), ray_ps_plugin.__file__
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as storage:
        ps, ddp = fit("ps", storage), fit("ddp", storage)
    ray.shutdown()
    assert ps["module_file"].startswith(INSTALLED), ps["module_file"]
    diff = max(abs(a - b) for pa, pb in zip(ps["weights"], ddp["weights"]) for a, b in zip(pa, pb))
    assert diff < 1e-5, diff
    print(
        f"wheel smoke: trained from {os.path.dirname(ps['module_file'])}; "
        f"sync PS vs DDP max difference {diff:.1e}"
    )


if __name__ == "__main__":
    main()
