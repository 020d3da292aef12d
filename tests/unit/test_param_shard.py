"""ParamShard: ownership, clocks, duplicates and the staleness bound."""

import asyncio

import numpy as np
import pytest

from ray_ps_plugin._errors import ShardProtocolError, ShardTimeoutError
from ray_ps_plugin._param.shard import ParamShard
from ray_ps_plugin._shm import Segment
from tests.unit.fakes import LoggedParamShard


def _run(coro):
    return asyncio.run(coro)


def _arr(*values):
    return np.array(values, dtype=np.float32)


def test_updates_are_averaged_into_the_owned_parameters():
    async def main():
        s = ParamShard(0, num_workers=2, staleness=None, timeout_s=5)
        assert await s.init(0, _arr(1, 1, 1))
        assert not await s.init(0, _arr(9, 9, 9))  # only the first init counts
        await s.push_pull(0, 0, 1, _arr(2, 0, 0))
        params, clocks, slowest = await s.push_pull(0, 1, 1, _arr(0, 4, 0))
        return params, clocks, slowest

    params, clocks, slowest = _run(main())
    np.testing.assert_array_equal(params, _arr(2, 3, 1))  # 1 + delta / 2
    assert clocks == (1, 1) and slowest == 1


def test_a_duplicated_push_is_applied_once():
    async def main():
        s = ParamShard(0, num_workers=2, staleness=None, timeout_s=5)
        await s.init(0, _arr(0, 0))
        await s.push_pull(0, 0, 1, _arr(2, 2))
        params, clocks, _ = await s.push_pull(0, 0, 1, _arr(2, 2))  # redelivered
        return params, clocks, s.stats()

    params, clocks, stats = _run(main())
    np.testing.assert_array_equal(params, _arr(1, 1))
    assert clocks == (1, 0)
    assert stats["pushes"] == 1 and stats["duplicates"] == 1


def test_a_missing_update_is_an_error_not_a_silent_gap():
    async def main():
        s = ParamShard(3, num_workers=1, staleness=None, timeout_s=5)
        await s.init(0, _arr(0))
        await s.push_pull(0, 0, 1, _arr(1))
        await s.push_pull(0, 0, 3, _arr(1))

    with pytest.raises(
        ShardProtocolError, match=r"shard 3: model 0: rank 0 .* clock 3 .* 2\.\.2 are missing"
    ):
        _run(main())


def test_a_slice_of_another_shape_names_the_model_mismatch():
    async def main():
        s = ParamShard(0, num_workers=2, staleness=None, timeout_s=5)
        await s.init(0, _arr(0, 0))
        await s.push_pull(0, 1, 1, _arr(1, 1, 1))

    with pytest.raises(ShardProtocolError, match="models differ"):
        _run(main())


def test_pushes_wait_for_the_initial_parameters_with_a_bound():
    async def main():
        s = ParamShard(0, num_workers=2, staleness=None, timeout_s=0.2)
        await s.push_pull(0, 1, 1, _arr(1))

    with pytest.raises(ShardTimeoutError, match="rank 0's initial parameters"):
        _run(main())


def test_ssp_holds_a_reader_until_the_slowest_is_within_the_bound():
    async def main():
        s = LoggedParamShard(0, num_workers=2, staleness=1, timeout_s=5)
        await s.init(0, _arr(0))
        await s.push_pull(0, 0, 1, _arr(2))  # clock 1, slowest 0: gap 1 <= 1, answered
        fast = asyncio.ensure_future(s.push_pull(0, 0, 2, _arr(2)))  # gap 2 > 1: waits
        await asyncio.sleep(0.05)
        waited = not fast.done()
        await s.push_pull(0, 1, 1, _arr(2))  # slowest reaches 1
        params, clocks, slowest = await asyncio.wait_for(fast, 1)
        return waited, params, clocks, slowest, s.reads

    waited, params, clocks, slowest, reads = _run(main())
    assert waited
    assert clocks == (2, 1) and slowest == 1
    np.testing.assert_array_equal(params, _arr(3))
    assert len(reads) == 3 and all(clock - included <= 1 for _, clock, included in reads)


async def _rank0_waiting_for_rank1():
    """A bulk-synchronous shard of two workers where rank 0 has pushed clock 1 (a
    delta of 2); returns the shard and rank 0's reply, left waiting for rank 1."""
    s = ParamShard(0, num_workers=2, staleness=0, timeout_s=5)
    await s.init(0, _arr(0))
    waiting = asyncio.ensure_future(s.push_pull(0, 0, 1, _arr(2)))
    await asyncio.sleep(0.05)  # time for the push to reach the shard and wait there
    return s, waiting


