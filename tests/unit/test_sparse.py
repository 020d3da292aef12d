"""Sparse embedding gradients in sync mode: touched rows only, summed on their shards."""

import asyncio
import threading

import numpy as np
import pytest
import torch

from ray_ps_plugin._ddp import check_supported
from ray_ps_plugin._errors import PSError, ShardProtocolError, ShardTimeoutError
from ray_ps_plugin._rows import RowSums, row_bounds, sum_rows
from ray_ps_plugin._sparse import sparse_params
from ray_ps_plugin._sync.client import SumClient
from ray_ps_plugin._sync.frames import ROWS as ROWS_FRAME
from ray_ps_plugin._sync.shard import SumShard
from tests.unit.fakes import (
    FakeBucket,
    FakeDirect,
    FakeTransport,
    LoopThread,
    Settings,
    setup_for,
)

ROWS, DIM = 50, 3


@pytest.fixture
def loop():
    lt = LoopThread()
    yield lt
    lt.stop()


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

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
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


def test_rows_outside_the_shard_or_disagreeing_spans_are_refused():
    async def run():
        sums = RowSums(1, 2, timeout_s=0.2)
        empty = np.empty((0, 2), np.float32)
        with pytest.raises(ShardProtocolError, match="outside this shard's range"):
            await sums.push(0, 1, 0, 0, (5, 10), np.array([3], np.int64), np.ones((1, 2)))
        with pytest.raises(ShardProtocolError, match="int64 row indices"):
            await sums.push(0, 2, 0, 0, (5, 10), np.array([6], np.int32), np.ones((1, 2)))
        task = asyncio.ensure_future(sums.push(0, 3, 0, 0, (5, 10), np.empty(0, np.int64), empty))
        await asyncio.sleep(0)
        with pytest.raises(ShardProtocolError, match="disagree on the table's size"):
            await sums.push(0, 3, 0, 1, (5, 11), np.empty(0, np.int64), empty)
        with pytest.raises(ShardTimeoutError, match=r"worker\(s\) \[1\]"):
            await task

    asyncio.run(run())


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
