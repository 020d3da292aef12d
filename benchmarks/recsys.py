"""A DLRM-style model with sparse embedding tables: DDP (Gloo's sparse all-reduce)
against sync PS (touched rows to their shards, the union back), in the same run.

The model (data generated in-process, no download): ``--tables`` ``EmbeddingBag``
tables of ``--rows`` x ``--dim`` (``sparse=True``, sum pooling, ``--bag`` ids per
sample), ids drawn from a Zipf law (exponent ``--zipf``) as recommendation traffic
is; 13 dense features through a bottom MLP; the pooled vectors and the bottom
output concatenated into a top MLP; binary cross-entropy. SparseAdam steps the
tables, Adam the MLPs: the split recommendation code uses.

Every step's ids are drawn from a generator seeded by (step, rank), so each worker
also knows every other worker's ids and counts, per step and table, the rows it
touched (``n``) and the union over workers (``U``). Per worker and step, with
``r = 8 + 4 * dim`` bytes per row (an int64 index and fp32 values):

- the PS moves ``sum_t (n_t + U_t) * r``: its rows to the owner shards, the union
  back (the cost model; the worker's counters give what was sent);
- DDP with Gloo moves about ``sum_t ((W - 1) * n_t + sum_{w' != w} n_{t,w'}) * r``: its
  sparse all-reduce is an all-gather of every rank's coalesced rows.

With the tables built on the meta device (variants ``ps_*_sharded``) no worker holds
them: the shards do, and each worker pulls its ``n_t`` unique rows and pushes their
gradients, about ``2 sum_t n_t * r`` per step. Every worker's and shard's peak
resident memory is recorded, so a table larger than DDP could hold (two replicas
and SparseAdam's two state tensors each) shows what it costs where.

Both add the dense MLPs' gradients (``B`` bytes): ``2 B`` for the PS (pushed, then
the sum pulled), ``4 (W - 1) / W * B`` sent and received by DDP's ring all-reduce.

Step time is rank 0's mean over the timed steps; each variant's ratio to DDP is
taken within the same round. ``--address`` runs it on a real cluster; in the bed
(``tools/netbed.py``) each worker also reads its node link's byte counters.

    python benchmarks/recsys.py --workers 4 --out benchmarks/results/recsys_1x4.json
    python benchmarks/recsys.py --workers-per-node 2 --tables 1 --rows 16777216 \\
        --variants ps_sync_sharded,ddp --rounds 1 \\
        --out benchmarks/results/recsys_sharded_4gib.json
    python tools/netbed.py --nodes 2 --cpus-per-node 2 --rate 1gbit -- \\
        python benchmarks/recsys.py --nodes 2 --workers-per-node 2 \\
        --out benchmarks/results/recsys_2x2_1gbit.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
import ray.train
import torch
import torch.nn as nn
from ray import cloudpickle
from ray.train import RunConfig, ScalingConfig

from ray_ps_plugin import PSConfig, PSTrainer, get_ps_context

sys.path.insert(0, str(Path(__file__).parent))
_common = importlib.import_module("_common")
cloudpickle.register_pickle_by_value(_common)

VARIANTS: dict[str, dict[str, Any]] = {
    "ddp": {"strategy": "ddp"},
    "ps_sync": {"strategy": "ps", "mode": "sync"},
    "ps_sync_bf16": {"strategy": "ps", "mode": "sync", "compression": "bf16"},
    # One shard per node (W x N messages a step instead of W x W; fewer processes).
    "ps_sync_node": {"strategy": "ps", "mode": "sync", "server_placement": "node"},
    "ps_sync_node_bf16": {
        "strategy": "ps",
        "mode": "sync",
        "server_placement": "node",
        "compression": "bf16",
    },
    # Replicated tables as under DDP, their SparseAdam applied once on the shards.
    "ps_sync_shard_opt": {"strategy": "ps", "mode": "sync", "sparse_optimizer": "shards"},
    # The tables built on the meta device: sharded over the shards, held by no worker.
    "ps_sync_sharded": {"strategy": "ps", "mode": "sync"},
    "ps_async_sharded": {"strategy": "ps", "mode": "async"},
}
SHARDED = {"ps_sync_sharded", "ps_async_sharded"}
DEFAULT_VARIANTS = "ddp,ps_sync"
DENSE_FEATURES = 13


class DLRM(nn.Module):
    """Sparse tables, a bottom MLP for the dense features, a top MLP over both."""

    def __init__(self, tables: int, rows: int, dim: int, meta: bool = False) -> None:
        super().__init__()
        device = "meta" if meta else None
        self.tables = nn.ModuleList(
            nn.EmbeddingBag(rows, dim, mode="sum", sparse=True, device=device)
            for _ in range(tables)
        )
        self.bottom = nn.Sequential(nn.Linear(DENSE_FEATURES, 64), nn.ReLU(), nn.Linear(64, dim))
        self.top = nn.Sequential(nn.Linear(dim * (tables + 1), 128), nn.ReLU(), nn.Linear(128, 1))

    def forward(self, dense: torch.Tensor, ids: list[torch.Tensor]) -> torch.Tensor:
        pooled = [t(i) for t, i in zip(self.tables, ids)]
        return self.top(torch.cat([self.bottom(dense), *pooled], dim=1)).squeeze(1)


def zipf_ids(cfg: dict[str, Any], step: int, rank: int) -> list[np.ndarray]:
    """One worker's ids of one step: per table, ``batch x bag`` rows drawn from a
    Zipf law over the table's rows (row 0 the most frequent), with a permutation per
    table so that the hot rows differ between tables."""
    g = np.random.default_rng([step, rank])
    out = []
    for t in range(cfg["tables"]):
        raw = g.zipf(cfg["zipf"], size=(cfg["batch"], cfg["bag"])) - 1
        out.append((raw % cfg["rows"] * (2 * t + 1) + t) % cfg["rows"])
    return out


def cost_rows(cfg: dict[str, Any], step: int, rank: int, world: int) -> tuple[int, int, int]:
    """``(n, U, others)`` summed over tables: this worker's unique rows, the union
    over workers, and the other workers' unique rows."""
    ids = [zipf_ids(cfg, step, r) for r in range(world)]
    n = u = others = 0
    for t in range(cfg["tables"]):
        uniq = [np.unique(ids[r][t]) for r in range(world)]
        n += len(uniq[rank])
        u += len(np.unique(np.concatenate(uniq)))
        others += sum(len(x) for r, x in enumerate(uniq) if r != rank)
    return n, u, others


