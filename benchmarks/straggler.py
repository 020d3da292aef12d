"""Throughput with and without a straggler, and accuracy against wall time, per mode.

Part 1 (reference MLP, synthetic batches): DDP, PS-sync, PS-async and PS-ssp, each
run with and without one straggler (rank 1 sleeps ``--sleep-ms`` after every
step). Throughput is samples per second over all workers, counted only while every
worker is still training (between the latest warm-up end and the earliest finish),
so a fast worker that finishes early is not flattered by running alone. Variants
alternate within a round; ratios to DDP are taken within a round, medians shown.

Part 2 (scikit-learn digits, with and without the same straggler): rank 0
measures test accuracy every few steps; one curve of accuracy against wall time per
mode with the straggler, saved as a PNG, and the final accuracy of every mode both
ways.

    python benchmarks/straggler.py            # reference run (~12 min on 2 cores)
    python benchmarks/straggler.py --quick    # smoke run (~3 min)

Targets: async >= 1.8x DDP throughput with a straggler; async and ssp within 2
points of sync's digits accuracy, with and without the straggler.
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

import numpy as np
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

MODES = {
    "ddp": PSConfig(strategy="ddp"),
    "ps_sync": PSConfig(strategy="ps", mode="sync"),
    "ps_async": PSConfig(strategy="ps", mode="async"),
    "ps_ssp": PSConfig(strategy="ps", mode="ssp", staleness=4),
}


# Where a step's time goes, per phase (see throughput_loop).
PHASES = ("forward", "backward", "ps_before_step", "optimizer", "ps_after_step", "ps_wait")


def throughput_loop(config: dict[str, Any]) -> None:
    """Fixed number of steps; every worker records when each step ended, and how
    long each phase of its step took.

    The phases come from public hooks only. Torch runs global optimizer pre-hooks
    (the plugin's) before an optimizer's own, and its own post-hooks before the
    global ones, so two hooks on this optimizer split ``opt.step()`` into the
    plugin's pre-step work (the NaN check), the optimizer's own update, and the
    plugin's post-step work (async/ssp: wait for the previous round trip, delta,
    install, push); ``stats.wait_s`` says how much of that was waiting.
    """
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rank = ray.train.get_context().get_world_rank()
    model = ray.train.torch.prepare_model(_common.reference_mlp(config["width"]))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    marks: dict[str, float] = {}
    opt.register_step_pre_hook(lambda *_: marks.__setitem__("pre", time.perf_counter()))
    opt.register_step_post_hook(lambda *_: marks.__setitem__("post", time.perf_counter()))
    x, y = torch.randn(config["batch"], 784), torch.randint(0, 10, (config["batch"],))
    sleep_s = config["sleep_s"] if rank == 1 else 0.0
    ctx = get_ps_context()
    ends, durations = [], []
    phases: dict[str, list[float]] = {k: [] for k in PHASES}
    for step in range(config["warmup"] + config["steps"]):
        waited = ctx.stats.wait_s if ctx is not None else 0.0
        t0 = time.perf_counter()
        opt.zero_grad()
        logits = model(x)
        t1 = time.perf_counter()
        nn.functional.cross_entropy(logits, y).backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        durations.append(t3 - t0)
        if step >= config["warmup"]:
            for key, value in (
                ("forward", t1 - t0),
                ("backward", t2 - t1),
                ("ps_before_step", marks["pre"] - t2),
                ("optimizer", marks["post"] - marks["pre"]),
                ("ps_after_step", t3 - marks["post"]),
                ("ps_wait", (ctx.stats.wait_s if ctx is not None else 0.0) - waited),
            ):
                phases[key].append(value)
        if sleep_s:
            time.sleep(sleep_s)
        ends.append(time.time())
    if ctx is not None:
        ctx.flush()
    out = {
        "rank": rank,
        "ends": ends,
        "warmup": config["warmup"],
        "median_step_s": statistics.median(durations[config["warmup"] :]),
        "phase_ms": {k: statistics.median(v) * 1e3 for k, v in phases.items()},
        "staleness_max": ctx.stats.staleness_max if ctx else 0,
        "staleness_mean": ctx.stats.staleness_mean if ctx else 0.0,
    }
    Path(config["out_dir"], f"rank{rank}.json").write_text(json.dumps(out))
    ray.train.report({"done": True})


def digits_loop(config: dict[str, Any]) -> None:
    """Digits with the straggler; rank 0 records (seconds, test accuracy)."""
    rank, xtr, ytr, xte, yte, model, opt = _common.prepared_digits(0, config["lr"])
    sleep_s = config["sleep_s"] if rank == 1 else 0.0
    g = torch.Generator().manual_seed(rank)
    curve = []
    start = time.perf_counter()
    for step in range(config["steps"]):
        idx = torch.randint(0, len(xtr), (32,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
        opt.step()
        if sleep_s:
            time.sleep(sleep_s)
        if rank == 0 and step % config["eval_every"] == 0:
            with torch.no_grad():
                acc = (model(xte).argmax(1) == yte).float().mean().item()
            curve.append((time.perf_counter() - start, acc))
    if rank == 0:
        with torch.no_grad():
            curve.append(
                (time.perf_counter() - start, (model(xte).argmax(1) == yte).float().mean().item())
            )
        Path(config["out_dir"], "curve.json").write_text(json.dumps(curve))
    ray.train.report({"done": True})


def _fit(loop: Any, cfg: PSConfig, config: dict[str, Any], storage: str) -> None:
    PSTrainer(
        loop,
        ps_config=cfg,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=storage, name=f"run-{time.time_ns()}"),
    ).fit()


def measure_throughput(
    mode: str, sleep_s: float, args: argparse.Namespace, storage: str
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out_dir:
        _fit(
            throughput_loop,
            MODES[mode],
            {
                "width": args.width,
                "batch": 32,
                "steps": args.steps,
                "warmup": args.warmup,
                "sleep_s": sleep_s,
                "out_dir": out_dir,
            },
            storage,
        )
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json"))]
    # The window in which every worker was past warm-up and still training.
    t0 = max(r["ends"][r["warmup"] - 1] for r in ranks)
    t1 = min(r["ends"][-1] for r in ranks)
    steps = sum(sum(1 for t in r["ends"] if t0 < t <= t1) for r in ranks)
    return {
        "samples_per_s": steps * 32 / (t1 - t0),
        "median_step_ms": [r["median_step_s"] * 1e3 for r in ranks],
        "phase_ms": [r["phase_ms"] for r in ranks],
        "staleness_max": [r["staleness_max"] for r in ranks],
        "staleness_mean": [r["staleness_mean"] for r in ranks],
    }


def parse_args() -> argparse.Namespace:
    """Parses the command line; ``--quick`` shrinks the rounds and steps."""
    p = _common.parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--sleep-ms", type=float, default=50.0, help="straggler's extra time per step")
    p.add_argument("--digits-steps", type=int, default=300)
    p.add_argument("--quick", action="store_true", help="1 round, 20 steps, 100 digits steps")
    p.add_argument("--out", default="benchmarks/results/straggler.json")
    p.add_argument("--plot", default="docs/img/straggler_accuracy.png")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.steps, args.digits_steps = 1, 20, 100
    return args


def throughput_rounds(
    args: argparse.Namespace, sleep_s: float, storage: str
) -> list[dict[str, dict[str, Any]]]:
    """Part 1: every mode without and with the straggler, once per round.

    Args:
        args: The command line.
        sleep_s: The straggler's extra time per step.
        storage: Ray Train's storage path.

    Returns:
        Per round, ``mode`` and ``mode+straggler``'s throughput figures.
    """
    rounds: list[dict[str, dict[str, Any]]] = []
    for r in range(args.rounds):
        row = {}
        for mode in MODES:
            for straggler in (False, True):
                key = f"{mode}{'+straggler' if straggler else ''}"
                row[key] = measure_throughput(mode, sleep_s if straggler else 0.0, args, storage)
                print(
                    f"round {r + 1} {key}: {row[key]['samples_per_s']:.0f} samples/s, "
                    f"steps {row[key]['median_step_ms']} ms",
                    flush=True,
                )
        rounds.append(row)
    return rounds


def digits_curve(
    mode: str, sleep_s: float, args: argparse.Namespace, storage: str
) -> list[tuple[float, float]]:
    """One digits run of ``mode``; returns rank 0's (seconds, test accuracy) points."""
    with tempfile.TemporaryDirectory() as out_dir:
        _fit(
            digits_loop,
            MODES[mode],
            {
                "lr": 0.05,
                "steps": args.digits_steps,
                "eval_every": 10,
                "sleep_s": sleep_s,
                "out_dir": out_dir,
            },
            storage,
        )
        return json.loads(Path(out_dir, "curve.json").read_text())


