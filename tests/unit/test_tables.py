"""Sharded embedding tables: the shard's store, the worker's client, torch compat."""

import asyncio
import inspect
import io
import itertools
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ray_ps_plugin import _torch_compat
from ray_ps_plugin._errors import PSError, ShardProtocolError, ShardTimeoutError
from ray_ps_plugin._modes import MODE_SPECS
from ray_ps_plugin._param.shard import ParamShard
from ray_ps_plugin._rows import row_bounds
from ray_ps_plugin._sync.shard import SumShard
from ray_ps_plugin._tables import spec as _table_spec
from ray_ps_plugin._tables import table as _table_table
from ray_ps_plugin._tables.checkpoint import load_tables, save_tables
from ray_ps_plugin._tables.client import ShardedTables, TableMode
from ray_ps_plugin._tables.frames import (
    pack_pull,
    pack_push,
    pack_push_answer,
    unpack_pull,
    unpack_push,
    unpack_push_answer,
)
from ray_ps_plugin._tables.layers import (
    check_tables,
    optimizer_step_spec,
    replica_table_names,
    skipped_in_apply,
)
from ray_ps_plugin._tables.spec import TableSpec, init_rows
from ray_ps_plugin._tables.store import TableStore
from ray_ps_plugin._tables.transfer import read_rows
from ray_ps_plugin._wire.frames import TABLE_PULL, TABLE_PUSH
from tests.unit.fakes import FakeDirect, FakeTransport, Settings, _copy

#: Real tables stepped on the shards: sync copies, async look-ups.
COPIES = TableMode(sync=True, staleness=0, real="copies")
LOOKUPS = TableMode(sync=False, staleness=None, real="lookups")
SGD_1 = {"lr": 1.0, "maximize": 0.0}
ADAM = {"lr": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "maximize": 0.0}


def _spec(rows=10, dim=3, padding_idx=None, seed=1, staleness=0, sync=True):
    return TableSpec(rows, dim, padding_idx, seed, staleness, sync)


def _ids(*values):
    return np.array(values, dtype=np.int64)


def _grads(n, dim, value=1.0):
    return np.full((n, dim), value, np.float32)


# --- initial rows ---------------------------------------------------------------------


def test_initial_rows_do_not_depend_on_how_the_table_is_cut(monkeypatch):
    monkeypatch.setattr(_table_spec, "INIT_BLOCK_ROWS", 7)
    spec = _spec(rows=50, dim=4, padding_idx=13, seed=5)
    whole = init_rows(spec, 2, 0, 50)
    for cuts in ([0, 3, 7, 8, 20, 21, 49, 50], [0, 1, 2, 13, 14, 50], [0, 50]):
        parts = [init_rows(spec, 2, a, b) for a, b in itertools.pairwise(cuts)]
        np.testing.assert_array_equal(np.concatenate(parts), whole)
    for shards in range(1, 6):
        bounds = row_bounds(50, shards)
        parts = [init_rows(spec, 2, a, b) for a, b in itertools.pairwise(bounds)]
        np.testing.assert_array_equal(np.concatenate(parts), whole)
    assert whole.dtype == np.float32 and whole.shape == (50, 4)
    assert not whole[13].any() and np.all(np.abs(whole[np.arange(50) != 13]).sum(1) > 0)
    # Another table, another seed: other values.
    assert not np.array_equal(init_rows(spec, 3, 0, 50), whole)
    assert not np.array_equal(init_rows(_spec(rows=50, dim=4, seed=6), 2, 0, 50)[:13], whole[:13])


def test_initial_rows_across_a_real_block_boundary_are_the_same_rows():
    block = _table_spec.INIT_BLOCK_ROWS
    spec = _spec(rows=block + 10, dim=1, seed=9)
    whole = init_rows(spec, 0, 0, block + 10)
    cuts = [0, block - 3, block, block + 2, block + 10]
    parts = [init_rows(spec, 0, a, b) for a, b in itertools.pairwise(cuts)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_initial_rows_are_standard_normal_with_a_zero_padding_row():
    spec = _spec(rows=2000, dim=64, padding_idx=0, seed=11)
    rows = init_rows(spec, 0, 0, 2000)
    assert not rows[0].any()
    values = rows[1:].astype(np.float64)
    assert abs(values.mean()) < 0.02
    assert abs(values.std() - 1.0) < 0.02


# --- the optimizers against torch -------------------------------------------------------

_OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD([p], lr=0.1),
    "sgd-maximize": lambda p: torch.optim.SGD([p], lr=0.1, maximize=True),
    "adagrad": lambda p: torch.optim.Adagrad(
        [p], lr=0.05, lr_decay=0.1, initial_accumulator_value=0.3, eps=1e-10
    ),
    "adagrad-maximize": lambda p: torch.optim.Adagrad(
        [p], lr=0.05, lr_decay=0.1, initial_accumulator_value=0.3, maximize=True
    ),
    "sparse_adam": lambda p: torch.optim.SparseAdam([p], lr=0.01, betas=(0.8, 0.95)),
    "sparse_adam-maximize": lambda p: torch.optim.SparseAdam(
        [p], lr=0.01, betas=(0.8, 0.95), eps=1e-6, maximize=True
    ),
}
# Repeated rows within a step, rows shared between steps and steps on disjoint rows;
# row 2 is the padding row; rows 9, 10, 11 are never touched.
_BATCHES = [[0, 1, 1, 2, 4], [4, 4, 4, 5], [6, 7], [0, 2, 6, 1], [5, 5, 3, 0], [1, 7, 8]]


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
@pytest.mark.parametrize("name", list(_OPTIMIZERS))
def test_the_store_steps_rows_as_torchs_sparse_optimizer_does(name, sync):
    rows, dim, pad = 12, 3, 2
    spec = _spec(rows, dim, padding_idx=pad, seed=4, staleness=0 if sync else None, sync=sync)
    start = init_rows(spec, 0, 0, rows)
    emb = torch.nn.Embedding(rows, dim, padding_idx=pad, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(start))
    opt = _OPTIMIZERS[name](emb.weight)
    gen = torch.Generator().manual_seed(0)

    async def main():
        store = TableStore(0, 1, timeout_s=5.0)
        assert store.create(0, 0, spec, 1) == (0, rows)
        for step, batch in enumerate(_BATCHES):
            if step == 3:  # as an LR scheduler does, between steps
                opt.param_groups[0]["lr"] *= 0.5
            ids = torch.tensor(batch)
            coef = torch.randn(len(batch), dim, generator=gen)
            opt.zero_grad()
            (emb(ids) * coef).sum().backward()
            grad = emb.weight.grad.coalesce()
            idx, values = grad.indices()[0].numpy(), grad.values().numpy()
            assert pad not in idx  # torch's sparse gradient leaves the padding row out
            # The client sends the padding row too: the store must drop it.
            push_ids = np.concatenate([idx, [pad]]).astype(np.int64)
            push_grads = np.concatenate([values, np.full((1, dim), 7.0, np.float32)])
            order = np.argsort(push_ids)
            kind, hyper = optimizer_step_spec(opt, opt.param_groups[0], "t")
            applied = await store.push(
                0, 0, 0, step + 1, push_ids[order], push_grads[order], kind, hyper
            )
            assert applied == step + 1
            opt.step()
            got = store.read(0, 0, 0, rows)["weight"]
            want = emb.weight.detach().numpy()
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=f"step {step}")
            untouched = [pad, 9, 10, 11]
            np.testing.assert_array_equal(got[untouched], start[untouched])
            np.testing.assert_array_equal(want[untouched], start[untouched])
            pulled = await store.pull(0, 0, 0, step + 1, np.arange(rows))
            np.testing.assert_array_equal(pulled, got)

    asyncio.run(main())


