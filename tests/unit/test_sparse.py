"""Sparse embedding gradients in sync mode: touched rows only, summed on their shards."""

import asyncio

import numpy as np
import pytest
import torch

from ray_ps_plugin._ddp import check_supported
from ray_ps_plugin._errors import PSError, ShardProtocolError, ShardTimeoutError
from ray_ps_plugin._rows import RowSums, row_bounds, sum_rows
from ray_ps_plugin._sparse import sparse_params
from ray_ps_plugin._sync.client import SumClient
from ray_ps_plugin._sync.shard import SumShard
from ray_ps_plugin._wire.frames import ROWS as ROWS_FRAME
from tests.unit.fakes import FakeBucket, FakeDirect, FakeTransport, Settings, in_threads, setup_for

ROWS, DIM = 50, 3


class _Recsys(torch.nn.Module):
    """A sparse table, a dense table and a dense layer: DDP's buckets for it are the
    dense parameters together and the sparse weight alone."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(ROWS, DIM, sparse=True, padding_idx=0)
        self.bag = torch.nn.EmbeddingBag(ROWS, DIM, sparse=True)
        self.dense_emb = torch.nn.Embedding(7, DIM)
        self.fc = torch.nn.Linear(DIM, 1)


def _clients(loop, world, num_shards, compression=None, timeout_s=5.0, direct=False):
    servers = [SumShard(i, world, timeout_s, compression) for i in range(num_shards)]
    transport = FakeTransport(loop, servers)
    if direct:
        transport.direct = FakeDirect(loop, servers)
    settings = Settings(ps_timeout_s=timeout_s, compression=compression)
    models = [_Recsys() for _ in range(world)]
    clients = [
        SumClient.build(setup_for(models[r], r, world, num_shards, settings), transport)
        for r in range(world)
    ]
    return clients, models, transport


def _sparse_grad(rows, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.tensor(rows, dtype=torch.long)[None]
    values = torch.randn(len(rows), DIM, generator=g)
    return torch.sparse_coo_tensor(idx, values, (ROWS, DIM), check_invariants=True)


def _step(clients, models, buckets):
    """Each worker, in its own thread, hooks ``buckets[rank]``: a list of
    ``(tensor, params)``; returns each worker's results."""
    results = {}

    def worker(rank):
        n = len(buckets[rank])
        futs = [
            clients[rank].hook(None, FakeBucket(i, t, params, last=i == n - 1))
            for i, (t, params) in enumerate(buckets[rank])
        ]
        results[rank] = [f.wait() for f in futs]

    in_threads(worker, len(clients))
    return results


@pytest.mark.parametrize(
    ("num_shards", "direct"),
    [(1, False), (2, False), (3, False), (3, True)],
    ids=["1-shard", "2-shards", "3-shards", "3-shards-direct-path"],
)
def test_touched_rows_come_back_as_the_mean_over_workers_with_dense_buckets_beside(
    loop, num_shards, direct
):
    world = 3
    clients, models, transport = _clients(loop, world, num_shards, direct=direct)
    # Rank 0 repeats rows (an uncoalesced gradient), rank 1 touched none (a batch of
    # padding_idx only), rank 2 touched rows in every shard's range.
    touched = {0: [3, 3, 17, 49], 1: [], 2: [1, 17, 30, 45]}
    grads = {r: _sparse_grad(touched[r], seed=r) for r in range(world)}
    bag_grads = {r: _sparse_grad([r, 2 * r + 20], seed=10 + r) for r in range(world)}
    dense = {r: torch.randn(7 * DIM + DIM + 1) for r in range(world)}
    # The tables' buckets first and last (DDP orders buckets by reversed parameters):
    # both tables travel in the same call per shard, sent at the last bucket.
    buckets = {
        r: [
            (bag_grads[r], [models[r].bag.weight]),
            (dense[r].clone(), []),
            (grads[r], [models[r].emb.weight]),
        ]
        for r in range(world)
    }
    results = _step(clients, models, buckets)

    expected_sparse = sum(grads[r].to_dense() for r in range(world)) / world
    expected_dense = sum(dense.values()) / world
    union = sorted({i for rows in touched.values() for i in rows})
    expected_bag = sum(g.to_dense() for g in bag_grads.values()) / world
    for r in range(world):
        got_bag, got_dense, got_sparse = results[r]
        torch.testing.assert_close(got_bag.to_dense(), expected_bag)
        torch.testing.assert_close(got_dense, expected_dense)
        assert got_sparse.is_sparse and got_sparse.is_coalesced()
        assert got_sparse.indices()[0].tolist() == union  # only the union travels back
        torch.testing.assert_close(got_sparse.to_dense(), expected_sparse)
    # Only touched rows travel: each worker's indices and values, nothing dense.
    if direct:  # one ROWS frame per worker and shard, no Ray call
        assert not [c for c in transport.calls if c[0] == "push_rows"]
        assert sum(1 for f in transport.direct.frames if f[1] == ROWS_FRAME) == world * num_shards
        return
    # One call per worker and shard; (method, shard, model, step, rank, tables).
    pushed = [c for c in transport.calls if c[0] == "push_rows"]
    assert len(pushed) == world * num_shards
    assert all(len(c[5]) == 2 for c in pushed)  # both tables in each call
    rows_sent = sum(len(entry[2]) for c in pushed for entry in c[5] if entry[0] == 0)
    assert rows_sent == sum(len(set(t)) for t in touched.values())
    for c in clients:
        c.close()


