"""PSClient's DDP hook against fake shards: chunks, sums, stats, timeouts."""

import threading
import time

import pytest
import torch

from ray_ps_plugin._codec import Codec
from ray_ps_plugin._layout import StreamLayout
from ray_ps_plugin._server import ShardServer
from ray_ps_plugin._worker import PSClient, PSTimeoutError, open_lanes

from tests.unit.fakes import FakeBucket, FakeTransport, LoopThread


@pytest.fixture
def loop():
    lt = LoopThread()
    yield lt
    lt.stop()


def _clients(
    loop, world_size, num_servers, total_bytes, chunk_bytes, timeout_s=5.0, local=lambda r, s: False
):
    """Clients of fake shards; ``local(rank, shard)`` says which pairs share memory."""
    servers = [ShardServer(i, world_size, timeout_s) for i in range(num_servers)]
    transport = FakeTransport(loop, servers)
    layout = StreamLayout(total_bytes, num_servers, chunk_bytes)
    clients = [
        PSClient(
            transport,
            layout,
            r,
            world_size,
            timeout_s,
            lanes=open_lanes(
                transport, [s for s in range(num_servers) if local(r, s)], layout, r
            ),
        )
        for r in range(world_size)
    ]
    return clients, transport


@pytest.mark.parametrize(
    "local",
    [
        pytest.param(lambda r, s: False, id="object-store"),
        pytest.param(lambda r, s: True, id="shared-memory"),
        # Rank r shares memory with shard r only, as with one shard per worker on
        # nodes of one worker each; the others reach it through the object store.
        pytest.param(lambda r, s: r == s, id="mixed"),
    ],
)
def test_buckets_come_back_as_the_mean_over_workers(loop, local):
    world, numels = 3, [1000, 4000, 333]
    total = sum(numels) * 4
    clients, transport = _clients(
        loop, world, num_servers=2, total_bytes=total, chunk_bytes=2048, local=local
    )
    grads = {
        r: [torch.randn(n, generator=torch.Generator().manual_seed(r * 10 + i)) for i, n in enumerate(numels)]
        for r in range(world)
    }
    results: dict[int, list[torch.Tensor]] = {}

    def worker(rank):
        bufs = [g.clone() for g in grads[rank]]
        futs = [clients[rank].hook(None, FakeBucket(i, b)) for i, b in enumerate(bufs)]
        results[rank] = [f.wait() for f in futs]

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for i in range(len(numels)):
        expected = sum(grads[r][i] for r in range(world)) / world
        for r in range(world):
            torch.testing.assert_close(results[r][i], expected)

    stats = clients[0].snapshot()
    assert stats.steps == 1 and stats.bytes_pushed == total and stats.bytes_pulled == total
    assert abs(stats.bytes_pushed_per_shard[0] - stats.bytes_pushed_per_shard[1]) <= 2048
    assert all(size * 4 <= 2048 for *_, size in transport.submitted)
    for c in clients:
        c.close()


@pytest.mark.parametrize("compression", [None, "bf16"])
@pytest.mark.parametrize("remote_rank1", [True, False], ids=["mixed", "all-local"])
def test_shared_memory_sums_stay_right_while_workers_race_ahead(loop, compression, remote_rank1):
    """Many steps without a barrier: a fast worker's next step must never clobber a
    sum a slow worker is still reading (the shard's two output buffers by parity),
    and local and object-store workers must receive bit-identical sums."""
    world, steps, numels = 2, 6, [700, 2500]
    total = sum(numels) * 4
    servers = [ShardServer(i, world, 5.0, compression) for i in range(2)]
    transport = FakeTransport(loop, servers)
    layout = StreamLayout(total, 2, 1024)
    codec = Codec(compression)
    clients = [  # rank 0 shares memory with both shards, rank 1 with none or both
        PSClient(
            transport,
            layout,
            r,
            world,
            5.0,
            codec=codec,
            lanes=open_lanes(transport, [] if r == 1 and remote_rank1 else [0, 1], layout, r),
        )
        for r in range(world)
    ]
    gen = torch.Generator().manual_seed(0)
    grads = [[[torch.randn(n, generator=gen) for n in numels] for _ in range(world)] for _ in range(steps)]
    results: dict[int, list[list[torch.Tensor]]] = {r: [] for r in range(world)}

    def worker(rank):
        for step in range(steps):
            if rank == 1:
                time.sleep(0.002 * (step % 3))  # uneven pace
            bufs = [g.clone() for g in grads[step][rank]]
            futs = [clients[rank].hook(None, FakeBucket(i, b)) for i, b in enumerate(bufs)]
            results[rank].append([f.wait().clone() for f in futs])

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for step in range(steps):
        for i in range(len(numels)):
            assert torch.equal(results[0][step][i], results[1][step][i])
            expected = sum(grads[step][r][i] for r in range(world)) / world
            # 16-bit rounding happens only when a worker gets the sum by wire.
            tol = 1e-2 if compression and remote_rank1 else 1e-6
            torch.testing.assert_close(results[0][step][i], expected, atol=tol, rtol=tol)
    for c in clients:
        c.close()


def test_bucket_index_zero_opens_a_new_step(loop):
    clients, transport = _clients(loop, 1, num_servers=1, total_bytes=40, chunk_bytes=1024)
    (c,) = clients
    for _ in range(3):
        c.hook(None, FakeBucket(0, torch.ones(10))).wait()
    assert c.snapshot().steps == 3
    assert [step for _, step, *_ in transport.submitted] == [1, 2, 3]
    c.close()


def test_a_silent_peer_fails_backward_with_shard_and_step(loop):
    clients, _ = _clients(loop, 2, num_servers=2, total_bytes=80, chunk_bytes=1024, timeout_s=0.2)
    fut = clients[0].hook(None, FakeBucket(0, torch.ones(20)))
    with pytest.raises(Exception, match=r"step 1: server shard\(s\) \[0, 1\].*ps_timeout_s") as info:
        fut.wait()
    assert "PSTimeoutError" in repr(info.value) or isinstance(info.value, PSTimeoutError)
    for c in clients:
        c.close()


def test_a_bad_reply_fails_the_future_instead_of_killing_the_thread(loop):
    """A reply of the wrong size must surface in backward, and later buckets still work."""
    import numpy as np

    class BadOnce(FakeTransport):
        calls = 0

        def wait(self, handles, timeout_s):
            BadOnce.calls += 1
            out = super().wait(handles, timeout_s)
            return [np.zeros(3, np.float32)] if BadOnce.calls == 1 else out

    servers = [ShardServer(0, 1, 5.0)]
    c = PSClient(BadOnce(loop, servers), StreamLayout(40, 1, 1024), 0, 1, 5.0)
    with pytest.raises(Exception, match=r"rank 0: step 1: server shard\(s\) \[0\] failed"):
        c.hook(None, FakeBucket(0, torch.ones(10))).wait()
    torch.testing.assert_close(c.hook(None, FakeBucket(0, torch.ones(10))).wait(), torch.ones(10))
    c.close()