# --- sync clocks ---------------------------------------------------------------------------


def test_sync_applies_a_clock_once_every_worker_pushed_it_as_the_sum():
    spec = _spec(rows=6, dim=2)
    start = init_rows(spec, 0, 0, 6)

    async def main():
        store = TableStore(0, 2, timeout_s=5.0)
        store.create(0, 0, spec, 1)
        a = asyncio.ensure_future(
            store.push(0, 0, 0, 1, _ids(0, 1), _grads(2, 2, 1.0), "sgd", SGD_1)
        )
        await asyncio.sleep(0.05)
        assert not a.done()  # the push waits for the clock's update
        with pytest.raises(asyncio.TimeoutError):  # so does a pull at clock 1
            await asyncio.wait_for(store.pull(0, 0, 0, 1, _ids(0, 1, 2)), 0.05)
        # Clock 0 needs nothing: nothing applied yet.
        np.testing.assert_array_equal(await store.pull(0, 0, 1, 0, np.arange(6)), start)
        waiting_pull = asyncio.ensure_future(store.pull(0, 0, 0, 1, np.arange(6)))
        await asyncio.sleep(0.02)
        assert not waiting_pull.done()
        b = await store.push(0, 0, 1, 1, _ids(1, 2), _grads(2, 2, 10.0), "sgd", SGD_1)
        assert b == 1 and await asyncio.wait_for(a, 1) == 1
        want = start.copy()
        want[0] -= 1.0
        want[1] -= 11.0  # both workers' gradients, summed
        want[2] -= 10.0
        np.testing.assert_allclose(await asyncio.wait_for(waiting_pull, 1), want, atol=1e-6)

        # A repeated clock is taken once.
        again = await store.push(0, 0, 0, 1, _ids(0, 1), _grads(2, 2, 50.0), "sgd", SGD_1)
        assert again == 1
        np.testing.assert_allclose(await store.pull(0, 0, 0, 1, np.arange(6)), want, atol=1e-6)

        # A finished worker no longer holds a clock back.
        held = asyncio.ensure_future(
            store.push(0, 0, 0, 2, _ids(3), _grads(1, 2, 2.0), "sgd", SGD_1)
        )
        await asyncio.sleep(0.05)
        assert not held.done()
        await store.finish(0, 1)
        assert await asyncio.wait_for(held, 1) == 2
        assert (
            await asyncio.wait_for(
                store.push(0, 0, 0, 3, _ids(4), _grads(1, 2, 3.0), "sgd", SGD_1), 1
            )
            == 3
        )
        want[3] -= 2.0
        want[4] -= 3.0
        got = await asyncio.wait_for(store.pull(0, 0, 0, 3, np.arange(6)), 1)
        np.testing.assert_allclose(got, want, atol=1e-6)

    asyncio.run(main())


def test_a_skipped_clock_is_a_protocol_error():
    async def main():
        store = TableStore(4, 1, timeout_s=5.0)
        assert store.create(0, 0, _spec(), 5) == (8, 10)
        await store.push(0, 0, 0, 1, _ids(8), _grads(1, 3), "sgd", SGD_1)
        await store.push(0, 0, 0, 3, _ids(9), _grads(1, 3), "sgd", SGD_1)

    with pytest.raises(ShardProtocolError, match=r"shard 4: rank 0 pushed update 3 .* after 1"):
        asyncio.run(main())


def test_rows_of_another_shard_are_a_protocol_error():
    async def main():
        store = TableStore(1, 1, timeout_s=5.0)
        assert store.create(0, 0, _spec(rows=10), 2) == (5, 10)
        assert store.create(0, 0, _spec(rows=10), 2) == (5, 10)  # every worker asks
        with pytest.raises(ShardProtocolError, match="described differently"):
            store.create(0, 0, _spec(rows=11), 2)
        with pytest.raises(ShardProtocolError, match=r"it holds \[5, 10\)"):
            await store.pull(0, 0, 0, 0, _ids(4, 5))
        with pytest.raises(ShardProtocolError, match=r"it holds \[5, 10\)"):
            await store.pull(0, 0, 0, 0, _ids(9, 10))
        with pytest.raises(ShardProtocolError, match=r"it holds \[5, 10\)"):
            await store.push(0, 0, 0, 1, _ids(2), _grads(1, 3), "sgd", SGD_1)
        with pytest.raises(ShardProtocolError, match="no table 1"):
            await store.pull(0, 1, 0, 0, _ids(5))
        # Nothing was taken: clock 1 is still free.
        assert await store.push(0, 0, 0, 1, _ids(5), _grads(1, 3), "sgd", SGD_1) == 1

    asyncio.run(main())


def test_a_second_optimizer_for_a_table_is_refused():
    async def main():
        store = TableStore(0, 1, timeout_s=5.0)
        store.create(0, 0, _spec(), 1)
        await store.push(0, 0, 0, 1, _ids(1), _grads(1, 3), "sparse_adam", ADAM)
        before = store.read(0, 0, 0, 10)
        with pytest.raises(ShardProtocolError, match="one optimizer per table"):
            await store.push(0, 0, 0, 2, _ids(1), _grads(1, 3), "sgd", SGD_1)
        after = store.read(0, 0, 0, 10)
        np.testing.assert_array_equal(after["weight"], before["weight"])
        assert after["steps"] == 1
        # The refused push took no clock.
        assert await store.push(0, 0, 0, 2, _ids(1), _grads(1, 3), "sparse_adam", ADAM) == 2

    asyncio.run(main())


def test_a_shard_refuses_a_rank_outside_the_run():
    async def main():
        shard = ParamShard(0, 2, None, 5.0)
        shard.table_create(0, 0, _spec(), 1)
        with pytest.raises(ShardProtocolError, match="rank 2"):
            await shard.table_pull(0, 0, 2, 0, _ids(1))
        with pytest.raises(ShardProtocolError, match="rank -1"):
            await shard.table_push(0, -1, [(0, 1, _ids(1), _grads(1, 3), "sgd", SGD_1, True)])

    asyncio.run(main())


def test_one_push_takes_every_tables_update_before_waiting_for_any():
    """Two workers list the same two sync tables in opposite orders: were one table's
    wait before the next table's update, each would wait for the other forever."""
    spec = _spec(rows=4, dim=1)
    start = init_rows(spec, 0, 0, 4)

    def entry(table, value):
        return (table, 1, _ids(table), _grads(1, 1, value), "sgd", SGD_1, True)

    async def main():
        store = TableStore(0, 2, timeout_s=5.0)
        store.create(0, 0, spec, 1)
        store.create(0, 1, spec, 1)
        a = asyncio.ensure_future(store.push_many(0, 0, [entry(0, 1.0), entry(1, 2.0)]))
        b = asyncio.ensure_future(store.push_many(0, 1, [entry(1, 4.0), entry(0, 8.0)]))
        answers = await asyncio.wait_for(asyncio.gather(a, b), 1)
        assert [[steps for steps, _, _ in per] for per in answers] == [[1, 1], [1, 1]]
        # Not replica tables: no rows in the answers.
        assert all(len(ids) == 0 for per in answers for _, ids, _ in per)
        assert await store.push_many(0, 0, []) == []
        t0 = await store.pull(0, 0, 0, 1, _ids(0))
        t1 = await store.pull(0, 1, 0, 1, _ids(1))
        np.testing.assert_allclose(t0, start[[0]] - 9.0, atol=1e-6)
        np.testing.assert_allclose(t1, init_rows(spec, 1, 1, 2) - 6.0, atol=1e-6)

    asyncio.run(main())


