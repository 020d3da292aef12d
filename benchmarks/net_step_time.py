"""Step time of DDP and PS-sync with workers spread over nodes joined by a real link.

Meant for the network test bed (``tools/netbed.py``), where every node sits
behind a rate-limited link, and for real clusters (``--address``). Workers are spread
over ``--nodes`` nodes, ``--workers-per-node`` each; the script checks where every
worker landed and refuses to report a run whose placement is not the one asked for.

Variants (run in alternation within each round, so drifts hit them alike):

- ``ddp``: stock DDP (gloo all-reduce, fp32).
- ``ddp_bf16``: DDP with torch's ``bf16_compress_hook`` (bf16 on the wire).
- ``ps_sync``: parameter servers, sync mode (fp32 on the wire; the direct TCP data
  path and node-level aggregation, the defaults).
- ``ps_sync_bf16``: the same with ``compression="bf16"``.
- ``ps_sync_onebit`` / ``ps_sync_topk`` / ``ps_sync_topk10``: the lossy encodings
  with error feedback (``compression="onebit"``; ``"topk"`` with ``topk_ratio``
  0.01 and 0.1).
- ``ps_sync_store`` / ``ps_sync_bf16_store``: the same through Ray's object store
  (``data_path="object_store"``), the other data path measured.
- ``ps_sync_noagg``: direct path, but every worker pushes for itself
  (``node_aggregation=False``).
- ``ps_sync_node`` / ``ps_sync_worker``: one shard per node / per worker
  (``server_placement``; the default, ``"auto"``, picks per node when a node has
  several workers).
- ``ps_sync_256kib`` / ``ps_sync_512kib`` / ``ps_sync_1mib`` / ``ps_sync_4mib`` /
  ``ps_sync_16mib``: fixed ``chunk_bytes``
  instead of the automatic choice (1 MiB across nodes on the direct path).
- ``ps_diloco_h1`` / ``ps_diloco_h8`` / ``ps_diloco_h32`` / ``ps_diloco_h128``:
  ``mode="diloco"`` with ``local_steps`` H (Nesterov outer step, synchronous
  rounds). Their warm-up and timed steps are rounded up to whole rounds (at least
  two timed rounds), so the mean holds every round's transfer.
  ``ps_diloco_h32_bf16``: H = 32 with ``compression="bf16"``;
  ``ps_diloco_h32_int8`` / ``ps_diloco_h32_int4``: H = 32, round changes as 8- or
  4-bit levels with error feedback, replies as bf16;
  ``ps_diloco_h32_overlap``: H = 32 with ``diloco_overlap=True``;
  ``ps_diloco_h32_noagg``: H = 32 without node relays (``node_aggregation=False``).
- ``ps_async`` / ``ps_async_replicated``: ``mode="async"``, the second with
  ``shard_replicas=1`` (each shard's state held on a second shard on another node,
  so every update also crosses the link to its replica); held against each other.
- ``compute``: no synchronisation at all (the floor; not run by default).

Step time is rank 0's mean over the steps after warm-up; the table shows the median
over rounds and, per variant, the median over rounds of its ratio to DDP's step time
in the same round. Every worker also reads the byte counters of its network interface
(``--ifname``, by default ``$GLOO_SOCKET_IFNAME``) around the timed steps, which shows
what actually crossed the link. With ``--link-trace`` the driver also samples its
own interface every millisecond (in the bed: the head node's link) and reports, per
variant, when each step's bytes moved (``_linktrace.py``).

    python tools/netbed.py --nodes 2 --rate 1gbit -- \\
        python benchmarks/net_step_time.py --steps 10 --rounds 1
    python benchmarks/net_step_time.py --address HEAD:6379 --nodes 2 \\
        --storage /shared/dir         # on a real cluster (storage all nodes can reach)

Reference model: MLP 784-2048-2048-10 (5.8 M params), batch 32, 1 CPU and 1 torch
thread per worker.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import ray.train
from ray import cloudpickle
from ray.train import RunConfig, ScalingConfig

from ray_ps_plugin import PSConfig, PSTrainer

# _common sits next to this script (benchmarks/ is not a package); workers get it
# by value.
sys.path.insert(0, str(Path(__file__).parent))
_common = importlib.import_module("_common")
cloudpickle.register_pickle_by_value(_common)
_linktrace = importlib.import_module("_linktrace")

# name -> (PSConfig fields, DDP comm hook, synchronise at all)
VARIANTS: dict[str, tuple[dict[str, Any], str | None, bool]] = {
    "ddp": ({"strategy": "ddp"}, None, True),
    "ddp_bf16": ({"strategy": "ddp"}, "bf16", True),
    "ps_sync": ({"strategy": "ps", "mode": "sync"}, None, True),
    "ps_sync_bf16": ({"strategy": "ps", "mode": "sync", "compression": "bf16"}, None, True),
    "ps_sync_onebit": ({"strategy": "ps", "mode": "sync", "compression": "onebit"}, None, True),
    "ps_sync_topk": ({"strategy": "ps", "mode": "sync", "compression": "topk"}, None, True),
    "ps_sync_topk10": (
        {"strategy": "ps", "mode": "sync", "compression": "topk", "topk_ratio": 0.1},
        None,
        True,
    ),
    "ps_sync_lowrank": ({"strategy": "ps", "mode": "sync", "compression": "lowrank"}, None, True),
    "ps_sync_store": ({"strategy": "ps", "data_path": "object_store"}, None, True),
    "ps_sync_bf16_store": (
        {"strategy": "ps", "data_path": "object_store", "compression": "bf16"},
        None,
        True,
    ),
    "ps_sync_noagg": ({"strategy": "ps", "node_aggregation": False}, None, True),
    "ps_sync_256kib": ({"strategy": "ps", "chunk_bytes": 1 << 18}, None, True),
    "ps_sync_512kib": ({"strategy": "ps", "chunk_bytes": 1 << 19}, None, True),
    "ps_sync_1mib": ({"strategy": "ps", "chunk_bytes": 1 << 20}, None, True),
    "ps_sync_4mib": ({"strategy": "ps", "chunk_bytes": 4 << 20}, None, True),
    "ps_sync_16mib": ({"strategy": "ps", "chunk_bytes": 16 << 20}, None, True),
    "ps_sync_node": ({"strategy": "ps", "server_placement": "node"}, None, True),
    "ps_sync_worker": ({"strategy": "ps", "server_placement": "worker"}, None, True),
    **{
        f"ps_diloco_h{h}": ({"strategy": "ps", "mode": "diloco", "local_steps": h}, None, True)
        for h in (1, 8, 32, 128)
    },
    "ps_diloco_h32_bf16": (
        {"strategy": "ps", "mode": "diloco", "local_steps": 32, "compression": "bf16"},
        None,
        True,
    ),
    **{
        f"ps_diloco_h32_{q}": (
            {"strategy": "ps", "mode": "diloco", "local_steps": 32, "compression": q},
            None,
            True,
        )
        for q in ("int8", "int4")
    },
    "ps_diloco_h32_overlap": (
        {"strategy": "ps", "mode": "diloco", "local_steps": 32, "diloco_overlap": True},
        None,
        True,
    ),
    "ps_diloco_h32_noagg": (
        {"strategy": "ps", "mode": "diloco", "local_steps": 32, "node_aggregation": False},
        None,
        True,
    ),
    "ps_async": ({"strategy": "ps", "mode": "async"}, None, True),
    "ps_async_replicated": ({"strategy": "ps", "mode": "async", "shard_replicas": 1}, None, True),
    "compute": ({"strategy": "ddp"}, None, False),
}
DEFAULT_VARIANTS = "ddp,ddp_bf16,ps_sync,ps_sync_bf16"


def _retransmits() -> int | None:
    """TCP segments retransmitted so far in this network namespace (the node's)."""
    try:
        lines = [ln.split() for ln in Path("/proc/net/snmp").read_text().splitlines()]
        head, values = [ln for ln in lines if ln[0] == "Tcp:"][:2]
        return int(values[head.index("RetransSegs")])
    except (OSError, ValueError, IndexError):
        return None


def bench_loop(config: dict[str, Any]) -> None:
    """Times the reference MLP's steps; rank 0 reports every worker's placement."""
    import torch.distributed as dist

    ifname = config["ifname"]
    start: dict[str, int | None] = {}
    model, times = _common.prepared_mlp_steps(
        config,
        lr=1e-3,
        on_timed_start=lambda: start.update(
            bytes=_common.link_bytes(ifname), retrans=_retransmits()
        ),
    )
    end, retrans = _common.link_bytes(ifname), _retransmits()
    ctx = ray.train.get_context()
    mine = {
        "rank": ctx.get_world_rank(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "link_bytes_per_step": (end - start["bytes"]) / len(times)
        if end is not None and start.get("bytes") is not None
        else None,
        "tcp_retransmits_per_step": (retrans - start["retrans"]) / len(times)
        if retrans is not None and start.get("retrans") is not None
        else None,
    }
    # After the timed steps: one small collective over the process group that both
    # strategies start, so rank 0 can report where every worker ran.
    workers: list[Any] = [None] * ctx.get_world_size()
    if dist.is_initialized():
        dist.all_gather_object(workers, mine)
    else:
        workers = [mine]
    metrics = {
        "mean_step_s": statistics.fmean(times),
        "median_step_s": statistics.median(times),
        "workers": workers,
        "params": sum(p.numel() for p in model.parameters()),
    }
    with tempfile.TemporaryDirectory() as d:
        Path(d, "m.json").write_text(json.dumps(metrics))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))


