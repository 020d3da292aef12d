"""Regenerates every measured figure in the docs from ``benchmarks/results``.

A figure that comes from a benchmark is never typed by hand. In ``README.md`` and
``docs/*.md`` it lies between two marker comments, which Markdown renders invisibly::

    <!-- generated: step_ratio ps_sync -->0.86×<!-- end generated -->

The first word names a renderer below, the other words are its arguments. Renderers
of tables (``*_table``) produce whole blocks; the others produce a few words inside a
sentence. Usage::

    python tools/render_docs.py            # rewrite the blocks in place
    python tools/render_docs.py --check    # exit 1 and list the stale blocks

``tests/unit/test_docs.py`` runs the check, so the docs cannot drift from the
results. The script reads only JSON and CSV files: no Ray, no torch.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import re
import statistics
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

BLOCK = re.compile(r"<!-- generated: (?P<spec>[^>]*?) -->(?P<body>.*?)<!-- end generated -->", re.S)
OPENING = re.compile(r"<!-- generated: ")
CLOSING = re.compile(r"<!-- end generated -->")

# Rows printed in bold: the variants each section is about (a presentation choice).
EMPHASIS = {
    "step_time": {"ps_sync", "ps_async"},
    "straggler": {"ps_async+straggler"},
    "resnet18": {"ps_async"},
}
# Labels of step-time variants that need a word of explanation in the table.
STEP_TIME_LABELS = {
    "ps_sync": "`ps_sync` (shared memory, the default)",
    "ps_sync_objstore": "`ps_sync_objstore` (`shared_memory=False`)",
}


class RenderError(ValueError):
    """A marker names an unknown renderer, has wrong arguments, or lacks its end."""


# --- reading the results ---------------------------------------------------------------
@functools.cache
def _json(name: str) -> Any:
    return json.loads((RESULTS / f"{name}.json").read_text())


@functools.cache
def _csv(name: str) -> tuple[dict[str, Any], ...]:
    with (RESULTS / f"{name}.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    return tuple({k: (v if k == "variant" else float(v)) for k, v in row.items()} for row in rows)


def _point(file: str, variant: str, params_m: float, workers: int) -> dict[str, Any]:
    for row in _csv(file):
        if (
            row["variant"] == variant
            and round(row["params"] / 1e6) == round(params_m)
            and int(row["workers"]) == workers
        ):
            return row
    raise RenderError(
        f"{file}.csv has no row {variant}, {params_m} M parameters, {workers} workers"
    )


def _grid(file: str) -> list[tuple[float, int]]:
    """(parameters, workers) of every point, in file order."""
    seen: dict[tuple[float, int], None] = {}
    for row in _csv(file):
        seen.setdefault((row["params"], int(row["workers"])), None)
    return list(seen)


# --- formatting --------------------------------------------------------------------------
def _x(ratio: float, digits: int = 2) -> str:
    return f"{ratio:.{digits}f}×"


def _bold(text: str, on: bool) -> str:
    return f"**{text}**" if on else text


def _and(items: Iterable[str]) -> str:
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _command(script: str, args: dict[str, Any]) -> str:
    """The command line that reproduces a run, from the arguments it recorded."""
    words = [f"python benchmarks/{script}.py"]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            words.append(flag)
        elif value is not False and value is not None:
            words.append(f"{flag} {value}")
    return " ".join(words)


def _at(m: dict[str, Any]) -> str:
    """Where a result says it was measured: `` at commit `abc` `` or nothing."""
    return f" at commit `{m['commit']}`" if "commit" in m else " (commit not recorded)"


def _provenance(meta: str, script: str, raw: str) -> str:
    m = _json(meta)
    return (
        f"Measured {m['date']}{_at(m)} on {m['machine']}, torch {m['torch']}, "
        f"Ray {m['ray']}. "
        f"Command: `{_command(script, m['args'])}`. Raw data: `benchmarks/results/{raw}`."
    )


# --- provenance of every result ------------------------------------------------------------
def result_files() -> list[Path]:
    """Every stored result that carries its own metadata (the JSON files)."""
    return sorted(RESULTS.glob("*.json"))


def _meta(path: Path) -> dict[str, Any]:
    d = json.loads(path.read_text())
    return d if isinstance(d, dict) else {}


def results_table() -> str:
    """When and on which commit each stored result was measured."""
    rows = [
        [
            f"`{p.name}`",
            _meta(p).get("date", "not recorded"),
            f"`{_meta(p)['commit']}`" if "commit" in _meta(p) else "not recorded",
        ]
        for p in result_files()
    ]
    return _table(["result", "measured", "commit"], rows)


def package_commits_since(commit: str) -> int | None:
    """Commits that changed ``ray_ps_plugin/`` after ``commit`` (None: unknown)."""
    import subprocess

    base = commit.removesuffix("-dirty")
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-list", "--count", f"{base}..HEAD", "--", "ray_ps_plugin"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return int(out) + (1 if commit.endswith("-dirty") else 0)


def staleness_report() -> list[str]:
    """One line per result: how many package commits came after its measurement."""
    lines = []
    for p in result_files():
        commit = _meta(p).get("commit")
        since = package_commits_since(commit) if commit else None
        if commit is None:
            lines.append(f"{p.name}: commit not recorded")
        elif since is None:
            lines.append(f"{p.name}: measured at {commit}, not in this checkout's history")
        else:
            lines.append(f"{p.name}: measured at {commit}, {since} package commit(s) since")
    return lines


# --- step time (benchmarks/step_time.py) -------------------------------------------------
def _step_ratio(variant: str) -> float:
    rounds = [r for r in _json("step_time")["rounds"] if variant in r]
    if not rounds:
        raise RenderError(f"step_time.json has no variant {variant!r}")
    return statistics.median(
        r[variant]["median_step_s"] / r["ddp"]["median_step_s"] for r in rounds
    )


def step_time_table() -> str:
    d = _json("step_time")
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


def _faster_or_slower(ratio: float, lower_wins: bool) -> str:
    """``7% faster`` / ``12% slower`` (within 1%: ``a tie``)."""
    pct = abs(ratio - 1) * 100
    if pct < 1:
        return "a tie"
    better = ratio < 1 if lower_wins else ratio > 1
    return f"{pct:.0f}% {'faster' if better else 'slower'}"


def step_compare(variant: str) -> str:
    """``0.93× DDP's step time (7% faster)``, saying which way it goes."""
    ratio = _step_ratio(variant)
    return f"{_x(ratio)} DDP's step time ({_faster_or_slower(ratio, lower_wins=True)})"


