"""Reading ``benchmarks/results``: where the results are, and each file, parsed once."""

from __future__ import annotations

import csv
import functools
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


class RenderError(ValueError):
    """A marker names an unknown renderer, has wrong arguments, or lacks its end."""


@functools.cache
def _json(name: str) -> Any:
    """``benchmarks/results/<name>.json``, parsed (each file read once)."""
    return json.loads((RESULTS / f"{name}.json").read_text())


def read_json(name: str) -> Any:
    """``benchmarks/results/<name>.json``, parsed: what every renderer reads.

    Calls this module's ``_json`` as it is at the time of the call, so that replacing
    it takes effect (``tests/unit/test_docs.py`` does, to see which results a
    document reads).

    Args:
        name: The file's name without ``.json``.

    Returns:
        The parsed JSON.
    """
    return _json(name)


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
