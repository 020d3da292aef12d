"""Renderers of ``benchmarks/recsys.py``'s sparse-embedding runs."""

from __future__ import annotations

import statistics
from typing import Any

from .fmt import _provenance, _table, _x
from .results import read_json


def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 1e6:.2f}"


def _setup(d: dict[str, Any]) -> str:
    a = d["args"]
    return f"{a['nodes']} × {a['workers_per_node']}"


def recsys_table(*results: str) -> str:
    """Step time against DDP and bytes per worker and step against the cost models: one
    run, or several in one table with a column naming each run's nodes × workers."""
    several = len(results) > 1
    rows, notes = [], []
    for result in results:
        d = read_json(result)
        prov = _provenance(result, "recsys", f"{result}.json")
        notes.append(f"- {_setup(d)}: {prov}" if several else prov)
        for variant, e in d["summary"].items():
            measured = e.get("ps_bytes_per_step")
            # A sharded table's cost model: the worker's rows out and back, once each.
            cost = e[
                "cost_sharded_bytes_per_step" if "sharded" in variant else "cost_ps_bytes_per_step"
            ]
            row = [
                f"`{variant}`",
                f"{e['median_step_s'] * 1e3:.1f}",
                _x(e["ratio_to_ddp"]),
                _mb(measured if variant != "ddp" else e["cost_ddp_bytes_per_step"]),
                _mb(cost if variant != "ddp" else None),
                "n/a" if measured is None else f"{measured / cost:.2f}",
                _mb(e.get("link_bytes_per_step")),
            ]
            rows.append([_setup(d), *row] if several else row)
    header = [
        "variant",
        "step (ms, median of rounds)",
        "step vs DDP",
        "MB per worker and step (PS: counted; DDP: cost model)",
        "PS cost model (MB)",
        "counted / cost model",
        "node link MB per step (bed)",
    ]
    if several:
        header = ["nodes × workers", *header]
    return "\n".join(notes) + "\n\n" + _table(header, rows)


def recsys_ratio(variant: str, result: str) -> str:
    """A variant's step time as a multiple of DDP's in a recsys result, e.g. ``1.73×``."""
    return _x(read_json(result)["summary"][variant]["ratio_to_ddp"])


def recsys_versus(variant: str, baseline: str, result: str) -> str:
    """A variant's step time as a multiple of another's, the median over the rounds
    of a recsys result (each round runs both), e.g. ``1.42×``."""
    rounds = read_json(result)["rounds"]
    return _x(
        statistics.median(r[variant]["mean_step_s"] / r[baseline]["mean_step_s"] for r in rounds)
    )


def _gib(value: float) -> str:
    return f"{value / 2**30:.2f}"


def recsys_memory_table(result: str) -> str:
    """Memory of a sharded-table run against what DDP would hold: the table, and
    SparseAdam's two state tensors of the table's size, on every worker."""
    d = read_json(result)
    a = d["args"]
    workers = a["nodes"] * a["workers_per_node"]
    table = a["tables"] * a["rows"] * a["dim"] * 4
    rows = []
    for variant, e in d["summary"].items():
        failed = e.get("failed")
        rows.append(
            [
                f"`{variant}`",
                f"{a['tables']} × {a['rows']:,} × {a['dim']} fp32 = {_gib(table)} GiB",
                "failed: " + failed if failed else _gib(e["max_worker_peak_rss_bytes"]),
                "" if failed else _gib(e["max_shard_peak_rss_bytes"] or 0),
                f"{_gib(3 * table)} per worker, {_gib(3 * table * workers)} for {workers}",
            ]
        )
    header = [
        "variant",
        "tables",
        "worker peak RSS (GiB, max)",
        "shard peak RSS (GiB, max)",
        "DDP's tables and SparseAdam state (GiB, arithmetic)",
    ]
    prov = _provenance(result, "recsys", f"{result}.json")
    return prov + "\n\n" + _table(header, rows)


def recsys_peak_gib(variant: str, result: str, who: str) -> str:
    """The highest peak RSS of a variant's workers or shards (``who``), in GiB."""
    e = read_json(result)["summary"][variant]
    return _gib(e[f"max_{who}_peak_rss_bytes"])
