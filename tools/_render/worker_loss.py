"""Renderers of ``benchmarks/worker_loss.py``: one worker killed, DDP beside each PS mode."""

from __future__ import annotations

from .fmt import _provenance, _table
from .results import read_json


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def worker_loss_table(result: str) -> str:
    """Per strategy: steps done again, seconds no worker stepped, the survivor's
    longest gap and processes, the replacement's first step after the kill, and
    accuracy against the same strategy without the kill."""
    d = read_json(result)
    rows = []
    for name, e in d["summary"].items():
        rows.append(
            [
                f"`{name}`",
                str(e["steps_done_again"]),
                _s(e["seconds_no_worker_stepped"]),
                f"{_s(e['survivor_longest_gap_s'])} ({e['survivor_processes']})",
                _s(e["replacement_first_step_s"]),
                _accuracy(e),
            ]
        )
    header = [
        "strategy",
        "steps done again",
        "s with no worker stepping",
        "survivor's longest gap, s (its processes)",
        "kill to replacement's first step, s",
        f"accuracy, mean of {_seeds(d)} seed(s) (points vs no kill)",
    ]
    return _provenance(result, "worker_loss", f"{result}.json") + "\n\n" + _table(header, rows)


def worker_loss_figure(strategy: str, field: str, result: str) -> str:
    """One figure of one strategy, e.g. ``worker_loss_figure ps_async
    survivor_longest_gap_s worker_loss`` → ``0.3``."""
    value = read_json(result)["summary"][strategy][field]
    return str(value) if isinstance(value, int) else _s(value)


def _accuracy(e: dict[str, float]) -> str:
    delta = (e["accuracy"] - e["accuracy_uninterrupted"]) * 100
    return f"{e['accuracy']:.3f} ({delta:+.1f})"


def _seeds(d: dict) -> int:
    """How many seeds each accuracy is the mean of (1 before seeds were recorded)."""
    first = next(iter(d["summary"].values()))
    return len(first.get("accuracy_by_seed", [None]))


def node_loss_table() -> str:
    """``benchmarks/node_loss.py``: per variant, steps done again, seconds no worker
    stepped, the longest such gap, worker processes per rank (2: a restart), and
    accuracy against the same variant without the loss."""
    d = read_json("node_loss")
    rows = [
        [
            f"`{name}`",
            str(e["steps_done_again"]),
            _s(e["seconds_no_worker_stepped"]),
            _s(e["longest_gap_s"]),
            str(e["processes_per_rank"]),
            _accuracy(e),
        ]
        for name, e in d["summary"].items()
    ]
    header = [
        "variant",
        "steps done again",
        "s with no worker stepping",
        "longest gap, s",
        "processes per rank",
        f"accuracy, mean of {_seeds(d)} seed(s) (points vs no loss)",
    ]
    return _provenance("node_loss", "node_loss", "node_loss.json") + "\n\n" + _table(header, rows)