@pytest.mark.parametrize("direct", [False, True], ids=["ray-calls", "direct-path"])
def test_bf16_compression_halves_the_rows_values(loop, direct):
    world = 2
    clients, models, _ = _clients(loop, world, 2, compression="bf16", direct=direct)
    grads = {r: _sparse_grad([2, 40], seed=r) for r in range(world)}
    results = _step(
        clients, models, {r: [(grads[r], [models[r].emb.weight])] for r in range(world)}
    )
    expected = sum(g.to_dense() for g in grads.values()) / world
    for r in range(world):
        (got,) = results[r]
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.to_dense(), expected, atol=2e-2, rtol=1e-2)
    # Two rows a worker: their int64 indices and 16-bit values.
    assert clients[0].snapshot().bytes_pushed == 2 * 8 + 2 * DIM * 2
    for c in clients:
        c.close()


def test_a_missing_worker_fails_the_step_naming_it_not_a_hang(loop):
    clients, models, _ = _clients(loop, 2, 1, timeout_s=0.5)
    bucket = FakeBucket(0, _sparse_grad([1], 0), [models[0].emb.weight], last=True)
    fut = clients[0].hook(None, bucket)
    fut.wait()  # completed (DDP must never wait forever), the error kept
    with pytest.raises(PSError, match=r"shard\(s\) \[0\] did not answer within ps_timeout_s"):
        clients[0].raise_pending()
    for c in clients:
        c.close()


def test_sum_rows_matches_torch_coalesce():
    rng = np.random.default_rng(0)
    idx = [rng.integers(0, 20, size=n) for n in (5, 0, 9)]
    vals = [rng.standard_normal((len(i), 4)).astype(np.float32) for i in idx]
    rows, sums = sum_rows(idx, vals)
    ref = torch.sparse_coo_tensor(
        torch.from_numpy(np.concatenate(idx))[None], torch.from_numpy(np.concatenate(vals)), (20, 4)
    ).coalesce()
    assert rows.tolist() == ref.indices()[0].tolist()
    np.testing.assert_allclose(sums, ref.values().numpy(), rtol=1e-6)
    assert row_bounds(10, 3) == [0, 3, 6, 10]


def test_sum_rows_of_coalesced_contributions_has_the_bits_of_the_general_path():
    """Senders' rows are coalesced, which takes a path without the gather; an
    unsorted contribution takes the general one; both add in contribution order."""
    rng = np.random.default_rng(1)
    idx = [np.unique(rng.integers(0, 50, size=n)) for n in (30, 0, 1, 40)]
    vals = [rng.standard_normal((len(i), 3)).astype(np.float32) for i in idx]
    rows, sums = sum_rows(idx, vals)
    shuffled = [i[::-1].copy() for i in idx]  # the same rows, not sorted
    rows2, sums2 = sum_rows(shuffled, [v[::-1].copy() for v in vals])
    assert rows.tolist() == rows2.tolist() == sorted(set(np.concatenate(idx).tolist()))
    np.testing.assert_array_equal(sums, sums2)
    assert sums.dtype == np.float32