# --- ssp and async ----------------------------------------------------------------------


def test_ssp_answers_a_pull_once_every_worker_is_within_the_bound():
    spec = _spec(rows=4, dim=1, staleness=1, sync=False)
    start = init_rows(spec, 0, 0, 4)

    async def main():
        store = TableStore(0, 2, timeout_s=5.0)
        store.create(0, 0, spec, 1)
        # Each push is applied as it comes, without waiting for the other worker.
        assert (
            await asyncio.wait_for(store.push(0, 0, 0, 1, _ids(0), _grads(1, 1), "sgd", SGD_1), 1)
            == 1
        )
        got = await asyncio.wait_for(store.pull(0, 0, 0, 1, _ids(0)), 1)  # needs clock 0
        np.testing.assert_allclose(got, start[[0]] - 1, atol=1e-6)
        await asyncio.wait_for(store.push(0, 0, 0, 2, _ids(1), _grads(1, 1), "sgd", SGD_1), 1)
        with pytest.raises(asyncio.TimeoutError):  # needs rank 1 at clock 1
            await asyncio.wait_for(store.pull(0, 0, 0, 2, _ids(0, 1, 2)), 0.05)
        pending = asyncio.ensure_future(store.pull(0, 0, 0, 2, _ids(0, 1, 2)))
        await asyncio.sleep(0.02)
        assert not pending.done()
        await store.push(0, 0, 1, 1, _ids(2), _grads(1, 1, 5.0), "sgd", SGD_1)
        got = await asyncio.wait_for(pending, 1)
        np.testing.assert_allclose(got, start[[0, 1, 2]] - [[1], [1], [5]], atol=1e-6)
        # A finished worker no longer holds the others back.
        await store.push(0, 0, 0, 3, _ids(3), _grads(1, 1), "sgd", SGD_1)
        pending = asyncio.ensure_future(store.pull(0, 0, 0, 3, _ids(3)))
        await asyncio.sleep(0.02)
        assert not pending.done()
        await store.finish(0, 1)
        np.testing.assert_allclose(await asyncio.wait_for(pending, 1), start[[3]] - 1, atol=1e-6)

    asyncio.run(main())


def test_ssp_confirms_the_bound_for_reads_from_shared_memory_per_table():
    """A worker of the shard's node reads rows from shared memory once the shard has
    confirmed, per table, that every worker is within the bound of that table's
    clock; a table at an older clock is not held to a newer one's bound."""
    spec = _spec(rows=4, dim=1, staleness=1, sync=False)

    async def main():
        store = TableStore(0, 2, timeout_s=5.0)
        for table in (0, 1):
            store.create(0, table, spec, 1)
        for clock in (1, 2):  # rank 0 two steps ahead on table 0, one on table 1
            await store.push(0, 0, 0, clock, _ids(0), _grads(1, 1), "sgd", SGD_1)
        await store.push(0, 1, 0, 1, _ids(0), _grads(1, 1), "sgd", SGD_1)
        await asyncio.wait_for(store.wait_bound(0, {0: 1, 1: 1}), 1)  # needs clock 0
        await asyncio.wait_for(store.wait_bound(0, {1: 1}), 1)
        pending = asyncio.ensure_future(store.wait_bound(0, {0: 2, 1: 1}))
        await asyncio.sleep(0.02)
        assert not pending.done()  # table 0 at clock 2 needs rank 1 at clock 1
        await store.push(0, 0, 1, 1, _ids(2), _grads(1, 1), "sgd", SGD_1)
        await asyncio.wait_for(pending, 1)

    asyncio.run(main())


def test_async_never_waits_for_another_worker():
    spec = _spec(rows=4, dim=1, staleness=None, sync=False)
    start = init_rows(spec, 0, 0, 4)

    async def main():
        store = TableStore(0, 2, timeout_s=5.0)
        store.create(0, 0, spec, 1)
        for clock in range(1, 6):
            steps = await asyncio.wait_for(
                store.push(0, 0, 0, clock, _ids(1), _grads(1, 1), "sgd", SGD_1), 0.5
            )
            assert steps == clock
            got = await asyncio.wait_for(store.pull(0, 0, 0, clock, _ids(1)), 0.5)
            np.testing.assert_allclose(got, start[[1]] - clock, atol=1e-5)
        # Rank 1 never pushed, and reads at clock 0 what rank 0 wrote.
        got = await asyncio.wait_for(store.pull(0, 0, 1, 0, _ids(1)), 0.5)
        np.testing.assert_allclose(got, start[[1]] - 5, atol=1e-5)

    asyncio.run(main())


# --- timeouts --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec", [_spec(sync=True), _spec(staleness=0, sync=False)], ids=["sync", "ssp"]
)
def test_a_pull_that_cannot_be_answered_times_out_within_the_bound(spec):
    async def main():
        store = TableStore(2, 2, timeout_s=0.2)
        assert store.create(0, 0, spec, 3) == (6, 10)
        t0 = time.monotonic()
        with pytest.raises(ShardTimeoutError, match=r"shard 2: waited 0.2s"):
            await store.pull(0, 0, 0, 1, _ids(7))
        return time.monotonic() - t0

    elapsed = asyncio.run(main())
    assert 0.15 <= elapsed < 1.5


def test_a_sync_push_whose_partner_never_comes_times_out_naming_it():
    async def main():
        store = TableStore(0, 2, timeout_s=0.2)
        store.create(0, 0, _spec(), 1)
        with pytest.raises(ShardTimeoutError, match=r"worker\(s\) \[1\] are behind"):
            await store.push(0, 0, 0, 1, _ids(1), _grads(1, 3), "sgd", SGD_1)

    asyncio.run(main())


# --- checkpoints -----------------------------------------------------------------------


def test_a_table_read_from_two_shards_and_written_to_three_steps_on_identically():
    rows, dim = 11, 3
    spec = _spec(rows, dim, padding_idx=4, seed=2)
    rng = np.random.default_rng(0)
    batches = [np.sort(rng.choice(rows, size=5, replace=False)) for _ in range(4)]
    grads = [rng.standard_normal((5, dim)).astype(np.float32) for _ in range(4)]

    async def step(stores, clock):
        ids, g = batches[clock - 1], grads[clock - 1]
        for store in stores:
            lo, hi = store.create(0, 0, spec, len(stores))
            keep = (ids >= lo) & (ids < hi)
            await store.push(0, 0, 0, clock, ids[keep], g[keep], "sparse_adam", ADAM)

    def whole(stores):
        parts = [s.read(0, 0, 0, rows) for s in stores]
        assert len({p["steps"] for p in parts}) == 1
        return {
            "weight": np.concatenate([p["weight"] for p in parts]),
            "state": {n: np.concatenate([p["state"][n] for p in parts]) for n in parts[0]["state"]},
            "steps": parts[0]["steps"],
            "optimizer": parts[0]["optimizer"],
        }

    async def main():
        two = [TableStore(s, 1, timeout_s=5.0) for s in range(2)]
        for s in two:
            s.create(0, 0, spec, 2)
        for clock in (1, 2, 3):
            await step(two, clock)
        saved = [s.read(0, 0, 0, rows) for s in two]
        three = [TableStore(s, 1, timeout_s=5.0) for s in range(3)]
        for s in three:
            s.create(0, 0, _spec(rows, dim, padding_idx=4, seed=99), 3)  # other values
            for part in saved:
                s.write(0, 0, part["lo"], part["weight"], part["state"], part["optimizer"], 3)
        a, b = whole(two), whole(three)
        np.testing.assert_array_equal(b["weight"], a["weight"])
        assert set(b["state"]) == {"exp_avg", "exp_avg_sq"} == set(a["state"])
        for name in a["state"]:
            np.testing.assert_array_equal(b["state"][name], a["state"][name])
        assert (b["steps"], b["optimizer"]) == (3, "sparse_adam")
        # The next step: one on the old layout (clock 4), one on the new (its clock 1).
        ids, g = batches[3], grads[3]
        for store in two:
            lo, hi = store.create(0, 0, spec, 2)
            keep = (ids >= lo) & (ids < hi)
            await store.push(0, 0, 0, 4, ids[keep], g[keep], "sparse_adam", ADAM)
        for store in three:
            lo, hi = store.create(0, 0, _spec(rows, dim, padding_idx=4, seed=99), 3)
            keep = (ids >= lo) & (ids < hi)
            await store.push(0, 0, 0, 1, ids[keep], g[keep], "sparse_adam", ADAM)
        a, b = whole(two), whole(three)
        assert a["steps"] == b["steps"] == 4
        np.testing.assert_array_equal(b["weight"], a["weight"])

    asyncio.run(main())


