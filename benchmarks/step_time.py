"""Step time of compute-only, DDP and the PS variants on the reference MLP.

The variants (``VARIANTS`` below: compute only, DDP, PS sync through shared memory,
through the object store, with 4 MiB chunks, with bf16 compression, and async with
and without bf16) are run in alternation (compute, DDP, PS, compute, DDP, PS, ...) so
drifts of the machine hit them alike; each ratio is taken within one round and the
table shows the median over rounds. ``--variants`` picks which PS variants run next
to compute and DDP. Also reports bytes moved per worker per step
against the minimum (push + pull of one model's gradients).

    python benchmarks/step_time.py            # reference: 3 rounds x 40 steps
    python benchmarks/step_time.py --quick    # smoke run

Reference model: MLP 784-2048-2048-10 (5.8 M params), batch 32,
2 CPU workers with 1 torch thread each.
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
from ray import cloudpickle
from ray.train import RunConfig, ScalingConfig

sys.path.insert(0, str(Path(__file__).parent))
import _common

from ray_ps_plugin import PSConfig, PSTrainer, get_ps_context

cloudpickle.register_pickle_by_value(_common)


def bench_loop(config: dict[str, Any]) -> None:
    model, times = _common.prepared_mlp_steps(config, lr=1e-3)
    ctx = get_ps_context()
    stats = ctx.stats if ctx is not None else None
    metrics = {
        "median_step_s": statistics.median(times),
        "steps_synced": stats.steps if stats else 0,
        # Remote calls this worker made to the shards (one per chunk; each both
        # pushes and pulls), to check "at most 2 per step per shard".
        "calls_per_step_per_shard": (
            stats.pushes / max(1, stats.steps) / ctx.num_servers if stats else 0
        ),
        "bytes_moved": (stats.bytes_pushed + stats.bytes_pulled) if stats else 0,
        "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }
    with tempfile.TemporaryDirectory() as d:
        Path(d, "m.json").write_text(json.dumps(metrics))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))


VARIANTS = {
    "compute": (PSConfig(strategy="ddp"), False),
    "ddp": (PSConfig(strategy="ddp"), True),
    "ps_sync": (PSConfig(strategy="ps", mode="sync"), True),
    # Same, every byte through Ray's object store instead of shared memory.
    "ps_sync_objstore": (PSConfig(strategy="ps", mode="sync", shared_memory=False), True),
    # Same, with 4 MiB chunks instead of the 16 MiB default: shows what chunking costs.
    "ps_sync_4mib": (PSConfig(strategy="ps", mode="sync", chunk_bytes=4 << 20), True),
    # 16-bit wire format: half the bytes, fp32 sums on the shards.
    "ps_sync_bf16": (PSConfig(strategy="ps", mode="sync", compression="bf16"), True),
    "ps_async": (PSConfig(strategy="ps", mode="async"), True),
    "ps_async_bf16": (PSConfig(strategy="ps", mode="async", compression="bf16"), True),
    # Every shard's state held twice (a replica per shard, in the other worker's
    # bundle): what replication costs a step, against the same mode without it.
    "ps_async_replicated": (PSConfig(strategy="ps", mode="async", shard_replicas=1), True),
    "ps_ssp": (PSConfig(strategy="ps", mode="ssp", staleness=2), True),
    "ps_ssp_replicated": (
        PSConfig(strategy="ps", mode="ssp", staleness=2, shard_replicas=1),
        True,
    ),
}

#: The default run's variants (``--variants``): the replication pairs run on their
#: own, into ``replication_step_time.json``.
DEFAULT_VARIANTS = [v for v in VARIANTS if v != "ps_ssp" and not v.endswith("_replicated")]


def run_variant(name: str, args: argparse.Namespace, storage: str) -> dict[str, Any]:
    cfg, sync = VARIANTS[name]
    result = PSTrainer(
        bench_loop,
        ps_config=cfg,
        train_loop_config={
            "sync": sync,
            "width": args.width,
            "steps": args.steps,
            "warmup": args.warmup,
        },
        scaling_config=ScalingConfig(num_workers=args.workers, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=storage, name=f"{name}-{time.time_ns()}"),
    ).fit()
    return dict(result.metrics)


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    """Parses and checks the command line; ``--quick`` shrinks the run.

    Returns:
        The arguments, and the variants to run (compute, ddp and ps_sync first).
    """
    p = _common.parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--quick", action="store_true", help="1 round, 10 steps, width 512")
    p.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help="comma-separated subset to run (compute, ddp and ps_sync are always run)",
    )
    p.add_argument("--out", default="benchmarks/results/step_time.json")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.steps, args.width = 1, 10, 512
    names = list(dict.fromkeys(["compute", "ddp", "ps_sync", *args.variants.split(",")]))
    _common.check_variants(p, names, VARIANTS)
    return args, names


def summarize(
    rounds: list[dict[str, dict[str, Any]]], names: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    """The results to store: step times, ratios, ps_sync's bytes and calls, every round.

    Args:
        rounds: Per round, every variant's rank-0 metrics.
        names: The variants.
        args: The command line.

    Returns:
        The results, keyed as ``tools/_render`` reads them.
    """
    ps = rounds[-1]["ps_sync"]
    bytes_per_step = ps["bytes_moved"] / max(1, ps["steps_synced"])
    minimum = 2 * ps["model_bytes"]
    return {
        **_common.machine_info(),
        "args": vars(args),
        "median_step_ms": {
            k: _common.round_median(rounds, k, "median_step_s") * 1e3 for k in names
        },
        "ratio_ps_to_ddp": _common.round_ratio(rounds, "ps_sync", "ddp", "median_step_s"),
        "ratio_ddp_to_compute": _common.round_ratio(rounds, "ddp", "compute", "median_step_s"),
        "ratio_ps_to_compute": _common.round_ratio(rounds, "ps_sync", "compute", "median_step_s"),
        "ps_bytes_per_worker_step": bytes_per_step,
        "min_bytes_per_worker_step": minimum,
        "bytes_over_minimum": bytes_per_step / minimum,
        "calls_per_step_per_shard": ps["calls_per_step_per_shard"],
        # 16-bit compression: against half the fp32 minimum.
        "bf16_bytes_over_half_minimum": (
            rounds[-1]["ps_sync_bf16"]["bytes_moved"]
            / max(1, rounds[-1]["ps_sync_bf16"]["steps_synced"])
            / (minimum / 2)
            if "ps_sync_bf16" in names
            else None
        ),
        "rounds": rounds,
    }


def print_report(
    summary: dict[str, Any], rounds: list[dict[str, dict[str, Any]]], names: list[str]
) -> None:
    """Prints the table of step times and ratios to DDP, then ps_sync's bytes and calls.

    Args:
        summary: The results of :func:`summarize`.
        rounds: Per round, every variant's rank-0 metrics.
        names: The variants.
    """
    print("\n| variant | median step (ms) | ratio to DDP (median of rounds) |")
    print("|---|---|---|")
    for k in names:
        r = _common.round_ratio(rounds, k, "ddp", "median_step_s")
        print(f"| {k} | {summary['median_step_ms'][k]:.1f} | {r:.2f}x |")
    bytes_per_step = summary["ps_bytes_per_worker_step"]
    minimum = summary["min_bytes_per_worker_step"]
    print(
        f"\nbytes per worker per step (PS): {bytes_per_step / 1e6:.2f} MB; minimum "
        f"(push + pull of one model): {minimum / 1e6:.2f} MB; ratio {bytes_per_step / minimum:.3f}"
    )
    print(
        "remote calls per worker per step per shard (ps_sync): "
        f"{summary['calls_per_step_per_shard']:.2f}"
    )


def main() -> None:
    """Runs the variants in rounds, stores the results and prints their table."""
    args, names = parse_args()
    ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as storage:
        rounds = _common.run_rounds(
            names, args.rounds, lambda name: run_variant(name, args, storage), "median_step_s"
        )
    ray.shutdown()
    summary = summarize(rounds, names, args)
    out = _common.write_json(args.out, summary)
    print_report(summary, rounds, names)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