def test_ssp_zero_is_bulk_synchronous():
    async def main():
        s, a = await _rank0_waiting_for_rank1()
        assert not a.done()
        b = await s.push_pull(0, 1, 1, _arr(4))
        return (await a)[0], b[0]

    a, b = _run(main())
    np.testing.assert_array_equal(a, _arr(3))
    np.testing.assert_array_equal(a, b)  # both see both updates


def test_ssp_zero_answers_a_held_reader_before_any_later_update_lands():
    # Rank 1 completes clock 1, which lets rank 0's held read through, and its push
    # of clock 2 is already queued behind it: rank 0 must get exactly clock 1's
    # parameters. (Woken a few loop turns later, it once read clock 2's update.)
    async def main():
        s = ParamShard(0, num_workers=2, staleness=0, timeout_s=5)
        await s.init(0, _arr(0, 0))
        held = asyncio.ensure_future(s.push_pull(0, 0, 1, _arr(2, 0)))
        await asyncio.sleep(0.01)
        assert not held.done()
        first = asyncio.ensure_future(s.push_pull(0, 1, 1, _arr(0, 2)))
        later = asyncio.ensure_future(s.push_pull(0, 1, 2, _arr(0, 100)))
        await asyncio.gather(first, asyncio.sleep(0.01))
        reply = await held
        later.cancel()  # it waits for rank 0's clock 2, which never comes
        return reply, first.result()

    (params, clocks, slowest), (ranks1, _, _) = _run(main())
    np.testing.assert_array_equal(params, _arr(1, 1))
    np.testing.assert_array_equal(ranks1, _arr(1, 1))
    assert clocks == (1, 1) and slowest == 1


def test_ssp_timeout_names_the_slow_worker_and_its_clock():
    async def main():
        s = ParamShard(1, num_workers=3, staleness=0, timeout_s=0.2)
        await s.init(0, _arr(0))
        await asyncio.gather(s.push_pull(0, 2, 1, _arr(1)), s.push_pull(0, 0, 1, _arr(1)))

    with pytest.raises(
        ShardTimeoutError,
        match=r"shard 1: model 0: rank \d at clock 1 .* workers \[1\] \(clocks \{1: 0\}\)",
    ):
        _run(main())


def test_a_finished_worker_no_longer_holds_the_others_back():
    async def main():
        s, waiting = await _rank0_waiting_for_rank1()
        await s.finish(0, 1)
        return await asyncio.wait_for(waiting, 1)

    params, clocks, slowest = _run(main())
    np.testing.assert_array_equal(params, _arr(1))
    assert clocks == (1, 0) and slowest == 1


def test_a_reply_is_a_snapshot_later_updates_do_not_change():
    async def main():
        s = ParamShard(0, num_workers=1, staleness=None, timeout_s=5)
        await s.init(0, _arr(0))
        first, _, _ = await s.push_pull(0, 0, 1, _arr(1))
        await s.push_pull(0, 0, 2, _arr(1))
        return first

    np.testing.assert_array_equal(_run(main()), _arr(1))


def test_shared_memory_push_answers_in_the_slot_the_worker_names():
    async def main():
        s = ParamShard(0, num_workers=1, staleness=None, timeout_s=5)
        await s.init(0, _arr(1, 1, 1))
        inputs = Segment.create(12)
        out0, out1 = (Segment.open(h) for h in s.attach(0, 0, inputs.handle, 0, 12))
        inputs.view(0, np.float32, 3)[:] = _arr(1, 2, 3)
        reply = await s.push_local(0, 0, 1, slot=1)
        first = out1.view(0, np.float32, 3).copy()
        inputs.view(0, np.float32, 3)[:] = _arr(1, 1, 1)
        await s.push_local(0, 0, 2, slot=0)  # the reply of clock 1 stays untouched
        await s.pull_local(0, 0, 2, slot=1)
        return reply, first, out0.view(0, np.float32, 3), out1.view(0, np.float32, 3)

    (arr, clocks, slowest), first, out0, out1 = _run(main())
    assert arr is None and clocks == (1,) and slowest == 1  # the data went to memory
    np.testing.assert_array_equal(first, _arr(2, 3, 4))
    np.testing.assert_array_equal(out0, _arr(3, 4, 5))
    np.testing.assert_array_equal(out1, _arr(3, 4, 5))


def test_a_shared_memory_slice_of_another_size_names_the_model_mismatch():
    async def main():
        s = ParamShard(0, num_workers=1, staleness=None, timeout_s=5)
        await s.init(0, _arr(1, 1, 1))
        inputs = Segment.create(8)
        s.attach(0, 0, inputs.handle, 0, 8)
        await s.push_local(0, 0, 1, slot=1)

    with pytest.raises(ShardProtocolError, match="models differ"):
        _run(main())


