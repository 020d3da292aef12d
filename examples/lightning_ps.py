"""A PyTorch Lightning loop under DDP, then under the parameter-server strategy.

The training function is Ray Train's Lightning recipe, unchanged: ``pl.Trainer`` with
``RayDDPStrategy``, ``RayLightningEnvironment`` and ``prepare_trainer``. Only
``PSConfig(strategy=..., mode=...)`` changes between the runs: under
``strategy="ps"`` the ``DistributedDataParallel`` Lightning builds synchronises
through the server shards. Runs on an embedded local Ray cluster with synthetic data.

    python examples/lightning_ps.py [--steps 100] [--workers 2] [--modes sync async ssp]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")

import pytorch_lightning as pl
import ray
import ray.train
import ray.train.collective
import torch
import torch.nn as nn
from ray.train import RunConfig, ScalingConfig
from ray.train.lightning import (
    RayDDPStrategy,
    RayLightningEnvironment,
    prepare_trainer,
)

from ray_ps_plugin import PSConfig, PSTrainer, get_ps_context


def make_data(n: int = 2048, dim: int = 32, classes: int = 8) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(classes, dim, generator=g) * 0.4
    y = torch.randint(0, classes, (n,), generator=g)
    x = centers[y] + torch.randn(n, dim, generator=g)
    return torch.utils.data.TensorDataset(x, y)


class Classifier(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 8))
        self.lr = lr
        self.step_times: list[float] = []
        self._t0 = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def on_train_batch_start(self, *args: Any) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.step_times.append(time.perf_counter() - self._t0)


def train_fn(config: dict[str, Any]) -> None:
    """Ray Train's Lightning recipe; nothing here names the plugin but the report."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Classifier(config["lr"])
    data = make_data()
    trainer = pl.Trainer(
        max_steps=config["steps"],
        accelerator="cpu",
        devices="auto",
        strategy=RayDDPStrategy(),
        plugins=[RayLightningEnvironment()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    trainer = prepare_trainer(trainer)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=32, shuffle=True))

    ctx = get_ps_context()  # None under strategy="ddp"
    if ctx is not None:
        # Every worker's last update on the servers before the final evaluation.
        ctx.flush()
        ray.train.collective.barrier()
    state = model.state_dict()  # async/ssp: installs the servers' parameters
    with torch.no_grad():
        final_loss = nn.functional.cross_entropy(model(data.tensors[0]), data.tensors[1])
    metrics = {
        "final_loss": final_loss.item(),
        "step_ms": 1e3 * statistics.median(model.step_times),
        "kb_pushed": ctx.stats.bytes_pushed / 1e3 if ctx else 0.0,
        "steps": trainer.global_step,
    }
    with tempfile.TemporaryDirectory() as d:
        checkpoint = None
        if ray.train.get_context().get_world_rank() == 0:
            torch.save(state, os.path.join(d, "model.pt"))
            checkpoint = ray.train.Checkpoint.from_directory(d)
        ray.train.report(metrics, checkpoint=checkpoint)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--modes", nargs="+", default=["sync", "async"])
    args = parser.parse_args()

    # address="local": always a fresh embedded cluster, never one found on the machine.
    ray.init(address="local", num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
    runs = [("ddp", "sync")] + [("ps", mode) for mode in args.modes]
    rows, states = {}, {}
    with tempfile.TemporaryDirectory() as storage:
        for strategy, mode in runs:
            trainer = PSTrainer(
                train_fn,
                train_loop_config={"steps": args.steps, "lr": args.lr},
                ps_config=PSConfig(strategy=strategy, mode=mode),
                scaling_config=ScalingConfig(
                    num_workers=args.workers, resources_per_worker={"CPU": 1}
                ),
                run_config=RunConfig(storage_path=storage, name=f"lightning-{strategy}-{mode}"),
            )
            label = "ddp" if strategy == "ddp" else f"ps/{mode}"
            result = trainer.fit()
            with result.checkpoint.as_directory() as d:
                states[label] = torch.load(os.path.join(d, "model.pt"), weights_only=True)
            rows[label] = result.metrics
    ray.shutdown()

    print(f"\nLightning, {args.workers} workers, {args.steps} steps")
    print(
        f"{'strategy':<10} {'final loss':>10} {'step (ms)':>10} {'kB pushed':>10} "
        f"{'max |param - DDP param|':>24}"
    )
    for label, m in rows.items():
        diff = max(
            (states[label][k].double() - states["ddp"][k].double()).abs().max().item()
            for k in states["ddp"]
            if states["ddp"][k].is_floating_point()
        )
        print(
            f"{label:<10} {m['final_loss']:>10.4f} {m['step_ms']:>10.2f} "
            f"{m['kb_pushed']:>10.1f} {diff:>24.3g}"
        )
    print("\nSame Lightning code in every row; ps/sync ends with DDP's parameters.")


if __name__ == "__main__":
    main()