def step_ratio(variant: str) -> str:
    """Median over rounds of the variant's step time over DDP's, e.g. ``0.86×``."""
    return _x(_step_ratio(variant))


def round_ms(variant: str) -> str:
    """The variant's median step in each round, e.g. ``41.8 and 53.0 ms``."""
    rounds = [r[variant] for r in _json("step_time")["rounds"] if variant in r]
    return _and(f"{r['median_step_s'] * 1e3:.1f}" for r in rounds) + " ms"


def step_bytes() -> str:
    """Bytes moved per worker and step by sync PS against the minimum."""
    d = _json("step_time")
    ratio = d["bytes_over_minimum"]
    return (
        f"{d['ps_bytes_per_worker_step'] / 1e6:.2f} MB against a minimum of "
        f"{d['min_bytes_per_worker_step'] / 1e6:.2f} MB, ratio **{ratio:.3f}** "
        f"(target ≤ 1.05: {'met' if ratio <= 1.05 else 'not met'})"
    )


def step_calls() -> str:
    """Remote calls per worker, step and shard of sync PS."""
    calls = _json("step_time")["calls_per_step_per_shard"]
    return f"**{calls:.2f}** (target ≤ 2: {'met' if calls <= 2 else 'not met'})"


# --- stragglers (benchmarks/straggler.py) ------------------------------------------------
def _label(key: str) -> str:
    return key.replace("+straggler", " + straggler")


