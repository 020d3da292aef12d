"""What local steps and lossy compression cost in quality: digits accuracy against DDP.

Every variant trains the same MLP on scikit-learn's digits (bundled, no download)
with the same inner optimizer (SGD, momentum 0.9), learning-rate schedule, batch,
number of steps per worker and seeds, so every variant sees the same number of
samples. ``--schedule cosine`` decays every variant's learning rate to zero over the
run (``CosineAnnealingLR``), as the DiLoCo paper does for its inner optimizer;
``constant`` (the default) keeps it fixed. The variants:

- ``ddp``, ``ps_sync``: the baselines (all-reduce, sync parameter servers);
- ``diloco_h{1,8,32,128}``: ``mode="diloco"``, synchronous rounds, Nesterov outer
  step with the paper's defaults (lr 0.7, momentum 0.9); at H = 32 also half that
  outer lr (``diloco_h32_olr0.35``), plain averaging (``diloco_h32_average``) and
  one round of delay (``diloco_h32_overlap``), and rounds quantized
  (``diloco_h32_int8``, ``diloco_h32_int4``: the changes as 8- or 4-bit levels with
  error feedback, the replies as bf16; every round by message), 4-bit rounds
  with half the outer lr or plain averaging (``diloco_h32_int4_olr0.35``,
  ``diloco_h32_int4_average``);
- ``ddp_bf16``: DDP with torch's ``bf16_compress_hook``; ``ps_sync_bf16``,
  ``ps_sync_onebit``, ``ps_sync_topk`` (1% of values), ``ps_sync_topk10``
  (10%), ``ps_sync_lowrank`` (rank 4) and ``ps_sync_lowrank1`` (rank 1): sync
  parameter servers with ``compression`` set, every chunk by message
  (``shared_memory=False``), so every push and every sum is compressed: more than
  on two nodes of one worker each, where a worker's own node's shard reads its
  chunks at full precision;
- with a straggler (rank 1 sleeps ``--sleep-ms`` after every step):
  ``ddp_straggler``, ``diloco_h32_straggler`` (synchronous rounds) and
  ``diloco_async_h32_straggler`` (asynchronous rounds, staleness 2).

Rank 0 evaluates the test accuracy after every round (every ``max(32, H)`` steps;
DDP and sync every 32) and at the end, after ``flush()`` has sent the last round.
The JSON holds every curve; the PNG shows accuracy against samples and against
wall time.

    python benchmarks/diloco_digits.py            # reference run (3 seeds)
    python benchmarks/diloco_digits.py --quick    # smoke run

The compression run writes ``--variants
ddp,ddp_bf16,ps_sync,ps_sync_bf16,ps_sync_onebit,ps_sync_topk,ps_sync_topk10,
ps_sync_lowrank,ps_sync_lowrank1,diloco_h32,diloco_h32_int8,diloco_h32_int4 --out
benchmarks/results/compression_digits.json --plot docs/img/compression_digits.png``;
``--replot --link-result net_2x1_100mbit,... --tta-plot docs/img/compression_tta.png``
then draws accuracy against time at 100 Mbit/s from it.
The cosine run writes ``--out benchmarks/results/diloco_digits_cosine.json --plot
docs/img/diloco_digits_cosine.png``.

Targets: the final accuracy (mean over seeds) of ``diloco_h32`` within 1 point of
DDP's, of ``diloco_async_h32_straggler`` within 2 points.
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
import torch.nn as nn
from ray import cloudpickle
from ray.train import RunConfig, ScalingConfig

sys.path.insert(0, str(Path(__file__).parent))
import _common

from ray_ps_plugin import PSConfig, PSTrainer, get_ps_context

cloudpickle.register_pickle_by_value(_common)


def _diloco(h: int, **kw: Any) -> dict[str, Any]:
    return {"strategy": "ps", "mode": "diloco", "local_steps": h, **kw}


def _compressed(compression: str, **kw: Any) -> dict[str, Any]:
    # Every chunk by message: shared memory would carry a node's own chunks uncompressed.
    sync = {"strategy": "ps", "mode": "sync", "shared_memory": False}
    return {**sync, "compression": compression, **kw}


# name -> (PSConfig fields, straggler)
VARIANTS: dict[str, tuple[dict[str, Any], bool]] = {
    "ddp": ({"strategy": "ddp"}, False),
    "ddp_bf16": ({"strategy": "ddp"}, False),  # with torch's bf16_compress_hook
    "ps_sync": ({"strategy": "ps", "mode": "sync"}, False),
    "ps_sync_bf16": (_compressed("bf16"), False),
    "ps_sync_onebit": (_compressed("onebit"), False),
    "ps_sync_topk": (_compressed("topk"), False),
    "ps_sync_topk10": (_compressed("topk", topk_ratio=0.1), False),
    "ps_sync_lowrank": (_compressed("lowrank"), False),
    "ps_sync_lowrank1": (_compressed("lowrank", lowrank_rank=1), False),
    **{f"diloco_h{h}": (_diloco(h), False) for h in (1, 8, 32, 128)},
    # The outer step's knobs at H = 32: half the outer lr; plain averaging (local SGD).
    "diloco_h32_olr0.35": (_diloco(32, outer_lr=0.35), False),
    "diloco_h32_average": (_diloco(32, outer_optimizer="average"), False),
    "diloco_h32_overlap": (_diloco(32, diloco_overlap=True), False),
    # Quantized round changes (replies as bf16), every round by message.
    "diloco_h32_int8": (_diloco(32, compression="int8", shared_memory=False), False),
    "diloco_h32_int4": (_diloco(32, compression="int4", shared_memory=False), False),
    # 4-bit rounds with the outer steps that trained closest to DDP at H = 32.
    "diloco_h32_int4_olr0.35": (
        _diloco(32, compression="int4", shared_memory=False, outer_lr=0.35),
        False,
    ),
    "diloco_h32_int4_average": (
        _diloco(32, compression="int4", shared_memory=False, outer_optimizer="average"),
        False,
    ),
    "ddp_straggler": ({"strategy": "ddp"}, True),
    "diloco_h32_straggler": (_diloco(32), True),
    "diloco_async_h32_straggler": (_diloco(32, diloco_rounds="async", staleness=2), True),
}


def digits_loop(config: dict[str, Any]) -> None:
    """Trains the digits MLP; rank 0 records (step, seconds, test accuracy)."""
    rank, xtr, ytr, xte, yte, model, opt = _common.prepared_digits(config["seed"], config["lr"])
    sleep_s = config["sleep_s"] if rank == 1 else 0.0
    g = torch.Generator().manual_seed(config["seed"] * 100 + rank)
    ps = get_ps_context()
    h = config["local_steps"]
    every = max(32, h)
    if config["bf16_hook"]:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
            bf16_compress_hook,
        )

        model.register_comm_hook(None, bf16_compress_hook)

    def accuracy() -> float:
        with torch.no_grad():
            return (model(xte).argmax(1) == yte).float().mean().item()

    sched = (
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=config["steps"])
        if config["schedule"] == "cosine"
        else None
    )
    curve = []
    start = time.perf_counter()
    for step in range(1, config["steps"] + 1):
        idx = torch.randint(0, len(xtr), (config["batch"],), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
        opt.step()
        if sched is not None:
            sched.step()
        if sleep_s:
            time.sleep(sleep_s)
        if rank == 0 and step % every == 0 and step < config["steps"]:
            curve.append((step, time.perf_counter() - start, accuracy()))
    if ps is not None:
        ps.flush()  # DiLoCo: the last round (if any steps are left) reaches the shards
    if rank == 0:
        curve.append((config["steps"], time.perf_counter() - start, accuracy()))
        Path(config["out_dir"], "curve.json").write_text(json.dumps(curve))
    ray.train.report({"done": True})


def run(name: str, seed: int, args: argparse.Namespace, storage: str) -> list[list[float]]:
    fields, straggler = VARIANTS[name]
    with tempfile.TemporaryDirectory() as out_dir:
        PSTrainer(
            digits_loop,
            ps_config=PSConfig(**fields),
            train_loop_config={
                "seed": seed,
                "lr": args.lr,
                "batch": args.batch,
                "steps": args.steps,
                "schedule": args.schedule,
                "local_steps": fields.get("local_steps", 1),
                "sleep_s": args.sleep_ms / 1e3 if straggler else 0.0,
                "bf16_hook": name == "ddp_bf16",
                "out_dir": out_dir,
            },
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(storage_path=storage, name=f"{name}-{time.time_ns()}"),
        ).fit()
        return json.loads(Path(out_dir, "curve.json").read_text())


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    """Parses and checks the command line; ``--quick`` shrinks the run.

    Returns:
        The arguments, and the variants to run.
    """
    p = _common.parser(__doc__)
    p.add_argument("--steps", type=int, default=640, help="optimizer steps per worker")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05, help="inner SGD learning rate")
    p.add_argument(
        "--schedule",
        choices=("constant", "cosine"),
        default="constant",
        help="every variant's learning rate: fixed, or cosine decay to 0 over --steps",
    )
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--sleep-ms", type=float, default=20.0, help="the straggler's sleep")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--quick", action="store_true", help="1 seed, 256 steps")
    p.add_argument("--out", default="benchmarks/results/diloco_digits.json")
    p.add_argument("--plot", default="docs/img/diloco_digits.png")
    p.add_argument(
        "--link-result",
        help="net_step_time.py results (comma-separated names in benchmarks/results): "
        "also plot each variant's mean accuracy against steps x its step time in the "
        "first that ran it (diloco_h32 as ps_diloco_h32), into --tta-plot",
    )
    p.add_argument("--tta-plot", default="docs/img/compression_tta.png")
    p.add_argument(
        "--replot",
        action="store_true",
        help="train nothing: draw --plot (and --tta-plot from --link-result) from the "
        "curves in --out, e.g. once a bed result with the variants' step times exists",
    )
    args = p.parse_args()
    if args.quick:
        args.seeds, args.steps = 1, 256
    names = args.variants.split(",")
    _common.check_variants(p, names, VARIANTS)
    return args, names


def run_all(names: list[str], args: argparse.Namespace) -> dict[str, list[list[list[float]]]]:
    """Runs every variant once per seed, seed by seed, printing each final accuracy.

    Args:
        names: The variants.
        args: The command line.

    Returns:
        Per variant, one curve per seed.
    """
    curves: dict[str, list[list[list[float]]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as storage:
        for seed in range(args.seeds):
            for name in names:
                curves[name].append(run(name, seed, args, storage))
                _, wall, acc = curves[name][-1][-1]
                print(f"seed {seed} {name}: accuracy {acc:.3f} after {wall:.1f} s", flush=True)
    return curves


def final(curves: dict[str, list[list[list[float]]]], name: str) -> float:
    """Variant ``name``'s final accuracy, mean over seeds."""
    return statistics.fmean(c[-1][2] for c in curves[name])