def bench_loop(config: dict[str, Any]) -> None:
    """Times DLRM steps; reports step times, counters and the cost model."""
    import ray.train.torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    net = DLRM(config["tables"], config["rows"], config["dim"], meta=config["sharded"])
    model = ray.train.torch.prepare_model(net)
    opts = [
        torch.optim.SparseAdam(list(net.tables.parameters()), lr=1e-2),
        torch.optim.Adam([*net.bottom.parameters(), *net.top.parameters()], lr=1e-3),
    ]
    ps = get_ps_context()
    times, start = _timed_steps(config, rank, model, opts, ps)
    link = _common.link_bytes(config["ifname"])
    mine = _worker_metrics(config, net, rank, world, times, start, link)
    if ps is not None and start.get("ps") is not None:
        mine["ps_bytes_per_step"] = _ps_bytes_since(ps, start) / len(times)
    import torch.distributed as dist

    workers: list[Any] = [None] * world
    dist.all_gather_object(workers, mine)
    metrics = {
        "mean_step_s": mine["mean_step_s"],
        "workers": workers,
        "table_bytes": config["tables"] * config["rows"] * config["dim"] * 4,
        "shard_peak_rss_bytes": _shard_peak_rss() if rank == 0 else None,
    }
    with tempfile.TemporaryDirectory() as d:
        Path(d, "m.json").write_text(json.dumps(metrics))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))


def _timed_steps(
    config: dict[str, Any], rank: int, model: nn.Module, opts: list[Any], ps: Any
) -> tuple[list[float], dict[str, Any]]:
    """Runs the warm-up and timed DLRM steps on this worker's Zipf ids.

    Args:
        config: The train loop's config.
        rank: This worker's rank.
        model: The prepared DLRM.
        opts: Its optimizers (SparseAdam for the tables, Adam for the MLPs).
        ps: The PS context, or None under DDP.

    Returns:
        The timed steps' seconds, and the counters read as timing began: ``link``
        (link bytes), ``ps`` (the PS stats) and ``tables`` (the table stats).
    """
    g = torch.Generator().manual_seed(rank)
    times = []
    start: dict[str, Any] = {}
    for step in range(config["warmup"] + config["steps"]):
        ids = [torch.from_numpy(i) for i in zipf_ids(config, step, rank)]
        dense = torch.randn(config["batch"], DENSE_FEATURES, generator=g)
        label = (ids[0][:, 0] % 2).float()
        if step == config["warmup"]:
            start = {
                "link": _common.link_bytes(config["ifname"]),
                "ps": ps.stats if ps is not None else None,
                "tables": ps.table_stats() if ps is not None else None,
            }
        t0 = time.perf_counter()
        for o in opts:
            o.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(model(dense, ids), label).backward()
        for o in opts:
            o.step()
        if step >= config["warmup"]:
            times.append(time.perf_counter() - t0)
    return times, start


