"""On which commit each stored result was measured: the ``--staleness`` report (each
table in the docs names its own commit, through ``fmt._provenance``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .results import RESULTS, ROOT


def result_files() -> list[Path]:
    """Every stored result that carries its own metadata (the JSON files)."""
    return sorted(RESULTS.glob("*.json"))


def _meta(path: Path) -> dict[str, Any]:
    d = json.loads(path.read_text())
    return d if isinstance(d, dict) else {}


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
