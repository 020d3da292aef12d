"""Sync mode across nodes: the topology, the direct TCP path and node relays.

Real sockets on 127.0.0.1 and real SumShard objects on one event loop: "nodes" are
only labels here, which is all the shards and workers act on.
"""

import asyncio

import numpy as np
import pytest

from ray_ps_plugin._codec import Codec
from ray_ps_plugin._errors import ShardLinkError
from ray_ps_plugin._rows import pack, unpack
from ray_ps_plugin._sync.shard import SumShard
from ray_ps_plugin._sync.topology import Route, Topology
from ray_ps_plugin._wire.frames import PUSH, ROWS, Frame, relayed_rows_key
from ray_ps_plugin._wire.streams import WireStreams

TOKEN = bytes(range(32))
TWO_BY_TWO = Topology(worker_nodes=(0, 0, 1, 1), shard_nodes=(0, 0, 1, 1))


def test_relays_are_the_first_shard_of_nodes_with_several_workers():
    t = TWO_BY_TWO
    assert (t.relay_of(0), t.relay_of(1)) == (0, 2)
    assert t.route(0, 1) == Route(1, direct=False)  # own node: straight to the owner
    assert t.route(1, 3) == Route(0, direct=False)  # other node: through the relay
    assert t.route(3, 0) == Route(2, direct=False)
    # Shard 2's chunks: node 1's two workers push themselves, node 0 once.
    assert t.sources(2) == {2, 3, 4 + 0}
    assert t.relayed_ranks(0) == {0, 1} and t.relayed_ranks(1) == set()
    assert t.describe(5) == "the relay of node 1"
    assert t.has_relays


def test_one_worker_per_node_or_no_aggregation_pushes_directly():
    for t in (
        Topology(worker_nodes=(0, 1), shard_nodes=(0, 1)),
        Topology(worker_nodes=(0, 0, 1, 1), shard_nodes=(0, 0, 1, 1), aggregate=False),
    ):
        assert t.relay_of(0) is None and not t.has_relays
        assert t.route(0, t.num_workers - 1) == Route(t.num_workers - 1, direct=True)
        assert t.sources(0) == frozenset(range(t.num_workers))
    # A node without a shard cannot relay: its workers push directly.
    t = Topology(worker_nodes=(0, 0, 1, 1), shard_nodes=(0,))
    assert t.route(2, 0) == Route(0, direct=True) and t.sources(0) == {0, 1, 2, 3}


def test_frames_round_trip_and_reject_garbage():
    f = Frame(PUSH, "float16", 3, 7, 1 << 40, 5, 12)
    assert Frame.unpack(f.pack()) == f
    with pytest.raises(ConnectionError, match="not a ray_ps_plugin frame"):
        Frame.unpack(b"XXXX" + f.pack()[4:])


async def _cluster(compression=None, timeout_s=5.0):
    """Two 'nodes' with two workers each, one shard per node, wired on loopback."""
    shards = [SumShard(i, 4, timeout_s, compression) for i in range(2)]
    addresses = tuple([await s.open_wire(TOKEN, "127.0.0.1") for s in shards])
    topo = Topology(worker_nodes=(0, 0, 1, 1), shard_nodes=(0, 1), addresses=addresses, token=TOKEN)
    for s in shards:
        await s.configure(topo)
    return shards, topo


@pytest.mark.parametrize(
    ("compression", "dtype"), [(None, "float32"), ("bf16", "float32"), (None, "bfloat16")]
)
def test_relayed_sums_equal_the_sum_over_all_workers(compression, dtype):
    """Through a relay on the direct path; a bf16 model's chunks and partial sums
    travel as bf16 patterns (frames name the dtype) and are summed in fp32."""
    grads = [np.arange(6, dtype=np.float32) * (r + 1) / 4 for r in range(4)]

    async def main():
        shards, topo = await _cluster(compression)
        codec = Codec(compression)

        async def push(rank, owner):
            home = shards[topo.worker_nodes[rank]]
            relayed = () if home.shard_index == owner else (owner,)
            wire = codec.encode_np(grads[rank], dtype)
            out = await home.push_pull(0, 1, 64 * owner, rank, wire, dtype, *relayed)
            return codec.decode_np(np.asarray(out), dtype).copy()

        outs = await asyncio.gather(*(push(r, o) for r in range(4) for o in range(2)))
        stats = [s.stats() for s in shards]
        for s in shards:
            s._wire_server.close()
            s._relay_streams.close()
        return outs, stats

    outs, stats = asyncio.run(main())
    want = sum(grads)
    tol = 0 if compression is None and dtype == "float32" else 0.05
    for out in outs:
        np.testing.assert_allclose(out, want, atol=tol)
    # Every worker got the same values, whatever path they came by.
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])
    # Each owner counted three sources: its two workers and the other node's relay.
    assert [s["pushes"] for s in stats] == [2 + 2 + 1, 2 + 2 + 1]


