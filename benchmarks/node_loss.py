"""A server node's loss, with and without ``shard_replicas``: what it costs a run.

A local cluster of four simulated nodes (``ray.cluster_utils.Cluster``): the head
holds the two workers (a ``trainer`` resource), and three nodes carry ``ps_server``
(two at a time: a fresh one replaces the one each killed run removes). The shards
run on nodes of their own (``server_resources={"ps_server": 1}``, two shards), each
replica on the other server node. One loop for all (``tests/integration/workerloss.py``):
the digits MLP, ``--steps`` steps per worker with ``--sleep-ms`` of pretend work,
a checkpoint every ``--every`` steps; at ``--kill-step`` rank 0 names shard 0's node
and this script removes it (every process on it dies). ``FailureConfig(max_failures=2)``.

Per variant: steps done again, seconds during which no worker stepped (gaps in the
union of both workers' steps longer than five median steps), worker processes per
rank (2: the run restarted), and test accuracy against the same variant's run
without a kill. Without replicas, the lost shard's state is gone: Ray Train restarts
every worker and the run goes back to its last checkpoint. With them, the workers
go on with the replica.

    python benchmarks/node_loss.py --out benchmarks/results/node_loss.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")

import ray
from ray import cloudpickle
from ray.cluster_utils import Cluster
from ray.train import FailureConfig, RunConfig, ScalingConfig

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
import _common

from ray_ps_plugin import PSConfig, PSTrainer
from tests.integration import digits, loops, workerloss

for module in (_common, digits, loops, workerloss):
    cloudpickle.register_pickle_by_value(module)

SERVERS = {"mode": "async", "server_resources": {"ps_server": 1}, "num_servers": 2}
VARIANTS: dict[str, dict[str, Any]] = {
    "ps_async": SERVERS,
    "ps_async_replicated": {**SERVERS, "shard_replicas": 1},
}
SCALING = ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5, "trainer": 1})


class ServerNodes:
    """The cluster's server nodes: two before each run (a removed one is replaced
    between runs: Ray starts nodes from the main thread only)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.nodes: list[Any] = []
        self.refill()

    def refill(self) -> None:
        """Adds fresh server nodes until two are alive."""
        while len(self.nodes) < 2:
            self.nodes.append(self.cluster.add_node(num_cpus=1, resources={"ps_server": 2}))
        self.cluster.wait_for_nodes()

    def remove(self, node_id: str) -> bool:
        """Removes the node: every process on it is killed."""
        for node in self.nodes:
            if node.node_id == node_id:
                self.cluster.remove_node(node, allow_graceful=False)
                self.nodes = [n for n in self.nodes if n is not node]
                return True
        return False


def run(name: str, args: argparse.Namespace, servers: ServerNodes, kill: bool, seed: int) -> dict:
    """One ``fit()`` on two server nodes; with ``kill``, shard 0's is removed mid-run."""
    with tempfile.TemporaryDirectory() as out:
        config = {
            "steps": args.steps,
            "every": args.every,
            "sleep_s": args.sleep_ms / 1e3,
            "out_dir": out,
            "seed": seed,
        }
        removed: list[float] = []
        servers.refill()
        if kill:
            config["name_shard_node_step"] = args.kill_step
            thread = threading.Thread(target=_remove_when_named, args=(out, servers, removed))
            thread.start()
        result = PSTrainer(
            workerloss.timeline_loop,
            train_loop_config=config,
            ps_config=PSConfig(ps_timeout_s=60, **VARIANTS[name]),
            scaling_config=SCALING,
            run_config=RunConfig(
                storage_path=args.storage,
                name=f"{name}-{time.time_ns()}",
                failure_config=FailureConfig(max_failures=2),
            ),
        ).fit()
        if kill:
            thread.join(30)
        return {
            "accuracy": workerloss.accuracy(result),
            "killed_at": removed[0] if removed else None,
            "timelines": {str(r): t for r, t in workerloss.read_timelines(out).items()},
        }


def _remove_when_named(out: str, servers: ServerNodes, removed: list[float]) -> None:
    marker = Path(out, "victim")
    if loops.wait_until(marker.exists, timeout_s=600):
        victim = json.loads(marker.read_text())
        if servers.remove(victim["node_id"]):
            removed.append(time.time())


def measure(run_: dict[str, Any]) -> dict[str, Any]:
    """The figures of one killed run (see the module docstring)."""
    timelines = {int(r): t for r, t in run_["timelines"].items()}
    own = [b["t"] - a["t"] for t in timelines.values() for a, b in itertools.pairwise(t)]
    step_s = statistics.median(own)
    every = sorted(rec["t"] for t in timelines.values() for rec in t)
    gaps = [b - a for a, b in itertools.pairwise(every)]
    return {
        "steps_done_again": sum(
            len(t) - len({rec["step"] for rec in t}) for t in timelines.values()
        ),
        "seconds_no_worker_stepped": sum(g for g in gaps if g > 5 * step_s),
        "longest_gap_s": max(gaps),
        "processes_per_rank": max(len({rec["pid"] for rec in t}) for t in timelines.values()),
        "median_step_s": step_s,
    }


def parse_args() -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = _common.parser(__doc__)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--kill-step", type=int, default=140)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--sleep-ms", type=float, default=40.0)
    p.add_argument("--seeds", type=int, default=2, help="accuracy: mean over this many seeds")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    _common.check_variants(p, args.variants.split(","), VARIANTS)
    return args


def main() -> None:
    """Runs each variant killed and uninterrupted, per seed; stores the figures."""
    args = parse_args()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"trainer": 4}, "include_dashboard": False},
    )
    servers = ServerNodes(cluster)
    ray.init(address=cluster.address, log_to_driver=False)
    args.storage = tempfile.mkdtemp(prefix="node-loss-")
    summary, runs = {}, {}
    for name in args.variants.split(","):
        killed = [run(name, args, servers, True, seed) for seed in range(args.seeds)]
        clean = [run(name, args, servers, False, seed)["accuracy"] for seed in range(args.seeds)]
        runs[name] = killed[0]
        print(name, end=" ")
        summary[name] = _common.loss_figures(killed, clean, measure)
    ray.shutdown()
    cluster.shutdown()
    if args.out:
        _common.write_json(
            args.out,
            {
                **_common.machine_info(),
                "args": {k: v for k, v in vars(args).items() if k not in ("out", "storage")},
                "summary": summary,
                "runs": runs,
            },
        )


if __name__ == "__main__":
    main()
