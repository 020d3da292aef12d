"""Forwarded updates through shared memory, for a replica on its primary's node.

A primary forwards every update it applies to its replica. Through Ray's object
store a 12 MB update costs about 9 ms of a loaded 2-core machine (the store's
put, the call, its bookkeeping) against 1.4 ms for copying the bytes; on one node
that made replication nearly double an async step. So when the replica runs on
the primary's node, it reads each update from shared memory and only the update's
place is forwarded:

- **The worker's own input** (:func:`lane_update`), where the worker wrote the
  update through shared memory: with replicas a worker's input holds two updates,
  written by clock parity, and update ``k``'s half is written again only for
  ``k + 2``, once the answer to ``k + 1`` confirmed the replica holds ``k``. No one
  copies the update: the worker keeps it there for a failover, the primary applies
  it from there, the replica replays it from there.
- **A slot of the primary** (:class:`Slots`) otherwise (an update that came by
  message, or in another dtype than the shard computes in): the primary copies the
  update into one of a few shared-memory slots.

A slot is written again only once the replica confirmed the change that last
used it (changes are confirmed in their order). When every slot is still in use,
or the host cannot share memory, the update goes through the object store, as
between nodes: the slots make forwarding cheaper, never different.

The replica maps the primary's segments while the primary is alive (it names a
slot only after writing it); its mapping outlives a primary that dies after.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import numpy as np
import torch

from ray_ps_plugin._codec import as_torch
from ray_ps_plugin._shm import Segment, SegmentHandle, available

__all__ = ["SlotReader", "SlotRef", "Slots", "dtype_name", "lane_update", "make_slots"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SlotRef:
    """Where a forwarded update lies: ``count`` values of ``dtype`` in a segment,
    from byte ``offset``."""

    handle: SegmentHandle
    dtype: str
    count: int
    offset: int = 0


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype's name, which is numpy's name for it too (``"float32"``)."""
    return str(dtype).removeprefix("torch.")


def lane_update(
    inputs: Segment, clock: int, dtype: np.dtype, count: int
) -> tuple[np.ndarray, SlotRef] | None:
    """The update of ``clock`` a worker wrote into its input segment (``count``
    values of ``dtype``) and where it lies; ``None`` when the segment is not the
    size of one update or of two (the workers' models differ). A segment of two
    updates holds odd clocks in its second half."""
    nbytes = count * dtype.itemsize
    if inputs.handle.nbytes not in (nbytes, 2 * nbytes):
        return None
    offset = nbytes * (clock % 2) if inputs.handle.nbytes == 2 * nbytes else 0
    ref = SlotRef(inputs.handle, dtype.name, count, offset)
    return inputs.view(offset, dtype, count), ref


class Slots:
    """The primary's slots, per model: written in turn, each reused once confirmed.

    Args:
        count: Slots per model (each the size of the model's slice).
    """

    def __init__(self, count: int) -> None:
        self._count = count
        self._rings: dict[int, list[tuple[Segment, list[int]]]] = {}  # slot, [its seq]
        self._next: dict[int, int] = {}
        self._confirmed = 0  # every change numbered up to this is held by the replica
        self._lock = threading.Lock()  # confirmations arrive on Ray's threads

    def confirmed(self, seq: int) -> None:
        """The replica holds change ``seq`` and every one before it."""
        with self._lock:
            self._confirmed = max(self._confirmed, seq)

    def put(self, model: int, values: torch.Tensor, seq: int) -> SlotRef | None:
        """Copies ``values`` into ``model``'s next slot as change ``seq``; ``None``
        when that slot still carries an unconfirmed change (or no slot can be made)."""
        ring = self._ring(model, values)
        if ring is None:
            return None
        i = self._next[model]
        segment, used = ring[i]
        with self._lock:
            if used[0] > self._confirmed:
                return None
        used[0] = seq
        self._next[model] = (i + 1) % len(ring)
        dtype = dtype_name(values.dtype)
        view = segment.view(0, np.dtype(dtype), values.numel())
        as_torch(view).copy_(values.reshape(-1))
        return SlotRef(segment.handle, dtype, values.numel())

    def _ring(self, model: int, values: torch.Tensor) -> list[tuple[Segment, list[int]]] | None:
        nbytes = values.numel() * values.element_size()
        ring = self._rings.get(model)
        if ring == []:
            return None  # no segment could be made: by value from then on
        if ring is not None and ring[0][0].handle.nbytes == nbytes:
            return ring
        if ring is not None:
            _close(ring)
        segments: list[Segment] = []
        try:
            for _ in range(self._count):
                segments.append(Segment.create(nbytes))
        except OSError as e:
            logger.warning("No shared memory for forwarding updates (%s): object store.", e)
            for segment in segments:  # those made before the host ran out
                segment.close()
            self._rings[model] = []
            return None
        self._rings[model] = ring = [(s, [0]) for s in segments]
        self._next[model] = 0
        return ring

    def close(self) -> None:
        """Unmaps every slot (a replica that mapped them keeps its mapping)."""
        rings, self._rings = self._rings, {}
        for ring in rings.values():
            _close(ring)


def _close(ring: list[tuple[Segment, list[int]]]) -> None:
    for segment, _ in ring:
        segment.close()


def make_slots(same_node: bool, num_workers: int) -> Slots | None:
    """Slots for a replica on the primary's node (``None`` for one on another node,
    or where the host cannot share memory). Each worker has at most two updates
    unconfirmed (see :mod:`ray_ps_plugin._param.replica`), so ``2 * num_workers``
    slots always suffice; at most 4 are made per model (each the slice's size)."""
    if not same_node or not available():
        return None
    return Slots(min(2 * num_workers, 4))


class SlotReader:
    """The replica's side: maps the primary's and the workers' segments once, reads
    the updates in them."""

    def __init__(self) -> None:
        self._segments: dict[SegmentHandle, Segment] = {}

    def open(self, handle: SegmentHandle) -> None:
        """Maps a segment now, while its creator surely lives (a worker's input, as
        it attaches): a worker that dies later leaves its mapping readable here.

        Raises:
            OSError: The creator is gone already.
        """
        if handle not in self._segments:
            self._segments[handle] = Segment.open(handle)

    def values(self, ref: SlotRef) -> np.ndarray:
        """The update in ``ref``'s place (no copy: read before it is confirmed)."""
        self.open(ref.handle)
        return self._segments[ref.handle].view(ref.offset, np.dtype(ref.dtype), ref.count)
