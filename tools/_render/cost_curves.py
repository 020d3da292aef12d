"""Renderers of ``benchmarks/cost_curves.py``'s sweeps (``cost_curves_*.csv``)."""

from __future__ import annotations

from typing import Any

from .fmt import _provenance, _table, _x
from .results import RenderError, _grid, _point


def _ms(row: dict[str, Any]) -> str:
    return f"{row['step_ms']:.0f}"


def _vs_ddp(file: str, variant: str, params: float, workers: int) -> float:
    ddp = _point(file, "ddp", params / 1e6, workers)["step_ms"]
    return _point(file, variant, params / 1e6, workers)["step_ms"] / ddp


def cost_shm_table() -> str:
    """The sweep with shared memory: DDP, PS-sync, PS-sync bf16, PS-async."""
    f = "cost_curves_shm"
    rows = []
    for params, workers in _grid(f):
        m = params / 1e6
        ddp, sync, bf16, asy = (
            _point(f, v, m, workers) for v in ("ddp", "ps_sync", "ps_sync_bf16", "ps_async")
        )
        rows.append(
            [
                f"{m:.0f}",
                str(workers),
                _ms(ddp),
                *(
                    f"{_ms(r)} ({_x(_vs_ddp(f, v, params, workers), 1)})"
                    for r, v in ((sync, "ps_sync"), (bf16, "ps_sync_bf16"), (asy, "ps_async"))
                ),
                " / ".join(f"{r['cross_node_bytes_per_step'] / 1e6:.0f}" for r in (sync, bf16)),
                " / ".join(f"{r['peak_rss_mb']:.0f}" for r in (ddp, sync, asy)),
            ]
        )
    header = [
        "params (M)",
        "workers",
        "DDP ms",
        "PS-sync ms (×DDP)",
        "PS-sync bf16 ms (×DDP)",
        "PS-async ms (×DDP)",
        "cross-node MB/step, sync / bf16",
        "peak RSS rank 0 (MB): DDP / sync / async",
    ]
    return _provenance(f, "cost_curves", f"{f}.csv") + "\n\n" + _table(header, rows)


def curve_ratio(file: str, variant: str, params_m: str, workers: str) -> str:
    """One point's step time over DDP's, e.g. ``1.7×``."""
    return _x(_vs_ddp(file, variant, float(params_m) * 1e6, int(workers)), 1)


def curve_range(file: str, variant: str, *scope: str) -> str:
    """Smallest to largest ratio to DDP over every multi-worker point, e.g.
    ``1.7–7.1×``; with ``but-worst``, over every point but the slowest one, which is
    then named, e.g. ``1.7–2.5× (7.1× at 50 M parameters with 4 workers)``."""
    if scope not in ((), ("but-worst",)):
        raise RenderError(f"curve_range takes an optional 'but-worst', got {scope}")
    points = [(_vs_ddp(file, variant, p, w), p, w) for p, w in _grid(file) if w > 1]
    points.sort()
    if scope:
        worst = points.pop()
        low, high = points[0][0], points[-1][0]
        return (
            f"{low:.1f}–{_x(high, 1)} ({_x(worst[0], 1)} at {worst[1] / 1e6:.0f} M "
            f"parameters with {worst[2]} workers)"
        )
    return f"{points[0][0]:.1f}–{_x(points[-1][0], 1)}"