def test_rows_of_another_shard_or_disagreeing_splits_are_refused():
    async def run():
        # Shard 1 of 2 owns the odd rows of a 10-row table.
        sums = RowSums(1, 2, timeout_s=0.2)
        empty = np.empty((0, 2), np.float32)
        with pytest.raises(ShardProtocolError, match="not this shard's"):
            await sums.push(0, 1, 0, 0, (10, 2), np.array([1, 4], np.int64), np.ones((2, 2)))
        with pytest.raises(ShardProtocolError, match="not this shard's"):
            await sums.push(0, 4, 0, 0, (10, 2), np.array([11], np.int64), np.ones((1, 2)))
        with pytest.raises(ShardProtocolError, match="int64 row indices"):
            await sums.push(0, 2, 0, 0, (10, 2), np.array([3], np.int32), np.ones((1, 2)))
        task = asyncio.ensure_future(sums.push(0, 3, 0, 0, (10, 2), np.empty(0, np.int64), empty))
        await asyncio.sleep(0)
        with pytest.raises(ShardProtocolError, match="disagree on the table's size"):
            await sums.push(0, 3, 0, 1, (11, 2), np.empty(0, np.int64), empty)
        with pytest.raises(ShardTimeoutError, match=r"for the rows of worker 1;"):
            await task

    asyncio.run(run())


def test_rows_are_interleaved_over_the_shards_so_hot_low_ids_spread():
    """Ids numbered by frequency (hot rows first) would all land on shard 0 with
    ranges; row r belongs to shard r % S."""
    from ray_ps_plugin._codec import Codec
    from ray_ps_plugin._sparse import SparseTable, assemble

    table = SparseTable(0, torch.nn.Embedding(ROWS, DIM, sparse=True).weight, 3)
    grad = _sparse_grad([0, 1, 2, 3, 4, 5, 7, 48], seed=0)
    parts = table.split(grad, 0.5, Codec(None))
    assert [s for s, _, _ in parts] == [0, 1, 2]
    assert [i.tolist() for _, i, _ in parts] == [[0, 3, 48], [1, 4, 7], [2, 5]]
    for _, idx, vals in parts:
        torch.testing.assert_close(torch.from_numpy(np.asarray(vals)), grad.to_dense()[idx] * 0.5)
    back = assemble(table, [(i, v) for _, i, v in parts], Codec(None), torch.device("cpu"))
    assert back.is_coalesced() and back.indices()[0].tolist() == [0, 1, 2, 3, 4, 5, 7, 48]
    torch.testing.assert_close(back.to_dense(), grad.to_dense() * 0.5)


def test_sparse_params_are_the_ones_ddp_buckets_alone():
    model = _Recsys()
    assert [id(p) for p in sparse_params(model)] == [id(model.emb.weight), id(model.bag.weight)]
    check_supported(model)  # no longer refused
    model.emb.weight.requires_grad_(False)
    assert [id(p) for p in sparse_params(model)] == [id(model.bag.weight)]


def test_the_nan_check_reads_a_sparse_gradients_rows():
    from ray_ps_plugin._nonfinite import all_finite

    g = _sparse_grad([1, 4], seed=0).coalesce()
    assert all_finite(g)
    g.values()[1, 2] = float("nan")
    assert not all_finite(g)


def test_rows_pack_into_frames_and_back_also_empty_and_16_bit():
    from ray_ps_plugin._dtypes import BF16_BITS
    from ray_ps_plugin._rows import pack, unpack

    entries = [
        (0, (0, 10), np.array([1, 3], np.int64), np.ones((2, 4), np.float32), "float32"),
        (2, (5, 9), np.empty(0, np.int64), np.empty((0, 4), BF16_BITS), "bfloat16"),
        (3, (5, 9), np.array([6], np.int64), np.full((1, 3), 7, np.float16), "float16"),
    ]
    back = unpack(pack(entries))
    for (t, span, idx, vals, dt), (t2, span2, idx2, vals2, dt2) in zip(entries, back):
        assert (t, span, dt) == (t2, span2, dt2)
        np.testing.assert_array_equal(idx, idx2)
        assert vals.dtype == vals2.dtype and vals.shape == vals2.shape
        np.testing.assert_array_equal(vals, vals2)
    with pytest.raises(ShardProtocolError, match=r"malformed|after its entries"):
        unpack(pack(entries)[:-3])


