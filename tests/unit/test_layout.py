"""StreamLayout: chunks cover every bucket exactly and balance the shards."""

import itertools
import random

import pytest

from ray_ps_plugin._sync.layout import StreamLayout


def _cut_stream(layout: StreamLayout, bucket_numels: list[int], itemsize: int):
    offset, pieces = 0, []
    for numel in bucket_numels:
        cut = layout.cut(offset, numel, itemsize)
        assert cut[0].start == 0 and cut[-1].stop == numel
        assert all(a.stop == b.start for a, b in itertools.pairwise(cut)), "gaps or overlaps"
        pieces += [(p, offset) for p in cut]
        offset += numel * itemsize
    return pieces


@pytest.mark.parametrize("num_shards", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("num_buckets", [1, 2, 7, 40])
def test_every_shard_gets_an_equal_share_within_one_chunk(num_shards, num_buckets):
    rng = random.Random(num_shards * 100 + num_buckets)
    itemsize, chunk_bytes = 4, 4096
    numels = [rng.randint(1, 20_000) for _ in range(num_buckets)]
    total = sum(numels) * itemsize
    layout = StreamLayout(total, num_shards, chunk_bytes)
    load = [0] * num_shards
    keys = set()
    for p, _ in _cut_stream(layout, numels, itemsize):
        assert p.numel * itemsize <= chunk_bytes
        load[p.shard] += p.numel * itemsize
        assert p.key not in keys, "chunk keys must be unique within a step"
        keys.add(p.key)
    assert sum(load) == total
    share = total / num_shards
    assert max(abs(x - share) for x in load) <= chunk_bytes


def test_one_huge_bucket_is_spread_over_all_shards():
    layout = StreamLayout(total_bytes=23_000_000, num_shards=4, chunk_bytes=1 << 20)
    pieces = layout.cut(0, 23_000_000 // 4, 4)
    assert {p.shard for p in pieces} == {0, 1, 2, 3}
    assert [p.shard for p in pieces] == sorted(p.shard for p in pieces)


def test_same_stream_gives_same_cuts_whatever_the_bucket_order():
    """DDP rebuilds buckets after step 1; shard loads must not change."""
    layout = StreamLayout(total_bytes=4 * 1000, num_shards=3, chunk_bytes=1024)
    loads = []
    for numels in ([100, 400, 500], [500, 400, 100], [1000]):
        load = [0, 0, 0]
        for p, _ in _cut_stream(layout, numels, 4):
            load[p.shard] += p.numel
        loads.append(load)
    assert loads[0] == loads[1] == loads[2]


def test_cuts_fall_on_element_boundaries_where_shard_bounds_do_not():
    # 42 bytes over 4 shards: bounds at 10, 21, 31 bytes, inside 2-byte elements.
    layout = StreamLayout(total_bytes=3 * 2 * 7, num_shards=4, chunk_bytes=1024)
    assert any(b % 2 for b in layout.bounds)
    for p, offset in _cut_stream(layout, [7, 7, 7], 2):
        assert (p.key - offset) % 2 == 0 and p.key == offset + 2 * p.start
        # The chunk goes to the shard owning its first byte.
        assert layout.bounds[p.shard] <= p.key < layout.bounds[p.shard + 1]


def test_bucket_outside_stream_is_a_clear_error():
    layout = StreamLayout(total_bytes=400, num_shards=2, chunk_bytes=1024)
    with pytest.raises(ValueError, match="requires_grad"):
        layout.cut(0, 101, 4)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(total_bytes=0, num_shards=1, chunk_bytes=1),
        dict(total_bytes=1, num_shards=0, chunk_bytes=1),
        dict(total_bytes=1, num_shards=1, chunk_bytes=0),
    ],
)
def test_bad_sizes_raise(kwargs):
    with pytest.raises(ValueError):
        StreamLayout(**kwargs)


def test_too_many_chunks_per_shard_is_refused_with_the_fix():
    from ray_ps_plugin._sync.layout import check_concurrency

    check_concurrency(StreamLayout(23_000_000, 2, 16 << 20), world_size=2)
    with pytest.raises(ValueError, match="Raise chunk_bytes"):
        check_concurrency(StreamLayout(23_000_000, 2, 1024), world_size=2)


def test_the_planned_layout_drops_the_taper_before_refusing_a_chunk_size():
    """On the direct path the range ends are tapered unless the extra chunks would
    not fit a shard; only a chunk size that fits neither way is refused."""
    from ray_ps_plugin._sync.layout import TAPER_MIN_BYTES, plan_layout

    mb = 1 << 20
    auto = plan_layout(23_000_000, 2, None, 4, relays=True, direct=True)
    assert (
        auto.chunk_bytes == mb
        and auto.chunks_per_shard != StreamLayout(23_000_000, 2, mb).chunks_per_shard
    )  # tapered
    assert plan_layout(23_000_000, 2, None, 4, relays=False, direct=False).chunk_bytes == 16 * mb
    # 2 workers x 2 steps x (chunks + 8) must stay within 4096: 1010 chunks per
    # range fit, 1010 plus a taper of 7 (64 x 64 KiB, 32 x, ... 1 x) do not.
    chunk = 128 * TAPER_MIN_BYTES
    total = 2 * 1010 * chunk
    fitted = plan_layout(total, 2, chunk, 2, relays=False, direct=True)
    assert fitted.chunks_per_shard == StreamLayout(total, 2, chunk).chunks_per_shard
    with pytest.raises(ValueError, match="Raise chunk_bytes"):
        plan_layout(total, 2, chunk // 2, 2, relays=False, direct=True)


def test_a_tapered_range_ends_in_halving_chunks_and_still_covers_the_stream():
    """Across a link, the sum of a range's last chunk travels back only after that
    chunk arrived: with ``taper`` the last chunk_bytes of each range are cut in
    halves down to TAPER_MIN_BYTES, so the step ends a small chunk after the last
    push."""
    from ray_ps_plugin._sync.layout import TAPER_MIN_BYTES

    mib = 1 << 20
    layout = StreamLayout(total_bytes=10 * mib, num_shards=2, chunk_bytes=mib, taper=True)
    pieces = _cut_stream(layout, [mib // 4, 10 * mib // 4 - mib // 4], 4)
    for shard in (0, 1):
        sizes = [p.numel * 4 for p, _ in pieces if p.shard == shard]
        assert sum(sizes) == 5 * mib and max(sizes) <= mib
        # The bucket boundary at 256 KiB only splits shard 0's first chunk.
        assert sizes[-5:] == [mib // 2, mib // 4, mib // 8, mib // 16, TAPER_MIN_BYTES]
    keys = [p.key for p, _ in pieces]
    assert len(keys) == len(set(keys))
    # Small ranges and small chunks are not tapered.
    assert StreamLayout(3 * mib, 2, mib, taper=True).chunks_per_shard == [2, 2]
    assert StreamLayout(8 * mib, 1, 64 << 10, taper=True).chunks_per_shard == [128]
