"""A PyTorch Lightning loop under DDP, then under the parameter-server strategy.

The training function is Ray Train's Lightning recipe, unchanged: ``pl.Trainer`` with
``RayDDPStrategy``, ``RayLightningEnvironment`` and ``prepare_trainer``. Only
``PSConfig(strategy=..., mode=...)`` changes between the runs: under
``strategy="ps"`` the ``DistributedDataParallel`` Lightning builds synchronises
through the server shards. Runs on an embedded local Ray cluster with synthetic data.

    python examples/lightning_ps.py [--steps 60] [--workers 2] [--modes sync async ssp]
"""

from __future__ import annotations

import os
import time
from typing import Any

os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")

import pytorch_lightning as pl
import torch
import torch.nn as nn
from _side_by_side import compare, parse_args, report, servers_up_to_date
from ray.train.lightning import (
    RayDDPStrategy,
    RayLightningEnvironment,
    prepare_trainer,
)


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

    servers_up_to_date()
    state = model.state_dict()  # async/ssp: installs the servers' parameters
    with torch.no_grad():
        final_loss = nn.functional.cross_entropy(model(data.tensors[0]), data.tensors[1])
    report(state, final_loss.item(), model.step_times, trainer.global_step)


if __name__ == "__main__":
    compare(train_fn, parse_args(__doc__, steps=60, lr=0.05), "Lightning", "lightning")