def straggler_table() -> str:
    d = _json("straggler")
    last = d["rounds"][-1]
    rows = [
        [
            _label(k),
            f"{d['samples_per_s'][k]:.0f}",
            _bold(_x(d["throughput_ratio_to_ddp"][k]), k in EMPHASIS["straggler"]),
            _x(d["rank0_step_ratio_to_ddp"][k]),
            ", ".join(str(s) for s in last[k]["staleness_max"]),
        ]
        for k in d["samples_per_s"]
    ]
    header = [
        "variant",
        "samples/s (both workers)",
        "throughput / DDP",
        "rank-0 step / DDP",
        "staleness max (rank 0, rank 1), last round",
    ]
    return _provenance("straggler", "straggler", "straggler.json") + "\n\n" + _table(header, rows)


def straggler_phase_table() -> str:
    """Rank 0's step split into phases, median over its steps, last round."""
    last = _json("straggler")["rounds"][-1]
    phases = ["forward", "backward", "ps_before_step", "optimizer", "ps_after_step", "ps_wait"]
    rows = [
        [
            _label(k),
            *(f"{last[k]['phase_ms'][0][ph]:.1f}" for ph in phases),
            f"{last[k]['median_step_ms'][0]:.1f}",
        ]
        for k in last
        if "phase_ms" in last[k]
    ]
    header = [
        "variant (rank 0)",
        "forward",
        "backward",
        "plugin before step",
        "optimizer",
        "plugin after step",
        "waiting, any phase",
        "whole step",
    ]
    return "Milliseconds, median over rank 0's steps in the last round.\n\n" + _table(header, rows)


def straggler_ratio(key: str) -> str:
    """Throughput over DDP's (with a straggler: over DDP's with one), e.g. ``1.89×``."""
    return _x(_json("straggler")["throughput_ratio_to_ddp"][key])


def straggler_compare(key: str) -> str:
    """``1.55× DDP's throughput (55% faster)``, saying which way it goes."""
    ratio = _json("straggler")["throughput_ratio_to_ddp"][key]
    return f"{_x(ratio)} DDP's throughput ({_faster_or_slower(ratio, lower_wins=False)})"


def straggler_step_compare(key: str) -> str:
    """``1.15× DDP's step time (15% slower)``: rank 0's median step over DDP's."""
    ratio = _json("straggler")["rank0_step_ratio_to_ddp"][key]
    return f"{_x(ratio)} DDP's step time ({_faster_or_slower(ratio, lower_wins=True)})"


def straggler_step_ratio(key: str) -> str:
    """Rank 0's median step over DDP's rank 0, e.g. ``0.35×``."""
    return _x(_json("straggler")["rank0_step_ratio_to_ddp"][key])


def straggler_staleness(key: str, rank: str) -> str:
    """A rank's largest clock gap in the last round."""
    return str(_json("straggler")["rounds"][-1][key]["staleness_max"][int(rank)])


def straggler_sleep() -> str:
    """How long the straggler sleeps after every step."""
    return f"{_json('straggler')['args']['sleep_ms']:g} ms"


def straggler_rounds(key: str) -> str:
    """Per-round throughput of ``key`` against DDP's, with the per-round ratios."""
    base = "ddp+straggler" if key.endswith("+straggler") else "ddp"
    rounds = _json("straggler")["rounds"]
    own = _and(f"{r[key]['samples_per_s']:.0f}" for r in rounds)
    ddp = _and(f"{r[base]['samples_per_s']:.0f}" for r in rounds)
    ratios = _and(_x(r[key]["samples_per_s"] / r[base]["samples_per_s"]) for r in rounds)
    return f"{own} samples/s against DDP's {ddp} ({ratios})"