def _worker_metrics(
    config: dict[str, Any],
    net: DLRM,
    rank: int,
    world: int,
    times: list[float],
    start: dict[str, Any],
    link: int | None,
) -> dict[str, Any]:
    """This worker's figures: placement, step time, the cost model's bytes, peak
    memory, rows touched and link bytes, all per timed step.

    Args:
        config: The train loop's config.
        net: The unwrapped DLRM.
        rank: This worker's rank.
        world: The number of workers.
        times: The timed steps' seconds.
        start: The counters read as timing began (see :func:`_timed_steps`).
        link: The link's byte counter read after the timed steps.

    Returns:
        The figures, gathered by rank 0.
    """
    steps = len(times)
    # After the timed steps: the workers share the machine's cores, so this
    # bookkeeping (every worker's ids, drawn again) would slow the others' steps.
    costs = [
        cost_rows(config, step, rank, world)
        for step in range(config["warmup"], config["warmup"] + steps)
    ]
    row = 8 + 4 * config["dim"]
    dense_bytes = sum(
        p.numel() * 4 for n, p in net.named_parameters() if not n.startswith("tables")
    )
    n, u, others = (sum(c[i] for c in costs) / steps for i in range(3))
    return {
        "rank": rank,
        "node_id": ray.get_runtime_context().get_node_id(),
        "mean_step_s": statistics.fmean(times),
        # The dense MLPs on top: pushed and pulled once by the PS; all-reduced by
        # DDP's ring (each rank sends and receives 2 (W - 1) / W of them).
        "cost_ps_bytes_per_step": (n + u) * row + 2 * dense_bytes,
        "cost_ddp_bytes_per_step": ((world - 1) * n + others) * row
        + 4 * (world - 1) / world * dense_bytes,
        # Sharded tables: the worker's unique ids out and their rows back, then the
        # ids with their gradients out.
        "cost_sharded_bytes_per_step": 2 * n * row + 2 * dense_bytes,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "unique_rows_per_step": n,
        "union_rows_per_step": u,
        "link_bytes_per_step": (link - start["link"]) / steps
        if link is not None and start.get("link") is not None
        else None,
    }


def _ps_bytes_since(ps: Any, start: dict[str, Any]) -> int:
    """Bytes this worker pushed and pulled (dense and tables) since ``start``'s stats."""
    end = ps.stats
    end_tables = ps.table_stats()
    table_bytes = sum(end_tables[k] - start["tables"][k] for k in ("bytes_pulled", "bytes_pushed"))
    return (
        end.bytes_pushed
        + end.bytes_pulled
        - start["ps"].bytes_pushed
        - start["ps"].bytes_pulled
        + table_bytes
    )


