"""Renderers of ``benchmarks/straggler.py``'s results (``straggler.json``): throughput
with a straggler, and the digits runs."""

from __future__ import annotations

from .fmt import EMPHASIS, _and, _bold, _faster_or_slower, _provenance, _table, _x
from .results import RenderError, read_json


def _label(key: str) -> str:
    return key.replace("+straggler", " + straggler")


def straggler_table() -> str:
    d = read_json("straggler")
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


def straggler_phase_table(only: str = "") -> str:
    """Rank 0's step split into phases, median over its steps, last round; with
    ``straggler``, only the runs with a straggler."""
    last = read_json("straggler")["rounds"][-1]
    if only not in ("", "straggler"):
        raise RenderError(f"straggler_phase_table takes an optional 'straggler', got {only!r}")
    phases = ["forward", "backward", "ps_before_step", "optimizer", "ps_after_step", "ps_wait"]
    rows = [
        [
            _label(k),
            *(f"{last[k]['phase_ms'][0][ph]:.1f}" for ph in phases),
            f"{last[k]['median_step_ms'][0]:.1f}",
        ]
        for k in last
        if "phase_ms" in last[k] and (not only or k.endswith("+straggler"))
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
    return _x(read_json("straggler")["throughput_ratio_to_ddp"][key])


def straggler_compare(key: str) -> str:
    """``1.55× DDP's throughput (55% faster)``, saying which way it goes."""
    ratio = read_json("straggler")["throughput_ratio_to_ddp"][key]
    return f"{_x(ratio)} DDP's throughput ({_faster_or_slower(ratio, lower_wins=False)})"


def straggler_step_compare(key: str) -> str:
    """``1.15× DDP's step time (15% slower)``: rank 0's median step over DDP's."""
    ratio = read_json("straggler")["rank0_step_ratio_to_ddp"][key]
    return f"{_x(ratio)} DDP's step time ({_faster_or_slower(ratio, lower_wins=True)})"


def straggler_sleep() -> str:
    """How long the straggler sleeps after every step."""
    return f"{read_json('straggler')['args']['sleep_ms']:g} ms"


def straggler_rounds(key: str) -> str:
    """Per-round throughput of ``key`` against DDP's, with the per-round ratios."""
    base = "ddp+straggler" if key.endswith("+straggler") else "ddp"
    rounds = read_json("straggler")["rounds"]
    own = _and(f"{r[key]['samples_per_s']:.0f}" for r in rounds)
    ddp = _and(f"{r[base]['samples_per_s']:.0f}" for r in rounds)
    ratios = _and(_x(r[key]["samples_per_s"] / r[base]["samples_per_s"]) for r in rounds)
    return f"{own} samples/s against DDP's {ddp} ({ratios})"


def digits_table() -> str:
    d = read_json("straggler")
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


def digits_reach(mode: str, accuracy: str) -> str:
    """Wall time until rank 0's test accuracy first reached ``accuracy``."""
    for t, a in read_json("straggler")["curves"][mode]:
        if a >= float(accuracy):
            return f"{t:.1f} s"
    return "never"
