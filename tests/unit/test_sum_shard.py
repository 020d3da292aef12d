"""SumShard: sums, duplicates, timeouts and protocol errors, on a bare event loop."""

import asyncio

import numpy as np
import pytest

from ray_ps_plugin._errors import ShardProtocolError, ShardTimeoutError
from ray_ps_plugin._sync.shard import SumShard


def _run(coro):
    return asyncio.run(coro)


def test_every_worker_gets_the_sum_of_all_pushes():
    async def main():
        s = SumShard(shard_index=0, num_workers=3, timeout_s=5)
        chunks = [np.full(4, r + 1.0, dtype=np.float32) for r in range(3)]
        outs = await asyncio.gather(
            *(s.push_pull(0, 1, 0, r, chunks[r], "float32") for r in range(3))
        )
        return [o.copy() for o in outs], s.stats()

    outs, stats = _run(main())
    for o in outs:
        np.testing.assert_array_equal(o, np.full(4, 6.0, dtype=np.float32))
    assert stats["pushes"] == 3 and stats["bytes_in"] == 3 * 16


def test_duplicate_push_is_applied_once():
    async def main():
        s = SumShard(0, num_workers=2, timeout_s=5)
        a = np.ones(3, dtype=np.float32)
        t0 = asyncio.ensure_future(s.push_pull(0, 1, 8, 0, a, "float32"))
        t0_dup = asyncio.ensure_future(s.push_pull(0, 1, 8, 0, a, "float32"))
        await asyncio.sleep(0)
        out = await s.push_pull(0, 1, 8, 1, 2 * a, "float32")
        return out.copy(), (await t0).copy(), (await t0_dup).copy(), s.stats()

    out, first, dup, stats = _run(main())
    np.testing.assert_array_equal(out, np.full(3, 3.0))
    np.testing.assert_array_equal(first, out)
    np.testing.assert_array_equal(dup, out)
    assert stats["duplicates"] == 1 and stats["pushes"] == 2


def test_missing_worker_times_out_naming_shard_step_and_rank():
    async def main():
        s = SumShard(shard_index=3, num_workers=2, timeout_s=0.05)
        await s.push_pull(0, 7, 64, 0, np.zeros(2, dtype=np.float32), "float32")

    with pytest.raises(ShardTimeoutError, match=r"shard 3: model 0: step 7.*for worker 1;"):
        _run(main())


def test_steps_reuse_buffers_and_keep_results_apart():
    async def main():
        s = SumShard(0, num_workers=2, timeout_s=5)
        results = []
        for step in range(1, 5):
            a = np.full(2, float(step), dtype=np.float32)
            outs = await asyncio.gather(
                s.push_pull(0, step, 0, 0, a, "float32"), s.push_pull(0, step, 0, 1, a, "float32")
            )
            results.append(outs[0].copy())
        return results

    assert [r[0] for r in _run(main())] == [2.0, 4.0, 6.0, 8.0]


def test_out_of_step_pushes_are_protocol_errors():
    async def main():
        s = SumShard(0, num_workers=2, timeout_s=5)
        a = np.ones(2, dtype=np.float32)
        pending = asyncio.ensure_future(s.push_pull(0, 1, 0, 0, a, "float32"))
        await asyncio.sleep(0)
        with pytest.raises(ShardProtocolError, match="still waits"):
            await s.push_pull(0, 3, 0, 0, a, "float32")  # step 3 while step 1 is open (same parity)
        with pytest.raises(ShardProtocolError, match="models differ"):
            await s.push_pull(0, 1, 0, 1, np.ones(5, dtype=np.float32), "float32")
        await s.push_pull(0, 1, 0, 1, a, "float32")
        await pending

    _run(main())


def test_models_have_their_own_slots():
    async def main():
        s = SumShard(0, num_workers=2, timeout_s=5)
        one, two = np.ones(3, np.float32), np.full(3, 2.0, np.float32)
        outs = await asyncio.gather(
            s.push_pull(0, 1, 0, 0, one, "float32"),
            s.push_pull(1, 1, 0, 0, two, "float32"),
            s.push_pull(0, 1, 0, 1, one, "float32"),
            s.push_pull(1, 1, 0, 1, two, "float32"),
        )
        return [o.copy() for o in outs]

    outs = _run(main())
    np.testing.assert_array_equal(outs[0], np.full(3, 2.0, np.float32))
    np.testing.assert_array_equal(outs[1], np.full(3, 4.0, np.float32))