def _shard_peak_rss() -> list[int]:
    """Peak resident memory of every shard process on this machine (``VmHWM``),
    found by the process title Ray gives actors (``ray::SumShard...``)."""
    peaks = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
            if not cmdline.startswith(b"ray::") or b"Shard" not in cmdline.split(b"\0")[0]:
                continue
            for line in (proc / "status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peaks.append(int(line.split()[1]) * 1024)
        except OSError:
            continue
    return sorted(peaks)


def run_variant(name: str, args: argparse.Namespace, storage: str) -> dict[str, Any]:
    """One ``fit()`` of variant ``name``; returns rank 0's metrics, or ``{"failed":
    message}`` when the run fails (DDP running out of memory on a table too large for
    it is a result, not a crash of the benchmark)."""
    try:
        return _fit_variant(name, args, storage)
    except ray.train.TrainingFailedError as e:
        # Ray's memory monitor names its reason on a line of its own; other
        # failures keep their first line.
        oom = re.search(r"OOM kill reason: (.*)", str(e))
        message = (
            f"out of memory, workers killed by Ray's memory monitor ({oom.group(1)})"
            if oom
            else str(e).splitlines()[0][:200]
        )
        print(f"{name} failed: {message}")
        return {"failed": message}


def _fit_variant(name: str, args: argparse.Namespace, storage: str) -> dict[str, Any]:
    n = args.nodes * args.workers_per_node
    strategy = "STRICT_SPREAD" if args.workers_per_node == 1 and args.nodes > 1 else "SPREAD"
    result = PSTrainer(
        bench_loop,
        ps_config=PSConfig(**VARIANTS[name]),
        train_loop_config={
            "tables": args.tables,
            "rows": args.rows,
            "dim": args.dim,
            "batch": args.batch,
            "bag": args.bag,
            "zipf": args.zipf,
            "steps": args.steps,
            "warmup": args.warmup,
            "ifname": args.ifname,
            "sharded": name in SHARDED,
        },
        scaling_config=ScalingConfig(
            num_workers=n,
            resources_per_worker={"CPU": args.cpus_per_worker},
            placement_strategy=strategy,
        ),
        run_config=RunConfig(storage_path=storage, name=f"recsys-{name}-{time.time_ns()}"),
    ).fit()
    metrics = dict(result.metrics)
    if args.nodes > 1:
        _common.check_placement(name, metrics["workers"], args)
    return metrics


def summarize(rounds: list[dict[str, Any]], variants: list[str]) -> dict[str, Any]:
    """Per variant: median step time, median ratio to DDP within a round, and the
    mean over workers and rounds of each byte figure."""

    def mean_of(name: str, key: str) -> float | None:
        vals = [w[key] for r in rounds for w in r[name]["workers"] if w.get(key) is not None]
        return statistics.fmean(vals) if vals else None

    out: dict[str, Any] = {}
    failed = {name for r in rounds for name in variants if "failed" in r[name]}
    for name in failed:
        out[name] = {"failed": next(r[name]["failed"] for r in rounds if "failed" in r[name])}
    for name in (v for v in variants if v not in failed):
        entry: dict[str, Any] = {
            "median_step_s": statistics.median(r[name]["mean_step_s"] for r in rounds),
        }
        if "ddp" in variants and "ddp" not in failed:
            entry["ratio_to_ddp"] = statistics.median(
                r[name]["mean_step_s"] / r["ddp"]["mean_step_s"] for r in rounds
            )
        for key in (
            "link_bytes_per_step",
            "ps_bytes_per_step",
            "cost_ps_bytes_per_step",
            "cost_ddp_bytes_per_step",
            "cost_sharded_bytes_per_step",
            "peak_rss_bytes",
            "unique_rows_per_step",
            "union_rows_per_step",
        ):
            entry[key] = mean_of(name, key)
        if entry["ps_bytes_per_step"] is not None:
            cost = "cost_sharded_bytes_per_step" if name in SHARDED else "cost_ps_bytes_per_step"
            entry["ps_bytes_to_cost_model"] = entry["ps_bytes_per_step"] / entry[cost]
        entry["max_worker_peak_rss_bytes"] = max(
            w["peak_rss_bytes"] for r in rounds for w in r[name]["workers"]
        )
        shard_peaks = [r[name].get("shard_peak_rss_bytes") for r in rounds]
        entry["max_shard_peak_rss_bytes"] = max((max(p) for p in shard_peaks if p), default=None)
        out[name] = entry
    return out


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--address", default=None, help="Ray cluster to join (default: local)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--workers-per-node", type=int, default=4)
    p.add_argument("--cpus-per-worker", type=float, default=0.5)
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--bag", type=int, default=4)
    p.add_argument("--zipf", type=float, default=1.2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    p.add_argument("--ifname", default=os.environ.get("GLOO_SOCKET_IFNAME"))
    p.add_argument("--storage", default=None, help="Ray Train storage (default: a temp dir)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; choose from {sorted(VARIANTS)}")
    ray.init(address=args.address)
    storage = args.storage or tempfile.mkdtemp(prefix="recsys-")
    rounds = []
    for i in range(args.rounds):
        rounds.append(
            _common.run_rotated(variants, i, lambda name: run_variant(name, args, storage))
        )
        print(_common.round_line(i + 1, rounds[-1], "mean_step_s"))
    summary = summarize(rounds, variants)
    for name, s in summary.items():
        print(name, json.dumps(s))
    if args.out:
        result = {
            **_common.machine_info(),
            "args": {k: v for k, v in vars(args).items() if k not in ("out", "storage", "address")},
            "summary": summary,
            "rounds": rounds,
        }
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