def digits_table() -> str:
    d = _json("straggler")
    curves = d["curves"]
    fastest = min(curves, key=lambda m: curves[m][-1][0])
    calm = d.get("final_digits_accuracy_no_straggler", {})
    rows = [
        [
            m,
            _bold(f"{c[-1][0]:.1f} s", m == fastest),
            f"{d['final_digits_accuracy'][m]:.3f}",
            f"{calm[m]:.3f}" if m in calm else "not measured",
        ]
        for m, c in curves.items()
    ]
    header = [
        "mode",
        f"rank 0's {d['args']['digits_steps']} steps took (straggler)",
        "final test accuracy (rank 0), straggler",
        "without straggler",
    ]
    return _table(header, rows)


def digits_gap(better: str, worse: str) -> str:
    """Final-accuracy difference in percentage points, e.g. ``1.5``."""
    acc = _json("straggler")["final_digits_accuracy"]
    return f"{(acc[better] - acc[worse]) * 100:.1f}"


def digits_reach(mode: str, accuracy: str) -> str:
    """Wall time until rank 0's test accuracy first reached ``accuracy``."""
    for t, a in _json("straggler")["curves"][mode]:
        if a >= float(accuracy):
            return f"{t:.1f} s"
    return "never"


# --- cost curves (benchmarks/cost_curves.py) ---------------------------------------------
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


def curve_s(file: str, variant: str, params_m: str, workers: str) -> str:
    """One point's median step in seconds, e.g. ``9.0 s``."""
    return f"{_point(file, variant, float(params_m), int(workers))['step_ms'] / 1e3:.1f} s"


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


def curve_rss(file: str, params_m: str, workers: str) -> str:
    """Peak resident memory of rank 0 for DDP, PS-sync and PS-async at one point."""
    gb = {
        v: _point(file, v, float(params_m), int(workers))["peak_rss_mb"] / 1e3
        for v in ("ddp", "ps_sync", "ps_async")
    }
    return (
        f"{gb['ddp']:.2f} GB (DDP), {gb['ps_sync']:.2f} GB (sync) "
        f"and {gb['ps_async']:.2f} GB (async)"
    )


# --- ResNet-18 (benchmarks/resnet18.py) --------------------------------------------------
def _resnet_rows() -> list[dict[str, Any]]:
    d = _json("resnet18")
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
    d = _json("resnet18")
    where = (
        f"Measured {d['date']}{_at(d)} on {d['machine']}, torch {d['torch']}, Ray {d['ray']}. "
        f"Command: `{' '.join(['python benchmarks/resnet18.py', *d['args']])}`. "
        if isinstance(d, dict)
        else ""
    )
    return where + "Raw data: `benchmarks/results/resnet18.json`.\n\n" + _table(header, rows)


def resnet_ratio(variant: str) -> str:
    """Throughput over DDP's on ResNet-18, e.g. ``1.21×``."""
    return _x(_resnet(variant)["samples_per_s"] / _resnet("ddp")["samples_per_s"])


# --- across a shaped link (benchmarks/net_step_time.py on tools/netbed.py) -------
NET_LABELS = {
    "ddp": "DDP",
    "ddp_bf16": "DDP + torch `bf16_compress_hook`",
    "ps_sync": "PS sync",
    "ps_sync_bf16": 'PS sync, `compression="bf16"`',
    "ps_sync_store": 'PS sync, `data_path="object_store"`',
    "ps_sync_bf16_store": 'PS sync, bf16, `data_path="object_store"`',
    "ps_sync_noagg": "PS sync, `node_aggregation=False`",
    "ps_sync_node": 'PS sync, `server_placement="node"`',
    "ps_sync_256kib": "PS sync, `chunk_bytes=256 KiB`",
    "ps_sync_512kib": "PS sync, `chunk_bytes=512 KiB`",
    "ps_sync_4mib": "PS sync, `chunk_bytes=4 MiB`",
    "ps_sync_16mib": "PS sync, `chunk_bytes=16 MiB`",
    "ps_sync_worker": 'PS sync, `server_placement="worker"`',
    # Measured before the switch that produced it was removed (the earlier design).
    "ps_sync_raycall": "PS sync, shared-memory notices as Ray calls (earlier design)",
    **{f"ps_diloco_h{h}": f"PS DiLoCo, `local_steps={h}`" for h in (1, 8, 32, 128)},
    "ps_diloco_h32_bf16": 'PS DiLoCo, `local_steps=32`, `compression="bf16"`',
    "ps_diloco_h32_overlap": "PS DiLoCo, `local_steps=32`, `diloco_overlap=True`",
    "compute": "compute only (no synchronisation)",
}
NET_BASES = {"ddp": "DDP", "ddp_bf16": "DDP + bf16 hook"}


