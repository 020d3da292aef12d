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
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

__all__ = ["Piece", "StreamLayout"]


@dataclass(frozen=True)
class Piece:
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

    Args:
        total_bytes: Size of one step's gradient stream (all trainable parameters).
        num_shards: Number of server shards.
        chunk_bytes: Largest chunk sent in one message.

    Raises:
        ValueError: If a size is not positive.
    """

    def __init__(self, total_bytes: int, num_shards: int, chunk_bytes: int) -> None:
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
        self._cache: dict[tuple[int, int, int], tuple[Piece, ...]] = {}

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
            s_lo, s_hi = self.bounds[s], self.bounds[s + 1]
            if lo < s_lo < hi:
                cuts.add(s_lo)
            # Chunk boundaries count from the start of each shard's range, so every
            # shard's range is cut the same way whatever the bucket layout.
            k = max(1, (lo - s_lo) // self.chunk_bytes + 1)
            while s_lo + k * self.chunk_bytes < min(hi, s_hi):
                b = s_lo + k * self.chunk_bytes
                if b > lo:
                    cuts.add(b)
                k += 1
        return sorted(cuts)

    def cut(self, stream_offset: int, numel: int, itemsize: int) -> tuple[Piece, ...]:
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
            Piece(
                shard=self.shard_of(stream_offset + a * itemsize),
                key=stream_offset + a * itemsize,
                start=a,
                stop=b,
            )
            for a, b in itertools.pairwise(edges)
        )
        self._cache[cache_key] = pieces
        return pieces