def whole_rounds(fields: dict[str, Any], warmup: int, steps: int) -> tuple[int, int]:
    """Warm-up and timed steps of a variant: for DiLoCo rounded up to whole rounds
    of ``local_steps``, with at least two timed rounds, so the timed window starts
    right after a round and holds every round's transfer."""
    h = fields.get("local_steps", 1) if fields.get("mode") == "diloco" else 1
    return -(-warmup // h) * h, max(-(-steps // h), 2 if h > 1 else 1) * h


def run_variant(name: str, args: argparse.Namespace, storage: str) -> dict[str, Any]:
    """One ``fit()`` of variant ``name``; returns rank 0's metrics."""
    fields, hook, sync = VARIANTS[name]
    warmup, steps = whole_rounds(fields, args.warmup, args.steps)
    n = args.nodes * args.workers_per_node
    # One worker per node: STRICT_SPREAD guarantees it. Several: SPREAD balances the
    # bundles over the nodes (checked below).
    strategy = "STRICT_SPREAD" if args.workers_per_node == 1 else "SPREAD"
    result = PSTrainer(
        bench_loop,
        ps_config=PSConfig(**fields),
        train_loop_config={
            "name": name,
            "sync": sync,
            "comm_hook": hook,
            "width": args.width,
            "steps": steps,
            "warmup": warmup,
            "ifname": args.ifname,
        },
        scaling_config=ScalingConfig(
            num_workers=n,
            resources_per_worker={"CPU": args.cpus_per_worker},
            placement_strategy=strategy,
        ),
        run_config=RunConfig(storage_path=storage, name=f"{name}-{time.time_ns()}"),
    ).fit()
    metrics = dict(result.metrics)
    _common.check_placement(name, metrics["workers"], args)
    return metrics


def _run_traced(name: str, args: argparse.Namespace, storage: str) -> dict[str, Any]:
    """:func:`run_variant`, with a trace of the driver's link if asked for."""
    if not args.link_trace:
        return run_variant(name, args, storage)
    with _linktrace.LinkSampler(args.ifname) as sampler:
        metrics = run_variant(name, args, storage)
    metrics["link_trace"] = _linktrace.summarize(sampler.samples, args.steps)
    return metrics


def build_parser() -> argparse.ArgumentParser:
    """The command line's flags and their defaults."""
    p = _common.parser(__doc__)
    p.add_argument(
        "--address",
        default=os.environ.get("RAY_ADDRESS"),
        help="Ray cluster to use (default: $RAY_ADDRESS, which netbed.py sets)",
    )
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--workers-per-node", type=int, default=1)
    p.add_argument("--cpus-per-worker", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument(
        "--variants",
        default=DEFAULT_VARIANTS,
        help=f"comma-separated, from {list(VARIANTS)} (ddp is always run)",
    )
    p.add_argument(
        "--ifname",
        default=os.environ.get("GLOO_SOCKET_IFNAME"),
        help="interface whose byte counters the workers read",
    )
    p.add_argument(
        "--rate",
        default=os.environ.get("PSBED_RATE", "unknown"),
        help="link rate to record (default: $PSBED_RATE, set by netbed.py)",
    )
    p.add_argument(
        "--link-trace",
        action="store_true",
        help="also trace when the driver's --ifname carries each step's bytes "
        "(1 ms samples; in the bed: the head node's link; see _linktrace.py)",
    )
    p.add_argument(
        "--storage",
        default=None,
        help="Ray Train storage path; on a real cluster one every node reaches "
        "(default: a local temp dir, enough for one machine)",
    )
    p.add_argument(
        "--out",
        default="benchmarks/results/net_step_time.json",
        help="where the raw results go (docs/benchmarks.md renders net_2x1_1gbit.json etc.)",
    )
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """Exits through ``p.error`` on unknown variants, no cluster or nothing to time.

    Args:
        p: The parser.
        args: Its parsed command line.

    Returns:
        The variants to run (``ddp`` first, no repeats).
    """
    names = list(dict.fromkeys(["ddp", *args.variants.split(",")]))
    _common.check_variants(p, names, VARIANTS)
    if not args.address:
        p.error("no cluster: pass --address or run under tools/netbed.py")
    if args.steps < 1 or args.rounds < 1:
        p.error("--steps and --rounds must be >= 1")
    return names


def join_cluster(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Connects to ``--address``; exits through ``p.error`` if it has fewer alive nodes
    than ``--nodes``."""
    ray.init(address=args.address, log_to_driver=False)
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) < args.nodes:
        p.error(f"the cluster has {len(alive)} alive node(s), fewer than --nodes {args.nodes}")


def run_rounds(names: list[str], args: argparse.Namespace) -> list[dict[str, dict[str, Any]]]:
    """Runs every variant once per round, in the order of ``names``.

    Args:
        names: The variants.
        args: The command line.

    Returns:
        Per round, every variant's rank-0 metrics.
    """
    with tempfile.TemporaryDirectory() as tmp:
        storage = args.storage or tmp
        return _common.run_rounds(
            names, args.rounds, lambda name: _run_traced(name, args, storage), "mean_step_s"
        )


def counterpart(name: str, names: list[str]) -> str:
    """What a PS variant is held against: DDP, DDP with its bf16 hook, or (a
    replicated variant) the same variant without replicas."""
    plain = name.removesuffix("_replicated")
    if plain != name and plain in names:
        return plain
    return "ddp_bf16" if "bf16" in name and "ddp_bf16" in names else "ddp"


def _link_mb(rounds: list[dict[str, dict[str, Any]]], name: str) -> float | None:
    """Median over rounds of rank 0's link traffic per step, in MB (None if unread)."""
    vals = [x[name]["workers"][0]["link_bytes_per_step"] for x in rounds]
    return statistics.median(vals) / 1e6 if None not in vals else None


def _retransmits_per_step(rounds: list[dict[str, dict[str, Any]]], name: str) -> float:
    """Median over rounds of the TCP retransmits per step on rank 0's node (unread: 0)."""
    return statistics.median(
        x[name]["workers"][0].get("tcp_retransmits_per_step") or 0 for x in rounds
    )


def _link_trace(rounds: list[dict[str, dict[str, Any]]], names: list[str]) -> dict[str, Any]:
    """Per variant, the median over rounds of every link-trace figure measured in all
    rounds."""
    return {
        k: {
            stat: statistics.median(x[k]["link_trace"][stat] for x in rounds)
            for stat in rounds[0][k]["link_trace"]
            if None not in [x[k]["link_trace"][stat] for x in rounds]
        }
        for k in names
    }


def summarize(
    rounds: list[dict[str, dict[str, Any]]],
    names: list[str],
    args: argparse.Namespace,
    load_start: tuple[float, float, float],
) -> dict[str, Any]:
    """The results to store: the setup, medians and ratios per variant, and every round.

    Args:
        rounds: Per round, every variant's rank-0 metrics.
        names: The variants.
        args: The command line.
        load_start: The machine's load averages before the first round.

    Returns:
        The results, keyed as ``tools/_render`` reads them.
    """
    return {
        **_common.machine_info(),
        "rate": args.rate,
        "nodes": args.nodes,
        "workers_per_node": args.workers_per_node,
        "link_delay": os.environ.get("PSBED_DELAY"),
        "link_loss_percent": os.environ.get("PSBED_LOSS"),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "args": vars(args),
        "mean_step_ms": {k: _common.round_median(rounds, k, "mean_step_s") * 1e3 for k in names},
        "ratio_to_ddp": {k: _common.round_ratio(rounds, k, "ddp", "mean_step_s") for k in names},
        "counterpart": {k: counterpart(k, names) for k in names},
        "ratio_to_counterpart": {
            k: _common.round_ratio(rounds, k, counterpart(k, names), "mean_step_s") for k in names
        },
        "rank0_link_mb_per_step": {k: _link_mb(rounds, k) for k in names},
        "rank0_node_retransmits_per_step": {k: _retransmits_per_step(rounds, k) for k in names},
        "placement_last_round": {
            name: [(w["rank"], w["node_ip"], w["node_id"]) for w in rounds[-1][name]["workers"]]
            for name in names
        },
        "link_trace": _link_trace(rounds, names) if args.link_trace else None,
        "rounds": rounds,
    }


def print_report(summary: dict[str, Any], names: list[str], args: argparse.Namespace) -> None:
    """Prints where the workers ran and the table of step times, ratios and traffic.

    Args:
        summary: The results of :func:`summarize`.
        names: The variants.
        args: The command line.
    """
    print(f"\nworkers (last round, {names[0]}): rank, node ip, node id")
    for rank, ip, node in summary["placement_last_round"][names[0]]:
        print(f"  {rank}  {ip}  {node}")
    print(
        f"\n{args.nodes} node(s) x {args.workers_per_node} worker(s), link {args.rate}, "
        f"{args.rounds} round(s) x {args.steps} steps"
    )
    print(
        "| variant | mean step (ms) | ratio to DDP | ratio to counterpart "
        "| rank 0's link, MB/step (tx+rx) |"
    )
    print("|---|---|---|---|---|")
    for k in names:
        mb = summary["rank0_link_mb_per_step"][k]
        print(
            f"| {k} | {summary['mean_step_ms'][k]:.1f} | {summary['ratio_to_ddp'][k]:.2f}x | "
            f"{summary['ratio_to_counterpart'][k]:.2f}x ({summary['counterpart'][k]}) | "
            f"{'n/a' if mb is None else f'{mb:.1f}'} |"
        )


def main() -> None:
    """Runs the variants in rounds, stores the results and prints their table."""
    p = build_parser()
    args = p.parse_args()
    # Ray Train waits for the controller's poll on every report (2 s by default); the
    # driver's value reaches the controller and the workers.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
    names = check_args(p, args)
    join_cluster(p, args)
    # Other work on the machine skews the times; the load averages say how much.
    load_start = os.getloadavg()
    rounds = run_rounds(names, args)
    ray.shutdown()
    summary = summarize(rounds, names, args, load_start)
    out = _common.write_json(args.out, summary)
    print_report(summary, names, args)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