def net_table(result: str = "net_step_time") -> str:
    """The step-time table of one ``net_step_time.py`` run (``results/<result>.json``)."""
    d = _json(result)
    rows = []
    for v, ms in d["mean_step_ms"].items():
        mb = d["rank0_link_mb_per_step"][v]
        base = d.get("counterpart", {}).get(v, "ddp")
        against = d.get("ratio_to_counterpart", d["ratio_to_ddp"])[v]
        rows.append(
            [
                NET_LABELS.get(v, f"`{v}`"),
                f"{ms:.0f}",
                _x(d["ratio_to_ddp"][v]),
                f"{_x(against)} ({NET_BASES[base]})",
                "n/a" if mb is None else f"{mb:.1f}",
            ]
        )
    header = [
        "variant",
        "mean step (ms)",
        "ratio to DDP",
        "ratio to its DDP counterpart",
        "rank 0's link, MB/step (sent + received)",
    ]
    shape = f"{d['nodes']} nodes × {d['workers_per_node']} worker(s), links shaped to {d['rate']}. "
    return (
        shape
        + _provenance(result, "net_step_time", f"{result}.json")
        + ("\n\n" + _table(header, rows))
    )


def _net_bytes_model(variant: str, nodes: int, k: int, model_bytes: float) -> float | None:
    """Bytes a node's link carries per step (sent + received) on paper.

    Ring all-reduce over ``W = nodes * k`` workers ordered by node: each node's link
    carries one ring edge each way, ``2 (W - 1) / W`` model sizes per direction. A PS
    whose shards split the stream evenly over the nodes: without node aggregation each
    of a node's ``k`` workers sends the other nodes' ranges and receives their sums,
    and the node's shards do the same for every remote worker, ``2 k (N - 1) / N`` per
    direction; with a relay per node the ``k`` becomes 1. bf16 halves everything.
    """
    w = nodes * k
    half = 0.5 if "bf16" in variant else 1.0
    if variant.startswith("ddp"):
        per_direction = 2 * (w - 1) / w
    elif variant.startswith("ps_sync"):
        relays = k > 1 and not variant.endswith(("_noagg", "_store"))
        per_direction = 2 * (1 if relays else k) * (nodes - 1) / nodes
    else:
        return None
    return 2 * per_direction * model_bytes * half


def _rate_bytes_per_s(rate: str) -> float:
    """A tc rate such as ``1gbit`` or ``10gbit``, in bytes per second."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not m:
        raise RenderError(f"cannot read the link rate {rate!r}")
    return float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m[2]] / 8


def _paper_link_bytes(d: dict[str, Any], variant: str) -> float | None:
    """The cost model's link bytes per step (sent + received) for a run's variant."""
    model_bytes = 4 * d["rounds"][0]["ddp"]["params"]
    return _net_bytes_model(variant, d["nodes"], d["workers_per_node"], model_bytes)


def _line_rate_ms(d: dict[str, Any], paper_bytes: float) -> float:
    """Time one direction of ``paper_bytes`` takes at the run's link rate."""
    return paper_bytes / 2 / _rate_bytes_per_s(d["rate"]) * 1e3


