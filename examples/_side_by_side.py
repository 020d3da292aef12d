"""What the framework examples share: one training function run under DDP and then
under each PS mode, and a table of the runs side by side.

The examples import this module next to them; their training functions call
:func:`report` on the Ray Train workers, which get this module by value (it is not
installed there).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import ray
import ray.train
import ray.train.collective
import torch
from ray import cloudpickle
from ray.train import RunConfig, ScalingConfig

from ray_ps_plugin import PSConfig, PSTrainer, get_ps_context

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def parse_args(
    doc: str | None, steps: int, lr: float, sharded_option: bool = False
) -> argparse.Namespace:
    """The examples' command line: ``--steps``, ``--workers``, ``--lr``, ``--modes``
    (and ``--sharded`` where the example has embedding tables to shard)."""
    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--modes", nargs="+", default=["sync", "async"])
    if sharded_option:
        parser.add_argument(
            "--sharded",
            action="store_true",
            help="PS runs build the tables on the meta device: only the shards hold them",
        )
        parser.add_argument(
            "--sparse-optimizer",
            choices=["workers", "shards"],
            default="workers",
            help="sync PS runs: where the tables' optimizer runs (PSConfig.sparse_optimizer)",
        )
    return parser.parse_args()


def servers_up_to_date() -> None:
    """Under a PS strategy, waits until every worker's last update is on the servers.

    Call it after training and before reading the model: in async/ssp the final
    parameters are the servers'.
    """
    ctx = get_ps_context()
    if ctx is not None:
        ctx.flush()
        ray.train.collective.barrier()


def report(
    state: dict[str, torch.Tensor], final_loss: float, step_times: Sequence[float], steps: int
) -> None:
    """Reports the run's figures, with rank 0's parameters as the checkpoint."""
    ctx = get_ps_context()
    pushed = ctx.stats.bytes_pushed + ctx.table_stats()["bytes_pushed"] if ctx else 0
    metrics = {
        "final_loss": final_loss,
        "step_ms": 1e3 * statistics.median(step_times),
        "kb_pushed": pushed / 1e3,
        # This worker's peak resident memory: a replicated table counts in it.
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "steps": steps,
    }
    with tempfile.TemporaryDirectory() as d:
        checkpoint = None
        if ray.train.get_context().get_world_rank() == 0:
            torch.save(state, os.path.join(d, "model.pt"))
            checkpoint = ray.train.Checkpoint.from_directory(d)
        ray.train.report(metrics, checkpoint=checkpoint)


def _table_options(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """``sparse_optimizer`` for the sync run when asked for (it is sync only)."""
    choice = getattr(args, "sparse_optimizer", "workers")
    return {"sparse_optimizer": choice} if mode == "sync" and choice != "workers" else {}


def compare(
    train_fn: Callable[[dict[str, Any]], None], args: argparse.Namespace, title: str, name: str
) -> None:
    """Runs ``train_fn`` under DDP, then under PS in each of ``args.modes``, and prints
    each run's final loss, step time, bytes pushed and distance to DDP's parameters."""
    # address="local": always a fresh embedded cluster, never one found on the machine.
    ray.init(address="local", num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
    runs = [("ddp", "sync")] + [("ps", mode) for mode in args.modes]
    rows, states = {}, {}
    with tempfile.TemporaryDirectory() as storage:
        for strategy, mode in runs:
            trainer = PSTrainer(
                train_fn,
                train_loop_config={
                    "steps": args.steps,
                    "lr": args.lr,
                    "sharded": getattr(args, "sharded", False),
                },
                ps_config=PSConfig(strategy=strategy, mode=mode, **_table_options(args, mode)),
                scaling_config=ScalingConfig(
                    num_workers=args.workers, resources_per_worker={"CPU": 1}
                ),
                run_config=RunConfig(storage_path=storage, name=f"{name}-{strategy}-{mode}"),
            )
            label = "ddp" if strategy == "ddp" else f"ps/{mode}"
            result = trainer.fit()
            with result.checkpoint.as_directory() as d:
                states[label] = torch.load(os.path.join(d, "model.pt"), weights_only=True)
            rows[label] = result.metrics
    ray.shutdown()

    print(f"\n{title}, {args.workers} workers, {args.steps} steps")
    print(
        f"{'strategy':<10} {'final loss':>10} {'step (ms)':>10} {'kB pushed':>10} "
        f"{'peak RSS (MB)':>14} {'max |param - DDP param|':>24}"
    )
    for label, m in rows.items():
        # A sharded table's weight stays on the meta device (its rows are the shards'):
        # the distance is then over the other parameters.
        diff = max(
            (states[label][k].double() - states["ddp"][k].double()).abs().max().item()
            for k in states["ddp"]
            if states["ddp"][k].is_floating_point() and not states[label][k].is_meta
        )
        print(
            f"{label:<10} {m['final_loss']:>10.4f} {m['step_ms']:>10.2f} "
            f"{m['kb_pushed']:>10.1f} {m['peak_rss_mb']:>14.0f} {diff:>24.3g}"
        )
    if getattr(args, "sharded", False):
        print("\nPS rows: the tables live on the shards (--sharded); the distance to DDP")
        print("covers the other parameters, as no worker holds the tables' rows.")
    else:
        print("\nSame training code in every row; ps/sync ends with DDP's parameters.")
