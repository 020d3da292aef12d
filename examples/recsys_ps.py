"""A recommendation model with sparse embedding tables, under DDP and then under the
parameter-server strategy.

Two ``nn.EmbeddingBag(sparse=True)`` tables feed a small MLP; ``SparseAdam`` steps
the tables and ``Adam`` the MLP, as recommendation code does. The ids follow a Zipf
law (a few rows are hot) and are generated in the process, so nothing is
downloaded. Only ``PSConfig(strategy=..., mode=...)`` changes between the runs: under
``mode="sync"`` each worker sends the shards only the rows its batch touched and
ends with DDP's parameters. With ``--sharded`` the PS runs build the tables on the
meta device: the shards hold them, each worker pulls the rows its batch needs and
holds none (compare the workers' peak memory with DDP's). With ``--sparse-optimizer
shards`` the sync run keeps the tables on every worker but has the shards apply
SparseAdam to them, once per row.

    python examples/recsys_ps.py [--steps 40] [--workers 2] [--modes sync async] [--sharded]
        [--sparse-optimizer shards]
"""

from __future__ import annotations

import os
import time
from typing import Any

os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.nn as nn
from _side_by_side import compare, parse_args, report, servers_up_to_date

from ray_ps_plugin import get_ps_context

ROWS, DIM, BAG, BATCH = 50_000, 32, 4, 128


class Recsys(nn.Module):
    def __init__(self, sharded: bool = False) -> None:
        super().__init__()
        device = "meta" if sharded else None  # meta: the tables live on the shards
        self.users = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True, device=device)
        self.items = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True, device=device)
        self.mlp = nn.Sequential(nn.Linear(2 * DIM, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.users(users), self.items(items)], dim=1)).squeeze(1)


def batch(step: int, rank: int) -> tuple[torch.Tensor, ...]:
    """Zipf-distributed ids and a click label that depends on them."""
    g = np.random.default_rng([step, rank])
    users = torch.from_numpy((g.zipf(1.3, size=(BATCH, BAG)) - 1) % ROWS)
    items = torch.from_numpy((g.zipf(1.3, size=(BATCH, BAG)) - 1) % ROWS)
    label = ((users[:, 0] + items[:, 0]) % 3 == 0).float()
    return users, items, label


def train_func(config: dict[str, Any]) -> None:
    torch.manual_seed(0)
    rank = ray.train.get_context().get_world_rank()
    # Under DDP every worker holds the tables; under PS with --sharded none does.
    sharded = config["sharded"] and get_ps_context() is not None
    net = Recsys(sharded)
    model = ray.train.torch.prepare_model(net)
    opts = [
        torch.optim.SparseAdam([net.users.weight, net.items.weight], lr=config["lr"]),
        torch.optim.Adam(net.mlp.parameters(), lr=config["lr"]),
    ]
    loss_fn = nn.functional.binary_cross_entropy_with_logits
    times = []
    for step in range(config["steps"]):
        users, items, label = batch(step, rank)
        t0 = time.perf_counter()
        for opt in opts:
            opt.zero_grad()
        loss_fn(model(users, items), label).backward()
        for opt in opts:
            opt.step()
        times.append(time.perf_counter() - t0)
    servers_up_to_date()
    with torch.no_grad():
        held_out = [batch(10_000 + i, 0) for i in range(4)]
        final = sum(loss_fn(model(u, i), y).item() for u, i, y in held_out) / len(held_out)
    report(net.state_dict(), final, times, config["steps"])


if __name__ == "__main__":
    args = parse_args(__doc__, steps=40, lr=1e-2, sharded_option=True)
    compare(train_func, args, "Sparse embedding tables (SparseAdam + Adam)", "recsys")
