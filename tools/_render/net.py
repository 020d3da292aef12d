"""Renderers of ``benchmarks/net_step_time.py``'s runs on ``tools/netbed.py``, and the
network cost model they are held against."""

from __future__ import annotations

import re
from typing import Any

from .fmt import _provenance, _table, _x
from .results import RenderError, read_json

NET_LABELS = {
    "ddp": "DDP",
    "ddp_bf16": "DDP + torch `bf16_compress_hook`",
    "ps_sync": "PS sync",
    "ps_sync_bf16": 'PS sync, `compression="bf16"`',
    "ps_sync_onebit": 'PS sync, `compression="onebit"`',
    "ps_sync_topk": 'PS sync, `compression="topk"` (1%)',
    "ps_sync_topk10": 'PS sync, `compression="topk"`, `topk_ratio=0.1`',
    "ps_sync_lowrank": 'PS sync, `compression="lowrank"` (rank 4)',
    "ps_sync_lowrank1": 'PS sync, `compression="lowrank"`, `lowrank_rank=1`',
    "ps_sync_store": 'PS sync, `data_path="object_store"`',
    "ps_sync_bf16_store": 'PS sync, bf16, `data_path="object_store"`',
    "ps_sync_noagg": "PS sync, `node_aggregation=False`",
    "ps_sync_node": 'PS sync, `server_placement="node"`',
    "ps_sync_256kib": "PS sync, `chunk_bytes=256 KiB`",
    "ps_sync_512kib": "PS sync, `chunk_bytes=512 KiB`",
    "ps_sync_4mib": "PS sync, `chunk_bytes=4 MiB`",
    "ps_sync_16mib": "PS sync, `chunk_bytes=16 MiB`",
    "ps_sync_worker": 'PS sync, `server_placement="worker"`',
    # Measured before the switch that produced it was removed (the earlier design).
    "ps_sync_raycall": "PS sync, shared-memory notices as Ray calls (earlier design)",
    **{f"ps_diloco_h{h}": f"PS DiLoCo, `local_steps={h}`" for h in (1, 8, 32, 128)},
    "ps_diloco_h32_bf16": 'PS DiLoCo, `local_steps=32`, `compression="bf16"`',
    "ps_diloco_h32_int8": 'PS DiLoCo, `local_steps=32`, `compression="int8"`',
    "ps_diloco_h32_int4": 'PS DiLoCo, `local_steps=32`, `compression="int4"`',
    "ps_diloco_h32_overlap": "PS DiLoCo, `local_steps=32`, `diloco_overlap=True`",
    "ps_diloco_h32_noagg": "PS DiLoCo, `local_steps=32`, `node_aggregation=False`",
    "ps_async": "PS async",
    "ps_async_replicated": "PS async, `shard_replicas=1`",
    "compute": "compute only (no synchronisation)",
}
NET_BASES = {"ddp": "DDP", "ddp_bf16": "DDP + bf16 hook", "ps_async": "PS async"}
# Variants that move PS sync's bytes by construction (another chunk size or shard
# placement): the cost-model table leaves them out.
SAME_BYTES_AS_PS_SYNC = {
    "ps_sync_worker",
    "ps_sync_node",
    "ps_sync_256kib",
    "ps_sync_512kib",
    "ps_sync_4mib",
    "ps_sync_16mib",
}


def _bed(d: dict[str, Any]) -> str:
    return f"{d['nodes']} × {d['workers_per_node']}"


def net_table(*results: str) -> str:
    """The step-time table of ``net_step_time.py`` runs (``results/<result>.json``):
    one run, or several in one table with a column naming each run's nodes × workers.

    A variant held against another DDP variant (``ps_sync_bf16`` against DDP with
    torch's bf16 hook) shows that ratio beside its ratio to plain DDP."""
    runs = [(r, read_json(r)) for r in results or ("net_step_time",)]
    several = len(runs) > 1
    rows, notes = [], []
    for result, d in runs:
        shape = (
            f"{d['nodes']} nodes × {d['workers_per_node']} worker(s), links shaped to {d['rate']}. "
        )
        prov = shape + _provenance(result, "net_step_time", f"{result}.json")
        notes.append(f"- {prov}" if several else prov)
        for v, ms in d["mean_step_ms"].items():
            mb = d["rank0_link_mb_per_step"][v]
            base = d.get("counterpart", {}).get(v, "ddp")
            ratio = _x(d["ratio_to_ddp"][v])
            if base != "ddp" and base != v:
                ratio += f" ({_x(d['ratio_to_counterpart'][v])} of {NET_BASES[base]})"
            row = [NET_LABELS.get(v, f"`{v}`"), f"{ms:.0f}", ratio]
            row.append("n/a" if mb is None else f"{mb:.1f}")
            rows.append([_bed(d), *row] if several else row)
    header = ["variant", "mean step (ms)", "ratio to DDP", "rank 0's link, MB/step (both ways)"]
    if several:
        header = ["nodes × workers", *header]
    return "\n".join(notes) + "\n\n" + _table(header, rows)