@pytest.mark.parametrize("compression", [None, "bf16"])
def test_a_nodes_rows_for_other_nodes_go_through_its_relay_once(loop, compression):
    """Two nodes of two workers, one shard each: a worker sends every row to its own
    node's shard; the relay sends the other node's shard one message of the node's
    summed rows, and every worker gets the same union, the mean over all four."""
    from ray_ps_plugin._sync.topology import Topology

    world = 4
    topo = Topology(
        worker_nodes=(0, 0, 1, 1),
        shard_nodes=(0, 1),
        addresses=(("127.0.0.1", 1), ("127.0.0.1", 2)),
        token=bytes(32),
    )
    servers = [SumShard(i, world, 5.0, compression) for i in range(2)]
    transport = FakeTransport(loop, servers)
    transport.direct = FakeDirect(loop, servers)
    for s in servers:
        loop.run(s.configure(topo)).result(5)
        s._relay_streams = transport.direct  # each relay's own sends, on the fake path
    settings = Settings(compression=compression)
    tables = [torch.nn.Embedding(ROWS, DIM, sparse=True) for _ in range(world)]
    clients = [
        SumClient.build(setup_for(tables[r], r, world, 2, settings, topology=topo), transport)
        for r in range(world)
    ]
    # Rows of both shards (odd rows are shard 1's); ranks 0 and 1 share row 7.
    touched = {0: [2, 7, 9], 1: [7, 12], 2: [1, 2], 3: []}
    grads = {r: _sparse_grad(touched[r], seed=r) for r in range(world)}
    results = _step(clients, tables, {r: [(grads[r], [tables[r].weight])] for r in range(world)})
    expected = sum(g.to_dense() for g in grads.values()) / world
    tol = {} if compression is None else {"atol": 2e-2, "rtol": 1e-2}
    for r in range(world):
        torch.testing.assert_close(results[r][0].to_dense(), expected, **tol)
        assert results[r][0].indices()[0].tolist() == [1, 2, 7, 9, 12]
    for r in range(1, world):  # every worker the same bits
        assert torch.equal(results[r][0].to_dense(), results[0][0].to_dense())
    # Node 0's workers sent nothing to shard 1 themselves; its relay (source 4) did,
    # once; and node 1's relay (source 5) once to shard 0.
    for shard, sources in ((0, [0, 0, 1, 1, 5]), (1, [2, 2, 3, 3, 4])):
        assert sorted(src for s, _, src in transport.direct.frames if s == shard) == sources
    assert not [c for c in transport.calls if c[0] == "push_rows"]
    for c in clients:
        c.close()


def test_a_relay_refuses_rows_of_workers_it_does_not_relay_for(loop):
    from ray_ps_plugin._rows import pack
    from ray_ps_plugin._sync.topology import Topology
    from ray_ps_plugin._wire.frames import Frame, relayed_rows_key

    topo = Topology(worker_nodes=(0, 0, 1, 1), shard_nodes=(0, 1))  # no path: no relays
    shard = SumShard(0, 4, 1.0, None)
    loop.run(shard.configure(topo)).result(5)
    entry = (0, (ROWS, 2), np.array([2], np.int64), np.ones((1, DIM), np.float32), "float32")
    payload = pack([entry])
    frame = Frame(ROWS_FRAME, "float32", 0, 1, relayed_rows_key(1), 0, payload.nbytes)
    with pytest.raises(ShardProtocolError, match="relays for no one"):
        loop.run(shard._on_frame(frame, payload)).result(5)
    # Rows from a source that is not the shard's own: another node's worker under relays.
    topo = Topology(
        worker_nodes=(0, 0, 1, 1), shard_nodes=(0, 1), addresses=(("h", 1), ("h", 2)), token=b"t"
    )
    loop.run(shard.configure(topo)).result(5)
    with pytest.raises(ShardProtocolError, match="worker 2 does not send rows to this shard"):
        loop.run(shard.push_rows(0, 1, 2, [entry])).result(5)


def test_a_model_of_sparse_tables_only(loop):
    servers = [SumShard(i, 2, 5.0, None) for i in range(2)]
    transport = FakeTransport(loop, servers)
    tables = [torch.nn.Embedding(ROWS, DIM, sparse=True) for _ in range(2)]
    clients = [
        SumClient.build(setup_for(tables[r], r, 2, 2, Settings()), transport) for r in range(2)
    ]
    grads = {r: _sparse_grad([r, 40], seed=r) for r in range(2)}
    results = _step(clients, tables, {r: [(grads[r], [tables[r].weight])] for r in range(2)})
    expected = (grads[0].to_dense() + grads[1].to_dense()) / 2
    for r in range(2):
        torch.testing.assert_close(results[r][0].to_dense(), expected)
    for c in clients:
        c.close()