def digits_curves(
    args: argparse.Namespace, sleep_s: float, storage: str
) -> dict[str, list[tuple[float, float]]]:
    """Part 2: every mode's digits curve with the straggler, then without.

    Args:
        args: The command line.
        sleep_s: The straggler's extra time per step.
        storage: Ray Train's storage path.

    Returns:
        The curves, keyed ``mode`` (straggler) and ``mode-no-straggler``.
    """
    curves: dict[str, list[tuple[float, float]]] = {}
    for straggler in (True, False):
        for mode in MODES:
            key = mode if straggler else f"{mode}-no-straggler"
            curves[key] = digits_curve(mode, sleep_s if straggler else 0.0, args, storage)
            print(
                f"digits {key}: final accuracy {curves[key][-1][1]:.3f} after "
                f"{curves[key][-1][0]:.1f} s",
                flush=True,
            )
    return curves


def ratio_to_ddp(
    rounds: list[dict[str, dict[str, Any]]], key: str, field: str = "samples_per_s"
) -> float:
    """Median over rounds of ``key``'s throughput (or, for any other ``field``, rank 0's
    step time) divided by DDP's in the same round, straggler against straggler."""
    base_key = "ddp" + ("+straggler" if key.endswith("+straggler") else "")
    if field == "samples_per_s":
        return _common.round_ratio(rounds, key, base_key, field)
    # Step time of the fast worker (rank 0).
    return statistics.median(
        x[key]["median_step_ms"][0] / x[base_key]["median_step_ms"][0] for x in rounds
    )


