"""A DLRM-shaped model and loop written the way facebookresearch/dlrm writes them.

Several ``nn.EmbeddingBag(mode="sum", sparse=True)`` tables of different sizes
initialised from NumPy, a bottom MLP over 13 dense features, dot interactions
between the pooled vectors and the bottom output, a top MLP, binary cross-entropy;
one ``torch.optim.SGD`` over every parameter under the repository's warm-up then
polynomial-decay policy. Ids are drawn from a Zipf law, several per bag, and ids
past a table's end are clipped to its last row (so that row is hot), as DLRM's
synthetic generator does with its ``--data-generation`` traces.

Shipped by value to the workers (the tests package is not importable there).
"""

from __future__ import annotations

import tempfile
from typing import Any

import numpy as np
import ray.train
import ray.train.torch
import torch
from torch import nn

DENSE = 13
DIM = 16


def _linear(rng: np.random.Generator, n: int, m: int) -> nn.Linear:
    """DLRM's create_mlp: weights N(0, sqrt(2 / (m + n))), biases N(0, sqrt(1 / m))."""
    layer = nn.Linear(n, m)
    layer.weight.data = torch.tensor(
        rng.normal(0.0, np.sqrt(2 / (m + n)), size=(m, n)).astype(np.float32)
    )
    layer.bias.data = torch.tensor(rng.normal(0.0, np.sqrt(1 / m), size=m).astype(np.float32))
    return layer


class DLRM(nn.Module):
    """Tables, bottom MLP, pairwise dot interactions, top MLP ending in a sigmoid."""

    def __init__(self, rows: list[int], seed: int) -> None:
        super().__init__()
        rng = np.random.default_rng(seed)
        self.tables = nn.ModuleList()
        for n in rows:
            bag = nn.EmbeddingBag(n, DIM, mode="sum", sparse=True)
            bound = np.sqrt(1 / n)  # DLRM's create_emb: uniform(-sqrt(1/n), sqrt(1/n))
            values = rng.uniform(-bound, bound, size=(n, DIM)).astype(np.float32)
            bag.weight.data = torch.tensor(values, requires_grad=True)
            self.tables.append(bag)
        self.bottom = nn.Sequential(
            _linear(rng, DENSE, 64), nn.ReLU(), _linear(rng, 64, DIM), nn.ReLU()
        )
        pairs = (len(rows) + 1) * len(rows) // 2
        self.top = nn.Sequential(
            _linear(rng, DIM + pairs, 64), nn.ReLU(), _linear(rng, 64, 1), nn.Sigmoid()
        )

    def forward(self, dense: torch.Tensor, ids: list[torch.Tensor], offsets: list[torch.Tensor]):
        x = self.bottom(dense)
        pooled = [t(i, o) for t, i, o in zip(self.tables, ids, offsets)]
        t = torch.stack([x, *pooled], dim=1)  # (batch, 1 + tables, dim)
        z = torch.bmm(t, t.transpose(1, 2))
        li, lj = torch.tril_indices(t.shape[1], t.shape[1], offset=-1)
        return self.top(torch.cat([x, z[:, li, lj]], dim=1)).squeeze(1)


class WarmupPolyDecay(torch.optim.lr_scheduler.LRScheduler):
    """DLRM's LRPolicyScheduler: a linear warm-up, the rate it reached held until
    the decay starts, then a square-law decay to ``1e-7``."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup: int, decay_start: int, decay: int):
        self.warmup, self.decay_start, self.decay = warmup, decay_start, decay
        self.held: list[float] | None = None
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        n = self._step_count
        if n < self.warmup:
            scale = 1.0 - (self.warmup - n) / self.warmup
            self.held = [lr * scale for lr in self.base_lrs]
        elif self.decay_start <= n < self.decay_start + self.decay:
            scale = ((self.decay - (n - self.decay_start)) / self.decay) ** 2
            self.held = [max(1e-7, lr * scale) for lr in self.base_lrs]
        return self.held if self.held is not None else list(self.base_lrs)


def batch(
    step: int, rank: int, rows: list[int], n: int, zipf: float, seed: int
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """One worker's batch: dense features, per table the bags' ids (1-3 ids per bag,
    Zipf, clipped to the last row) and offsets, and a click label that depends on
    both."""
    rng = np.random.default_rng([seed, step, rank])
    dense = torch.from_numpy(rng.standard_normal((n, DENSE)).astype(np.float32))
    ids, offsets = [], []
    score = dense[:, 0].clone()
    for t, size in enumerate(rows):
        lengths = rng.integers(1, 4, size=n)
        drawn = np.minimum(rng.zipf(zipf, size=int(lengths.sum())) - 1, size - 1)
        ids.append(torch.from_numpy(drawn.astype(np.int64)))
        offsets.append(torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)[:-1]])))
        first = torch.from_numpy(drawn[offsets[-1].numpy()])
        score += ((first % 3 == t % 3).float() - 0.5) * 0.5
    label = (score > 0).float()
    return dense, ids, offsets, label


def dlrm_loop(config: dict[str, Any]) -> None:
    """For each seed of ``seeds``, a model trained for ``steps`` SGD steps (DLRM's
    recipe: one SGD over every parameter, ``lr`` 0.1, BCE, warm-up then decay from
    half-way); every rank reports its final parameters as ``rank{r}.pt``, a list
    with one state dict per seed."""
    rows = list(config["rows"])
    rank = ray.train.get_context().get_world_rank()
    steps = config["steps"]
    finals, losses = [], []
    for seed in config.get("seeds", [0]):
        net = DLRM(rows, seed)
        model = ray.train.torch.prepare_model(net)
        opt = torch.optim.SGD(net.parameters(), lr=config.get("lr", 0.1))
        sched = WarmupPolyDecay(opt, config.get("warmup", 10), steps // 2, steps - steps // 2)
        loss_fn = nn.BCELoss()
        for step in range(steps):
            dense, ids, offsets, label = batch(
                step, rank, rows, config.get("batch", 128), config.get("zipf", 1.2), seed
            )
            opt.zero_grad()
            loss = loss_fn(model(dense, ids, offsets), label)
            loss.backward()
            opt.step()
            sched.step()
        finals.append({k: v.detach().clone() for k, v in net.state_dict().items()})
        losses.append(loss.item())
    with tempfile.TemporaryDirectory() as d:
        torch.save(finals, f"{d}/rank{rank}.pt")
        ray.train.report(
            {"losses": losses, "rank": rank},
            checkpoint=ray.train.Checkpoint.from_directory(d),
        )


def final_parameters(result: ray.train.Result, world: int) -> list[list[dict[str, torch.Tensor]]]:
    """Per rank, the per-seed state dicts :func:`dlrm_loop` reported."""
    with result.checkpoint.as_directory() as d:
        return [torch.load(f"{d}/rank{r}.pt", weights_only=True) for r in range(world)]