def net_cost_table() -> str:
    """The cost model on paper: model sizes per direction on a worker node's link."""
    rows = []
    for nodes, k in ((2, 1), (2, 2), (2, 8), (8, 1), (8, 8), (64, 8)):
        w = nodes * k
        ring = 2 * (w - 1) / w
        plain = 2 * k * (nodes - 1) / nodes
        relays = 2 * (nodes - 1) / nodes if k > 1 else plain
        servers = 1.0  # push M to the server nodes, pull M back; S >= N of them
        rows.append(
            [
                f"{nodes} × {k}",
                f"{ring:.2f}",
                f"{plain:.2f} ({_x(plain / ring)})",
                f"{relays:.2f} ({_x(relays / ring)})",
                f"{servers:.2f} ({_x(servers / ring)})",
            ]
        )
    header = [
        "N nodes × k workers",
        "ring all-reduce",
        "PS, every worker pushes",
        "PS with node relays",
        "PS on ≥ N extra server nodes",
    ]
    return _table(header, rows)


def net_model_table(*results: str) -> str:
    """Measured link bytes and communication time of every network run against the
    cost model's."""
    rows = []
    for result in results:
        d = _json(result)
        nodes, k = d["nodes"], d["workers_per_node"]
        compute = d["mean_step_ms"].get("compute")
        for v, mb in d["rank0_link_mb_per_step"].items():
            paper = _paper_link_bytes(d, v)
            if paper is None or mb is None:
                continue
            wire_ms = _line_rate_ms(d, paper)
            comm = "n/a" if compute is None else f"{d['mean_step_ms'][v] - compute:.0f}"
            rows.append(
                [
                    f"{nodes} × {k}, {d['rate']}",
                    NET_LABELS.get(v, f"`{v}`"),
                    f"{paper / 1e6:.1f}",
                    f"{mb:.1f}",
                    f"{mb * 1e6 / paper:.2f}",
                    f"{wire_ms:.0f}",
                    comm,
                ]
            )
    header = [
        "nodes × workers, link",
        "variant",
        "link bytes, model (MB)",
        "measured (MB)",
        "measured / model",
        "one direction at line rate (ms)",
        "measured step − compute-only step (ms)",
    ]
    return _table(header, rows)


def net_ratio(variant: str, result: str = "net_step_time", base: str = "ddp") -> str:
    """A variant's step time over a DDP variant's across the shaped link, e.g. ``0.93×``."""
    d = _json(result)
    if base == "ddp":
        return _x(d["ratio_to_ddp"][variant])
    if d["counterpart"][variant] != base:
        raise RenderError(f"{result}: {variant} is not held against {base}")
    return _x(d["ratio_to_counterpart"][variant])


def net_round_ratios(variant: str, result: str, base: str = "ddp") -> str:
    """Each round's step-time ratio of ``variant`` to ``base``, e.g. ``0.99×, 1.04×``."""
    d = _json(result)
    return ", ".join(_x(r[variant]["mean_step_s"] / r[base]["mean_step_s"]) for r in d["rounds"])


def net_floor(variant: str, result: str, base: str = "ddp") -> str:
    """The best step-time ratio ``variant`` could reach against ``base`` in that run
    if everything but its bytes cost what it costs ``base``: ``base``'s measured step
    with ``base``'s bytes at line rate swapped for the variant's (cost model bytes,
    one direction)."""
    d = _json(result)
    wire = {}
    for v in (variant, base):
        paper = _paper_link_bytes(d, v)
        if paper is None:
            raise RenderError(f"{result}: no cost model for {v}")
        wire[v] = _line_rate_ms(d, paper)
    step = d["mean_step_ms"][base]
    return _x((step - wire[base] + wire[variant]) / step)


def _link_trace(result: str) -> tuple[dict[str, Any], dict[str, dict[str, float]]]:
    d = _json(result)
    if not d.get("link_trace"):
        raise RenderError(f"{result}: run without --link-trace")
    return d, d["link_trace"]


