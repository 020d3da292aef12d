"""PSClient's DDP hook against fake shards: chunks, sums, stats, timeouts."""

import dataclasses
import time

import pytest
import torch

from ray_ps_plugin._errors import PSError, PSTimeoutError
from ray_ps_plugin._sync.client import SumClient
from ray_ps_plugin._sync.shard import SumShard
from ray_ps_plugin._sync.topology import Topology
from ray_ps_plugin._wire.frames import LOCAL, PUSH
from tests.unit.fakes import FakeBucket, FakeDirect, FakeTransport, Settings, in_threads, setup_for


def _module(numel):
    """A model whose gradient stream is ``numel`` float32 elements."""
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.zeros(numel))
    return m


def _clients(
    loop,
    world_size,
    num_servers,
    total_bytes,
    chunk_bytes,
    timeout_s=5.0,
    local=lambda r, s: False,
    compression=None,
    transport_cls=FakeTransport,
):
    """Clients of fake shards; ``local(rank, shard)`` says which pairs share memory."""
    servers = [SumShard(i, world_size, timeout_s, compression) for i in range(num_servers)]
    transport = transport_cls(loop, servers)
    settings = Settings(chunk_bytes=chunk_bytes, ps_timeout_s=timeout_s, compression=compression)
    clients = [
        SumClient.build(
            setup_for(
                _module(total_bytes // 4),
                r,
                world_size,
                num_servers,
                settings,
                local=[s for s in range(num_servers) if local(r, s)],
            ),
            transport,
        )
        for r in range(world_size)
    ]
    return clients, transport


def _seeded_grads(world, numels, seed_stride):
    """Each rank's buckets of ``numels`` elements: bucket ``i`` of rank ``r`` is drawn
    with seed ``r * seed_stride + i``."""
    return {
        r: [
            torch.randn(n, generator=torch.Generator().manual_seed(r * seed_stride + i))
            for i, n in enumerate(numels)
        ]
        for r in range(world)
    }


def _assert_one_step_gives_the_mean(clients, grads):
    """Every worker, in its own thread, hooks its buckets (``grads[rank]``, one tensor
    per bucket) through its client; each must get back the mean over workers."""
    world = len(clients)
    results: dict[int, list[torch.Tensor]] = {}

    def worker(rank):
        bufs = [g.clone() for g in grads[rank]]
        futs = [clients[rank].hook(None, FakeBucket(i, b)) for i, b in enumerate(bufs)]
        results[rank] = [f.wait() for f in futs]

    in_threads(worker, world)
    for i in range(len(grads[0])):
        expected = sum(grads[r][i] for r in range(world)) / world
        for r in range(world):
            torch.testing.assert_close(results[r][i], expected)


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
    grads = _seeded_grads(world, numels, seed_stride=10)
    _assert_one_step_gives_the_mean(clients, grads)

    stats = clients[0].snapshot()
    assert stats.steps == 1 and stats.bytes_pushed == total and stats.bytes_pulled == total
    assert abs(stats.bytes_pushed_per_shard[0] - stats.bytes_pushed_per_shard[1]) <= 2048
    # Every chunk within chunk_bytes: (key, numel, owner) of each chunk of a local
    # push, the chunk's element count for a push_pull (its array's size).
    sizes = [
        n
        for c in transport.pushes()
        for n in ([numel for _, numel, _ in c[-1]] if c[0] == "push_local" else [c[-2]])
    ]
    assert sizes and all(n * 4 <= 2048 for n in sizes)
    for c in clients:
        c.close()


@pytest.mark.parametrize("compression", [None, "bf16"])
@pytest.mark.parametrize(
    "local",
    [
        pytest.param(lambda r, s: False, id="object-store"),
        pytest.param(lambda r, s: True, id="shared-memory"),
        pytest.param(lambda r, s: r == s, id="mixed"),
    ],
)
def test_bf16_and_fp32_buckets_of_one_model_come_back_as_their_mean(loop, local, compression):
    """DDP buckets parameters by dtype: a bf16 bucket and a fp32 bucket of one model
    share the gradient stream (bf16 trunk, fp32 head). The bf16 mean is the fp32 mean
    rounded once to bf16, on every path."""
    world, shards = 2, 2
    m = torch.nn.Module()
    m.trunk = torch.nn.Parameter(torch.zeros(1500, dtype=torch.bfloat16))
    m.head = torch.nn.Parameter(torch.zeros(700))
    settings = Settings(chunk_bytes=1024, ps_timeout_s=5.0, compression=compression)
    servers = [SumShard(i, world, 5.0, compression) for i in range(shards)]
    transport = FakeTransport(loop, servers)
    clients = [
        SumClient.build(
            setup_for(
                m, r, world, shards, settings, local=[s for s in range(shards) if local(r, s)]
            ),
            transport,
        )
        for r in range(world)
    ]
    grads = {
        r: [
            torch.randn(1500, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16),
            torch.randn(700, generator=torch.Generator().manual_seed(10 + r)),
        ]
        for r in range(world)
    }
    results: dict[int, list[torch.Tensor]] = {}

    def worker(rank):
        bufs = [g.clone() for g in grads[rank]]
        futs = [clients[rank].hook(None, FakeBucket(i, b)) for i, b in enumerate(bufs)]
        results[rank] = [f.wait().clone() for f in futs]

    in_threads(worker, world)
    bf16_mean = ((grads[0][0].float() / 2) + (grads[1][0].float() / 2)).to(torch.bfloat16)
    fp32_mean = grads[0][1] / 2 + grads[1][1] / 2
    for r in range(world):
        assert results[r][0].dtype == torch.bfloat16
        assert torch.equal(results[r][0], bf16_mean)
        if compression is None:
            torch.testing.assert_close(results[r][1], fp32_mean)
        else:
            torch.testing.assert_close(results[r][1], fp32_mean, rtol=1 / 64, atol=1e-2)
        assert torch.equal(results[r][0], results[0][0]) and torch.equal(
            results[r][1], results[0][1]
        )
    stats = clients[0].snapshot()
    if local(0, 0) == local(0, 1):  # bf16 is 2 bytes on every path; fp32 shrinks on the wire
        wide = 4 if compression is None or local(0, 0) else 2
        assert stats.bytes_pushed == 1500 * 2 + 700 * wide
    for c in clients:
        c.close()


def test_a_bucket_reaches_each_shard_of_its_node_in_one_call(loop):
    """Small chunks (as on the direct path between nodes) must not cost one Ray call
    each where they go through shared memory: one push_local per (bucket, shard)
    names all of the bucket's chunks for that shard."""
    world, numels = 2, [3000, 500]
    clients, transport = _clients(
        loop,
        world,
        num_servers=2,
        total_bytes=sum(numels) * 4,
        chunk_bytes=1024,
        local=lambda r, s: True,
    )
    grads = [[torch.full((n,), float(r + 1)) for n in numels] for r in range(world)]

    def worker(rank):
        futs = [
            clients[rank].hook(None, FakeBucket(i, g.clone())) for i, g in enumerate(grads[rank])
        ]
        return [f.wait() for f in futs]

    in_threads(worker, world)
    calls = [c for c in transport.pushes() if c[0] == "push_local"]
    # (method, shard, model, step, rank, dtype, chunks); bucket 0 spans both shards.
    per_rank_shard = {(c[4], c[1]) for c in calls}
    assert len(calls) <= world * len(numels) * 2 and len(per_rank_shard) == world * 2
    assert max(len(c[-1]) for c in calls) >= 5  # bucket 0: 12000 bytes in 1 KiB chunks
    chunks = sum(len(c[-1]) for c in calls)
    assert clients[0].snapshot().pushes < chunks / world
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
    # rank 0 shares memory with both shards, rank 1 with none or both
    clients, _ = _clients(
        loop,
        world,
        num_servers=2,
        total_bytes=total,
        chunk_bytes=1024,
        compression=compression,
        local=lambda r, s: not (r == 1 and remote_rank1),
    )
    gen = torch.Generator().manual_seed(0)
    grads = [
        [[torch.randn(n, generator=gen) for n in numels] for _ in range(world)]
        for _ in range(steps)
    ]
    results: dict[int, list[list[torch.Tensor]]] = {r: [] for r in range(world)}

    def worker(rank):
        for step in range(steps):
            if rank == 1:
                time.sleep(0.002 * (step % 3))  # uneven pace
            bufs = [g.clone() for g in grads[step][rank]]
            futs = [clients[rank].hook(None, FakeBucket(i, b)) for i, b in enumerate(bufs)]
            results[rank].append([f.wait().clone() for f in futs])

    in_threads(worker, world)
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
    assert [c[3] for c in transport.pushes()] == [1, 2, 3]  # (method, shard, model, step, ...)
    c.close()


def test_a_silent_peer_fails_the_step_with_the_real_error_not_a_hang(loop):
    """The future completes (DDP never waits forever); the PSTimeoutError itself is
    kept and raised, message intact, before the optimizer can step on the sum."""
    clients, _ = _clients(loop, 2, num_servers=2, total_bytes=80, chunk_bytes=1024, timeout_s=0.2)
    fut = clients[0].hook(None, FakeBucket(0, torch.ones(20)))
    fut.wait()
    with pytest.raises(
        PSTimeoutError,
        match=r"step 1: server shard\(s\) \[0, 1\] did not answer within ps_timeout_s=0.2s",
    ):
        clients[0].before_step()
    with pytest.raises(PSTimeoutError):  # and again: the run is broken
        clients[0].before_forward()
    for c in clients:
        c.close()


def test_the_error_is_raised_by_backward_itself(loop):
    """Inside a real backward pass, the round's PSTimeoutError comes out of
    ``backward()`` with its type and message, not as torch's RuntimeError."""
    (c0, c1), _ = _clients(loop, 2, num_servers=2, total_bytes=80, chunk_bytes=1024, timeout_s=0.2)

    class PushInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            c0.hook(None, FakeBucket(0, grad.detach().clone()))  # rank 1 never pushes
            return grad

    x = torch.ones(20, requires_grad=True)
    with pytest.raises(PSTimeoutError, match=r"rank 0: model 0: step 1: server shard"):
        PushInBackward.apply(x).sum().backward()
    c0.close()
    c1.close()


def test_a_stopped_shard_is_named_as_the_one_not_answering(loop):
    clients, transport = _clients(
        loop, 2, num_servers=2, total_bytes=80, chunk_bytes=1024, timeout_s=0.2
    )
    transport.silent_shards = {1}
    clients[0].hook(None, FakeBucket(0, torch.ones(20))).wait()
    with pytest.raises(
        PSTimeoutError, match=r"server shard\(s\) \[1\] did not answer.*stopped answering pings"
    ):
        clients[0].before_step()
    for c in clients:
        c.close()


def test_a_bad_reply_is_raised_and_the_thread_survives(loop):
    """A reply of the wrong size must surface as a PSError, and later buckets still work."""
    import numpy as np

    class BadOnce(FakeTransport):
        waits = 0

        def wait(self, handles, timeout_s):
            BadOnce.waits += 1
            out = super().wait(handles, timeout_s)
            return [np.zeros(3, np.float32)] if BadOnce.waits == 1 else out

    (c,), _ = _clients(loop, 1, 1, 40, 1024, transport_cls=BadOnce)
    c.hook(None, FakeBucket(0, torch.ones(10))).wait()
    with pytest.raises(PSError, match=r"rank 0: model 0: step 1: server shard\(s\) \[0\] failed"):
        c.raise_pending()
    # The comm thread lives on: the next bucket is summed.
    c._error = None
    torch.testing.assert_close(c.hook(None, FakeBucket(0, torch.ones(10))).wait(), torch.ones(10))
    c.close()


def test_an_empty_bucket_completes_at_once(loop):
    (c,), transport = _clients(loop, 1, 1, 40, 1024)
    fut = c.hook(None, FakeBucket(0, torch.ones(0)))
    assert fut.done() and fut.wait().numel() == 0 and transport.pushes() == []
    c.close()


def test_two_models_with_equal_shapes_never_mix_their_sums(loop):
    """Each prepared model has its own keys on the shards."""
    servers = [SumShard(0, 2, 5.0)]
    transport = FakeTransport(loop, servers)
    settings = Settings(chunk_bytes=1024)
    clients = {
        (r, m): SumClient.build(setup_for(_module(10), r, 2, 1, settings, model_id=m), transport)
        for r in range(2)
        for m in range(2)
    }
    futs = {
        (r, m): clients[r, m].hook(None, FakeBucket(0, torch.full((10,), float(10 * m + r + 1))))
        for r in range(2)
        for m in range(2)
    }
    for m in range(2):
        expected = torch.full((10,), (10 * m + 1 + 10 * m + 2) / 2)
        for r in range(2):
            torch.testing.assert_close(futs[r, m].wait(), expected)
    for c in clients.values():
        c.close()


def test_a_failing_metrics_export_neither_kills_the_thread_nor_the_step(loop):
    """Metrics are exported after the bucket's future is completed; an export that
    raises must not leave DDP waiting for the next bucket."""

    class Broken:
        def due(self):
            return True

        def export(self, stats):
            raise RuntimeError("metrics backend down")

    (c,), _ = _clients(loop, 1, 1, 40, 1024)
    c._metrics = Broken()
    for _ in range(2):  # the second bucket proves the thread survived the first export
        torch.testing.assert_close(
            c.hook(None, FakeBucket(0, torch.ones(10))).wait(), torch.ones(10)
        )
    c.raise_pending()  # nothing kept: a metrics failure is not a training failure
    c.close()


def test_a_kept_error_raised_again_does_not_grow_its_traceback(loop):
    """Every call after a failed round raises the same error; each raise starts from
    the original traceback instead of piling the earlier raises' frames on it."""
    (c0, c1), _ = _clients(loop, 2, num_servers=1, total_bytes=80, chunk_bytes=1024)
    try:
        raise PSTimeoutError("rank 0: model 0: step 1: a failed round")
    except PSTimeoutError as e:
        c0.fail(e)
    depths = []
    for _ in range(3):
        with pytest.raises(PSTimeoutError, match="a failed round") as info:
            c0.raise_pending()
        depths.append(len(info.traceback))
    assert depths[0] == depths[1] == depths[2]
    c0.close()
    c1.close()


def direct_clients(loop, worker_nodes, shard_nodes, numel, compression=None):
    """Clients of shards on 'nodes' joined by the direct path (the real shards'
    frame handler, no sockets), each node's shards in shared memory with its workers;
    ``(clients, transport, topology)``."""
    world = len(worker_nodes)
    topo = Topology(
        worker_nodes=worker_nodes,
        shard_nodes=shard_nodes,
        addresses=tuple(("fake", s) for s in range(len(shard_nodes))),
        token=bytes(32),
    )
    servers = [SumShard(i, world, 5.0, compression) for i in range(len(shard_nodes))]
    transport = FakeTransport(loop, servers)
    transport.direct = FakeDirect(loop, servers)
    for s in servers:
        s._relay_streams = None  # configured below; relays forward on the fake path
        loop.run(s.configure(topo)).result(5)
        if s._relayed:
            s._relay_streams = transport.direct
    settings = Settings(chunk_bytes=2048, compression=compression)
    clients = []
    for r, node in enumerate(worker_nodes):
        mine = [s for s, n in enumerate(shard_nodes) if n == node]
        setup = setup_for(
            _module(numel),
            r,
            world,
            len(shard_nodes),
            settings,
            local=mine,
            remote={s for s in range(len(shard_nodes)) if s not in mine},
        )
        clients.append(SumClient.build(dataclasses.replace(setup, topology=topo), transport))
    return clients, transport, topo


@pytest.mark.parametrize(
    ("worker_nodes", "shard_nodes"),
    [((0, 1), (0, 1)), ((0, 0, 1, 1), (0, 1))],
    ids=["2x1", "2x2-relays"],
)
def test_the_direct_path_carries_chunks_and_notices_and_sums_stay_right(
    loop, worker_nodes, shard_nodes
):
    """Across 'nodes' on the direct path (the real shards' frame handler, no
    sockets): other nodes' chunks go as frames, this node's as shared-memory notices
    on the same path; with two workers per node the node's shard relays their
    partial sum. Every worker gets the mean of all workers' buckets."""
    world, numels = len(worker_nodes), [3000, 700]
    clients, transport, topo = direct_clients(loop, worker_nodes, shard_nodes, sum(numels))
    grads = _seeded_grads(world, numels, seed_stride=7)
    _assert_one_step_gives_the_mean(clients, grads)
    kinds = {kind for _, kind, _ in transport.direct.frames}
    assert kinds == {PUSH, LOCAL}, kinds  # data frames and notices both took the path
    assert not transport.pushes(), "no chunk went through a Ray call"
    if topo.has_relays:
        # Only the relays' partial sums crossed nodes: sources beyond the ranks.
        crossing = {src for shard, kind, src in transport.direct.frames if kind == PUSH}
        assert crossing and all(src >= world for src in crossing), crossing
    for c in clients:
        c.close()
