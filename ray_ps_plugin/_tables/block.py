"""One table's rows on one shard: the block, its optimizer state and clocks.

NumPy only: shard processes use it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ray_ps_plugin._shard import resized
from ray_ps_plugin._shm import Segment
from ray_ps_plugin._shm import available as shm_available
from ray_ps_plugin._tables.optim import TableOptimizer
from ray_ps_plugin._tables.spec import TableSpec

__all__ = ["TableBlock", "zeroed_rows"]

logger = logging.getLogger(__name__)


@dataclass
class TableBlock:
    """One table's block of rows on this shard: local row ``i`` is the table's row
    ``lo + i * stride`` (below ``hi``); ``stride`` is 1 for a range of rows, the
    number of shards for interleaved rows."""

    spec: TableSpec
    lo: int
    hi: int
    num_workers: int
    weight: np.ndarray
    # The shared memory ``weight`` lies in, which workers of this node read rows
    # from directly (None: private memory, rows go by message).
    segment: Segment | None = None
    optimizer: TableOptimizer | None = None
    state: dict[str, np.ndarray] = field(default_factory=dict)
    steps: int = 0  # updates applied (torch's per-parameter ``step``)
    clocks: list[int] = field(default_factory=list)
    finished: set[int] = field(default_factory=set)
    free: set[int] = field(default_factory=set)  # replacements catching up (ssp)
    applied: int = 0  # sync: the last clock whose summed update is applied
    # Sync: each clock's pushes so far, and the hyperparameters of that step.
    pending: dict[int, list[tuple[int, np.ndarray, np.ndarray, bool]]] = field(default_factory=dict)
    pending_hyper: dict[int, dict[str, float]] = field(default_factory=dict)
    generation: int = 0  # restores so far (load_tables)
    # Replica tables: the rows each recent clock changed (table indices) and their
    # values after it; a worker pushes clock c + 1 only after its answer to c.
    changed_rows: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    stride: int = 1

    def own(self, lo: int, hi: int) -> tuple[int, int]:
        """The local rows ``[a, b)`` holding this block's rows among ``[lo, hi)``."""
        a = max(0, -(-(lo - self.lo) // self.stride))
        b = min(len(self.weight), -(-(hi - self.lo) // self.stride))
        return a, max(a, b)

    def slowest(self) -> int:
        """The slowest clock a pull waits for: of the workers still training that are
        not catching up after a replacement."""
        active = [
            c for r, c in enumerate(self.clocks) if r not in self.finished and r not in self.free
        ]
        return min(active) if active else max(self.clocks, default=0)

    def catch_up(self, rank: int) -> None:
        """A free rank within the bound of the others again is waited for."""
        bound = self.spec.staleness
        if rank in self.free and bound is not None and self.clocks[rank] >= self.slowest() - bound:
            self.free.discard(rank)

    def export(self) -> dict[str, Any]:
        """The block, its optimizer state and clocks as plain values (copies)."""
        return {
            "spec": self.spec,
            "lo": self.lo,
            "hi": self.hi,
            "stride": self.stride,
            "weight": self.weight.copy(),
            "shared": self.segment is not None,
            "optimizer": self.optimizer,
            "state": {n: v.copy() for n, v in self.state.items()},
            "steps": self.steps,
            "clocks": list(self.clocks),
            "generation": self.generation,
        }

    @classmethod
    def restore(cls, e: dict[str, Any], num_workers: int, bounded: bool) -> TableBlock:
        """The block :meth:`export` gave, for ``num_workers`` workers (in shared
        memory again where it was; clocks resized as :func:`resized` does)."""
        rows, dim = e["weight"].shape
        weight, segment = zeroed_rows(rows, dim, e["shared"])
        weight[:] = e["weight"]
        t = cls(e["spec"], e["lo"], e["hi"], num_workers, weight, segment)
        t.stride, t.optimizer, t.steps = e["stride"], e["optimizer"], e["steps"]
        t.state = {n: v.copy() for n, v in e["state"].items()}
        t.clocks = resized(e["clocks"], num_workers, set(), bounded)
        t.generation, t.applied = e["generation"], max(e["clocks"], default=0)
        return t


def zeroed_rows(rows: int, dim: int, shared: bool) -> tuple[np.ndarray, Segment | None]:
    """``rows`` zeroed fp32 rows and the segment they lie in: shared memory where
    ``shared`` asks for it and the host has it (a new segment is zeroed), else
    private memory and ``None``."""
    segment = _segment(rows, dim) if shared else None
    if segment is None:
        return np.zeros((rows, dim), np.float32), None
    return segment.view(0, "float32", rows * dim).reshape(rows, dim), segment


def _segment(rows: int, dim: int) -> Segment | None:
    """A segment for ``rows`` fp32 rows, or ``None`` where the host has none."""
    if not shm_available():
        return None
    try:
        return Segment.create(rows * dim * 4)
    except OSError as e:
        logger.warning("no shared memory for a table's rows (%s): rows go by message", e)
        return None