def net_link_table(result: str) -> str:
    """When the head node's link carried each step's bytes (``--link-trace``)."""
    d, trace = _link_trace(result)
    rows = []
    for v, t in trace.items():
        if "later_start_to_end_ms" not in t:
            continue  # no traffic: the compute floor
        if t["steps_traced"] < d["args"]["steps"]:
            # Steps ran into each other without a quiet gap: no per-step figures.
            rows.append([NET_LABELS.get(v, f"`{v}`"), f"{d['mean_step_ms'][v]:.0f}"] + ["n/a"] * 4)
            continue
        line = _line_rate_ms(d, 2e6 * max(t["tx_mb"], t["rx_mb"]))
        rows.append(
            [
                NET_LABELS.get(v, f"`{v}`"),
                f"{d['mean_step_ms'][v]:.0f}",
                f"{t['gap_ms']:.0f}",
                f"{t['skew_ms']:.0f}",
                f"{t['later_start_to_end_ms']:.0f}",
                f"{line:.0f}",
            ]
        )
    header = [
        "variant",
        "mean step (ms)",
        "quiet between steps (ms)",
        "start skew (ms)",
        "later side's first byte to the last (ms)",
        "its bytes one way at line rate (ms)",
    ]
    note = (
        f"Medians per step, then over rounds, of the head node's link in `{result}.json` "
        "(`--link-trace`, sampled every millisecond; `benchmarks/_linktrace.py`). n/a: "
        "the link never went quiet between steps, so they cannot be told apart."
    )
    return note + "\n\n" + _table(header, rows)


def net_link(variant: str, result: str, stat: str) -> str:
    """One traced figure (``gap_ms``, ``skew_ms``, ``later_start_to_end_ms``), in ms."""
    _, trace = _link_trace(result)
    return f"{trace[variant][stat]:.0f} ms"


def wire_server_table() -> str:
    """Event-loop CPU per MiB of the direct path's listening side, per implementation."""
    d = _json("wire_server")
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
    return f"{_json('wire_server')['rows'][int(which)]['loop_cpu_ms_per_mib']:.2f} ms"


# --- chaos soak (benchmarks/chaos_soak.py on tools/netbed.py) ----------------------
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
    d = _json("chaos_soak")
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


# --- DiLoCo (benchmarks/diloco_digits.py, and the diloco variants of net_step_time) ----
def diloco_digits_table(result: str = "diloco_digits") -> str:
    """Final digits accuracy (mean over seeds) and wall time of every variant."""
    d = _json(result)
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
    return f"{_json(result)['points_below_ddp'][variant]:.1f}"


def net_bytes_fraction(variant: str, result: str) -> str:
    """Rank 0's link bytes per step of ``variant`` as a fraction of DDP's, e.g. ``1/37.2``."""
    mb = _json(result)["rank0_link_mb_per_step"]
    return f"1/{mb['ddp'] / mb[variant]:.1f}"


# --- sparse embeddings (benchmarks/recsys.py) ------------------------------------------
def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 1e6:.2f}"


def recsys_table(result: str) -> str:
    """Step time against DDP and bytes per worker and step against the cost models."""
    d = _json(result)
    rows = []
    for variant, e in d["summary"].items():
        measured = e.get("ps_bytes_per_step")
        rows.append(
            [
                f"`{variant}`",
                f"{e['median_step_s'] * 1e3:.1f}",
                _x(e["ratio_to_ddp"]),
                _mb(measured if variant != "ddp" else e["cost_ddp_bytes_per_step"]),
                _mb(e["cost_ps_bytes_per_step"] if variant != "ddp" else None),
                "n/a" if measured is None else f"{measured / e['cost_ps_bytes_per_step']:.2f}",
                _mb(e.get("link_bytes_per_step")),
            ]
        )
    header = [
        "variant",
        "step (ms, median of rounds)",
        "step vs DDP",
        "MB per worker and step (PS: counted; DDP: cost model)",
        "PS cost model (MB)",
        "counted / cost model",
        "node link MB per step (bed)",
    ]
    return _provenance(result, "recsys", f"{result}.json") + ("\n\n" + _table(header, rows))


