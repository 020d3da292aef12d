"""DLRM as the field writes it, in every mode: step time, throughput with a straggler, loss.

The model is facebookresearch/dlrm's shape (``tests/integration/dlrm.py``): eight
``EmbeddingBag(mode="sum", sparse=True)`` tables of 100 to 200,000 rows x 16,
initialised from NumPy; a bottom MLP 13-64-16, dot interactions, a top MLP ending in
a sigmoid, binary cross-entropy; one ``torch.optim.SGD`` over every parameter (lr
0.1) under DLRM's warm-up and polynomial decay. Each worker's batch: 128 samples,
bags of 1-3 ids per table from a Zipf law, ids past a table's end clipped to its
last row. Two workers, one CPU and one torch thread each.

Per variant, one ``fit()`` records every step's end time on every worker. Step time
is the median over workers of each worker's median step; throughput is samples per
second over all workers while every worker is past warm-up and still training (as
``benchmarks/straggler.py`` counts it). With ``--sleep-ms`` rank 1 also sleeps that
long after every step: a straggler. Rank 0 reports the loss on a held-out batch
after the last step. Variants alternate within a round (each round starts one
later); ratios to DDP are taken within a round, medians over rounds.

    python benchmarks/dlrm.py --out benchmarks/results/dlrm_1x2.json
    python benchmarks/dlrm.py --sleep-ms 50 --variants ddp,ps_async,ps_ssp \\
        --out benchmarks/results/dlrm_1x2_straggler.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")

import ray
import ray.train
import ray.train.torch
import torch
from ray import cloudpickle
from ray.train import RunConfig, ScalingConfig

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
import _common

from ray_ps_plugin import PSConfig, PSTrainer, get_ps_context
from tests.integration import dlrm

cloudpickle.register_pickle_by_value(_common)
cloudpickle.register_pickle_by_value(dlrm)

VARIANTS: dict[str, dict[str, Any]] = {
    "ddp": {"strategy": "ddp"},
    "ps_sync": {"mode": "sync"},
    # The tables' SGD applied once, on the shards; every worker's copy written back.
    "ps_sync_shard_opt": {"mode": "sync", "sparse_optimizer": "shards"},
    # The default in async and ssp: rows looked up on the shards, stepped there.
    "ps_async": {"mode": "async"},
    # The same, its rows' pulls and pushes as Ray calls instead of frames.
    "ps_async_ray_calls": {"mode": "async", "data_path": "object_store"},
    # Async with the tables as plain parameters: their whole change pushed each step.
    "ps_async_workers": {"mode": "async", "sparse_optimizer": "workers"},
    "ps_ssp": {"mode": "ssp", "staleness": 4},
    "ps_diloco": {"mode": "diloco", "local_steps": 16},
}
DEFAULT_VARIANTS = "ddp,ps_sync,ps_sync_shard_opt,ps_async,ps_async_workers,ps_ssp,ps_diloco"
ROWS = [100, 500, 1000, 5000, 10_000, 20_000, 50_000, 200_000]


def bench_loop(config: dict[str, Any]) -> None:
    """DLRM's recipe for ``warmup + steps`` steps; every rank writes its step end
    times, rank 0 the held-out loss."""
    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    rows, batch = config["rows"], config["batch"]
    net = dlrm.DLRM(rows, seed=0)
    model = ray.train.torch.prepare_model(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    total = config["warmup"] + config["steps"]
    sched = dlrm.WarmupPolyDecay(opt, 10, total // 2, total - total // 2)
    loss_fn = torch.nn.BCELoss()
    sleep_s = config["sleep_s"] if rank == 1 else 0.0
    batches = [dlrm.batch(step, rank, rows, batch, 1.2, 0) for step in range(total)]
    ends, durations = [], []
    for dense, ids, offsets, label in batches:
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(dense, ids, offsets), label).backward()
        opt.step()
        sched.step()
        durations.append(time.perf_counter() - t0)
        if sleep_s:
            time.sleep(sleep_s)
        ends.append(time.time())
    ctx = get_ps_context()
    if ctx is not None:
        ctx.flush()
    out: dict[str, Any] = {
        "rank": rank,
        "ends": ends,
        "median_step_s": statistics.median(durations[config["warmup"] :]),
    }
    if rank == 0:
        held_out = [dlrm.batch(10_000 + i, 0, rows, 512, 1.2, 0) for i in range(4)]
        with torch.no_grad():
            out["held_out_loss"] = statistics.fmean(
                loss_fn(model(d, i, o), y).item() for d, i, o, y in held_out
            )
    Path(config["out_dir"], f"rank{rank}.json").write_text(json.dumps(out))
    ray.train.report({"done": True})


def run_variant(name: str, args: argparse.Namespace, storage: str) -> dict[str, Any]:
    """One ``fit()`` of ``name``: step time, throughput in the common window, loss."""
    with tempfile.TemporaryDirectory() as out_dir:
        PSTrainer(
            bench_loop,
            ps_config=PSConfig(**VARIANTS[name]),
            train_loop_config={
                "rows": ROWS,
                "batch": args.batch,
                "steps": args.steps,
                "warmup": args.warmup,
                "sleep_s": args.sleep_ms / 1e3,
                "out_dir": out_dir,
            },
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(storage_path=storage, name=f"dlrm-{name}-{time.time_ns()}"),
        ).fit()
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json"))]
    t0 = max(r["ends"][args.warmup - 1] for r in ranks)
    t1 = min(r["ends"][-1] for r in ranks)
    steps = sum(sum(1 for t in r["ends"] if t0 < t <= t1) for r in ranks)
    return {
        "median_step_s": statistics.median(r["median_step_s"] for r in ranks),
        "samples_per_s": steps * args.batch / (t1 - t0),
        "held_out_loss": ranks[0]["held_out_loss"],
    }


def summarize(rounds: list[dict[str, Any]], variants: list[str]) -> dict[str, Any]:
    """Per variant: medians over rounds of step time, throughput, loss, and of the
    ratios to DDP's within each round."""
    out = {}
    for name in variants:
        runs = [r[name] for r in rounds]
        entry = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        if "ddp" in variants:
            entry["step_ratio_to_ddp"] = statistics.median(
                r[name]["median_step_s"] / r["ddp"]["median_step_s"] for r in rounds
            )
            entry["throughput_ratio_to_ddp"] = statistics.median(
                r[name]["samples_per_s"] / r["ddp"]["samples_per_s"] for r in rounds
            )
        out[name] = entry
    return out


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--sleep-ms", type=float, default=0.0, help="rank 1 sleeps after each step")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; choose from {sorted(VARIANTS)}")
    ray.init(num_cpus=2)
    storage = tempfile.mkdtemp(prefix="dlrm-")
    rounds = []
    for i in range(args.rounds):
        rounds.append(
            _common.run_rotated(variants, i, lambda name: run_variant(name, args, storage))
        )
        print(f"round {i + 1}: " + json.dumps(rounds[-1]), flush=True)
    summary = summarize(rounds, variants)
    for name, entry in summary.items():
        print(name, json.dumps(entry))
    if args.out:
        result = {
            **_common.machine_info(),
            "args": {k: v for k, v in vars(args).items() if k != "out"},
            "rows": ROWS,
            "summary": summary,
            "rounds": rounds,
        }
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
