"""What a parameter shard answers a push or a pull with (and its bytes on the direct
path), and a worker's push waiting for it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:  # the shard process keeps clear of Ray Train
    from ray_ps_plugin._transport import Handle, Transport

__all__ = ["InFlight", "Reply"]


class Reply(NamedTuple):
    """A shard's answer to a push or a pull.

    Attributes:
        params: The shard's slice, or ``None`` when it was written to the worker's
            shared memory instead.
        clocks: Every worker's clock when the answer was made.
        slowest: The slowest unfinished worker's clock (all its updates are in).
    """

    params: np.ndarray | None
    clocks: tuple[int, ...]
    slowest: int

    def packed(self) -> np.ndarray:
        """A reply without parameters as the bytes of a frame: int64 ``slowest``,
        then the clocks."""
        assert self.params is None
        return np.array([self.slowest, *self.clocks], "<i8").view(np.uint8)

    @classmethod
    def unpack(cls, payload: np.ndarray) -> Reply:
        """The reply :meth:`packed` wrote."""
        values = payload.view("<i8").tolist()
        return cls(None, tuple(values[1:]), values[0])


@dataclass
class InFlight:
    """A worker's push (one call per shard) waiting for its replies.

    Attributes:
        held: What each shard with a replica applies of this push (its half of
            a two-delta shared-memory input, else a copy): once answered, kept
            until the next answer confirms the replica holds it (see
            :mod:`ray_ps_plugin._param.replica`).
    """

    clock: int
    handles: list[Handle[Any]]
    started: float
    held: dict[int, np.ndarray] = field(default_factory=dict)

    def hold(self, transport: Transport, model: int, rank: int) -> None:
        """This push is answered: a shard that dies before confirming the next one
        hands its successor these updates first (by :meth:`Transport.hold`)."""
        for shard, values in self.held.items():
            transport.hold(shard, ("param", model), ("mirror", (model, rank, self.clock, values)))