# --- the client's pure functions -------------------------------------------------------


def _param():
    return torch.nn.Parameter(torch.zeros(3, 2))


def test_the_step_spec_reads_the_groups_hyperparameters_at_each_step():
    sgd = torch.optim.SGD([_param()], lr=0.1)
    assert optimizer_step_spec(sgd, sgd.param_groups[0], "t") == (
        "sgd",
        {"lr": 0.1, "maximize": 0.0},
    )
    sgd.param_groups[0]["lr"] = 0.025  # what an LR scheduler does
    assert optimizer_step_spec(sgd, sgd.param_groups[0], "t")[1]["lr"] == 0.025
    ada = torch.optim.Adagrad([_param()], lr=0.2, lr_decay=0.01, initial_accumulator_value=0.5)
    kind, hyper = optimizer_step_spec(ada, ada.param_groups[0], "t")
    assert kind == "adagrad"
    assert hyper == {
        "lr": 0.2,
        "lr_decay": 0.01,
        "eps": 1e-10,
        "initial_accumulator_value": 0.5,
        "maximize": 0.0,
    }
    adam = torch.optim.SparseAdam([_param()], lr=0.3, betas=(0.7, 0.8), eps=1e-6, maximize=True)
    assert optimizer_step_spec(adam, adam.param_groups[0], "t") == (
        "sparse_adam",
        {"lr": 0.3, "beta1": 0.7, "beta2": 0.8, "eps": 1e-6, "maximize": 1.0},
    )
    scheduler = torch.optim.lr_scheduler.StepLR(adam, step_size=1, gamma=0.5)
    scheduler.step()
    assert optimizer_step_spec(adam, adam.param_groups[0], "t")[1]["lr"] == pytest.approx(0.15)


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.Adam([p]),
        # transformers.Trainer's default optimizer.
        lambda p: torch.optim.AdamW([p]),
        lambda p: torch.optim.SGD([p], lr=0.1, momentum=0.9),
        lambda p: torch.optim.SGD([p], lr=0.1, weight_decay=0.01),
        lambda p: torch.optim.Adagrad([p], weight_decay=0.1),
    ],
    ids=["adam", "adamw", "sgd-momentum", "sgd-weight-decay", "adagrad-weight-decay"],
)
def test_the_step_spec_refuses_what_the_shards_cannot_apply_and_names_sparse_adam(make):
    opt = make(_param())
    with pytest.raises(ValueError, match=r"'emb\.weight'.*SparseAdam"):
        optimizer_step_spec(opt, opt.param_groups[0], "emb.weight")


class _Model(torch.nn.Module):
    def __init__(self, emb: torch.nn.Module) -> None:
        super().__init__()
        self.emb = emb
        self.head = torch.nn.Linear(4, 2)


class _MyEmbedding(torch.nn.Embedding):
    pass


@pytest.mark.parametrize(
    ("emb", "mode", "says"),
    [
        (lambda: torch.nn.Embedding(8, 4, device="meta"), "sync", "sparse=False"),
        (
            lambda: torch.nn.Embedding(8, 4, sparse=True, max_norm=1.0, device="meta"),
            "async",
            "max_norm",
        ),
        (
            lambda: torch.nn.EmbeddingBag(8, 4, sparse=True, dtype=torch.bfloat16, device="meta"),
            "ssp",
            "bfloat16",
        ),
        (lambda: _MyEmbedding(8, 4, sparse=True, device="meta"), "sync", "_MyEmbedding"),
        (lambda: torch.nn.EmbeddingBag(8, 4, sparse=True, device="meta"), "diloco", "diloco"),
    ],
    ids=["dense", "max-norm", "bfloat16", "subclass", "diloco"],
)
def test_check_tables_refuses_a_meta_table_it_cannot_train_naming_the_layer(emb, mode, says):
    with pytest.raises(ValueError, match=r"'emb'") as info:
        check_tables(_Model(emb()), MODE_SPECS[mode].tables_on_shards, mode)
    assert says in str(info.value)


@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
def test_check_tables_accepts_a_plain_sparse_meta_bag_and_ignores_real_tables(mode):
    check_tables(_Model(torch.nn.EmbeddingBag(8, 4, sparse=True, device="meta")), True, mode)
    check_tables(_Model(torch.nn.Embedding(8, 4, sparse=True, device="meta")), True, mode)
    # Tables on a real device are ordinary parameters, in every mode.
    for m in (mode, "diloco"):
        on_shards = MODE_SPECS[m].tables_on_shards
        check_tables(
            _Model(torch.nn.Embedding(8, 4, max_norm=1.0, dtype=torch.bfloat16)), on_shards, m
        )
        check_tables(_Model(_MyEmbedding(8, 4)), on_shards, m)


# --- torch compat ---------------------------------------------------------------------


def test_to_leaves_a_meta_tables_weight_alone_only_inside_skipping_in_apply():
    model = _Model(torch.nn.EmbeddingBag(8, 4, sparse=True, device="meta"))
    weight = model.emb.weight
    original = torch.nn.Module._apply
    with _torch_compat.skipping_in_apply(skipped_in_apply):
        model.to(torch.float64)
        model.to("cpu")
    assert torch.nn.Module._apply is original
    assert model.head.weight.dtype == torch.float64 and model.head.bias.dtype == torch.float64
    assert model.emb.weight is weight and weight.is_meta and weight.dtype == torch.float32
    assert list(dict(model.named_parameters())) == ["emb.weight", "head.weight", "head.bias"]
    with pytest.raises(NotImplementedError, match="meta"):
        model.to("cpu")


def test_skipping_in_apply_restores_apply_after_an_error():
    original = torch.nn.Module._apply
    model = _Model(torch.nn.EmbeddingBag(8, 4, sparse=True, device="meta"))
    weight = model.emb.weight

    def boom(m):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):  # noqa: SIM117
        with _torch_compat.skipping_in_apply(skipped_in_apply):
            model._apply(boom)
    assert torch.nn.Module._apply is original
    assert model.emb.weight is weight


def test_ignore_in_ddp_adds_names_and_keeps_those_already_there():
    model = _Model(torch.nn.EmbeddingBag(8, 4, sparse=True, device="meta"))
    _torch_compat.ignore_in_ddp(model, ["head.bias"])
    _torch_compat.ignore_in_ddp(model, ["emb.weight", "head.bias"])
    assert list(model._ddp_params_and_buffers_to_ignore) == ["head.bias", "emb.weight"]


# --- the client end to end, on real shards through a fake transport ---------------------