def recsys_ratio(variant: str, result: str) -> str:
    """A variant's step time as a multiple of DDP's in a recsys result, e.g. ``1.73×``."""
    return _x(_json(result)["summary"][variant]["ratio_to_ddp"])


# --- the markers -----------------------------------------------------------------------
RENDERERS: dict[str, Callable[..., str]] = {
    f.__name__: f
    for f in (
        step_time_table,
        step_ratio,
        step_compare,
        round_ms,
        step_bytes,
        step_calls,
        straggler_table,
        straggler_ratio,
        straggler_compare,
        straggler_phase_table,
        straggler_step_ratio,
        straggler_step_compare,
        straggler_staleness,
        straggler_sleep,
        straggler_rounds,
        digits_table,
        digits_gap,
        digits_reach,
        cost_shm_table,
        curve_ratio,
        curve_s,
        curve_range,
        curve_rss,
        resnet_table,
        resnet_ratio,
        results_table,
        net_table,
        net_ratio,
        net_model_table,
        net_floor,
        net_round_ratios,
        net_link_table,
        net_link,
        net_cost_table,
        wire_server_table,
        wire_loop_cpu,
        chaos_table,
        diloco_digits_table,
        diloco_points,
        net_bytes_fraction,
        recsys_table,
        recsys_ratio,
    )
}


def render(spec: str) -> str:
    """The text a marker ``<!-- generated: spec -->`` stands for."""
    name, *args = spec.split()
    if name not in RENDERERS:
        raise RenderError(f"unknown renderer {name!r}; known: {sorted(RENDERERS)}")
    try:
        text = RENDERERS[name](*args)
    except (KeyError, IndexError, TypeError) as e:
        raise RenderError(f"{spec!r}: {type(e).__name__}: {e}") from e
    # A table is a block of its own: blank lines keep Markdown from gluing it to
    # the marker comments.
    return f"\n\n{text}\n\n" if name.endswith("_table") else text


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def render_text(text: str, where: str) -> tuple[str, list[str]]:
    """Returns ``text`` with every block regenerated, and the blocks that changed.

    Raises:
        RenderError: If a marker is malformed or its renderer fails.
    """
    if len(OPENING.findall(text)) != len(CLOSING.findall(text)):
        raise RenderError(f"{where}: a '<!-- generated: ... -->' has no matching end marker")
    stale: list[str] = []

    def one(m: re.Match[str]) -> str:
        spec = m["spec"].strip()
        try:
            body = render(spec)
        except RenderError as e:
            raise RenderError(f"{where}: {e}") from e
        if body != m["body"]:
            stale.append(f"{where}: {spec}")
        return f"<!-- generated: {spec} -->{body}<!-- end generated -->"

    return BLOCK.sub(one, text), stale


def stale_blocks() -> list[str]:
    """Every generated block whose text differs from what the results give."""
    stale: list[str] = []
    for path in doc_files():
        stale += render_text(path.read_text(), str(path.relative_to(ROOT)))[1]
    return stale


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if a block is stale"
    )
    p.add_argument(
        "--staleness",
        action="store_true",
        help="list each result's commit and the package commits made since (changes nothing)",
    )
    args = p.parse_args(argv)
    if args.staleness:
        print("\n".join(staleness_report()))
        return 0
    try:
        if args.check:
            stale = stale_blocks()
            for s in stale:
                print(f"stale: {s}")
            if stale:
                print("Run: python tools/render_docs.py", file=sys.stderr)
            return 1 if stale else 0
        for path in doc_files():
            text = path.read_text()
            new, stale = render_text(text, str(path.relative_to(ROOT)))
            if new != text:
                path.write_text(new)
                for s in stale:
                    print(f"rewrote: {s}")
    except RenderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
