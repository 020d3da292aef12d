"""Renderers of ``benchmarks/diloco_digits.py``'s results, and the DiLoCo variants of
``net_step_time.py``."""

from __future__ import annotations

from typing import Any

from .fmt import _provenance, _table
from .results import read_json


def diloco_digits_table(result: str = "diloco_digits") -> str:
    """Final digits accuracy (mean over seeds) and wall time of every variant."""
    d = read_json(result)
    below = d["points_below_ddp"]
    rows = [
        [
            f"`{v}`",
            f"{acc:.3f}",
            "n/a" if v not in below else f"{below[v]:+.1f}",
            f"{d['wall_s'][v]:.1f}",
        ]
        for v, acc in d["final_accuracy"].items()
    ]
    header = [
        "variant",
        f"final test accuracy (rank 0, mean of {d['args']['seeds']} seeds)",
        "points below DDP (with the straggler: below DDP with it)",
        "wall time (s)",
    ]
    return _provenance(result, "diloco_digits", f"{result}.json") + ("\n\n" + _table(header, rows))


def diloco_points(variant: str, result: str = "diloco_digits") -> str:
    """Points of final digits accuracy a variant lies below DDP's, e.g. ``0.3``."""
    return f"{read_json(result)['points_below_ddp'][variant]:.1f}"


def net_bytes_fraction(variant: str, result: str) -> str:
    """Rank 0's link bytes per step of ``variant`` as a fraction of DDP's, e.g. ``1/37.2``."""
    mb = read_json(result)["rank0_link_mb_per_step"]
    return f"1/{mb['ddp'] / mb[variant]:.1f}"


def _mean_curve(curves: list[list[list[float]]]) -> list[tuple[int, float]]:
    """(step, accuracy) of a variant's curves, the accuracy the mean over seeds."""
    return [(int(points[0][0]), sum(p[2] for p in points) / len(points)) for points in zip(*curves)]


def _link_step_ms(nets: list[dict[str, Any]], variant: str) -> float | None:
    """A digits variant's step time in the first network run that measured it
    (``ddp_bf16`` as itself, ``diloco_h32`` as ``ps_diloco_h32``)."""
    for n in nets:
        for name in (variant, f"ps_{variant}"):
            if name in n["mean_step_ms"]:
                return float(n["mean_step_ms"][name])
    return None


def time_to_accuracy_table(digits: str, *nets: str) -> str:
    """Per variant run in both: its step time on the shaped link (the first of
    ``nets`` that ran it), its final digits accuracy (``digits``), and the steps and
    link time it takes its mean curve to reach DDP's final accuracy less one point."""
    d = read_json(digits)
    runs = [read_json(n) for n in nets]
    target = d["final_accuracy"]["ddp"] - 0.01
    rows = []
    for v, curves in d["curves"].items():
        ms = _link_step_ms(runs, v)
        if ms is None:
            continue
        reached = next((s for s, acc in _mean_curve(curves) if acc >= target), None)
        rows.append(
            [
                f"`{v}`",
                f"{ms:.0f}",
                f"{d['final_accuracy'][v]:.3f}",
                "not reached" if reached is None else str(reached),
                "n/a" if reached is None else f"{reached * ms / 1e3:.1f}",
            ]
        )
    rate = runs[0]["rate"]
    header = [
        "variant",
        f"step on the {rate} bed (ms)",
        "final accuracy (mean of seeds)",
        f"steps to {target:.3f} (DDP's final − 1 point)",
        f"time to it at {rate} (s)",
    ]
    sources = ", ".join(f"`benchmarks/results/{r}.json`" for r in (digits, *nets))
    note = (
        f"From {sources}: steps are those of the first evaluation (every 32 steps) "
        "at which the mean over seeds reaches the target; time is those steps × the "
        "variant's measured step on the bed."
    )
    return note + "\n\n" + _table(header, rows)