def summarize(
    rounds: list[dict[str, dict[str, Any]]],
    curves: dict[str, list[tuple[float, float]]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The results to store: ratios to DDP, throughput, final accuracies, every curve
    and round.

    Args:
        rounds: Part 1's rounds.
        curves: Part 2's curves.
        args: The command line.

    Returns:
        The results, keyed as ``tools/_render`` reads them.
    """
    keys = list(rounds[0])
    return {
        **_common.machine_info(),
        "args": vars(args),
        "throughput_ratio_to_ddp": {k: ratio_to_ddp(rounds, k) for k in keys},
        "rank0_step_ratio_to_ddp": {k: ratio_to_ddp(rounds, k, "step") for k in keys},
        "samples_per_s": {k: _common.round_median(rounds, k, "samples_per_s") for k in keys},
        "final_digits_accuracy": {m: curves[m][-1][1] for m in MODES},
        "final_digits_accuracy_no_straggler": {
            m: curves[f"{m}-no-straggler"][-1][1] for m in MODES
        },
        "curves": {m: curves[m] for m in MODES},
        "rounds": rounds,
    }


def print_table(summary: dict[str, Any], rounds: list[dict[str, dict[str, Any]]]) -> None:
    """Prints part 1's table: throughput, ratios to DDP and the last round's staleness."""
    print(
        "\n| variant | samples/s (all workers) | throughput / DDP | rank-0 step / DDP "
        "| staleness max (rank 0, 1) |"
    )
    print("|---|---|---|---|---|")
    for k in rounds[0]:
        last = rounds[-1][k]
        print(
            f"| {k} | {summary['samples_per_s'][k]:.0f} "
            f"| {summary['throughput_ratio_to_ddp'][k]:.2f}x | "
            f"{summary['rank0_step_ratio_to_ddp'][k]:.2f}x | {last['staleness_max']} |"
        )


def main() -> None:
    """Runs both parts, stores the results and the plot, prints the table."""
    args = parse_args()
    sleep_s = args.sleep_ms / 1e3
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as storage:
        rounds = throughput_rounds(args, sleep_s, storage)
        curves = digits_curves(args, sleep_s, storage)
    ray.shutdown()
    summary = summarize(rounds, curves, args)
    out = _common.write_json(args.out, summary)
    _plot({m: curves[m] for m in MODES}, args.plot, args.sleep_ms)
    print_table(summary, rounds)
    print(f"\nwrote {out} and {args.plot}")


def _plot(curves: dict[str, list[tuple[float, float]]], path: str, sleep_ms: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, curve in curves.items():
        t, acc = np.array(curve).T
        ax.plot(t, acc, label=mode, marker=".", markersize=3)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("test accuracy (rank 0)")
    ax.set_title(f"digits, 2 workers, rank 1 sleeps {sleep_ms:g} ms/step")
    ax.grid(alpha=0.3)
    ax.legend()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
