"""How one step's gradients are cut into chunks and spread over the server shards.

DDP hands the gradients to its communication hook one bucket at a time, always in
bucket-index order, and the buckets of one step together hold every trainable
parameter exactly once. Concatenated, they form the step's *gradient stream* of
``total_bytes`` bytes. The stream is split into ``num_shards`` contiguous ranges of
(nearly) equal size, one per shard, and each range into chunks of at most
``chunk_bytes``. A bucket is then cut wherever a shard or chunk boundary falls inside
it.

Balancing in stream space rather than per parameter or per bucket is what keeps the
shards even "however many parameters or buckets the model has": a single 23 MB
bucket is split across all shards just like two hundred small ones. It also survives
DDP's bucket rebuild after the first iteration, which reorders parameters inside the
stream but never changes its length.

Every worker sees the same buckets in the same order (DDP guarantees identical
bucket layouts across ranks), so every worker computes the same cuts without
talking to anyone, and a chunk's byte offset in the stream is a key that is unique
within a step.

The module also sizes the chunks (:func:`auto_chunk_bytes`), checks that a step's
pushes fit the shards' concurrency (:func:`check_concurrency`, both through
:func:`plan_layout`), and groups a relay's chunks into calls (:func:`relay_groups`).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "SHARD_MAX_CONCURRENCY",
    "TAPER_MIN_BYTES",
    "Chunk",
    "StreamLayout",
    "auto_chunk_bytes",
    "check_concurrency",
    "plan_layout",
    "relay_groups",
]

#: The smallest chunk of a tapered range end (see :class:`StreamLayout`).
TAPER_MIN_BYTES = 64 << 10


@dataclass(frozen=True)
class Chunk:
    """One chunk of a bucket, bound for one shard.

    Attributes:
        shard: Index of the shard that sums this chunk.
        key: Byte offset of the chunk in the step's gradient stream; unique per step.
        start: First element of the chunk inside the bucket buffer.
        stop: One past the last element of the chunk inside the bucket buffer.
    """

    shard: int
    key: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


class StreamLayout:
    """Deterministic cutting of the gradient stream into shard-balanced chunks.

    With ``taper``, the last ``chunk_bytes`` of every shard's range are cut into
    halving chunks (``chunk_bytes / 2``, ``/ 4``, ... down to
    :data:`TAPER_MIN_BYTES`). A shard's range is sent in stream order, and the sum of
    its last chunk can only travel back once that chunk has arrived: on a link, the
    step then ends one small chunk's transfer after the last push instead of a
    full chunk's (8 ms for 1 MiB at 1 Gbit/s).

    Args:
        total_bytes: Size of one step's gradient stream (all trainable parameters).
        num_shards: Number of server shards.
        chunk_bytes: Largest chunk sent in one message.
        taper: Whether to cut the end of each shard's range into smaller chunks.

    Raises:
        ValueError: If a size is not positive.
    """

    def __init__(
        self, total_bytes: int, num_shards: int, chunk_bytes: int, taper: bool = False
    ) -> None:
        if total_bytes <= 0:
            raise ValueError(
                f"total_bytes must be > 0, got {total_bytes}: the model has no "
                "parameter with requires_grad=True, so there is nothing to synchronise."
            )
        if num_shards <= 0:
            raise ValueError(f"num_shards must be > 0, got {num_shards}.")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}.")
        self.total_bytes = total_bytes
        self.num_shards = num_shards
        self.chunk_bytes = chunk_bytes
        # Shard s owns stream bytes [bounds[s], bounds[s + 1]).
        self.bounds = [k * total_bytes // num_shards for k in range(num_shards + 1)]
        # Chunk boundaries strictly inside each shard's range, counted from its
        # start, so every shard's range is cut the same way whatever the buckets.
        self._cuts = [
            self._range_cuts(lo, hi, chunk_bytes, taper)
            for lo, hi in itertools.pairwise(self.bounds)
        ]
        self._cache: dict[tuple[int, int, int], tuple[Chunk, ...]] = {}

    @staticmethod
    def _range_cuts(lo: int, hi: int, chunk: int, taper: bool) -> list[int]:
        tail = hi
        if taper and hi - lo > 2 * chunk and chunk >= 2 * TAPER_MIN_BYTES:
            tail = hi - chunk
        cuts = list(range(lo + chunk, tail, chunk))
        if tail < hi:
            cuts.append(tail)
            size = chunk // 2
            while size >= TAPER_MIN_BYTES:
                cuts.append(hi - size)
                size //= 2
        return cuts

    @property
    def chunks_per_shard(self) -> list[int]:
        """How many chunks each shard's range is cut into (without bucket cuts)."""
        return [len(c) + 1 for c in self._cuts]

    def shard_of(self, byte_offset: int) -> int:
        """Returns the shard that owns the stream byte at ``byte_offset``."""
        if not 0 <= byte_offset < self.total_bytes:
            raise ValueError(
                f"byte offset {byte_offset} is outside the gradient stream [0, {self.total_bytes})."
            )
        return bisect.bisect_right(self.bounds, byte_offset) - 1

    def _boundaries(self, lo: int, hi: int) -> list[int]:
        """All shard and chunk boundaries strictly inside the byte range (lo, hi)."""
        cuts: set[int] = set()
        first, last = self.shard_of(lo), self.shard_of(hi - 1)
        for s in range(first, last + 1):
            s_lo = self.bounds[s]
            if lo < s_lo < hi:
                cuts.add(s_lo)
            inside = self._cuts[s]
            cuts.update(inside[bisect.bisect_right(inside, lo) : bisect.bisect_left(inside, hi)])
        return sorted(cuts)

    def cut(self, stream_offset: int, numel: int, itemsize: int) -> tuple[Chunk, ...]:
        """Cuts one bucket into pieces.

        Args:
            stream_offset: Byte offset of the bucket's first element in the stream.
            numel: Number of elements in the bucket buffer.
            itemsize: Bytes per element of the bucket's dtype.

        Returns:
            The pieces in buffer order; together they cover the whole bucket.

        Raises:
            ValueError: If the bucket does not fit inside the stream, which means the
                workers' models (or their trainable parameters) differ from the one
                the layout was built for.
        """
        cache_key = (stream_offset, numel, itemsize)
        cached = self._cache.get(cache_key)
        if cached is not None:
            return cached
        hi = stream_offset + numel * itemsize
        if numel <= 0 or stream_offset < 0 or hi > self.total_bytes:
            raise ValueError(
                f"a gradient bucket of {numel} elements at stream byte {stream_offset} "
                f"does not fit the layout of {self.total_bytes} bytes built from the "
                "model's trainable parameters. Did requires_grad change after "
                "prepare_model()? Freeze parameters before calling prepare_model()."
            )
        # Boundaries fall on byte positions; round each up to a whole element.
        elem_cuts = sorted(
            {
                min(numel, -(-(b - stream_offset) // itemsize))
                for b in self._boundaries(stream_offset, hi)
            }
            - {0, numel}
        )
        edges = [0, *elem_cuts, numel]
        pieces = tuple(
            Chunk(
                shard=self.shard_of(stream_offset + a * itemsize),
                key=stream_offset + a * itemsize,
                start=a,
                stop=b,
            )
            for a, b in itertools.pairwise(edges)
        )
        self._cache[cache_key] = pieces
        return pieces


# Each push occupies one of the shard actor's concurrent calls until every worker has
# pushed that chunk, so a shard must admit all chunks of two steps from all workers.
SHARD_MAX_CONCURRENCY = 4096


def check_concurrency(layout: StreamLayout, world_size: int, relays: bool = False) -> None:
    """Raises if a step has more in-flight pushes per shard than a shard admits."""
    per_shard = layout.chunks_per_shard
    # A relay also holds other nodes' chunks: the whole stream.
    largest, chunks = (
        (layout.total_bytes, sum(per_shard))
        if relays
        else (
            max(b - a for a, b in zip(layout.bounds, layout.bounds[1:])),
            max(per_shard),
        )
    )
    # Bucket boundaries add one extra cut each; +8 allows for a handful of buckets
    # falling inside one shard's range.
    chunks += 8
    if 2 * world_size * chunks > SHARD_MAX_CONCURRENCY:
        raise ValueError(
            f"PSConfig.chunk_bytes={layout.chunk_bytes} cuts each shard's "
            f"{largest} bytes into ~{chunks} chunks; with {world_size} workers "
            f"that exceeds the {SHARD_MAX_CONCURRENCY} pushes a shard holds at once. "
            "Raise chunk_bytes or num_servers."
        )


#: ``chunk_bytes=None``: the chunk size where every message is a Ray call (one node,
#: or the object store between nodes), and where chunks cross on the direct path.
CALL_CHUNK_BYTES = 16 << 20
WIRE_CHUNK_BYTES = 1 << 20


def auto_chunk_bytes(
    total_bytes: int, largest_share: int, world_size: int, relays: bool, direct: bool
) -> int:
    """The chunk size ``chunk_bytes=None`` picks for one model.

    On the direct path a frame costs a 40-byte header, and 1 MiB chunks let the
    owner sum and answer the first chunks while later ones still travel (measured on
    a 1 Gbit/s link: see docs/benchmarks.md); elsewhere each chunk is a Ray call.
    Chunks are never so small that a shard would hold more pushes at once than it
    admits.
    """
    if not direct:
        return CALL_CHUNK_BYTES
    share = total_bytes if relays else largest_share
    per_shard = SHARD_MAX_CONCURRENCY // (2 * world_size) - 8
    return max(WIRE_CHUNK_BYTES, -(-share // max(1, per_shard)))


#: The first group of relayed chunks a worker hands its node's relay (see
#: :func:`relay_groups`).
FIRST_RELAY_GROUP_BYTES = 2 << 20


def relay_groups(nbytes: Sequence[int], first: int = FIRST_RELAY_GROUP_BYTES) -> list[range]:
    """Cuts a bucket's chunks for the node's relay into groups, one notice each.

    A relay forwards a chunk only once every worker of its node has handed it over,
    and a worker hands over a group with one notice (see ``SumShard.push_local``)
    after writing all of it: a whole bucket at once would leave the link idle while
    the worker writes the bucket and the relay takes in the first worker's copy. So
    the first group is small (``first`` bytes) and each next group twice the size:
    the link starts early, and a 23 MB bucket costs about four notices rather than
    one per chunk.

    Args:
        nbytes: Size of each chunk, in stream order.
        first: Bytes of the first group.

    Returns:
        Consecutive index ranges covering every chunk.
    """
    groups: list[range] = []
    start = size = 0
    limit = first
    for i, n in enumerate(nbytes):
        size += n
        if size >= limit:
            groups.append(range(start, i + 1))
            start, size, limit = i + 1, 0, limit * 2
    if start < len(nbytes):
        groups.append(range(start, len(nbytes)))
    return groups


def plan_layout(
    total_bytes: int,
    num_shards: int,
    chunk_bytes: int | None,
    world_size: int,
    *,
    relays: bool,
    direct: bool,
) -> StreamLayout:
    """The layout every worker of a run cuts one model's gradient stream with.

    Every input is the same on every worker, so every worker cuts alike.

    Args:
        total_bytes: Size of the model's gradient stream.
        num_shards: Number of server shards.
        chunk_bytes: ``PSConfig.chunk_bytes`` (``None``: :func:`auto_chunk_bytes`).
        world_size: Number of workers.
        relays: Whether the run has node relays (a relay holds the whole stream).
        direct: Whether chunks cross nodes on the direct path, where range ends
            are tapered (see :class:`StreamLayout`).

    Raises:
        ValueError: If a shard would hold more pushes at once than it admits.
    """
    if chunk_bytes is None:
        share = -(-total_bytes // num_shards) + 1
        chunk_bytes = auto_chunk_bytes(total_bytes, share, world_size, relays, direct)
    if direct:
        tapered = StreamLayout(total_bytes, num_shards, chunk_bytes, taper=True)
        try:
            check_concurrency(tapered, world_size, relays=relays)
            return tapered
        except ValueError:
            # Tapered range ends add a few chunks per shard; without them the
            # layout may still fit.
            pass
    layout = StreamLayout(total_bytes, num_shards, chunk_bytes)
    check_concurrency(layout, world_size, relays=relays)
    return layout
