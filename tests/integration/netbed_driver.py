"""Ray driver that test_netbed.py runs inside a network test bed's head namespace.

Runs ``faults.resumable_loop`` (sync PS, one worker per node, a checkpoint every few
steps) once and writes what happened to the JSON file given as ``--out``: on success
the final parameters and where the run resumed; on failure the workers' error types
and messages and when ``fit()`` returned. Either way it also records how many shard
actors and placement groups were still alive afterwards. Link faults are injected by
the test, which watches ``--marker-dir`` for the loop's ``link_fault`` marker.

    python tests/integration/netbed_driver.py --out run.json --marker-dir DIR \\
        [--steps 30] [--every 5] [--link-fault-step 12] [--retries 0] [--ps-timeout 60] \\
        [--record-placement 1]

Needs ``RAY_ADDRESS`` (set by the bed) and a cluster of at least two nodes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError

from ray_ps_plugin import PSConfig, PSTrainer
from tests.integration import faults, loops


def _run(args: argparse.Namespace, storage: str) -> dict[str, Any]:
    config: dict[str, Any] = {
        "steps": args.steps,
        "every": args.every,
        "marker_dir": args.marker_dir,
    }
    if args.link_fault_step is not None:
        config["link_fault_step"] = args.link_fault_step
    if args.record_placement:
        config["record_placement"] = True
    trainer = PSTrainer(
        faults.resumable_loop,
        train_loop_config=config,
        ps_config=PSConfig(mode="sync", timeout_s=60, ps_timeout_s=args.ps_timeout),
        # One worker per node, on different nodes: every step crosses node 1's link.
        scaling_config=ScalingConfig(
            num_workers=2, resources_per_worker={"CPU": 1}, placement_strategy="STRICT_SPREAD"
        ),
        run_config=RunConfig(
            storage_path=storage,
            name="run",
            failure_config=FailureConfig(max_failures=args.retries),
        ),
    )
    t0 = time.monotonic()
    try:
        result = trainer.fit()
    except TrainingFailedError as e:
        errors = loops.worker_errors(e)
        return {
            "ok": False,
            "wall_s": time.monotonic() - t0,
            "failed_at": time.time(),
            "error": f"{type(e).__name__}: {e}"[:4000],
            "worker_errors": [[type(w).__name__, str(w)[:2000]] for w in errors],
        }
    state = faults.load(result)
    return {
        "ok": True,
        "wall_s": time.monotonic() - t0,
        "finished_at": time.time(),
        "metrics": dict(result.metrics),
        "step": state["step"],
        "params": {k: v.tolist() for k, v in state["model"].items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--marker-dir", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--link-fault-step", type=int, default=None)
    p.add_argument("--retries", type=int, default=0)
    p.add_argument("--ps-timeout", type=float, default=60.0)
    p.add_argument("--record-placement", type=int, default=0, help="1: report placement")
    args = p.parse_args()
    t0 = time.monotonic()
    ray.init(log_to_driver=False)
    print(f"connected in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    # When (if ever) Ray declares a node dead: a link down for long enough looks to
    # Ray's health checks exactly like a dead node.
    deaths: list[float] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_nodes, args=(deaths, stop), daemon=True)
    watcher.start()
    with tempfile.TemporaryDirectory() as storage:
        out = _run(args, storage)
    stop.set()
    watcher.join(10)
    out["node_declared_dead_at"] = deaths[0] if deaths else None
    # Nothing of the run may outlive it, failed or not (bounded waits: the GCS reaps
    # actors of a dead node only once it has declared the node dead).
    out["leaked_shards_after_s"] = _settle(loops.live_shards)
    out["leaked_placement_groups_after_s"] = _settle(loops.live_placement_groups)
    out["nodes_alive"] = sum(1 for n in ray.nodes() if n["Alive"])
    ray.shutdown()
    Path(args.out).write_text(json.dumps(out))
    print(f"done in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)


def _watch_nodes(deaths: list[float], stop: threading.Event) -> None:
    """Appends the time at which the number of live nodes first drops."""
    alive = sum(1 for n in ray.nodes() if n["Alive"])
    while not stop.wait(0.5):
        now = sum(1 for n in ray.nodes() if n["Alive"])
        if now < alive:
            deaths.append(time.time())
            return


def _settle(count: Any, timeout_s: float = 60.0) -> float | None:
    """Seconds until ``count()`` reached 0, or None if it did not within the bound."""
    t0 = time.monotonic()
    return time.monotonic() - t0 if loops.wait_until(lambda: count() == 0, timeout_s) else None


if __name__ == "__main__":
    main()