class _TableTransport(FakeTransport):
    """FakeTransport for ``table_*`` calls: some are plain methods (as Ray's async
    actors allow), which FakeTransport can only await; these run on the loop too."""

    def call(self, shard, method, *args):
        fn = getattr(self.servers[shard], method)
        if inspect.iscoroutinefunction(fn):
            return super().call(shard, method, *args)
        self.calls.append((method, shard, *args))

        async def plain():
            return fn(*[_copy(a) for a in args])

        return self.loop.run(self._gated(plain()))


class _Tables(torch.nn.Module):
    def __init__(self, device) -> None:
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(
            20, 4, mode="mean", padding_idx=5, sparse=True, device=device
        )
        self.emb = torch.nn.Embedding(20, 4, sparse=True, device=device)

    def forward(self, ids, offsets, tokens):
        return self.bag(ids, offsets), self.emb(tokens)


_INPUTS = [
    (torch.tensor([1, 5, 5, 7, 3, 1, 19, 0]), torch.tensor([0, 3, 5]), torch.tensor([[2, 2, 9]])),
    (torch.tensor([7, 8, 5]), torch.tensor([0, 1]), torch.tensor([[9, 0], [19, 19]])),
    (torch.tensor([3, 3, 11, 12]), torch.tensor([0, 2]), torch.tensor([4, 9, 4])),
]


def _loss(outputs, k):
    gen = torch.Generator().manual_seed(k)
    return sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outputs)


def _read(transport, shards, index, rows):
    handles = [transport.call(s, "table_read", 0, index, 0, rows) for s in range(shards)]
    parts = transport.wait(handles, 5)
    return {
        "weight": np.concatenate([p["weight"] for p in parts]),
        "state": {n: np.concatenate([p["state"][n] for p in parts]) for n in parts[0]["state"]},
        "steps": {p["steps"] for p in parts},
    }


def _build(loop, shards, seed, world=1, rank=0, servers=None, local=(), direct=False):
    servers = servers or [ParamShard(s, world, None, 5.0) for s in range(shards)]
    transport = _TableTransport(loop, servers)
    if direct:
        transport.direct = FakeDirect(loop, servers)
    module = _Tables("meta")
    settings = Settings(mode="sync", ps_timeout_s=5.0)
    mode = TableMode(sync=True, staleness=0)
    tables = ShardedTables(0, module, transport, settings, rank, world, shards, seed, mode, local)
    return module, transport, tables


def _replica(tables):
    """The module with real tables holding the sharded tables' initial rows."""
    replica = _Tables("cpu")
    with torch.no_grad():
        for t, layer in zip(tables.tables, (replica.bag, replica.emb)):
            layer.weight.copy_(torch.from_numpy(init_rows(t.spec, t.ref.index, 0, 20)))
    return replica