def _net_bytes_model(variant: str, nodes: int, k: int, model_bytes: float) -> float | None:
    """Bytes a node's link carries per step (sent + received) on paper.

    Ring all-reduce over ``W = nodes * k`` workers ordered by node: each node's link
    carries one ring edge each way, ``2 (W - 1) / W`` model sizes per direction. A PS
    whose shards split the stream evenly over the nodes: without node aggregation each
    of a node's ``k`` workers sends the other nodes' ranges and receives their sums,
    and the node's shards do the same for every remote worker, ``2 k (N - 1) / N`` per
    direction; with a relay per node the ``k`` becomes 1. bf16 halves everything, the
    lossy encodings scale it by what they send per fp32 byte.
    """
    w = nodes * k
    half = _encoded_fraction(variant)
    if variant.startswith("ddp"):
        per_direction = 2 * (w - 1) / w
    elif variant.startswith("ps_sync"):
        relays = k > 1 and not variant.endswith(("_noagg", "_store"))
        per_direction = 2 * (1 if relays else k) * (nodes - 1) / nodes
    else:
        return None
    return 2 * per_direction * model_bytes * half


def _encoded_fraction(variant: str) -> float:
    """Bytes a variant's encoding sends per byte of fp32, by the encoding's own
    arithmetic on the 1 MiB chunks that cross nodes (headers and scales included)."""
    from ray_ps_plugin._lossy import LowRank, OneBit, TopK

    n = (1 << 20) // 4
    if variant.endswith("_onebit"):
        return OneBit().nbytes(n) / (4 * n)
    if variant.endswith("_topk"):
        return TopK(0.01).nbytes(n) / (4 * n)
    if variant.endswith("_topk10"):
        return TopK(0.1).nbytes(n) / (4 * n)
    if variant.endswith("_lowrank"):
        return LowRank(4).nbytes(n) / (4 * n)
    return 0.5 if "bf16" in variant else 1.0


def _rate_bytes_per_s(rate: str) -> float:
    """A tc rate such as ``1gbit`` or ``10gbit``, in bytes per second."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not m:
        raise RenderError(f"cannot read the link rate {rate!r}")
    return float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m[2]] / 8


def _paper_link_bytes(d: dict[str, Any], variant: str) -> float | None:
    """The cost model's link bytes per step (sent + received) for a run's variant."""
    model_bytes = 4 * d["rounds"][0]["ddp"]["params"]
    return _net_bytes_model(variant, d["nodes"], d["workers_per_node"], model_bytes)


def _line_rate_ms(d: dict[str, Any], paper_bytes: float) -> float:
    """Time one direction of ``paper_bytes`` takes at the run's link rate."""
    return paper_bytes / 2 / _rate_bytes_per_s(d["rate"]) * 1e3


def net_cost_table() -> str:
    """The cost model on paper: model sizes per direction on a worker node's link."""
    rows = []
    for nodes, k in ((2, 1), (2, 2), (2, 8), (8, 1), (8, 8), (64, 8)):
        w = nodes * k
        ring = 2 * (w - 1) / w
        plain = 2 * k * (nodes - 1) / nodes
        relays = 2 * (nodes - 1) / nodes if k > 1 else plain
        servers = 1.0  # push M to the server nodes, pull M back; S >= N of them
        rows.append(
            [
                f"{nodes} × {k}",
                f"{ring:.2f}",
                f"{plain:.2f} ({_x(plain / ring)})",
                f"{relays:.2f} ({_x(relays / ring)})",
                f"{servers:.2f} ({_x(servers / ring)})",
            ]
        )
    header = [
        "N nodes × k workers",
        "ring all-reduce",
        "PS, every worker pushes",
        "PS with node relays",
        "PS on ≥ N extra server nodes",
    ]
    return _table(header, rows)


