"""Renderers of ``benchmarks/resnet18.py``'s results (``resnet18.json``)."""

from __future__ import annotations

from typing import Any

from .fmt import EMPHASIS, _at, _bold, _table, _x
from .results import RenderError, read_json


def _resnet_rows() -> list[dict[str, Any]]:
    d = read_json("resnet18")
    return d["rows"] if isinstance(d, dict) else d


def _resnet(variant: str) -> dict[str, Any]:
    for row in _resnet_rows():
        if row["variant"] == variant:
            return row
    raise RenderError(f"resnet18.json has no variant {variant!r}")


def resnet_table() -> str:
    ddp = _resnet("ddp")["samples_per_s"]
    rows = [
        [
            r["variant"],
            f"{r['samples_per_s']:.1f}",
            _bold(_x(r["samples_per_s"] / ddp), r["variant"] in EMPHASIS["resnet18"]),
            f"{r['median_step_ms']:.0f}",
            f"{r['loss_first']:.3f} → {r['loss_last']:.3f}",
        ]
        for r in _resnet_rows()
    ]
    header = ["variant", "samples/s", "vs DDP", "median step (ms)", "loss, first 5 → last 5 steps"]
    d = read_json("resnet18")
    where = (
        f"Measured {d['date']}{_at(d)} on {d['machine']}, torch {d['torch']}, Ray {d['ray']}. "
        f"Command: `{' '.join(['python benchmarks/resnet18.py', *d['args']])}`. "
        if isinstance(d, dict)
        else ""
    )
    return where + "Raw data: `benchmarks/results/resnet18.json`.\n\n" + _table(header, rows)
