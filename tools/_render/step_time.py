"""Renderers of ``benchmarks/step_time.py``'s results (``step_time.json``)."""

from __future__ import annotations

import statistics

from .fmt import EMPHASIS, _and, _bold, _faster_or_slower, _provenance, _table, _x
from .results import RenderError, read_json

# Labels of step-time variants that need a word of explanation in the table.
STEP_TIME_LABELS = {
    "ps_sync": "`ps_sync` (shared memory, the default)",
    "ps_sync_objstore": "`ps_sync_objstore` (`shared_memory=False`)",
}


def _step_ratio(variant: str) -> float:
    rounds = [r for r in read_json("step_time")["rounds"] if variant in r]
    if not rounds:
        raise RenderError(f"step_time.json has no variant {variant!r}")
    return statistics.median(
        r[variant]["median_step_s"] / r["ddp"]["median_step_s"] for r in rounds
    )


def step_time_table() -> str:
    d = read_json("step_time")
    rows = [
        [
            STEP_TIME_LABELS.get(v, f"`{v}`"),
            f"{ms:.1f}",
            _bold(_x(_step_ratio(v)), v in EMPHASIS["step_time"]),
        ]
        for v, ms in d["median_step_ms"].items()
    ]
    table = _table(["variant", "median step (ms)", "ratio to DDP (median of rounds)"], rows)
    return _provenance("step_time", "step_time", "step_time.json") + "\n\n" + table


def step_compare(variant: str) -> str:
    """``0.93× DDP's step time (7% faster)``, saying which way it goes."""
    ratio = _step_ratio(variant)
    return f"{_x(ratio)} DDP's step time ({_faster_or_slower(ratio, lower_wins=True)})"


def step_ratio(variant: str) -> str:
    """Median over rounds of the variant's step time over DDP's, e.g. ``0.86×``."""
    return _x(_step_ratio(variant))


def round_ms(variant: str) -> str:
    """The variant's median step in each round, e.g. ``41.8 and 53.0 ms``."""
    rounds = [r[variant] for r in read_json("step_time")["rounds"] if variant in r]
    return _and(f"{r['median_step_s'] * 1e3:.1f}" for r in rounds) + " ms"


def step_bytes() -> str:
    """Bytes moved per worker and step by sync PS against the minimum."""
    d = read_json("step_time")
    ratio = d["bytes_over_minimum"]
    return (
        f"{d['ps_bytes_per_worker_step'] / 1e6:.2f} MB against a minimum of "
        f"{d['min_bytes_per_worker_step'] / 1e6:.2f} MB, ratio **{ratio:.3f}** "
        f"(target ≤ 1.05: {'met' if ratio <= 1.05 else 'not met'})"
    )


def step_calls() -> str:
    """Remote calls per worker, step and shard of sync PS."""
    calls = read_json("step_time")["calls_per_step_per_shard"]
    return f"**{calls:.2f}** (target ≤ 2: {'met' if calls <= 2 else 'not met'})"


def replication_table() -> str:
    """Each replicated variant's step against the same mode's without replicas
    (median over rounds of the ratio within a round)."""
    d = read_json("replication_step_time")
    rows = []
    for v in d["median_step_ms"]:
        if not v.endswith("_replicated"):
            continue
        base = v.removesuffix("_replicated")
        ratios = [r[v]["median_step_s"] / r[base]["median_step_s"] for r in d["rounds"]]
        ratio = statistics.median(ratios)
        rows.append(
            [
                f"`{base}`",
                f"{d['median_step_ms'][base]:.1f}",
                f"{d['median_step_ms'][v]:.1f}",
                _bold(_x(ratio), ratio <= 1.15),
                ", ".join(_x(x) for x in ratios),
            ]
        )
    table = _table(
        [
            "mode",
            "median step (ms)",
            "with shard_replicas=1 (ms)",
            "ratio (median of rounds)",
            "each round's ratio",
        ],
        rows,
    )
    provenance = _provenance("replication_step_time", "step_time", "replication_step_time.json")
    return provenance + "\n\n" + table


def replication_profile_table() -> str:
    """CPU time per step of each kind of process, by part of the work, without and
    with replicas (``benchmarks/replication_profile.py``), and both runs' totals."""
    d = read_json("replication_profile")
    base, repl = (d["variants"][v] for v in ("ps_async", "ps_async_replicated"))

    def cell(run: dict, role: str, part: str | None = None) -> float:
        entry = run["roles"].get(role)
        if entry is None:
            return 0.0
        parts = entry["ms_per_step"]
        return parts.get(part, 0.0) if part else sum(parts.values())

    def ms(value: float) -> str:
        return f"{value:.1f}" if value else "–"

    rows = []
    for role in ("worker", "primary shard", "replica"):
        entry = repl["roles"].get(role) or base["roles"].get(role)
        if entry is None:
            continue
        parts = sorted(entry["ms_per_step"], key=lambda p: -entry["ms_per_step"][p])
        for part in parts:
            row = [f"{role} (×{entry['processes']})", part]
            rows.append([*row, ms(cell(base, role, part)), ms(cell(repl, role, part))])
    totals = [sum(cell(run, r) for r in run["roles"]) for run in (base, repl)]
    rows.append(["all", "**CPU, ms per step**", *(f"**{t:.0f}**" for t in totals)])
    steps = [run["median_step_ms"] for run in (base, repl)]
    rows.append(["", "**median step, ms**", *(f"**{s:.1f}**" for s in steps)])
    rows.append(
        ["", "ratio", "", f"CPU {_x(totals[1] / totals[0])}, step {_x(steps[1] / steps[0])}"]
    )
    table = _table(["process", "part of the work", "async", "async, `shard_replicas=1`"], rows)
    provenance = _provenance(
        "replication_profile", "replication_profile", "replication_profile.json"
    )
    return provenance + "\n\n" + table
