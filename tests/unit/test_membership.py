"""Workers lost, replaced and restarted: what the shards keep and whom they wait for.

A lost worker's rank leaves (no one waits for it); its replacement is admitted and
goes on from the clock the lost one stopped at; where the clock gap is bounded (ssp)
it holds no one back until it is within the bound again; in diloco's synchronous
rounds its rounds apply as they arrive and no round waits for it. A whole group's
restart exports every shard's state and imports it into the next group's shards.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from ray_ps_plugin._param.diloco_shard import DilocoShard
from ray_ps_plugin._param.shard import ParamShard
from ray_ps_plugin._shard import rejoin_clock, resized
from ray_ps_plugin._tables.spec import TableSpec
from tests.unit.test_tables import SGD_1, _grads, _ids


def _run(coro):
    return asyncio.run(coro)


async def _pushes(shard, rank, clocks, value=1.0, model=0):
    for clock in clocks:
        await shard.push_pull(model, rank, clock, np.full(4, value, np.float32))


def test_an_async_replacement_goes_on_from_the_lost_workers_clock():
    async def main():
        shard = ParamShard(0, 2, None, 5.0)
        await shard.init(0, np.zeros(4, np.float32))
        await _pushes(shard, 0, range(1, 11))
        await _pushes(shard, 1, range(1, 4))  # rank 1 dies after its third update
        await shard.leave(1)
        await _pushes(shard, 0, range(11, 15))
        await shard.admit(1)
        reply = await shard.pull(0, 1, 0)
        assert reply.clocks[1] == 3  # the replacement's next update is its fourth
        await _pushes(shard, 1, [4])
        params = (await shard.pull(0, 0, 0)).params
        # Every applied update once: 14 of rank 0 and 4 of rank 1, each 1/2.
        np.testing.assert_allclose(params, np.full(4, 9.0), rtol=0)
        with pytest.raises(Exception, match="missing"):
            await _pushes(shard, 1, [6])  # a clock skipped is still refused

    _run(main())


def test_an_ssp_replacement_holds_no_one_back_until_it_is_within_the_bound():
    async def main():
        shard = ParamShard(0, 2, 1, 0.2)
        await shard.init(0, np.zeros(4, np.float32))
        await _pushes(shard, 0, [1])
        await _pushes(shard, 1, [1])
        await _pushes(shard, 0, [2])
        await shard.leave(1)
        await _pushes(shard, 0, range(3, 9))  # nothing waits for the lost rank
        await shard.admit(1)
        await _pushes(shard, 0, [9])  # nor for its replacement, six steps behind
        await asyncio.wait_for(shard.pull(0, 0, 9), 1)
        reply = await asyncio.wait_for(shard.pull(0, 1, 1), 1)  # nor it for anyone
        assert reply.clocks[1] == 1
        await _pushes(shard, 1, range(2, 9))  # within the bound of rank 0's 9 again
        with pytest.raises(Exception, match="staleness bound"):
            await _pushes(shard, 0, [10])  # now rank 0 at 10 waits for rank 1 at 8

    _run(main())


def test_a_diloco_replacement_joins_the_round_being_collected():
    async def main():
        shard = DilocoShard(0, 2, 0, 0.5, None, "average", 1.0, 0.9)
        await shard.init(0, np.zeros(4, np.float32))
        both = [shard.push_pull(0, r, 1, np.full(4, 2.0, np.float32)) for r in (0, 1)]
        await asyncio.gather(*both)  # round 1: the mean of two changes of 2
        await shard.leave(1)
        await _pushes(shard, 0, [2, 3], value=2.0)  # rounds 2, 3 close over rank 0
        await shard.admit(1)
        reply = await shard.pull(0, 1, 0)
        assert reply.clocks[1] == 3  # it goes on with round 4, as rank 0 does
        both = [shard.push_pull(0, r, 4, np.full(4, r * 4.0, np.float32)) for r in (0, 1)]
        replies = await asyncio.wait_for(asyncio.gather(*both), 1)
        np.testing.assert_allclose(replies[1].params, np.full(4, 8.0), rtol=0)

    _run(main())


def test_a_restart_exports_and_imports_parameters_clocks_and_tables():
    spec = TableSpec(6, 2, None, 3, 1, False)

    async def main():
        old = ParamShard(0, 2, 1, 5.0)
        await old.init(0, np.arange(4, dtype=np.float32))
        await _pushes(old, 0, [1])
        await _pushes(old, 1, [1])
        await _pushes(old, 0, [2])
        old.table_create(0, 0, spec, 1, rank=0)
        await old.table_push(0, 0, [(0, 1, _ids(2), _grads(1, 2), "sgd", SGD_1, True)])
        exported = old.export_state()
        new = ParamShard(0, 3, 1, 5.0)  # an elastic restart onto three workers
        new.import_state(exported)
        reply = await new.pull(0, 2, 0)
        np.testing.assert_array_equal(reply.params, (await old.pull(0, 0, 0)).params)
        # The ranks that remain keep their clocks; the new one joins the slowest.
        assert reply.clocks == (2, 1, 1)
        assert new.table_create(0, 0, spec, 1, rank=0)[3] == 1
        np.testing.assert_array_equal(
            new.table_read(0, 0, 0, 6)["weight"], old.table_read(0, 0, 0, 6)["weight"]
        )

    _run(main())


def test_rejoin_and_resize_rules():
    assert rejoin_clock([5, 2, 9], {2}, 1, bounded=True) == 5  # the slowest still training
    assert rejoin_clock([5, 2, 9], set(), 1, bounded=False) == 2  # its own
    assert resized([4, 6], 3, set(), bounded=True) == [4, 6, 4]
    assert resized([4, 6, 1], 2, set(), bounded=True) == [4, 6]
    assert resized([4, 6], 3, set(), bounded=False) == [4, 6, 0]


def test_a_tables_replacement_goes_on_from_its_clock_and_ssp_pulls_do_not_wait_for_it():
    spec = TableSpec(4, 1, None, 1, 1, False)

    async def main():
        shard = ParamShard(0, 2, 1, 0.2)
        shard.table_create(0, 0, spec, 1, rank=0)
        step = [(0, 0, _ids(0), _grads(1, 1), "sgd", SGD_1, True)]

        async def push(rank, clock):
            entry = [(0, clock, *step[0][2:])]
            await shard.table_push(0, rank, entry)

        for clock in (1, 2, 3):
            await push(0, clock)
        await push(1, 1)
        await shard.leave(1)
        await push(0, 4)
        await shard.admit(1)
        assert shard.table_create(0, 0, spec, 1, rank=1)[3] == 1
        # Rank 0 at clock 5 reads without waiting for the replacement at 1.
        await asyncio.wait_for(shard.table_pull(0, 0, 0, 5, _ids(0)), 1)
        await push(1, 2)

    _run(main())


def test_leave_and_admit_refuse_a_rank_outside_the_run():
    shard = ParamShard(0, 2, None, 5.0)
    with pytest.raises(Exception, match="rank"):
        _run(shard.admit(2))
    with pytest.raises(Exception, match="rank"):
        _run(shard.leave(-1))


def test_diloco_exports_its_outer_state():
    async def main():
        old = DilocoShard(0, 1, 0, 5.0, None, "nesterov", 0.7, 0.9)
        await old.init(0, np.zeros(4, np.float32))
        await _pushes(old, 0, [1, 2], value=1.0)
        new = DilocoShard(0, 1, 0, 5.0, None, "nesterov", 0.7, 0.9)
        new.import_state(old.export_state())
        a = await old.push_pull(0, 0, 3, np.ones(4, np.float32))
        b = await new.push_pull(0, 0, 3, np.ones(4, np.float32))
        torch.testing.assert_close(torch.from_numpy(a.params), torch.from_numpy(b.params))
        assert (await new.outer_state(0))[1] == 3

    _run(main())


def test_diloco_sync_rounds_export_the_last_round_applied():
    """Rank 0 sent round 2, rank 1 died before sending it: the export drops that
    half-collected round and sets rank 0's clock back, so the next group's workers,
    which all start their loop at the same step, send round 2 together."""

    async def main():
        old = DilocoShard(0, 2, 0, 0.5, None, "average", 1.0, 0.9)
        await old.init(0, np.zeros(4, np.float32))
        both = [old.push_pull(0, r, 1, np.full(4, 2.0, np.float32)) for r in (0, 1)]
        await asyncio.gather(*both)
        pending = asyncio.ensure_future(old.push_pull(0, 0, 2, np.full(4, 8.0, np.float32)))
        await asyncio.sleep(0.01)
        exported = old.export_state()
        pending.cancel()
        assert exported["models"][0]["clocks"] == [1, 1]
        new = DilocoShard(0, 2, 0, 0.5, None, "average", 1.0, 0.9)
        new.import_state(exported)
        both = [new.push_pull(0, r, 2, np.full(4, 4.0, np.float32)) for r in (0, 1)]
        replies = await asyncio.wait_for(asyncio.gather(*both), 1)
        np.testing.assert_allclose(replies[0].params, np.full(4, 6.0), rtol=0)

    _run(main())