def _assert_same_lookups(module, replica, inputs):
    """The sharded layers' outputs equal the replica's, layer by layer."""
    for got, want in zip(module(*inputs), replica(*inputs)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def _step_both(tables, opt, ref_opt):
    """One step of the sharded tables (``opt``) and of the replica (``ref_opt``),
    returning once the tables' pushes are confirmed."""
    tables.before_step(opt)
    ref_opt.step()
    tables.flush()


def _assert_rows(transport, shards, replica, steps):
    for i, layer in enumerate((replica.bag, replica.emb)):
        got = _read(transport, shards, i, 20)
        assert got["steps"] == {steps}
        np.testing.assert_allclose(got["weight"], layer.weight.detach().numpy(), atol=1e-5)


@pytest.mark.parametrize("local", [(), (0, 1)], ids=["by_message", "shared_memory"])
def test_sharded_layers_look_up_step_and_checkpoint_as_a_real_replica(loop, tmp_path, local):
    """By message, or with both shards on the worker's node: rows read from their
    shared memory after the step's push returned."""
    module, transport, tables = _build(loop, 2, seed=3, local=local)
    try:
        assert sorted(s for t in tables.tables for s in t.local) == sorted(local * 2)
        assert [type(m).__name__ for m in (module.bag, module.emb)] == [
            "_ShardedBag",
            "_ShardedEmbedding",
        ]
        specs = [t.spec for t in tables.tables]
        assert [(s.rows, s.dim, s.padding_idx, s.sync, s.staleness) for s in specs] == [
            (20, 4, 5, True, 0),
            (20, 4, None, True, 0),
        ]
        replica = _Tables("cpu")
        with torch.no_grad():
            for i, layer in enumerate((replica.bag, replica.emb)):
                layer.weight.copy_(torch.from_numpy(init_rows(specs[i], i, 0, 20)))
        assert module.bag.weight.is_meta and module.emb.weight.is_meta

        # The forward equals the layer's own on the whole table.
        for ids, offsets, tokens in _INPUTS:
            got, want = module(ids, offsets, tokens), replica(ids, offsets, tokens)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
        full = torch.from_numpy(init_rows(specs[0], 0, 0, 20))
        ids, offsets, _ = _INPUTS[0]
        torch.testing.assert_close(
            module.bag(ids, offsets),
            F.embedding_bag(ids, full, offsets, mode="mean", padding_idx=5),
        )

        # Two backward passes, then the step: the same as a SparseAdam step of the replica.
        opt = torch.optim.SparseAdam([module.bag.weight, module.emb.weight], lr=0.01)
        ref_opt = torch.optim.SparseAdam([replica.bag.weight, replica.emb.weight], lr=0.01)
        ref_opt.zero_grad()
        for k, inputs in enumerate(_INPUTS[:2]):
            _loss(module(*inputs), k).backward()
            _loss(replica(*inputs), k).backward()
        transport.calls.clear()
        tables.before_step(opt)
        # One call per shard carries the step of both tables.
        pushes = [c for c in transport.calls if c[0] == "table_push"]
        assert sorted(c[1] for c in pushes) == [0, 1]
        assert all([e[0] for e in c[4]] == [0, 1] for c in pushes)
        opt.step()  # the meta weights have no gradient: torch's step skips them
        ref_opt.step()
        tables.flush()
        _assert_rows(transport, 2, replica, 1)
        _assert_same_lookups(module, replica, _INPUTS[2])

        pulls = sum(1 for c in transport.calls if c[0] == "table_pull")
        assert (pulls == 0) if local else (pulls > 0)
        save_tables(tables, tmp_path)
        saved = [_read(transport, 2, i, 20) for i in range(2)]
    finally:
        tables.close()

    module, transport, tables = _build(loop, 3, seed=77)  # other initial rows
    try:
        load_tables(tables, tmp_path)
        for i in range(2):
            got = _read(transport, 3, i, 20)
            np.testing.assert_array_equal(got["weight"], saved[i]["weight"])
            assert set(got["state"]) == set(saved[i]["state"]) == {"exp_avg", "exp_avg_sq"}
            for name, values in saved[i]["state"].items():
                np.testing.assert_array_equal(got["state"][name], values)
            assert got["steps"] == {1}
        _assert_same_lookups(module, replica, _INPUTS[2])
        # The restored step count and moments carry on as the replica's.
        opt = torch.optim.SparseAdam([module.bag.weight, module.emb.weight], lr=0.01)
        ref_opt.zero_grad()
        _loss(module(*_INPUTS[2]), 5).backward()
        _loss(replica(*_INPUTS[2]), 5).backward()
        _step_both(tables, opt, ref_opt)
        _assert_rows(transport, 3, replica, 2)
    finally:
        tables.close()


@pytest.mark.parametrize("direct", [False, True], ids=["ray-calls", "direct-path"])
def test_two_sync_workers_tables_step_as_ddp_averaging_their_gradients(loop, direct):
    """Through Ray calls, or (a sync run's sync shards) as frames on the direct path."""
    servers = (
        [SumShard(s, 2, 5.0) for s in range(2)]
        if direct
        else [ParamShard(s, 2, None, 5.0) for s in range(2)]
    )
    workers = [
        _build(loop, 2, 3, world=2, rank=r, servers=servers, direct=direct) for r in range(2)
    ]
    live = [{t.ref: t for t in w[2].tables} for w in workers]

    def use(rank):
        # One process holds both workers here: each layer finds its own worker's table
        # (in a run, each worker process has its own).
        _table_table._LIVE.update(live[rank])
        return workers[rank]

    try:
        replica = _replica(workers[0][2])
        # SGD: unlike Adam's, its step shows a gradient not divided by the world size.
        ref_opt = torch.optim.SGD([replica.bag.weight, replica.emb.weight], lr=0.5)
        opts = [torch.optim.SGD([w[0].bag.weight, w[0].emb.weight], lr=0.5) for w in workers]
        for step in range(2):
            ref_opt.zero_grad()
            for rank in range(2):
                module, _, tables = use(rank)
                inputs = _INPUTS[(step + rank) % 3]
                _loss(module(*inputs), 10 * step + rank).backward()
                (_loss(replica(*inputs), 10 * step + rank) / 2).backward()
                tables.before_step(opts[rank])
            ref_opt.step()
            for _, _, tables in workers:
                tables.flush()
            _assert_rows(workers[0][1], 2, replica, step + 1)
        module, _, _ = use(1)
        _assert_same_lookups(module, replica, _INPUTS[0])
        for _, transport, _ in workers:
            pulls_and_pushes = [c for c in transport.calls if c[0] in ("table_pull", "table_push")]
            kinds = {f[1] for f in transport.direct.frames} if direct else set()
            if direct:  # every pull and push a frame, none a Ray call
                assert not pulls_and_pushes and kinds == {TABLE_PULL, TABLE_PUSH}
            else:
                assert pulls_and_pushes
    finally:
        for _, _, tables in workers:
            tables.close()


def test_table_pulls_and_pushes_pack_into_frames_and_back():
    ids = _ids(3, 4, 9)
    table, clock, got = unpack_pull(pack_pull(2, 7, ids))
    assert (table, clock) == (2, 7) and np.array_equal(got, ids)
    entries = [
        (0, 3, ids, np.arange(6, dtype=np.float32).reshape(3, 2), "sparse_adam", ADAM, True),
        (1, 3, _ids(), np.empty((0, 5), np.float32), "sgd", {"lr": 0.1, "maximize": 1.0}, False),
    ]
    back = unpack_push(pack_push(entries))
    for want, have in zip(entries, back, strict=True):
        assert want[:2] == have[:2] and want[4:] == have[4:]
        np.testing.assert_array_equal(want[2], have[2])
        np.testing.assert_array_equal(want[3], have[3])
    assert back[0][5]["eps"] == ADAM["eps"]  # floats exact through JSON
    raw = pack_push(entries)
    for bad in (raw[:-4], np.concatenate([raw, np.zeros(8, np.uint8)]), raw[:12]):
        with pytest.raises(ShardProtocolError, match="table push"):
            unpack_push(bad)
    with pytest.raises(ShardProtocolError, match="table pull"):
        unpack_pull(np.zeros(12, np.uint8))


def test_a_table_no_backward_reached_keeps_torchs_step_count(loop):
    """SparseAdam skips a parameter whose grad is None (zero_grad's default): its
    ``step`` does not advance, so the next bias correction is step 2, not 3. Every
    table still gets a push each step (sync keeps its clocks in step), marked
    untouched, and the shards count a step only when some worker touched it."""
    module, transport, tables = _build(loop, 2, seed=3)
    try:
        replica = _replica(tables)
        opt = torch.optim.SparseAdam([module.bag.weight, module.emb.weight], lr=0.01)
        ref_opt = torch.optim.SparseAdam([replica.bag.weight, replica.emb.weight], lr=0.01)
        ids, offsets, tokens = _INPUTS[0]
        for step, both in enumerate([True, False, True]):
            ref_opt.zero_grad()
            for m in (module, replica):
                out = m.bag(ids, offsets)
                if both:
                    out = out.sum() + (m.emb(tokens) * 2).sum()
                _loss((out,), step).backward()
            _step_both(tables, opt, ref_opt)
        assert ref_opt.state[replica.emb.weight]["step"] == 2
        got = _read(transport, 2, 1, 20)
        np.testing.assert_allclose(got["weight"], replica.emb.weight.detach().numpy(), atol=1e-5)
        assert got["steps"] == {2}
    finally:
        tables.close()


def test_zero_grad_between_a_backward_and_the_step_keeps_the_rows_as_documented(loop):
    """The documented limit (docs/sparse.md): a sharded table's row gradients are
    kept by the client from backward to the step, not in ``weight.grad``, so a
    ``zero_grad()`` in between does not discard them: the step applies both backward
    passes, as a replica that accumulated both would. (Should this change, the docs
    must change with it.)"""
    module, _, tables = _build(loop, 2, seed=3)
    try:
        replica = _replica(tables)
        opt = torch.optim.SGD([module.bag.weight, module.emb.weight], lr=0.5)
        ref_opt = torch.optim.SGD([replica.bag.weight, replica.emb.weight], lr=0.5)
        ref_opt.zero_grad()
        for k, inputs in enumerate(_INPUTS[:2]):
            opt.zero_grad()  # does not reach the rows kept for the sharded layers
            _loss(module(*inputs), k).backward()
            _loss(replica(*inputs), k).backward()  # accumulates, no zero_grad
        _step_both(tables, opt, ref_opt)
        _assert_same_lookups(module, replica, _INPUTS[0])
    finally:
        tables.close()


def test_a_step_refused_for_one_table_leaves_every_table_as_it_was(loop):
    """The second group's momentum is refused; once it is fixed, the next step of the
    first table must still be its update 1, with the gradients kept so far: every
    table's optimizer is checked before any table gives up its gradients."""
    module, _, tables = _build(loop, 2, seed=3)
    try:
        replica = _replica(tables)
        groups = [{"params": [module.bag.weight]}, {"params": [module.emb.weight], "momentum": 0.9}]
        opt = torch.optim.SGD(groups, lr=0.5)
        ref_opt = torch.optim.SGD([replica.bag.weight, replica.emb.weight], lr=0.5)
        _loss(module(*_INPUTS[0]), 0).backward()
        _loss(replica(*_INPUTS[0]), 0).backward()
        with pytest.raises(ValueError, match=r"momentum=0\.9"):
            tables.before_step(opt)
        opt.param_groups[1]["momentum"] = 0.0
        _step_both(tables, opt, ref_opt)
        _assert_same_lookups(module, replica, _INPUTS[0])
    finally:
        tables.close()


def test_a_shard_refusing_a_direct_path_pull_fails_it_naming_the_shard(loop):
    """A refusal that comes back as an error frame is a PSError naming the shard and
    carrying the shard's reason, as through a Ray call."""
    servers = [SumShard(s, 1, 5.0) for s in range(2)]
    _, _, tables = _build(loop, 2, seed=3, servers=servers, direct=True)
    try:
        lo, hi = row_bounds(20, 2)[1:]  # shard 1's rows, asked of shard 0
        handle = tables.call_pull(0, 0, 0, np.arange(lo, hi, dtype=np.int64))
        with pytest.raises(PSError, match=r"shard\(s\) \[0\].*it holds \[0, 10\)"):
            tables.wait([handle], [0], "pulling")
    finally:
        tables.close()


# --- replica tables (sparse_optimizer="shards") -----------------------------------------


def _replica_spec(rows=7, dim=2, padding_idx=3):
    return TableSpec(rows, dim, padding_idx, 0, 0, True, replica=True)


def test_a_replica_tables_rows_are_interleaved_and_a_push_answers_the_rows_it_changed():
    """Shard 1 of 2 holds rows 1, 3, 5; a sync clock's answer, the same to every
    worker, is the union of rows it changed with their new values (the padding row
    among them, unchanged)."""
    weight = np.arange(14, dtype=np.float32).reshape(7, 2)

    async def main():
        store = TableStore(1, 2, timeout_s=5.0)
        store.create(0, 0, _replica_spec(), 2)
        store.write(0, 0, 0, weight, {}, None, None)
        part = store.read(0, 0, 0, 7)
        assert (part["lo"], part["stride"]) == (1, 2)
        np.testing.assert_array_equal(part["weight"], weight[1::2])
        with pytest.raises(ShardProtocolError, match=r"it holds \[1, 7\) in steps of 2"):
            await store.push(0, 0, 0, 1, _ids(2), _grads(1, 2), "sgd", SGD_1)
        a = store.push_many(0, 0, [(0, 1, _ids(1, 3), _grads(2, 2, 1.0), "sgd", SGD_1, True)])
        b = store.push_many(0, 1, [(0, 1, _ids(5), _grads(1, 2, 2.0), "sgd", SGD_1, True)])
        (got_a,), (got_b,) = await asyncio.wait_for(asyncio.gather(a, b), 1)
        expected = weight.copy()
        expected[1] -= 1.0
        expected[5] -= 2.0  # row 3 is padding_idx: never stepped
        for steps, ids, rows in (got_a, got_b):
            assert steps == 1 and ids.tolist() == [1, 3, 5]
            np.testing.assert_array_equal(rows, expected[[1, 3, 5]])
        # Rows sent again (rank 0's copy changed outside the steps) keep the count.
        store.write(0, 0, 2, weight[2:6] + 100, {}, None, None)
        part = store.read(0, 0, 2, 7)
        assert part["steps"] == 1 and part["lo"] == 3
        np.testing.assert_array_equal(part["weight"], weight[[3, 5]] + 100)

    asyncio.run(main())
    with pytest.raises(ShardProtocolError, match="replica table outside sync"):
        TableStore(0, 1, 5.0).create(0, 0, TableSpec(4, 1, None, 0, None, False, True), 1)


def test_push_answers_pack_into_a_frame_and_back():
    answers = [
        (3, _ids(1, 4), np.arange(6, dtype=np.float32).reshape(2, 3)),
        (0, np.empty(0, np.int64), np.empty((0, 5), np.float32)),
    ]
    back = unpack_push_answer(pack_push_answer(answers))
    for (s1, i1, r1), (s2, i2, r2) in zip(answers, back, strict=True):
        assert s1 == s2 and i1.tolist() == i2.tolist()
        np.testing.assert_array_equal(r1, r2)
    assert unpack_push_answer(answers) == answers  # a Ray call's answer as it is
    with pytest.raises(ShardProtocolError, match="malformed"):
        unpack_push_answer(pack_push_answer(answers)[:-4])


def _replica_worker(loop, servers, rank, world, direct=False):
    transport = _TableTransport(loop, servers)
    if direct:
        transport.direct = FakeDirect(loop, servers)
    torch.manual_seed(0)  # every worker's copy starts as rank 0's (DDP broadcasts it)
    module = _Tables("cpu")
    settings = Settings(mode="sync", ps_timeout_s=5.0, sparse_optimizer="shards")
    tables = ShardedTables(
        0,
        module,
        transport,
        settings,
        rank,
        world,
        len(servers),
        0,
        COPIES,
    )
    return module, transport, tables


def _rows_on_shards(tables, index):
    return read_rows(tables, tables.tables[index], 0, 20)[0]


def _with_reference(workers, make_optimizer):
    """The reference module (every worker's initial copy: seed 0), its optimizer and
    one per worker, all made by ``make_optimizer(parameters)``."""
    torch.manual_seed(0)
    ref = _Tables("cpu")
    opts = [make_optimizer(w[0].parameters()) for w in workers]
    return ref, make_optimizer(ref.parameters()), opts


def _step_replicas(workers, opts, ref, ref_opt, k):
    """One step of every worker (the runtime's hooks around the user's step, called
    by hand) and of the reference on the workers' mean gradient."""
    ref_opt.zero_grad()
    for rank, (module, _, tables) in enumerate(workers):
        opts[rank].zero_grad()
        inputs = _INPUTS[(k + rank) % 3]
        _loss(module(*inputs), 10 * k + rank).backward()
        (_loss(ref(*inputs), 10 * k + rank) / len(workers)).backward()
        tables.before_step(opts[rank])
        assert module.bag.weight.grad is None and module.emb.weight.grad is None
        opts[rank].step()  # the weights have no gradient left: it skips them
    ref_opt.step()
    for _, _, tables in workers:
        tables.after_step()


def _close(workers):
    for _, _, tables in workers:
        tables.finish()
        tables.close()


@pytest.mark.parametrize("direct", [False, True], ids=["ray-calls", "direct-path"])
def test_two_workers_replicas_step_on_the_shards_as_ddp_averaging_their_gradients(
    loop, tmp_path, direct
):
    """The gradient leaves weight.grad (the user's optimizer skips the weight); the
    shards apply SGD once to the mean; after the step every worker's copy holds the
    reference's rows, as do the shards; a copy changed outside the steps is sent
    again; the tables save and restore onto three shards with the copies."""
    servers = (
        [SumShard(s, 2, 5.0) for s in range(2)]
        if direct
        else [ParamShard(s, 2, None, 5.0) for s in range(2)]
    )
    workers = [_replica_worker(loop, servers, r, 2, direct) for r in range(2)]
    ref, ref_opt, opts = _with_reference(workers, lambda ps: torch.optim.SGD(ps, lr=0.5))
    try:
        for step in range(3):
            _step_replicas(workers, opts, ref, ref_opt, step)
            for module, _, _ in workers:
                for got, want in zip(module.parameters(), ref.parameters(), strict=True):
                    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        np.testing.assert_allclose(
            _rows_on_shards(workers[0][2], 0), ref.bag.weight.detach().numpy(), atol=1e-6
        )
        if direct:  # the pushes went as frames, none as a Ray call
            assert not [c for c in workers[0][1].calls if c[0] == "table_push"]
        # load_state_dict after the start: rank 0's copy goes to the shards again.
        changed = {"weight": torch.full((20, 4), 2.0)}
        for rank, (module, _, tables) in enumerate(workers):
            module.emb.load_state_dict(changed)
            tables.before_step(opts[rank])  # no gradient: nothing stepped
        for _, _, tables in workers:
            tables.after_step()
        np.testing.assert_array_equal(_rows_on_shards(workers[0][2], 1), np.full((20, 4), 2.0))
        save_tables(workers[0][2], tmp_path)  # rank 0 writes
    finally:
        _close(workers)
    three = [ParamShard(s, 1, None, 5.0) for s in range(3)]
    module, _, tables = _replica_worker(loop, three, 0, 1)
    try:
        assert not torch.equal(module.bag.weight, ref.bag.weight)
        load_tables(tables, tmp_path)
        torch.testing.assert_close(module.bag.weight, ref.bag.weight, rtol=0, atol=1e-6)
        assert torch.equal(module.emb.weight, torch.full((20, 4), 2.0))
    finally:
        tables.close()


def test_the_optimizers_state_dict_holds_the_shards_state_and_resumes_on_new_shards(loop):
    """SparseAdam on the shards: rank 0's optimizer.state_dict() holds what torch's
    SparseAdam holds for the reference (read from the shards, step count included)
    while no worker's optimizer keeps any; a new run on three shards that loads the
    module's and the optimizer's state dicts, as a DDP loop resumes, steps on as the
    reference did."""
    servers = [ParamShard(s, 2, None, 5.0) for s in range(2)]
    workers = [_replica_worker(loop, servers, r, 2) for r in range(2)]
    ref, ref_opt, opts = _with_reference(workers, lambda ps: torch.optim.SparseAdam(ps, lr=0.05))
    try:
        for k in range(3):
            _step_replicas(workers, opts, ref, ref_opt, k)
        assert not opts[0].state and not opts[1].state
        buffer = io.BytesIO()  # a checkpoint, as rank 0 writes one
        torch.save({"model": workers[0][0].state_dict(), "opt": opts[0].state_dict()}, buffer)
    finally:
        _close(workers)
    saved = torch.load(io.BytesIO(buffer.getvalue()))
    want = ref_opt.state_dict()
    assert saved["opt"]["param_groups"] == want["param_groups"]
    assert sorted(saved["opt"]["state"]) == sorted(want["state"]) == [0, 1]
    for i, entry in want["state"].items():
        assert saved["opt"]["state"][i]["step"] == entry["step"] == 3
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                saved["opt"]["state"][i][name], entry[name], atol=1e-5, rtol=0
            )

    three = [ParamShard(s, 2, None, 5.0) for s in range(3)]
    workers = [_replica_worker(loop, three, r, 2) for r in range(2)]
    opts = [torch.optim.SparseAdam(w[0].parameters(), lr=0.05) for w in workers]
    try:
        for (module, _, _), opt in zip(workers, opts):
            module.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
        _step_replicas(workers, opts, ref, ref_opt, 3)
        assert not opts[1].state  # the loaded state went to the shards
        for module, _, _ in workers:
            for got, want_p in zip(module.parameters(), ref.parameters(), strict=True):
                torch.testing.assert_close(got, want_p, rtol=0, atol=1e-5)
        resumed = opts[0].state_dict()["state"]
        for i, entry in ref_opt.state_dict()["state"].items():
            assert resumed[i]["step"] == entry["step"] == 4
            torch.testing.assert_close(
                resumed[i]["exp_avg_sq"], entry["exp_avg_sq"], atol=1e-5, rtol=0
            )
    finally:
        _close(workers)


