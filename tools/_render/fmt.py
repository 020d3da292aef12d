"""Formatting shared by the renderers: ratios, bold, lists, tables, provenance."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .results import read_json

# Rows printed in bold: the variants each section is about (a presentation choice).
EMPHASIS = {
    "step_time": {"ps_sync", "ps_async"},
    "straggler": {"ps_async+straggler"},
    "resnet18": {"ps_async"},
}


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
    m = read_json(meta)
    return (
        f"Measured {m['date']}{_at(m)} on {m['machine']}, torch {m['torch']}, "
        f"Ray {m['ray']}. "
        f"Command: `{_command(script, m['args'])}`. Raw data: `benchmarks/results/{raw}`."
    )


def _faster_or_slower(ratio: float, lower_wins: bool) -> str:
    """``7% faster`` / ``12% slower`` (within 1%: ``a tie``)."""
    pct = abs(ratio - 1) * 100
    if pct < 1:
        return "a tie"
    better = ratio < 1 if lower_wins else ratio > 1
    return f"{pct:.0f}% {'faster' if better else 'slower'}"