def test_a_relay_that_cannot_reach_the_owner_fails_every_local_waiter():
    async def main():
        shards, _ = await _cluster(timeout_s=2.0)
        shards[1]._wire_server.close()  # node 1's shard stops listening
        await asyncio.sleep(0.05)
        g = np.ones(3, np.float32)
        return await asyncio.gather(
            *(shards[0].push_pull(0, 1, 0, r, g, "float32", 1) for r in (0, 1)),
            return_exceptions=True,
        )

    errors = asyncio.run(main())
    # A lost link, not a protocol error: ConnectionError, as the worker's own path.
    assert all(isinstance(e, ShardLinkError) for e in errors), errors
    assert all("relaying to shard 1 failed" in str(e) for e in errors)


def _rows_frame(rank, owner, rows):
    """Rank ``rank``'s rows of a 10-row table (split over 2 shards) for ``owner``,
    sent to its node's relay: the frame and its payload."""
    values = np.asarray(rows, np.float32)[:, None] * np.ones((1, 3), np.float32) * (rank + 1)
    payload = pack([(0, (10, 2), np.asarray(rows, np.int64), values, "float32")])
    return Frame(ROWS, "float32", 0, 1, relayed_rows_key(owner), rank, payload.nbytes), payload


def test_a_relay_sends_its_nodes_rows_on_a_socket_and_hands_back_the_owners_union():
    async def main():
        shards, _ = await _cluster()
        own = (0, (10, 2), np.empty(0, np.int64), np.empty((0, 3), np.float32), "float32")
        # Shard 1 owns the odd rows. Node 0's workers send theirs to shard 0 (the
        # relay); node 1's workers push to shard 1 themselves.
        relayed = [
            shards[0]._on_frame(*_rows_frame(r, 1, rows)) for r, rows in ((0, [1, 3]), (1, [3]))
        ]
        direct = [
            shards[1].push_rows(
                0, 1, r, [(0, (10, 2), np.array([3, 5]), np.ones((2, 3), np.float32), "float32")]
            )
            for r in (2, 3)
        ]
        # Shard 0's own (even) rows: nobody touched one; every source still sends.
        empty = [shards[0].push_rows(0, 1, r, [own]) for r in (0, 1)]
        empty += [shards[1]._on_frame(*_rows_frame(r, 0, [])) for r in (2, 3)]
        out = await asyncio.gather(*relayed, *direct, *empty)
        for s in shards:
            s._wire_server.close()
            s._relay_streams.close()
        return out

    out = asyncio.run(main())
    ((_, _, rows0, sums0, _),) = unpack(out[0])
    ((_, _, rows1, sums1, _),) = unpack(out[1])
    rows2, sums2 = out[2][0]
    assert rows0.tolist() == rows1.tolist() == rows2.tolist() == [1, 3, 5]
    want = np.array([[1 * 1], [3 * 1 + 3 * 2 + 1 + 1], [1 + 1]], np.float32) * np.ones((1, 3))
    for sums in (sums0, sums1, sums2):
        np.testing.assert_allclose(sums, want)


def test_a_relay_that_cannot_reach_the_owner_fails_every_local_waiters_rows():
    async def main():
        shards, _ = await _cluster(timeout_s=2.0)
        shards[1]._wire_server.close()
        await asyncio.sleep(0.05)
        return await asyncio.gather(
            *(shards[0]._on_frame(*_rows_frame(r, 1, [1])) for r in (0, 1)),
            return_exceptions=True,
        )

    errors = asyncio.run(main())
    assert all(isinstance(e, ShardLinkError) for e in errors), errors
    assert all("relaying to shard 1 failed" in str(e) for e in errors)


