"""Renderers of ``benchmarks/chaos_soak.py``'s soak on ``tools/netbed.py`` (``chaos_soak.json``)."""

from __future__ import annotations

from typing import Any

from .fmt import _provenance, _table
from .results import read_json


def _fault_detail(f: dict[str, Any]) -> str:
    if "skipped" in f:
        return f"skipped: {f['skipped']}"
    if f["kind"] == "shard_hung":
        return f"stopped {f['hung_s']:.1f} s"
    if f["kind"] == "link_down":
        return f"down {f['down_s']:.1f} s"
    if f["kind"] == "link_lossy":
        return (
            f"{f['loss_pct']:g}% loss for {f['lossy_s']:g} s, "
            f"{f['packets_dropped']} packets dropped"
        )
    if f["kind"] == "node_lost":
        return f"{f['processes_killed']} processes killed, node restarted"
    return "SIGKILL"


def chaos_table() -> str:
    """The soak's outcome, then every fault it injected."""
    d = read_json("chaos_soak")
    chaos, clean = d["chaos"], d["fault_free"]
    diff = d["max_abs_diff"]
    slowdown = chaos["wall_s"] / clean["wall_s"]
    summary = [
        [
            str(d["injected"]),
            str(d["survived"]),
            str(d["restarts"]),
            f"{chaos['steps_reexecuted']} of {d['args']['steps']}",
            f"{clean['wall_s']:.0f} s → {chaos['wall_s']:.0f} s ({slowdown:.1f}×)",
            "n/a (a run failed)" if diff is None else f"{diff:.1e}" if diff else "0",
        ]
    ]
    header = [
        "faults injected",
        "survived",
        "restarts",
        "steps re-executed",
        "wall time, fault-free → chaos",
        "max \\|Δθ\\| vs fault-free",
    ]
    rows = [
        [
            str(i + 1),
            f"`{f['kind']}`",
            f"{f['at_s']:.0f}",
            str(f["step"]),
            _fault_detail(f),
            "yes" if f.get("restarted") else "no",
            "–" if f.get("healed_after_s") is None else f"{f['healed_after_s']:.0f}",
        ]
        for i, f in enumerate(d["faults"])
    ]
    faults_header = [
        "#",
        "fault",
        "at (s)",
        "at step",
        "what",
        "restart",
        "training again after (s)",
    ]
    return (
        _provenance("chaos_soak", "chaos_soak", "chaos_soak.json")
        + ("\n\n" + _table(header, summary))
        + ("\n\n" + _table(faults_header, rows))
    )
