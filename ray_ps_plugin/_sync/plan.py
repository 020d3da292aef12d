"""What one DDP gradient bucket does every step: its pieces and the message of each.

The stream layout is fixed for the run and so is every route, so a bucket (its byte
offset in the stream, its size, dtype and device) always cuts into the same pieces
and sends them the same way. :func:`plan_bucket` works that out once; the sync
client caches the :class:`BucketPlan` and its hook only stages, sends, notices and
counts what the plan says, and the completion thread walks the same plan back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ray_ps_plugin._sync.layout import Chunk, StreamLayout, relay_groups
from ray_ps_plugin._sync.topology import Route

__all__ = ["BucketPlan", "Send", "plan_bucket"]

#: One piece inside a notice: its stream key, its size in elements, and its owner
#: shard where the notice goes to a relay (``None`` when the target owns it).
NoticeEntry = tuple[int, int, int | None]


@dataclass(frozen=True)
class Send:
    """One message of a bucket: pieces that travel and are answered together.

    Attributes:
        target: The shard the message goes to (the owner, or a node's relay).
        indices: The bucket's pieces it carries (indices into ``BucketPlan.pieces``).
        pieces: Those pieces.
        notice: ``True``: the pieces are written into the target's shared memory and
            the message only announces them (one reply for all); ``False``: one piece
            travels by value (encoded) to a shard without shared memory.
        direct: Whether it goes on the direct TCP path (else it is a Ray call).
        relayed: For a piece sent by value to a relay: its owner, which rides along.
        entries: For a notice: what :class:`NoticeEntry` says of each piece.
    """

    target: int
    indices: tuple[int, ...]
    pieces: tuple[Chunk, ...]
    notice: bool
    direct: bool
    relayed: tuple[int, ...] = ()
    entries: tuple[NoticeEntry, ...] = ()


@dataclass(frozen=True)
class BucketPlan:
    """Everything a bucket's round does that does not depend on its values.

    Attributes:
        pieces: The bucket's chunks, in buffer order.
        sends: Its messages in sending order: pieces for other nodes first (their
            pushes only enter a queue, and the network is the slow part), then one
            notice per shared-memory group.
        wait_order: ``sends`` indices in the order the answers are taken: by first
            piece, the order in which the bucket's bytes lie.
        targets: The shard each piece goes to.
        push_bytes: Bytes pushed per piece (encoded size for those sent by value).
        in_place: The shard of this node whose output segment holds the whole
            bucket's sum contiguously (a CPU bucket summed by one local shard: DDP
            reads it there and the worker copies nothing), else ``None``.
    """

    pieces: tuple[Chunk, ...]
    sends: tuple[Send, ...]
    wait_order: tuple[int, ...]
    targets: tuple[int, ...]
    push_bytes: tuple[int, ...]
    in_place: int | None

    @property
    def by_value(self) -> int:
        """How many pieces travel by value (none of them through shared memory)."""
        return sum(1 for s in self.sends if not s.notice)

    @property
    def has_local(self) -> bool:
        """Whether any piece goes through shared memory."""
        return any(s.notice for s in self.sends)


def plan_bucket(
    layout: StreamLayout,
    routes: Sequence[Route],
    local: frozenset[int],
    reaches: Callable[[int], bool] | None,
    offset: int,
    numel: int,
    itemsize: int,
    encoded_nbytes: Callable[[int], int],
    on_gpu: bool,
) -> BucketPlan:
    """Plans one bucket.

    Args:
        layout: The run's stream layout.
        routes: Where the chunks of each owner shard go, by owner.
        local: The shards whose shared memory this worker writes into.
        reaches: Whether a shard listens on the direct path (``None``: the run has
            no direct path, and every message is a Ray call).
        offset: The bucket's byte offset in the step's gradient stream.
        numel: Its number of elements.
        itemsize: Bytes per element of its dtype.
        encoded_nbytes: Bytes of a message carrying a given number of its elements.
        on_gpu: Whether the bucket lives on a GPU (its sum is then never read in place).

    Raises:
        ValueError: If the bucket does not fit the layout (see ``StreamLayout.cut``).
    """
    pieces = layout.cut(offset, numel, itemsize)
    targets = tuple(routes[p.shard].target for p in pieces)
    sends: list[Send] = []
    grouped: dict[int, list[int]] = {}
    for i, (p, target) in enumerate(zip(pieces, targets)):
        if target in local:
            grouped.setdefault(target, []).append(i)
            continue
        relayed = () if target == p.shard else (p.shard,)
        direct = routes[p.shard].direct and reaches is not None
        sends.append(Send(target, (i,), (p,), notice=False, direct=direct, relayed=relayed))
    for target, indices in grouped.items():
        direct = reaches is not None and reaches(target)
        for group in _notice_groups(pieces, target, indices, itemsize):
            entries = tuple(
                (
                    pieces[i].key,
                    pieces[i].numel,
                    None if pieces[i].shard == target else pieces[i].shard,
                )
                for i in group
            )
            chunks = tuple(pieces[i] for i in group)
            sends.append(Send(target, group, chunks, notice=True, direct=direct, entries=entries))
    wait_order = tuple(sorted(range(len(sends)), key=lambda k: sends[k].indices[0]))
    push_bytes = tuple(
        p.numel * itemsize if t in local else encoded_nbytes(p.numel)
        for p, t in zip(pieces, targets)
    )
    in_place = None
    if not on_gpu and len(grouped) == 1 and all(s.notice for s in sends):
        (in_place,) = grouped
    return BucketPlan(tuple(pieces), tuple(sends), wait_order, targets, push_bytes, in_place)


def _notice_groups(
    pieces: Sequence[Chunk], target: int, indices: list[int], itemsize: int
) -> list[tuple[int, ...]]:
    """The notices to one shard of this node: a relay's pieces for other nodes first,
    in growing groups (see ``relay_groups``), then the shard's own pieces in one,
    which wait for nobody on the link."""
    forwarded = [i for i in indices if pieces[i].shard != target]
    own = tuple(i for i in indices if pieces[i].shard == target)
    sizes = [pieces[i].numel * itemsize for i in forwarded]
    groups = [tuple(forwarded[j] for j in g) for g in relay_groups(sizes)]
    return [*groups, own] if own else groups
