"""ShardServer: sums, duplicates, timeouts and protocol errors, on a bare event loop."""

import asyncio

import numpy as np
import pytest

from ray_ps_plugin._server import ShardProtocolError, ShardServer, ShardTimeoutError


def _run(coro):
    return asyncio.run(coro)


def test_every_worker_gets_the_sum_of_all_pushes():
    async def main():
        s = ShardServer(shard_index=0, num_workers=3, timeout_s=5)
        chunks = [np.full(4, r + 1.0, dtype=np.float32) for r in range(3)]
        outs = await asyncio.gather(*(s.push_pull(1, 0, r, chunks[r]) for r in range(3)))
        return [o.copy() for o in outs], s.stats()

    outs, stats = _run(main())
    for o in outs:
        np.testing.assert_array_equal(o, np.full(4, 6.0, dtype=np.float32))
    assert stats["pushes"] == 3 and stats["bytes_in"] == 3 * 16


def test_duplicate_push_is_applied_once():
    async def main():
        s = ShardServer(0, num_workers=2, timeout_s=5)
        a = np.ones(3, dtype=np.float32)
        t0 = asyncio.ensure_future(s.push_pull(1, 8, 0, a))
        t0_dup = asyncio.ensure_future(s.push_pull(1, 8, 0, a))
        await asyncio.sleep(0)
        out = await s.push_pull(1, 8, 1, 2 * a)
        return out.copy(), (await t0).copy(), (await t0_dup).copy(), s.stats()

    out, first, dup, stats = _run(main())
    np.testing.assert_array_equal(out, np.full(3, 3.0))
    np.testing.assert_array_equal(first, out)
    np.testing.assert_array_equal(dup, out)
    assert stats["duplicates"] == 1 and stats["pushes"] == 2


def test_missing_worker_times_out_naming_shard_step_and_rank():
    async def main():
        s = ShardServer(shard_index=3, num_workers=2, timeout_s=0.05)
        await s.push_pull(7, 64, 0, np.zeros(2, dtype=np.float32))

    with pytest.raises(ShardTimeoutError, match=r"shard 3: step 7.*workers \[1\]"):
        _run(main())


def test_steps_reuse_buffers_and_keep_results_apart():
    async def main():
        s = ShardServer(0, num_workers=2, timeout_s=5)
        results = []
        for step in range(1, 5):
            a = np.full(2, float(step), dtype=np.float32)
            outs = await asyncio.gather(s.push_pull(step, 0, 0, a), s.push_pull(step, 0, 1, a))
            results.append(outs[0].copy())
        return results

    assert [r[0] for r in _run(main())] == [2.0, 4.0, 6.0, 8.0]


def test_out_of_step_pushes_are_protocol_errors():
    async def main():
        s = ShardServer(0, num_workers=2, timeout_s=5)
        a = np.ones(2, dtype=np.float32)
        pending = asyncio.ensure_future(s.push_pull(1, 0, 0, a))
        await asyncio.sleep(0)
        with pytest.raises(ShardProtocolError, match="still waits"):
            await s.push_pull(3, 0, 0, a)  # step 3 while step 1 is open (same parity)
        with pytest.raises(ShardProtocolError, match="models differ"):
            await s.push_pull(1, 0, 1, np.ones(5, dtype=np.float32))
        await s.push_pull(1, 0, 1, a)
        await pending

    _run(main())
