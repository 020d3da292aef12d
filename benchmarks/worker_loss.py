"""A worker's loss, side by side: DDP against each PS mode, as a user would look at it.

One loop for all (``tests/integration/workerloss.py``): the digits MLP, 2 workers,
``--steps`` steps each with ``--sleep-ms`` of pretend work after every step, rank 0
reporting a checkpoint every ``--every`` steps; rank 1's process is SIGKILLed at
``--kill-step``, with ``FailureConfig(max_failures=2)``. DDP restarts every worker
from the last checkpoint (Ray Train's recovery); async, ssp and diloco replace the
lost worker alone while the other goes on, and the replacement goes on from
``get_ps_context().start_step``. Every worker records the wall time of each step.

Per strategy: steps done again (steps a rank ran more than once), seconds during
which no worker stepped (gaps in the union of both workers' steps longer than five
median steps), the longest gap of the worker that was not killed, time from the
kill to the replacement's first step, and test accuracy at the end against the
same strategy's run without a kill (means over ``--seeds`` seeds of the model and
the batches; the other figures are the first seed's run). The timeline (steps
against wall time, one line per worker process, one panel per strategy) is drawn
as a PNG.

    python benchmarks/worker_loss.py --out benchmarks/results/worker_loss.json \\
        --plot docs/img/worker_loss.png
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
from ray import cloudpickle
from ray.train import FailureConfig, RunConfig, ScalingConfig

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
import _common

from ray_ps_plugin import PSConfig, PSTrainer
from tests.integration import digits, loops, workerloss

for module in (_common, digits, loops, workerloss):
    cloudpickle.register_pickle_by_value(module)

STRATEGIES: dict[str, dict[str, Any]] = {
    "ddp": {"strategy": "ddp"},
    "ps_async": {"mode": "async", "replace_lost_workers": True},
    "ps_ssp": {"mode": "ssp", "staleness": 4, "replace_lost_workers": True},
    "ps_diloco": {"mode": "diloco", "local_steps": 16, "replace_lost_workers": True},
}


def run(
    name: str, args: argparse.Namespace, kill: bool, storage: str, seed: int = 0
) -> dict[str, Any]:
    """One ``fit()``: the timelines, the kill's time and the final accuracy."""
    with tempfile.TemporaryDirectory() as out:
        config = {
            "steps": args.steps,
            "every": args.every,
            "sleep_s": args.sleep_ms / 1e3,
            "out_dir": out,
            "seed": seed,
        }
        if kill:
            config.update(kill_rank=1, kill_step=args.kill_step)
        result = PSTrainer(
            workerloss.timeline_loop,
            train_loop_config=config,
            ps_config=PSConfig(**STRATEGIES[name]),
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(
                storage_path=storage,
                name=f"{name}-{time.time_ns()}",
                failure_config=FailureConfig(max_failures=2),
            ),
        ).fit()
        killed = Path(out, "killed")
        return {
            "accuracy": workerloss.accuracy(result),
            "killed_at": float(killed.read_text()) if killed.exists() else None,
            "timelines": {str(r): t for r, t in workerloss.read_timelines(out).items()},
        }


def measure(run_: dict[str, Any]) -> dict[str, Any]:
    """The figures of one killed run (see the module docstring)."""
    timelines = {int(r): t for r, t in run_["timelines"].items()}
    own = [b["t"] - a["t"] for t in timelines.values() for a, b in itertools.pairwise(t)]
    step_s = statistics.median(own)  # a worker's usual step, sleep included
    every = sorted(rec["t"] for t in timelines.values() for rec in t)
    gaps = [b - a for a, b in itertools.pairwise(every)]
    survivor = [rec["t"] for rec in timelines[0]]
    killed = run_["killed_at"]
    after = [rec["t"] for rec in timelines[1] if rec["t"] > killed]
    return {
        "steps_done_again": sum(
            len(t) - len({rec["step"] for rec in t}) for t in timelines.values()
        ),
        "seconds_no_worker_stepped": sum(g for g in gaps if g > 5 * step_s),
        "survivor_longest_gap_s": max(b - a for a, b in itertools.pairwise(survivor)),
        "survivor_processes": len({rec["pid"] for rec in timelines[0]}),
        "replacement_first_step_s": after[0] - killed if after else None,
        "median_step_s": step_s,
    }


