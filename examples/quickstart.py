"""Train one small model with DDP, then with the parameter-server strategy.

The training function is an ordinary Ray Train loop; only ``PSConfig(strategy=...)``
changes between the two runs. Runs on an embedded local Ray cluster, no data
download (synthetic classification data).

    python examples/quickstart.py [--steps 60] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")

import ray  # noqa: E402
import ray.train  # noqa: E402
import ray.train.torch  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from ray.train import RunConfig, ScalingConfig  # noqa: E402

from ray_ps_plugin import PSConfig, PSTrainer, get_ps_context  # noqa: E402


def make_data(n: int = 4096, dim: int = 64, classes: int = 8) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(classes, dim, generator=g) * 2
    y = torch.randint(0, classes, (n,), generator=g)
    x = centers[y] + torch.randn(n, dim, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def train_fn(config: dict[str, Any]) -> None:
    """An unchanged TorchTrainer loop: prepare_model, prepare_data_loader, Adam, report."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
    model = ray.train.torch.prepare_model(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    loader = ray.train.torch.prepare_data_loader(
        torch.utils.data.DataLoader(make_data(), batch_size=64, shuffle=True)
    )
    step, step_times, losses = 0, [], []
    while step < config["steps"]:
        for x, y in loader:
            t0 = time.perf_counter()
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step_times.append(time.perf_counter() - t0)
            losses.append(loss.item())
            step += 1
            if step >= config["steps"]:
                break
    ctx = get_ps_context()  # None under strategy="ddp"
    metrics = {
        "first_loss": losses[0],
        "final_loss": statistics.mean(losses[-10:]),
        "step_ms": 1e3 * statistics.median(step_times),
        "servers": ctx.num_servers if ctx else 0,
        "mb_pushed": ctx.stats.bytes_pushed / 1e6 if ctx else 0.0,
    }
    with tempfile.TemporaryDirectory() as d:
        checkpoint = None
        if ray.train.get_context().get_world_rank() == 0:
            torch.save(model.module.state_dict(), os.path.join(d, "model.pt"))
            checkpoint = ray.train.Checkpoint.from_directory(d)
        ray.train.report(metrics, checkpoint=checkpoint)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
    rows = {}
    with tempfile.TemporaryDirectory() as storage:
        for strategy in ("ddp", "ps"):
            trainer = PSTrainer(
                train_fn,
                train_loop_config={"steps": args.steps, "lr": args.lr},
                ps_config=PSConfig(strategy=strategy),
                scaling_config=ScalingConfig(num_workers=args.workers, resources_per_worker={"CPU": 1}),
                run_config=RunConfig(storage_path=storage, name=f"quickstart-{strategy}"),
            )
            rows[strategy] = trainer.fit().metrics
    ray.shutdown()

    print(f"\n{'strategy':<9} {'first loss':>10} {'final loss':>10} {'step (ms)':>10} {'servers':>8} {'MB pushed':>10}")
    for strategy, m in rows.items():
        print(
            f"{strategy:<9} {m['first_loss']:>10.4f} {m['final_loss']:>10.4f} {m['step_ms']:>10.2f} "
            f"{m['servers']:>8} {m['mb_pushed']:>10.2f}"
        )
    print("\nSame seeds, same maths: the loss columns agree; see docs/benchmarks.md for speed.")


if __name__ == "__main__":
    main()
