"""Renderers of ``benchmarks/recsys.py``'s sparse-embedding runs."""

from __future__ import annotations

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
            row = [
                f"`{variant}`",
                f"{e['median_step_s'] * 1e3:.1f}",
                _x(e["ratio_to_ddp"]),
                _mb(measured if variant != "ddp" else e["cost_ddp_bytes_per_step"]),
                _mb(e["cost_ps_bytes_per_step"] if variant != "ddp" else None),
                "n/a" if measured is None else f"{measured / e['cost_ps_bytes_per_step']:.2f}",
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