def points_below_ddp(
    curves: dict[str, list[list[list[float]]]], names: list[str]
) -> dict[str, float]:
    """Per variant, how many points its final accuracy lies below DDP's (a straggler
    variant's: below ``ddp_straggler``'s), where that DDP variant ran."""
    below = {}
    for n in names:
        if "ddp" in names and ("straggler" not in n or "ddp_straggler" in names):
            ddp = "ddp" if "straggler" not in n else "ddp_straggler"
            below[n] = (final(curves, ddp) - final(curves, n)) * 100
    return below


def summarize(
    curves: dict[str, list[list[list[float]]]], names: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    """The results to store: final accuracies, points below DDP, wall times, every curve.

    Args:
        curves: Per variant, one curve per seed.
        names: The variants.
        args: The command line.

    Returns:
        The results, keyed as ``tools/_render`` reads them.
    """
    return {
        **_common.machine_info(),
        "args": vars(args),
        "final_accuracy": {n: final(curves, n) for n in names},
        "points_below_ddp": points_below_ddp(curves, names),
        "wall_s": {n: statistics.fmean(c[-1][1] for c in curves[n]) for n in names},
        "curves": curves,
    }


def print_table(summary: dict[str, Any], names: list[str]) -> None:
    """Prints each variant's final accuracy, points below DDP and wall time."""
    print("| variant | final accuracy (mean of seeds) | points below DDP | wall time (s) |")
    print("|---|---|---|---|")
    for n in names:
        below = summary["points_below_ddp"].get(n)
        print(
            f"| {n} | {summary['final_accuracy'][n]:.3f} "
            f"| {'n/a' if below is None else f'{below:+.1f}'} "
            f"| {summary['wall_s'][n]:.1f} |"
        )


def main() -> None:
    """Runs the variants for every seed, stores the results and plot, prints the table."""
    args, names = parse_args()
    if args.replot:
        curves = json.loads(Path(args.out).read_text())["curves"]
        _plot(curves, args)
        if args.link_result:
            _plot_link_time(curves, args)
        return
    ray.init(num_cpus=2, log_to_driver=False)
    curves = run_all(names, args)
    ray.shutdown()
    summary = summarize(curves, names, args)
    out = _common.write_json(args.out, summary)
    _plot(curves, args)
    if args.link_result:
        _plot_link_time(curves, args)
    print_table(summary, names)
    print(f"wrote {out} and {args.plot}")


def _plot(curves: dict[str, list[list[list[float]]]], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_samples, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for name, runs in curves.items():
        seed0 = runs[0]
        samples = [s * args.batch * 2 for s, _, _ in seed0]
        style = "--" if "straggler" in name else "-"
        acc = [a for *_, a in seed0]
        by_samples.plot(samples, acc, style, marker=".", label=name)
        by_time.plot([t for _, t, _ in seed0], acc, style, marker=".", label=name)
    by_samples.set_xlabel("samples (both workers)")
    by_time.set_xlabel("wall time (s)")
    for ax in (by_samples, by_time):
        ax.set_ylabel("test accuracy (rank 0, seed 0)")
        ax.grid(alpha=0.3)
    by_time.legend(fontsize=7)
    fig.suptitle(
        f"digits, 2 workers, {args.schedule} learning rate; "
        f"dashed: rank 1 sleeps {args.sleep_ms:g} ms/step"
    )
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)


def _plot_link_time(curves: dict[str, list[list[list[float]]]], args: argparse.Namespace) -> None:
    """Mean accuracy over seeds against steps x the variant's step on a shaped link."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = Path(__file__).parent / "results"
    nets = [json.loads((results / f"{n}.json").read_text()) for n in args.link_result.split(",")]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, runs in curves.items():
        times = [n["mean_step_ms"].get(k) for n in nets for k in (name, f"ps_{name}")]
        step_ms = next((t for t in times if t is not None), None)
        if step_ms is None:
            continue
        steps = [s for s, _, _ in runs[0]]
        acc = [statistics.fmean(points) for points in zip(*([a for *_, a in r] for r in runs))]
        ax.plot([s * step_ms / 1e3 for s in steps], acc, marker=".", label=name)
    ax.set_xscale("log")
    ax.set_xlabel(f"time at {nets[0]['rate']} (s, log): steps x the measured step on the bed")
    ax.set_ylabel(f"test accuracy (mean of {args.seeds} seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle(f"digits, 2 workers; step times from {args.link_result}", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.tta_plot, dpi=110)


if __name__ == "__main__":
    main()