def test_an_adagrad_state_before_any_step_is_dropped_and_a_mismatched_one_refused(loop):
    """Adagrad makes its zeros at construction: they stay out of the way (the shards
    make their own). A state of another optimizer loaded into the table's is refused
    at the step, naming the fix."""
    servers = [ParamShard(s, 1, None, 5.0) for s in range(2)]
    module, _, tables = _replica_worker(loop, servers, 0, 1)
    try:
        opt = torch.optim.Adagrad(module.parameters(), lr=0.1)
        assert opt.state  # torch's own zeros
        _loss(module(*_INPUTS[0]), 0).backward()
        tables.before_step(opt)
        tables.after_step()
        assert not opt.state
        entry = opt.state_dict()["state"][0]
        assert float(entry["step"]) == 1 and entry["sum"].shape == (20, 4)
        opt.state[module.bag.weight] = {"step": 3, "exp_avg": torch.zeros(20, 4)}
        _loss(module(*_INPUTS[1]), 1).backward()
        with pytest.raises(ValueError, match=r"without \['sum'\].*same optimizer"):
            tables.before_step(opt)
    finally:
        tables.close()


@pytest.mark.parametrize(
    "layer, says",
    [
        (torch.nn.Embedding(4, 2, sparse=True, max_norm=1.0), "max_norm"),
        (torch.nn.EmbeddingBag(4, 2, sparse=True, dtype=torch.bfloat16), "float32"),
    ],
)
def test_replica_tables_the_shards_cannot_step_are_refused_naming_the_fix(layer, says):
    module = torch.nn.Sequential(layer)
    with pytest.raises(ValueError, match=f"{says}.*sparse_optimizer='workers'"):
        replica_table_names(module)


