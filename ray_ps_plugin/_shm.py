"""Shared-memory segments between a worker and a shard on the same node.

BytePS moves intra-machine traffic through shared memory and keeps the network for
traffic between machines; this module is that idea for a worker and a colocated
shard. The bulk data (gradient chunks, sums, deltas, parameters) is written into a
segment both processes have mapped, and only a small notice of what was written
(step, keys, rank) travels separately: a Ray actor call, or in sync mode a frame on
the shard's direct TCP socket where the run has one (``_wire/``). Compared
with Ray's object store this saves, per message, the object's creation, sealing,
reference counting and deletion and one or two full copies, which on a small
machine cost more than the data itself.

A segment is an anonymous ``memfd``: it never has a name in a file system, so a
process killed at any moment cannot leave it behind; the kernel frees the memory
when the last process that maps it exits. The other process opens it through
``/proc/<pid>/fd/<fd>`` of the creator, which works between processes of one user
on one Linux host. :func:`available` says whether this host supports it; callers
fall back to the object store where it does not.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

__all__ = ["Segment", "SegmentHandle", "attach_each", "available"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def available() -> bool:
    """Whether this host can share segments (Linux with ``memfd_create``)."""
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create")


def _mapped(nbytes: int) -> int:
    """Bytes actually mapped for a segment of ``nbytes``: mmap refuses 0, and an
    empty slice (a shard with nothing of a tiny model) is still a segment."""
    return max(1, nbytes)


@dataclass(frozen=True)
class SegmentHandle:
    """What another process of the node needs to map a segment.

    Attributes:
        pid: Process id of the segment's creator.
        fd: The creator's file descriptor of the segment.
        nbytes: Size of the segment.
        dev: Device of the segment's inode, as the creator saw it.
        ino: The segment's inode number. With ``dev`` it identifies the segment:
            a pid or fd number reused after the creator died cannot pass for it.
    """

    pid: int
    fd: int
    nbytes: int
    dev: int = -1
    ino: int = -1


class Segment:
    """A byte buffer mapped into this process, shareable with others on the node.

    Use :meth:`create` or :meth:`open`, not the constructor.
    """

    def __init__(self, mm: mmap.mmap, handle: SegmentHandle, fd: int | None) -> None:
        self._mm = mm
        self._fd = fd  # kept open by the creator so that others can open it
        self.handle = handle
        self.bytes = np.frombuffer(mm, dtype=np.uint8)

    @classmethod
    def create(cls, nbytes: int) -> Segment:
        """Allocates a zero-filled segment of ``nbytes`` bytes.

        Raises:
            OSError: If the host cannot create one (callers fall back).
        """
        nbytes = int(nbytes)
        fd = os.memfd_create("ray_ps_plugin", os.MFD_CLOEXEC)
        try:
            # Reserve the pages now: a tmpfs that runs out of memory later would
            # kill the process with SIGBUS on a write; here it fails with OSError.
            os.posix_fallocate(fd, 0, _mapped(nbytes))
            mm = mmap.mmap(fd, _mapped(nbytes))
        except BaseException:
            os.close(fd)
            raise
        st = os.fstat(fd)
        return cls(mm, SegmentHandle(os.getpid(), fd, nbytes, st.st_dev, st.st_ino), fd)

    @classmethod
    def open(cls, handle: SegmentHandle) -> Segment:
        """Maps a segment another process of this node created.

        Raises:
            OSError: If the creator is gone or is not reachable from here (another
                node, another user), or the file found there is not the segment
                the handle names (a reused pid or fd).
        """
        fd = os.open(f"/proc/{handle.pid}/fd/{handle.fd}", os.O_RDWR)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (handle.dev, handle.ino):
                raise OSError(f"segment {handle} is not the file found there; stale handle?")
            if st.st_size != _mapped(handle.nbytes):
                raise OSError(f"segment {handle} has the wrong size; stale handle?")
            mm = mmap.mmap(fd, _mapped(handle.nbytes))
        finally:
            os.close(fd)  # the mapping keeps the memory alive
        return cls(mm, handle, None)

    def view(self, offset: int, dtype: np.dtype | str, count: int) -> np.ndarray:
        """``count`` values of ``dtype`` starting at byte ``offset`` (no copy).

        Raises:
            ValueError: If the range does not fit the segment.
        """
        dtype = np.dtype(dtype)
        end = offset + count * dtype.itemsize
        if offset < 0 or end > self.handle.nbytes:
            raise ValueError(
                f"bytes [{offset}, {end}) lie outside the {self.handle.nbytes}-byte segment"
            )
        return self.bytes[offset:end].view(dtype)

    def close(self) -> None:
        """Drops this process's mapping (the memory lives on while others map it)."""
        self.bytes = np.empty(0, np.uint8)
        # A view may still be alive somewhere; then the GC unmaps it later.
        with contextlib.suppress(BufferError):
            self._mm.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def attach_each(
    shards: Sequence[int], rank: int, attach: Callable[[int, list[Segment]], T]
) -> dict[int, T]:
    """Connects a worker to each of ``shards`` through shared memory, where it can.

    Args:
        shards: Shards on the worker's node.
        rank: The worker's rank, for messages.
        attach: Connects one shard; appends every segment it creates to the list,
            so that they are released if it fails part-way.

    Returns:
        What ``attach`` returned, by shard. A shard that could not be attached (no
        memfd on this host, /proc not readable, the call failed) is left out with a
        warning: its data then travels through the object store, which is slower
        but equivalent.
    """
    if not shards or not available():
        return {}
    lanes: dict[int, T] = {}
    for s in shards:
        created: list[Segment] = []
        try:
            lanes[s] = attach(s, created)
        except Exception as e:
            for seg in created:
                seg.close()
            logger.warning(
                "rank %d: no shared memory with shard %d (%s); using the object store.",
                rank,
                s,
                e,
            )
    return lanes