@pytest.mark.parametrize("dtype", ["float64", "float16"])
def test_compressed_pushes_sum_in_the_models_dtype(dtype):
    """Wire in bf16; a worker sharing memory pushes the model's dtype into the same slot."""
    from ray_ps_plugin._codec import Codec
    from ray_ps_plugin._shm import Segment

    async def main():
        s = SumShard(0, num_workers=2, timeout_s=5, compression="bf16")
        itemsize = np.dtype(dtype).itemsize
        inputs = Segment.create(4 * itemsize)
        outs = [Segment.open(h) for h in s.attach(0, 0, inputs.handle, 0, 4 * itemsize)]
        inputs.view(0, dtype, 4)[:] = 1.5
        wire = Codec("bf16").encode(
            __import__("torch").full((4,), 2.5, dtype=getattr(__import__("torch"), dtype))
        )
        local = asyncio.ensure_future(s.push_local(0, 1, 0, dtype, [(0, 4, None)]))
        remote = await s.push_pull(0, 1, 0, 1, wire, dtype)
        await local
        return outs[1].view(0, dtype, 4).copy(), Codec("bf16").decode(remote).numpy()

    shared, wired = _run(main())
    np.testing.assert_array_equal(shared, np.full(4, 4.0, dtype))
    np.testing.assert_array_equal(wired, np.full(4, 4.0, np.float32))


@pytest.mark.parametrize("compression", [None, "bf16"])
def test_a_bfloat16_model_sums_in_fp32_and_answers_bfloat16_on_both_paths(compression):
    """A bf16 chunk: one worker through shared memory, one on the wire; both read the
    same bf16 sum, rounded once from an fp32 sum (a bf16 sum would lose the 1/256)."""
    import torch

    from ray_ps_plugin._codec import Codec, as_torch, to_numpy
    from ray_ps_plugin._shm import Segment

    n = 6
    a = torch.tensor([1.0, 2.0, -3.0, 256.0, 1e-3, 1e38]).to(torch.bfloat16)
    b = torch.tensor([1.0, 0.5, 3.0, 1.0, 1e-3, 1e38]).to(torch.bfloat16)
    expect = (a.float() + b.float()).to(torch.bfloat16)  # 256 + 1 rounds to 256

    async def main():
        s = SumShard(0, num_workers=2, timeout_s=5, compression=compression)
        inputs = Segment.create(2 * n)
        outs = [Segment.open(h) for h in s.attach(0, 0, inputs.handle, 0, 2 * n)]
        results = []
        for step in (1, 2):
            as_torch(inputs.view(0, np.int16, n)).copy_(a * step)
            wire = Codec(compression).encode(b * step)
            local = asyncio.ensure_future(s.push_local(0, step, 0, "bfloat16", [(0, n, None)]))
            remote = await s.push_pull(0, step, 0, 1, wire, "bfloat16")
            assert await local is None
            shared = outs[step % 2].view(0, np.int16, n).copy()
            results.append((shared, np.asarray(remote).copy()))
        return results, s.stats()

    results, stats = _run(main())
    for step, (shared, remote) in zip((1, 2), results):
        want = to_numpy((a.float() * step + b.float() * step).to(torch.bfloat16))
        assert remote.dtype == np.int16
        np.testing.assert_array_equal(shared, want)
        np.testing.assert_array_equal(remote, want)
    np.testing.assert_array_equal(results[0][0], to_numpy(expect))
    assert stats["bytes_in"] == 4 * 2 * n  # 16-bit in both directions


def test_a_bfloat16_chunk_begun_before_a_worker_attached_is_answered_in_its_segment():
    import torch

    from ray_ps_plugin._codec import as_torch, to_numpy
    from ray_ps_plugin._shm import Segment

    async def main():
        s = SumShard(0, num_workers=2, timeout_s=5)
        first = asyncio.ensure_future(
            s.push_pull(0, 1, 0, 1, to_numpy(torch.ones(4, dtype=torch.bfloat16)), "bfloat16")
        )
        await asyncio.sleep(0)
        inputs = Segment.create(8)
        outs = [Segment.open(h) for h in s.attach(0, 0, inputs.handle, 0, 8)]
        as_torch(inputs.view(0, np.int16, 4)).fill_(2.0)
        await s.push_local(0, 1, 0, "bfloat16", [(0, 4, None)])
        return as_torch(outs[1].view(0, np.int16, 4)).float().tolist(), (await first).copy()

    shared, remote = _run(main())
    assert shared == [3.0] * 4
    np.testing.assert_array_equal(remote, to_numpy(torch.full((4,), 3.0, dtype=torch.bfloat16)))


def test_bad_dtype_and_rank_are_refused():
    async def main(dtype, rank):
        s = SumShard(0, num_workers=2, timeout_s=5)
        await s.push_local(0, 1, rank, dtype, [(0, 4, None)])

    with pytest.raises(ShardProtocolError, match="dtype 'int64'"):
        _run(main("int64", 0))
    with pytest.raises(ShardProtocolError, match=r"rank -1 is not an int"):
        _run(main("float32", -1))
