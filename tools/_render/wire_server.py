"""Renderers of ``benchmarks/wire_server.py``'s results (``wire_server.json``)."""

from __future__ import annotations

from .fmt import _table
from .results import read_json


def wire_server_table() -> str:
    """Event-loop CPU per MiB of the direct path's listening side, per implementation."""
    d = read_json("wire_server")
    rows = [
        [
            r["label"],
            f"`{r['commit']}`",
            f"{r['loop_cpu_ms_per_mib']:.2f}",
            f"{r['wall_ms_per_mib']:.2f}",
        ]
        for r in d["rows"]
    ]
    first = d["rows"][0]
    note = (
        f"Measured {first['date']} on {first['machine']}: median of {first['repeats']} × "
        f"{first['frames']} frames of {first['chunk_bytes'] >> 10} KiB echoed on 127.0.0.1 "
        "(`benchmarks/wire_server.py`; raw data: `benchmarks/results/wire_server.json`)."
    )
    header = [
        "shard side reads and answers with",
        "commit",
        "event-loop CPU (ms/MiB)",
        "wall (ms/MiB)",
    ]
    return note + "\n\n" + _table(header, rows)


def wire_loop_cpu(which: str) -> str:
    """One implementation's event-loop CPU per MiB (row 0 or 1 of the wire_server run)."""
    return f"{read_json('wire_server')['rows'][int(which)]['loop_cpu_ms_per_mib']:.2f} ms"
