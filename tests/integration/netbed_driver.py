"""Ray driver that test_netbed.py runs inside a network test bed's head namespace.

Trains a tiny model for a few steps with one worker per node, once under DDP and once
under PS sync, and writes each run's final parameters and placement (every worker's
node id; the PS shards' node ids) to the JSON file given as ``--out``.

    python tests/integration/netbed_driver.py --out runs.json [--steps 5]

Needs ``RAY_ADDRESS`` (set by the bed) and a cluster of at least two nodes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from ray.train import FailureConfig, RunConfig, ScalingConfig
from torch import nn

from ray_ps_plugin import PSConfig, PSTrainer, get_ps_context


def tiny_loop(config: dict[str, Any]) -> None:
    """A few SGD steps on per-rank data; rank 0 reports parameters and placement."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = ray.train.get_context().get_world_rank()
    # Different data on each rank, so that the averaged gradient differs from each
    # worker's own and an unsynchronised run would not match.
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(config["steps"]):
        x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 2, (16,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    ctx = get_ps_context()
    nodes: list[Any] = [None] * ray.train.get_context().get_world_size()
    dist.all_gather_object(nodes, ray.get_runtime_context().get_node_id())
    metrics = {
        "worker_nodes": nodes,
        "server_node_ids": list(ctx.server_node_ids) if ctx is not None else None,
        "params": {k: v.tolist() for k, v in model.module.state_dict().items()},
    }
    with tempfile.TemporaryDirectory() as d:
        checkpoint = None
        if rank == 0:
            # Train V2 keeps the metrics reported with the latest checkpoint.
            Path(d, "m.json").write_text(json.dumps(metrics))
            checkpoint = ray.train.Checkpoint.from_directory(d)
        ray.train.report(metrics if rank == 0 else {}, checkpoint=checkpoint)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
    t0 = time.monotonic()
    ray.init(log_to_driver=False)
    print(f"connected in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    runs = {}
    with tempfile.TemporaryDirectory() as storage:
        for name, cfg in {
            "ddp": PSConfig(strategy="ddp", timeout_s=60),
            "ps": PSConfig(strategy="ps", mode="sync", timeout_s=60, ps_timeout_s=60),
        }.items():
            result = PSTrainer(
                tiny_loop,
                train_loop_config={"steps": args.steps},
                ps_config=cfg,
                # One worker per node, on different nodes.
                scaling_config=ScalingConfig(
                    num_workers=2,
                    resources_per_worker={"CPU": 1},
                    placement_strategy="STRICT_SPREAD",
                ),
                run_config=RunConfig(
                    storage_path=storage, name=name, failure_config=FailureConfig(0)
                ),
            ).fit()
            runs[name] = dict(result.metrics)
            print(f"{name} done at {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    ray.shutdown()
    Path(args.out).write_text(json.dumps(runs))


if __name__ == "__main__":
    main()