def plot(runs: dict[str, dict[str, Any]], path: str, kill_step: int) -> None:
    """Steps against seconds since the kill, one line per worker process, one panel
    per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(4 * len(runs), 3.2), sharey=True)
    # Both workers step in near lockstep: rank 0 as a broad pale band under rank 1.
    styles = {
        (0, 0): {"color": "tab:blue", "linewidth": 5, "alpha": 0.35, "label": "rank 0"},
        (0, 1): {"color": "tab:cyan", "linewidth": 5, "alpha": 0.35, "label": "rank 0, restarted"},
        (1, 0): {"color": "tab:orange", "linewidth": 1.2, "label": "rank 1 (killed)"},
        (1, 1): {"color": "tab:red", "linewidth": 1.2, "label": "rank 1, its replacement"},
    }
    for ax, (name, r) in zip(axes, runs.items()):
        killed = r["killed_at"]
        for rank, recs in sorted(r["timelines"].items()):
            for n, pid in enumerate(dict.fromkeys(rec["pid"] for rec in recs)):
                mine = [rec for rec in recs if rec["pid"] == pid]
                ax.plot(
                    [rec["t"] - killed for rec in mine],
                    [rec["step"] for rec in mine],
                    **styles[(int(rank), min(n, 1))],
                )
        ax.axvline(0, color="grey", linewidth=0.8)
        ax.set_title(name)
        ax.set_xlabel(f"seconds since rank 1 was killed (step {kill_step})")
        ax.legend(fontsize=7, loc="lower right")
    axes[0].set_ylabel("step")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def parse_args() -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = _common.parser(__doc__)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--kill-step", type=int, default=140)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--sleep-ms", type=float, default=40.0)
    p.add_argument(
        "--seeds",
        type=int,
        default=3,
        help="accuracy is the mean over this many seeds (model and batches); the "
        "timelines are the first seed's",
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--plot", default=None, help="draw the timelines as a PNG here")
    p.add_argument(
        "--remeasure",
        default=None,
        help="recompute the figures (and the plot) from this result file's timelines; runs nothing",
    )
    return p.parse_args()


def remeasure(path: str, plot_path: str | None) -> None:
    """Recomputes a result file's figures from the timelines it holds."""
    data = json.loads(Path(path).read_text())
    for name, r in data["runs"].items():
        data["summary"][name].update(measure(r))
    Path(path).write_text(json.dumps(data, indent=2))
    if plot_path:
        plot(data["runs"], plot_path, data["args"]["kill_step"])


def main() -> None:
    args = parse_args()
    if args.remeasure:
        remeasure(args.remeasure, args.plot)
        return
    names = args.strategies.split(",")
    # A report no other worker makes fails the run after 5 minutes instead of
    # hanging the benchmark (Ray Train's collectives wait for ever by default).
    os.environ.setdefault("RAY_TRAIN_COLLECTIVE_TIMEOUT_S", "300")
    ray.init(num_cpus=2)
    storage = tempfile.mkdtemp(prefix="worker-loss-")
    summary, killed_runs = {}, {}
    for name in names:
        killed = [run(name, args, True, storage, seed) for seed in range(args.seeds)]
        clean = [run(name, args, False, storage, seed)["accuracy"] for seed in range(args.seeds)]
        killed_runs[name] = killed[0]
        print(name, end=" ")
        summary[name] = _common.loss_figures(killed, clean, measure)
    if args.plot:
        plot(killed_runs, args.plot, args.kill_step)
    if args.out:
        _common.write_json(
            args.out,
            {
                **_common.machine_info(),
                "args": {k: v for k, v in vars(args).items() if k not in ("out", "plot")},
                "summary": summary,
                "runs": killed_runs,
            },
        )


if __name__ == "__main__":
    main()
