"""What an async/ssp shard holds for one prepared model: the master slice, the
workers' clocks, and the reads the staleness bound holds back."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ray_ps_plugin._param.reply import Reply
from ray_ps_plugin._shm import Segment, SegmentHandle

__all__ = ["ParamState", "Waiting", "export_models", "import_model"]


@dataclass(eq=False)
class Waiting:
    """A read held back by the staleness bound, answered the moment it is met."""

    rank: int
    clock: int
    need: int  # the slowest clock that lets it through
    slot: int | None
    answer: asyncio.Future[Reply]


@dataclass
class ParamState:
    """One prepared model's state on this shard."""

    num_workers: int
    params: torch.Tensor | None = None  # the master copy of this shard's slice
    dtype: str = "float32"  # the model's dtype: what workers send and receive
    clocks: list[int] = field(default_factory=list)
    finished: set[int] = field(default_factory=set)  # no longer holds the others back
    # Replacements that go on from their own clock and hold no one back until they
    # are within the bound again (see ParamShard.admit).
    free: set[int] = field(default_factory=set)
    generation: int = 0  # bumped by every reseed (a checkpoint loaded mid-run)
    initialised: asyncio.Event = field(default_factory=asyncio.Event)
    # Workers of this node attached through shared memory: input, two outputs.
    lanes: dict[int, tuple[Segment, tuple[Segment, Segment]]] = field(default_factory=dict)
    waiting: list[Waiting] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.clocks = [0] * self.num_workers

    def slowest(self) -> int:
        """The slowest clock the others wait for: of the workers still training that
        are not catching up after a replacement."""
        active = [
            c for r, c in enumerate(self.clocks) if r not in self.finished and r not in self.free
        ]
        return min(active) if active else max(self.clocks)

    def input_handles(self) -> list[SegmentHandle]:
        """The input segment of each worker attached through shared memory."""
        return [inputs.handle for inputs, _ in self.lanes.values()]

    def let_through(self) -> list[Waiting]:
        """Takes out the held-back reads the clocks now let through."""
        if not self.waiting:
            return []
        slowest = self.slowest()
        ready = [w for w in self.waiting if w.need <= slowest or w.rank in self.free]
        self.waiting = [w for w in self.waiting if w not in ready]
        return ready


def export_models(models: dict[int, ParamState]) -> dict[int, dict[str, Any]]:
    """What a later shard of the same slice needs of each initialised model: the
    parameters, dtype, clocks and reseed generation."""
    return {
        model: {
            "params": state.params.numpy().copy(),
            "dtype": state.dtype,
            "clocks": list(state.clocks),
            "finished": sorted(state.finished),
            "free": sorted(state.free),
            "generation": state.generation,
        }
        for model, state in models.items()
        if state.params is not None
    }


def import_model(state: ParamState, exported: dict[str, Any], clocks: list[int]) -> None:
    """Takes one model's exported state, with ``clocks`` for this run's workers."""
    state.params = torch.from_numpy(np.array(exported["params"], copy=True))
    state.dtype = exported["dtype"]
    state.clocks = clocks
    state.generation = exported["generation"]
    state.initialised.set()