def test_a_worker_pushes_to_another_nodes_shard_on_the_direct_path():
    """One worker per node: worker 1 reaches shard 0 from a thread, as in a worker."""

    async def main():
        shard = SumShard(0, 2, 5.0)
        address = await shard.open_wire(TOKEN, "127.0.0.1")
        await shard.configure(
            Topology(worker_nodes=(0, 1), shard_nodes=(0,), addresses=(address,), token=TOKEN)
        )
        wire = WireStreams([address], TOKEN, connect_timeout_s=5.0)
        stranger = WireStreams([address], bytes(32), connect_timeout_s=5.0)
        try:
            remote = wire.push(0, 0, 1, 0, 1, "float32", np.full(4, 2.0, np.float32))
            local = await shard.push_pull(0, 1, 0, 0, np.full(4, 1.0, np.float32), "float32")
            answer = await asyncio.wrap_future(remote)
            # A source the shard does not know is refused with a reason.
            refused = wire.push(0, 0, 1, 0, 7, "float32", np.ones(4, np.float32))
            with pytest.raises(Exception, match="does not push to this shard directly"):
                await asyncio.wrap_future(refused)
            # A connection without the run's token is closed before any push counts.
            intruder = stranger.push(0, 0, 2, 0, 1, "float32", np.ones(4, np.float32))
            with pytest.raises(ConnectionError, match=r"shard 0 at 127\.0\.0\.1"):
                await asyncio.wait_for(asyncio.wrap_future(intruder), 5)
            assert shard.stats()["pushes"] == 2
        finally:
            stranger.close()
            wire.close()
            shard._wire_server.close()
        return np.asarray(local).copy(), answer.view(np.float32).copy()

    local, remote = asyncio.run(main())
    np.testing.assert_array_equal(local, np.full(4, 3.0))
    np.testing.assert_array_equal(remote, local)


def test_workers_of_the_shards_node_push_through_shared_memory_and_a_socket_notice():
    """Two workers of shard 0's node write their chunks into shared memory and tell
    the shard on its data-path socket (no Ray call): the sums land in the output
    segment, a rank the shard does not know is refused with the reason, and a notice
    names its chunks exactly (the frame layout round-trips)."""
    from ray_ps_plugin._shm import Segment
    from ray_ps_plugin._wire.frames import pack_local, unpack_local

    chunks = [(0, 4, None), (16, 2, 3)]
    assert unpack_local(pack_local(chunks)) == chunks

    async def main():
        shard = SumShard(0, 2, 5.0)
        address = await shard.open_wire(TOKEN, "127.0.0.1")
        await shard.configure(
            Topology(worker_nodes=(0, 0), shard_nodes=(0,), addresses=(address,), token=TOKEN)
        )
        inputs = [Segment.create(24) for _ in range(2)]
        outs = [Segment.open(h) for h in shard.attach(0, 0, inputs[0].handle, 0, 24)]
        shard.attach(0, 1, inputs[1].handle, 0, 24)
        # One connection per worker, as each worker process has its own.
        wires = [WireStreams([address], TOKEN, connect_timeout_s=5.0) for _ in range(3)]
        try:
            for rank in (0, 1):
                inputs[rank].view(0, "float32", 6)[:] = rank + 1
            futs = [wires[r].push_local(0, 0, 1, r, "float32", [(0, 6, None)]) for r in (0, 1)]
            answers = [await asyncio.wait_for(asyncio.wrap_future(f), 5) for f in futs]
            stranger = wires[2].push_local(0, 0, 1, 5, "float32", [(0, 6, None)])
            with pytest.raises(Exception, match="rank 5 is not an int in"):
                await asyncio.wait_for(asyncio.wrap_future(stranger), 5)
            return [a.nbytes for a in answers], outs[1].view(0, "float32", 6).copy()
        finally:
            for w in wires:
                w.close()
            shard._wire_server.close()

    sizes, summed = asyncio.run(main())
    assert sizes == [0, 0]  # the answer carries no data: the sum is in shared memory
    np.testing.assert_array_equal(summed, np.full(6, 3.0))


