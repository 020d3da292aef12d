"""Renderers of ``benchmarks/diloco_digits.py``'s results, and the DiLoCo variants of
``net_step_time.py``."""

from __future__ import annotations

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
