"""The digits task: scikit-learn's bundled 8x8 digits, a small MLP.

No download: the data ships inside scikit-learn. Shipped to workers by value.
"""

import dataclasses
import json
import time
from typing import Any

import numpy as np
import ray
import ray.train
import ray.train.collective
import ray.train.torch
import torch
import torch.nn as nn

from ray_ps_plugin import get_ps_context
from tests.integration.loops import report_with_model, run_servers


def load_digits_split(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Train/test tensors (70/30 split, features scaled to [0, 1])."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(x))
    x = torch.tensor(x[order] / 16.0, dtype=torch.float32)
    y = torch.tensor(y[order], dtype=torch.long)
    cut = int(0.7 * len(x))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def make_optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}")


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def digits_loop(config: dict[str, Any]) -> None:
    """An ordinary Ray Train loop: prepare_model, optimizer, scheduler, report.

    Config: epochs, lr, optimizer ("sgd"|"adam"), batch_size, step_sleep_s and
    slow_rank (an injected straggler), seed.
    """
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(config.get("seed", 0))
    device = ray.train.torch.get_device()  # a GPU under use_gpu=True
    xtr, ytr, xte, yte = (t.to(device) for t in load_digits_split())
    xtr, ytr = xtr[rank::world], ytr[rank::world]
    model = ray.train.torch.prepare_model(make_model())
    opt = make_optimizer(config.get("optimizer", "sgd"), model.parameters(), config["lr"])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=config.get("lr_step", 100), gamma=0.5)
    bs = config.get("batch_size", 32)
    sleep_s = config.get("step_sleep_s", 0.0) if rank == config.get("slow_rank", -1) else 0.0
    g = torch.Generator().manual_seed(config.get("seed", 0) + rank)
    start = time.perf_counter()
    steps = 0
    for _ in range(config["epochs"]):
        order = torch.randperm(len(xtr), generator=g)
        for i in range(0, len(order) - bs + 1, bs):
            idx = order[i : i + bs]
            loss = nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            steps += 1
            if sleep_s:
                time.sleep(sleep_s)
    elapsed = time.perf_counter() - start
    metrics = {
        "accuracy": accuracy(model, xte, yte),
        "steps": steps,
        "elapsed_s": elapsed,
        "lr": opt.param_groups[0]["lr"],
    }
    ps = get_ps_context()
    if ps is not None and config.get("final_barrier"):
        # The documented recipe for a final checkpoint with every worker's last
        # update: flush on all workers, then a barrier.
        ps.flush()
        ray.train.collective.barrier()
        if rank == 0 and ps.mode != "sync":
            metrics["probe"] = probe_servers(model)
    if ps is not None:
        metrics["ps"] = dataclasses.asdict(ps.stats)
    if config.get("out_dir"):
        # Result.metrics holds rank 0's report only; every rank leaves its own here.
        with open(f"{config['out_dir']}/rank{rank}.json", "w") as f:
            json.dump(metrics, f)
    report_with_model(model, metrics)


def probe_servers(model: nn.Module) -> dict[str, Any]:
    """Rank 0, async/ssp: the checkpoint equals the shards' parameters, and a
    redelivered push changes nothing. Reaches into the run's shard handles."""
    servers = run_servers()
    saved = model.module.state_dict()  # pulls the shards' current parameters
    flat_saved = torch.cat([v.reshape(-1) for k, v in saved.items()])
    clock = get_ps_context().stats.clock
    pulled = [ray.get(s.pull.remote(0, 0, clock), timeout=30) for s in servers]
    flat_server = torch.from_numpy(np.concatenate([r[0] for r in pulled]))
    # Redeliver rank 0's last update (same clock) with a huge delta: must be ignored.
    bounds = [0, *list(np.cumsum([r[0].size for r in pulled]))]
    replies = [
        ray.get(s.push_pull.remote(0, 0, clock, np.full(b - a, 1e6, dtype=np.float32)), timeout=30)
        for s, a, b in zip(servers, bounds, bounds[1:])
    ]
    flat_after = torch.from_numpy(np.concatenate([r[0] for r in replies]))
    stats = [ray.get(s.stats.remote(), timeout=30) for s in servers]
    reads = [ray.get(s.reads.remote(), timeout=30) for s in servers]
    return {
        "checkpoint_vs_server": (flat_saved - flat_server).abs().max().item(),
        "duplicate_changed": (flat_after - flat_server).abs().max().item(),
        "duplicates": sum(st["duplicates"] for st in stats),
        "pushes": sum(st["pushes"] for st in stats),
        "max_read_gap": max(c - m for r in reads for _, c, m in r),
        "max_read_gap_counter": max(st["max_read_gap"] for st in stats),
        "reads": sum(len(r) for r in reads),
        "rounds": [st["rounds"].get(0, 0) for st in stats if "rounds" in st],
    }