def net_model_table(*results: str) -> str:
    """Measured link bytes and communication time of network runs against the cost
    model's (one row per distinct cost: ``SAME_BYTES_AS_PS_SYNC`` are left out)."""
    rows = []
    for result in results:
        d = read_json(result)
        nodes, k = d["nodes"], d["workers_per_node"]
        compute = d["mean_step_ms"].get("compute")
        for v, mb in d["rank0_link_mb_per_step"].items():
            paper = _paper_link_bytes(d, v)
            if paper is None or mb is None or v in SAME_BYTES_AS_PS_SYNC:
                continue
            wire_ms = _line_rate_ms(d, paper)
            comm = "n/a" if compute is None else f"{d['mean_step_ms'][v] - compute:.0f}"
            rows.append(
                [
                    f"{nodes} × {k}, {d['rate']}",
                    NET_LABELS.get(v, f"`{v}`"),
                    f"{paper / 1e6:.1f}",
                    f"{mb:.1f}",
                    f"{mb * 1e6 / paper:.2f}",
                    f"{wire_ms:.0f}",
                    comm,
                ]
            )
    header = [
        "nodes × workers, link",
        "variant",
        "link bytes, model (MB)",
        "measured (MB)",
        "measured / model",
        "one direction at line rate (ms)",
        "measured step − compute-only step (ms)",
    ]
    return _table(header, rows)


def net_ratio(variant: str, result: str = "net_step_time", base: str = "ddp") -> str:
    """A variant's step time over a DDP variant's across the shaped link, e.g. ``0.93×``."""
    d = read_json(result)
    if base == "ddp":
        return _x(d["ratio_to_ddp"][variant])
    if d["counterpart"][variant] != base:
        raise RenderError(f"{result}: {variant} is not held against {base}")
    return _x(d["ratio_to_counterpart"][variant])


def net_round_ratios(variant: str, result: str, base: str = "ddp") -> str:
    """Each round's step-time ratio of ``variant`` to ``base``, e.g. ``0.99×, 1.04×``."""
    d = read_json(result)
    return ", ".join(_x(r[variant]["mean_step_s"] / r[base]["mean_step_s"]) for r in d["rounds"])


def net_floor(variant: str, result: str, base: str = "ddp") -> str:
    """The best step-time ratio ``variant`` could reach against ``base`` in that run
    if everything but its bytes cost what it costs ``base``: ``base``'s measured step
    with ``base``'s bytes at line rate swapped for the variant's (cost model bytes,
    one direction)."""
    d = read_json(result)
    wire = {}
    for v in (variant, base):
        paper = _paper_link_bytes(d, v)
        if paper is None:
            raise RenderError(f"{result}: no cost model for {v}")
        wire[v] = _line_rate_ms(d, paper)
    step = d["mean_step_ms"][base]
    return _x((step - wire[base] + wire[variant]) / step)


def _link_trace(result: str) -> tuple[dict[str, Any], dict[str, dict[str, float]]]:
    d = read_json(result)
    if not d.get("link_trace"):
        raise RenderError(f"{result}: run without --link-trace")
    return d, d["link_trace"]


def net_link_table(result: str) -> str:
    """When the head node's link carried each step's bytes (``--link-trace``)."""
    d, trace = _link_trace(result)
    rows = []
    for v, t in trace.items():
        if "later_start_to_end_ms" not in t or v in SAME_BYTES_AS_PS_SYNC:
            continue  # no traffic (the compute floor), or PS sync's bytes again
        if t["steps_traced"] < d["args"]["steps"]:
            # Steps ran into each other without a quiet gap: no per-step figures.
            rows.append([NET_LABELS.get(v, f"`{v}`"), f"{d['mean_step_ms'][v]:.0f}"] + ["n/a"] * 4)
            continue
        line = _line_rate_ms(d, 2e6 * max(t["tx_mb"], t["rx_mb"]))
        rows.append(
            [
                NET_LABELS.get(v, f"`{v}`"),
                f"{d['mean_step_ms'][v]:.0f}",
                f"{t['gap_ms']:.0f}",
                f"{t['skew_ms']:.0f}",
                f"{t['later_start_to_end_ms']:.0f}",
                f"{line:.0f}",
            ]
        )
    header = [
        "variant",
        "mean step (ms)",
        "quiet between steps (ms)",
        "start skew (ms)",
        "later side's first byte to the last (ms)",
        "its bytes one way at line rate (ms)",
    ]
    note = (
        f"Medians per step, then over rounds, of the head node's link in `{result}.json` "
        "(`--link-trace`, sampled every millisecond; `benchmarks/_linktrace.py`). n/a: "
        "the link never went quiet between steps, so they cannot be told apart."
    )
    return note + "\n\n" + _table(header, rows)