def test_models_have_their_own_parameters_and_clocks():
    async def main():
        s = ParamShard(0, num_workers=1, staleness=None, timeout_s=5)
        await s.init(0, _arr(1, 1))
        await s.init(1, _arr(5, 5))
        a = await s.push_pull(0, 0, 1, _arr(1, 1))
        b = await s.push_pull(1, 0, 1, _arr(2, 2))  # clock 1 of model 1: not a duplicate
        return a, b

    a, b = _run(main())
    np.testing.assert_array_equal(a.params, _arr(2, 2))
    np.testing.assert_array_equal(b.params, _arr(7, 7))


@pytest.mark.parametrize(("model", "rank"), [(0, -1), (0, 2), (-1, 0), (0, True), (0, "0")])
def test_ranks_and_models_from_callers_are_validated(model, rank):
    async def main():
        s = ParamShard(0, num_workers=2, staleness=None, timeout_s=5)
        await s.init(0, _arr(0))
        await s.push_pull(model, rank, 1, _arr(1))

    with pytest.raises(ShardProtocolError, match=r"(model|rank) .* is not an int in \[0, "):
        _run(main())


def test_fp16_models_keep_fp32_master_parameters():
    """A step smaller than fp16's resolution at 1.0 still adds up on the shard."""

    async def main():
        s = ParamShard(0, num_workers=1, staleness=None, timeout_s=5)
        await s.init(0, np.ones(2, np.float16))
        for clock in range(1, 9):
            reply = await s.push_pull(0, 0, clock, np.full(2, 1e-4, np.float16))
        return reply

    reply = _run(main())
    assert reply.params.dtype == np.float16
    # 8 x 1e-4 on fp32 masters = 1.0008 -> fp16 1.0010 (fp16 steps would stay at 1.0)
    assert reply.params[0] > 1.0


def test_bfloat16_models_keep_fp32_masters_on_the_wire_and_in_shared_memory():
    """bf16 travels as int16 patterns both ways; steps below bf16's resolution at 1.0
    (1/128) still add up on the fp32 master; shared memory holds bf16 patterns."""
    import torch

    from ray_ps_plugin._codec import as_torch, to_numpy

    def bf16(*values):
        return to_numpy(torch.tensor(values, dtype=torch.bfloat16))

    async def main():
        s = ParamShard(0, num_workers=2, staleness=None, timeout_s=5)
        await s.init(0, bf16(1.0, 1.0))
        inputs = Segment.create(4)
        outs = [Segment.open(h) for h in s.attach(0, 1, inputs.handle, 0, 4)]
        for clock in range(1, 9):
            reply = await s.push_pull(0, 0, clock, bf16(2e-3, 0.0))
            as_torch(inputs.view(0, np.int16, 2)).copy_(torch.tensor([0.0, 2e-3]))
            await s.push_local(0, 1, clock, slot=clock % 2)
        return reply, as_torch(outs[0].view(0, np.int16, 2)).clone()

    reply, shared = _run(main())
    assert reply.params.dtype == np.int16 and reply.params.nbytes == 4
    got = as_torch(reply.params).float()
    # 8 x 2e-3 / 2 on fp32 masters = 1.008 -> bf16 1.0078 (bf16 steps would stay at 1.0)
    assert got.tolist() == [1.0078125] * 2  # 1.008 and 1.007 (rank 1 has pushed 7 so far)
    assert shared.dtype == torch.bfloat16 and shared.float().tolist() == [1.0078125] * 2


def test_a_reseed_replaces_parameters_once_per_generation():
    async def main():
        s = ParamShard(0, num_workers=2, staleness=None, timeout_s=5)
        await s.init(0, _arr(0, 0))
        waiter = asyncio.ensure_future(s.wait_generation(0, 1, 1))
        await asyncio.sleep(0.02)
        blocked = not waiter.done()
        await s.reseed(0, 1, _arr(3, 3))
        await asyncio.wait_for(waiter, 1)
        await s.reseed(0, 1, _arr(9, 9))  # a repeat of generation 1: ignored
        return blocked, await s.pull(0, 0, 0)

    blocked, reply = _run(main())
    assert blocked
    np.testing.assert_array_equal(reply.params, _arr(3, 3))


def test_a_reseed_of_another_models_slice_is_refused():
    async def main():
        s = ParamShard(0, num_workers=1, staleness=None, timeout_s=5)
        await s.init(0, _arr(0, 0))
        with pytest.raises(ShardProtocolError, match=r"float32\[3\] for a slice of float32\[2\]"):
            await s.reseed(0, 1, _arr(1, 2, 3))
        with pytest.raises(ShardProtocolError, match=r"float64\[2\]"):
            await s.reseed(0, 1, np.zeros(2))
        return await s.pull(0, 0, 0)

    np.testing.assert_array_equal(_run(main()).params, _arr(0, 0))