def test_waits_on_direct_path_pushes_are_bounded_and_raise_their_error():
    import concurrent.futures

    from ray_ps_plugin._errors import PSError, PSTimeoutError
    from ray_ps_plugin._transport import RayTransport, wait_all

    class Silent(RayTransport):
        def silent(self, shards, timeout_s):
            return [s for s in shards if s == 0]  # shard 0 stopped answering pings

    t = Silent([], timeout_s=1.0)
    ok, hung, broken = (concurrent.futures.Future() for _ in range(3))
    ok.set_result(np.ones(2))
    broken.set_exception(ConnectionError("connection to shard 1 at 10.0.0.2:5 lost"))
    assert t.wait([ok], 0.1)[0].sum() == 2
    with pytest.raises(PSTimeoutError, match=r"step 3: server shard\(s\) \[0\] did not answer"):
        wait_all(t, [ok, hung], [1, 0], 0.05, "rank 1: step 3")
    with pytest.raises(PSError, match=r"server shard\(s\) \[1\] failed: connection to shard 1"):
        wait_all(t, [broken, ok], [1, 0], 0.05, "rank 1: step 3")


def test_automatic_chunks_are_small_only_where_they_cross_on_the_direct_path():
    from ray_ps_plugin._sync.layout import SHARD_MAX_CONCURRENCY, auto_chunk_bytes

    mb = 1 << 20
    assert auto_chunk_bytes(23 * mb, 12 * mb, 2, relays=False, direct=False) == 16 * mb
    assert auto_chunk_bytes(23 * mb, 12 * mb, 2, relays=False, direct=True) == mb
    # A big model never needs more concurrent pushes per shard than a shard admits.
    big = auto_chunk_bytes(8 << 30, 4 << 30, 8, relays=True, direct=True)
    assert big > mb and 2 * 8 * (-(-(8 << 30) // big) + 8) <= SHARD_MAX_CONCURRENCY


def test_a_relay_gets_its_first_chunks_early_then_in_growing_groups():
    """A worker hands its relay the chunks for other nodes in groups, one Ray call
    each: small first (so the link starts while the rest is written), then
    doubling (so a big bucket costs a few calls, not one per chunk)."""
    from ray_ps_plugin._sync.layout import relay_groups

    mb = 1 << 20
    groups = relay_groups([mb] * 12, first=2 * mb)
    assert [len(g) for g in groups] == [2, 4, 6]
    assert [i for g in groups for i in g] == list(range(12))  # each chunk once, in order
    assert relay_groups([], first=mb) == []
    assert relay_groups([5 * mb], first=mb) == [range(0, 1)]
    # Uneven chunks (bucket boundaries) still cover the stream in order.
    groups = relay_groups([mb // 2, mb, 3 * mb, mb // 4], first=mb)
    assert [list(g) for g in groups] == [[0, 1], [2], [3]]


def test_a_closed_server_ends_its_connection_threads_and_fails_the_pushers_waits():
    """A shard reads and answers each connection on threads of its own; closing it
    must end them (no thread left behind in a shard process) and fail the pusher's
    next push with a ConnectionError rather than leave it waiting."""
    import threading
    import time

    from ray_ps_plugin._wire.server import WireServer

    names = ("ps-wire-serve", "ps-wire-answer")

    def alive():
        return [t for t in threading.enumerate() if t.name in names and t.is_alive()]

    async def echo(frame, payload):
        return payload

    async def main():
        server = WireServer(echo, TOKEN)
        address = await server.start("127.0.0.1")
        streams = WireStreams([address], TOKEN, connect_timeout_s=5.0)
        try:
            data = np.arange(4, dtype=np.float32)
            answer = await asyncio.wrap_future(streams.push(0, 0, 1, 0, 1, "float32", data))
            np.testing.assert_array_equal(answer.view(np.float32), data)
            assert len(alive()) == 2
            server.close()
            late = streams.push(0, 0, 2, 0, 1, "float32", data)
            with pytest.raises(ConnectionError, match=r"shard 0 at 127\.0\.0\.1"):
                await asyncio.wait_for(asyncio.wrap_future(late), 5)
            deadline = time.monotonic() + 5
            while alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert not alive()
        finally:
            streams.close()

    asyncio.run(main())
