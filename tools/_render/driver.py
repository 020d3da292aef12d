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
import re
import sys
from collections.abc import Callable
from pathlib import Path

from .chaos_soak import chaos_table
from .cost_curves import cost_shm_table
from .diloco import diloco_digits_table, diloco_points, net_bytes_fraction, time_to_accuracy_table
from .dlrm import dlrm_loss_gap, dlrm_ratio, dlrm_table
from .net import (
    net_cost_table,
    net_floor,
    net_link_table,
    net_model_table,
    net_ratio,
    net_round_ratios,
    net_table,
)
from .provenance import staleness_report
from .recsys import (
    recsys_memory_table,
    recsys_peak_gib,
    recsys_ratio,
    recsys_table,
    recsys_versus,
)
from .resnet18 import resnet_table
from .results import ROOT, RenderError
from .step_time import (
    replication_profile_table,
    replication_table,
    round_ms,
    step_bytes,
    step_calls,
    step_compare,
    step_ratio,
    step_time_table,
)
from .straggler import (
    digits_reach,
    digits_table,
    straggler_compare,
    straggler_phase_table,
    straggler_ratio,
    straggler_rounds,
    straggler_sleep,
    straggler_step_compare,
    straggler_table,
)
from .wire_server import wire_loop_cpu, wire_server_table
from .worker_loss import node_loss_table, worker_loss_figure, worker_loss_table

BLOCK = re.compile(r"<!-- generated: (?P<spec>[^>]*?) -->(?P<body>.*?)<!-- end generated -->", re.S)
OPENING = re.compile(r"<!-- generated: ")
CLOSING = re.compile(r"<!-- end generated -->")


#: Every renderer a marker may name, by name.
RENDERERS: dict[str, Callable[..., str]] = {
    f.__name__: f
    for f in (
        step_time_table,
        replication_table,
        replication_profile_table,
        step_ratio,
        step_compare,
        round_ms,
        step_bytes,
        step_calls,
        straggler_table,
        straggler_ratio,
        straggler_compare,
        straggler_phase_table,
        straggler_step_compare,
        straggler_sleep,
        straggler_rounds,
        digits_table,
        digits_reach,
        cost_shm_table,
        resnet_table,
        net_table,
        net_ratio,
        net_model_table,
        net_floor,
        net_round_ratios,
        net_link_table,
        net_cost_table,
        wire_server_table,
        wire_loop_cpu,
        chaos_table,
        diloco_digits_table,
        diloco_points,
        time_to_accuracy_table,
        net_bytes_fraction,
        recsys_table,
        recsys_ratio,
        recsys_versus,
        recsys_memory_table,
        recsys_peak_gib,
        dlrm_table,
        dlrm_ratio,
        dlrm_loss_gap,
        worker_loss_table,
        node_loss_table,
        worker_loss_figure,
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
    """The files with generated blocks: ``README.md``, then ``docs/*.md``."""
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
    """The command line of ``tools/render_docs.py`` (its help is this module's docstring)."""
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
