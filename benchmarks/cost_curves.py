"""Cost curves: step time, bytes per step and peak memory against model size and workers.

Sweeps the reference MLP's width (about 1 M to 50 M parameters) and the number of
workers (1, 2, 4) on a simulated two-node cluster (``ray.cluster_utils.Cluster``: two
raylets, two object stores, one machine), for compute-only, DDP, PS-sync, PS-sync
with bf16 compression and PS-async. Each point is one ``fit()`` of a few steps; rank 0
reports the median step time, the bytes it moved per step (all, and across nodes) and
its peak resident memory. Writes a CSV and a PNG (step time against parameters, one
panel per worker count).

    python benchmarks/cost_curves.py              # 4 sizes x 3 worker counts x 5 variants
    python benchmarks/cost_curves.py --quick      # 2 sizes x 2 worker counts

With one worker ``prepare_model`` does not wrap the model, so DDP and PS cost what
compute-only costs: the curves start at the single-worker floor.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
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
from ray.cluster_utils import Cluster
from ray.train import RunConfig, ScalingConfig

sys.path.insert(0, str(Path(__file__).parent))
import _common

from ray_ps_plugin import PSConfig, PSTrainer, get_ps_context

cloudpickle.register_pickle_by_value(_common)

VARIANTS = {
    "compute": (PSConfig(strategy="ddp"), False),
    "ddp": (PSConfig(strategy="ddp"), True),
    "ps_sync": (PSConfig(strategy="ps", mode="sync"), True),
    # 16-bit on the wire: halves what crosses nodes (shared memory stays fp32).
    "ps_sync_bf16": (PSConfig(strategy="ps", mode="sync", compression="bf16"), True),
    "ps_async": (PSConfig(strategy="ps", mode="async"), True),
}


def width_for(params_m: float) -> int:
    """Hidden width of the 784-w-w-10 MLP with about ``params_m`` million parameters."""
    # w^2 + 796 w + 10 ≈ params: solve the quadratic.
    p = params_m * 1e6
    return max(16, int((-796 + (796**2 + 4 * p) ** 0.5) / 2))


def loop(config: dict[str, Any]) -> None:
    model, times = _common.prepared_mlp_steps(config, lr=1e-4)
    ctx = get_ps_context()
    stats = ctx.stats if ctx is not None else None
    metrics = {
        "median_step_s": statistics.median(times),
        "bytes_per_step": (stats.bytes_pushed + stats.bytes_pulled) / max(1, stats.steps)
        if stats
        else 0.0,
        "cross_node_bytes_per_step": stats.bytes_cross_node / max(1, stats.steps) if stats else 0.0,
        # Linux reports ru_maxrss in KiB.
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "params": sum(p.numel() for p in model.parameters()),
    }
    with tempfile.TemporaryDirectory() as d:
        Path(d, "m.json").write_text(json.dumps(metrics))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))


def parse_args() -> argparse.Namespace:
    """Parses the command line; ``--quick`` shrinks the sweep."""
    p = _common.parser(__doc__)
    p.add_argument("--sizes", default="1,6,25,50", help="millions of parameters")
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="sizes 1,6; workers 1,2")
    p.add_argument("--out", default="benchmarks/results/cost_curves.csv")
    p.add_argument("--plot", default="docs/img/cost_curves.png")
    args = p.parse_args()
    if args.quick:
        args.sizes, args.workers = "1,6", "1,2"
    return args


def start_cluster() -> Cluster:
    """Starts the simulated two-node cluster and connects this driver to it."""
    # Two simulated nodes of 2 logical CPUs each; workers take 0.5 CPU, so 4 workers
    # spread over both nodes (SPREAD) and every run fits.
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False}
    )
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster


def run_point(
    name: str, size: float, w: int, args: argparse.Namespace, storage: str
) -> dict[str, Any]:
    """One ``fit()`` of variant ``name`` at about ``size`` million parameters on ``w``
    workers.

    Args:
        name: The variant.
        size: Millions of parameters.
        w: Workers.
        args: The command line.
        storage: Ray Train's storage path.

    Returns:
        The CSV row: variant, workers, parameters, step time, bytes and peak memory.
    """
    cfg, sync = VARIANTS[name]
    result = PSTrainer(
        loop,
        ps_config=cfg,
        train_loop_config={
            "sync": sync,
            "width": width_for(size),
            "steps": args.steps,
            "warmup": args.warmup,
        },
        scaling_config=ScalingConfig(
            num_workers=w,
            resources_per_worker={"CPU": 0.5},
            placement_strategy="SPREAD",
        ),
        run_config=RunConfig(storage_path=storage, name=f"{name}-{time.time_ns()}"),
    ).fit()
    m = result.metrics
    return {
        "variant": name,
        "workers": w,
        "params": m["params"],
        "step_ms": m["median_step_s"] * 1e3,
        "bytes_per_step": m["bytes_per_step"],
        "cross_node_bytes_per_step": m["cross_node_bytes_per_step"],
        "peak_rss_mb": m["peak_rss_mb"],
    }


def sweep(
    sizes: list[float], workers: list[int], variants: list[str], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Runs every (size, worker count, variant) point, printing each row as it ends.

    Args:
        sizes: Millions of parameters.
        workers: Worker counts.
        variants: The variants.
        args: The command line.

    Returns:
        The rows, in the order run.
    """
    rows = []
    with tempfile.TemporaryDirectory() as storage:
        for size in sizes:
            for w in workers:
                # One worker: no wrap, every variant is the compute floor; run it once.
                for name in ["compute"] if w == 1 else variants:
                    row = run_point(name, size, w, args, storage)
                    rows.append(row)
                    print(
                        ", ".join(
                            f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in row.items()
                        ),
                        flush=True,
                    )
    return rows


def write_results(rows: list[dict[str, Any]], workers: list[int], args: argparse.Namespace) -> Path:
    """Writes the rows as CSV to ``--out``, the machine facts and arguments next to it
    as JSON, and the plot to ``--plot``.

    Args:
        rows: The sweep's rows.
        workers: Worker counts (one panel each).
        args: The command line.

    Returns:
        The CSV's path.
    """
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    info = _common.machine_info()
    _common.write_json(out.with_suffix(".json"), {**info, "args": vars(args)})
    _plot(rows, workers, args.plot, info)
    return out


def main() -> None:
    """Sweeps sizes, worker counts and variants; writes the CSV, JSON and PNG."""
    args = parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    workers = [int(w) for w in args.workers.split(",")]
    variants = args.variants.split(",")
    cluster = start_cluster()
    rows = sweep(sizes, workers, variants, args)
    ray.shutdown()
    cluster.shutdown()
    out = write_results(rows, workers, args)
    print(f"wrote {out} and {args.plot}")


def _plot(rows: list[dict[str, Any]], workers: list[int], path: str, info: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(workers), figsize=(4 * len(workers), 3.5), sharey=True)
    axes = axes if len(workers) > 1 else [axes]
    for ax, w in zip(axes, workers):
        for name in dict.fromkeys(r["variant"] for r in rows):
            pts = sorted(
                (r["params"] / 1e6, r["step_ms"])
                for r in rows
                if r["variant"] == name and r["workers"] == w
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_title(f"{w} worker(s)")
        ax.set_xlabel("parameters (millions)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("median step (ms)")
    axes[-1].legend()
    fig.suptitle(
        f"Reference MLP, batch 32, 2 simulated nodes ({info['machine']}, {info['date']})",
        fontsize=9,
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
