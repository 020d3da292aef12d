"""Renderers of ``benchmarks/cost_curves.py``'s sweeps (``cost_curves_*.csv``)."""

from __future__ import annotations

from typing import Any

from .fmt import _provenance, _table, _x
from .results import _grid, _point


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