def test_replica_table_names_are_the_sparse_trainable_tables_only():
    module = torch.nn.ModuleDict(
        {
            "sparse": torch.nn.Embedding(4, 2, sparse=True),
            "dense": torch.nn.Embedding(4, 2),
            "frozen": torch.nn.Embedding(4, 2, sparse=True).requires_grad_(False),
            "meta": torch.nn.Embedding(4, 2, sparse=True, device="meta"),
        }
    )
    assert replica_table_names(module) == ["sparse.weight"]


def test_a_replica_weight_tied_to_a_dense_layer_is_refused_at_the_step(loop):
    """Tied to an output projection, the weight's gradient is dense: the shards step
    rows only, so the step refuses it, naming sparse_optimizer='workers'."""
    module, _, tables = _replica_worker(loop, [ParamShard(0, 1, None, 5.0)], 0, 1)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    try:
        out = module.emb(torch.tensor([1, 2]))
        (out.sum() + (out @ module.emb.weight.T).sum()).backward()
        assert not module.emb.weight.grad.is_sparse
        with pytest.raises(ValueError, match=r"'emb'.*dense.*sparse_optimizer='workers'"):
            tables.before_step(opt)
    finally:
        tables.close()


# --- looked-up tables (async and ssp: real layers whose rows the shards own) --------------


def test_async_looks_a_real_tables_rows_up_on_the_shards_and_checkpoints_them(loop):
    """Two async workers with real tables: the shards start with rank 0's rows (rank
    1's differ and are never used), forward looks rows up (the layers' outputs equal
    a reference holding rank 0's rows), a step moves rows on the shards only, and
    state_dict() reads them; rows loaded into the weight go to the shards at once."""
    servers = [ParamShard(s, 2, None, 5.0) for s in range(2)]
    settings = Settings(mode="async", ps_timeout_s=5.0)
    workers = []
    for rank in range(2):
        torch.manual_seed(rank)  # different copies: only rank 0's reach the shards
        module = _Tables("cpu")
        transport = _TableTransport(loop, servers)
        tables = ShardedTables(
            0,
            module,
            transport,
            settings,
            rank,
            2,
            2,
            0,
            LOOKUPS,
        )
        workers.append((module, torch.optim.SGD(module.parameters(), lr=0.5), tables))
    torch.manual_seed(0)
    ref = _Tables("cpu")
    try:
        for module, _, _ in workers:
            for got, want in zip(module(*_INPUTS[0]), ref(*_INPUTS[0])):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
        module, opt, tables = workers[1]
        before = module.bag.weight.detach().clone()
        opt.zero_grad()
        _loss(module(*_INPUTS[1]), 1).backward()
        assert module.bag.weight.grad is None  # the gradient went to the looked-up rows
        tables.before_step(opt)
        opt.step()
        tables.after_step()
        tables.flush()
        assert torch.equal(module.bag.weight, before)  # the copy is not kept current
        on_shards = _rows_on_shards(tables, 0)
        touched = sorted(set(_INPUTS[1][0].tolist()) - {5})  # 5: the padding row
        changed = np.flatnonzero(np.abs(on_shards - ref.bag.weight.detach().numpy()).max(1))
        assert changed.tolist() == touched
        # state_dict() holds the shards' rows, on any rank.
        np.testing.assert_array_equal(workers[0][0].state_dict()["bag.weight"], on_shards)
        # Rows loaded into the weight reach the shards before load_state_dict returns.
        loaded = {"weight": torch.full((20, 4), 3.0)}
        for module, _, _ in workers:
            module.emb.load_state_dict(loaded)
        np.testing.assert_array_equal(_rows_on_shards(tables, 1), np.full((20, 4), 3.0))
    finally:
        _close(workers)
