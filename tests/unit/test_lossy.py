"""The lossy encodings (onebit, top-k, low-rank, integer levels), their error
feedback, and sync mode's buckets through them: what each sends, and that nothing
given is ever lost."""

import math

import numpy as np
import pytest
import torch

from ray_ps_plugin import PSConfig
from ray_ps_plugin._codec import Codec
from ray_ps_plugin._ddp import check_supported
from ray_ps_plugin._feedback import ErrorFeedback
from ray_ps_plugin._lossy import BLOCK, IntLevels, LowRank, OneBit, TopK
from tests.unit.fakes import FakeBucket, in_threads
from tests.unit.test_client import _clients, direct_clients


def _values(n, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


@pytest.mark.parametrize("n", [1, 7, BLOCK, BLOCK + 1, 3 * BLOCK + 17])
def test_onebit_sends_each_sign_and_each_blocks_mean_magnitude(n):
    v = _values(n)
    encoded = OneBit().encode(v)
    assert encoded.dtype == np.uint8 and encoded.size == OneBit().nbytes(n)
    assert encoded.size == 8 + 4 * math.ceil(n / BLOCK) + math.ceil(n / 8)
    decoded = OneBit().decode(encoded)
    assert np.array_equal(np.sign(decoded), np.where(v < 0, -1.0, 1.0))
    for lo in range(0, n, BLOCK):
        block = slice(lo, min(n, lo + BLOCK))
        np.testing.assert_allclose(np.abs(decoded[block]), np.abs(v[block]).mean(), rtol=1e-6)


def test_onebit_is_25_times_smaller_than_fp32():
    n = 1 << 18  # a 1 MiB chunk of fp32
    assert 4 * n / OneBit().nbytes(n) == pytest.approx(25.6, abs=0.1)


@pytest.mark.parametrize("ratio", [0.01, 0.1, 1.0])
def test_topk_sends_the_largest_magnitudes_with_their_indices(ratio):
    n = 5000
    v = _values(n, seed=1)
    codec = TopK(ratio)
    k = math.ceil(ratio * n)
    encoded = codec.encode(v)
    assert encoded.size == codec.nbytes(n) == 8 + 8 * k
    decoded = codec.decode(encoded)
    kept = np.flatnonzero(decoded)
    assert kept.size == k
    assert np.array_equal(decoded[kept], v[kept])
    # No value left out is larger than one sent.
    assert np.abs(np.delete(v, kept)).max(initial=0) <= np.abs(v[kept]).min()


@pytest.mark.parametrize(("bits", "top"), [(8, 127), (4, 7)])
@pytest.mark.parametrize("n", [1, 7, BLOCK, 3 * BLOCK + 17])
def test_integer_levels_round_each_value_to_its_blocks_nearest_level(bits, top, n):
    v = _values(n, seed=n)
    v[: min(n, 3)] = 0.0  # zeros stay zeros
    codec = IntLevels(bits)
    encoded = codec.encode(v)
    assert encoded.size == codec.nbytes(n) == 8 + 4 * math.ceil(n / BLOCK) + math.ceil(n * bits / 8)
    decoded = codec.decode(encoded)
    for lo in range(0, n, BLOCK):
        block = slice(lo, min(n, lo + BLOCK))
        step = np.abs(v[block]).max() / top
        assert np.abs(decoded[block] - v[block]).max() <= step / 2 * (1 + 1e-5) + 1e-12
    assert not decoded[: min(n, 3)].any()
    assert 4 * 4096 / IntLevels(4).nbytes(4096) == pytest.approx(7.50, abs=0.01)


@pytest.mark.parametrize("n", [1, 7, 100, 4096, 5000])
def test_lowrank_sends_two_factors_and_decodes_a_low_rank_chunk_exactly(n):
    """A chunk whose matrix has rank <= r decodes to itself; the bytes are the two
    factors' floats; P's columns are orthonormal."""
    encoding = LowRank(3)
    rows, cols, r = encoding.shape(n)
    assert rows * cols >= n > (rows - 1) * cols and r == min(3, rows, cols)
    gen = np.random.default_rng(n)
    m = np.zeros(rows * cols, np.float32)
    m[:] = (gen.standard_normal((rows, r)) @ gen.standard_normal((r, cols))).reshape(-1)
    m[n:] = 0.0  # what padding adds is zero, so the chunk's own rank counts
    values = m[:n].copy()
    encoded = encoding.encode(values, key="c")
    assert encoded.nbytes == encoding.nbytes(n) == 8 + 4 * r * (rows + cols)
    p = encoded[8 : 8 + 4 * rows * r].view(np.float32).reshape(rows, r)
    np.testing.assert_allclose(p.T @ p, np.eye(r), atol=1e-5)
    if np.linalg.matrix_rank(m.reshape(rows, cols)) <= r:
        np.testing.assert_allclose(
            encoding.decode(encoded), values, atol=1e-4 * np.abs(values).max()
        )


def test_lowrank_warm_start_tracks_a_slowly_changing_chunk():
    """Reusing the chunk's previous factor is a power iteration: on a chunk of
    rank 8 sent at rank 2, the error shrinks toward the best rank-2 error."""
    gen = np.random.default_rng(0)
    u, _ = np.linalg.qr(gen.standard_normal((64, 8)))
    v, _ = np.linalg.qr(gen.standard_normal((64, 8)))
    m = (u * np.geomspace(10, 0.1, 8)) @ v.T
    values = m.astype(np.float32).reshape(-1)
    best = np.linalg.norm(np.geomspace(10, 0.1, 8)[2:])  # Eckart-Young
    encoding = LowRank(2)
    first = np.linalg.norm(encoding.decode(encoding.encode(values, key="k")) - values)
    for _ in range(10):
        last = np.linalg.norm(encoding.decode(encoding.encode(values, key="k")) - values)
    assert last < 1.01 * best < first
    encoding.clear()
    again = np.linalg.norm(encoding.decode(encoding.encode(values, key="k")) - values)
    assert again == pytest.approx(first)


def test_lowrank_is_64_times_smaller_than_fp32_at_rank_4_on_a_1_mib_chunk():
    assert LowRank(4).nbytes(262144) == 8 + 4 * 4 * (512 + 512)
    assert 4 * 262144 / LowRank(4).nbytes(262144) > 63.9


def test_a_chunk_of_another_encoding_is_refused_by_name():
    with pytest.raises(ValueError, match=r"disagree on PSConfig\.compression"):
        TopK(0.1).decode(OneBit().encode(_values(100)))
    with pytest.raises(ValueError, match="onebit: expected an encoded uint8"):
        OneBit().decode(_values(100))
    with pytest.raises(ValueError, match=r"topk ratio must be in \(0, 1\]"):
        TopK(0.0)


@pytest.mark.parametrize(
    "encoding",
    [OneBit(), TopK(0.01), LowRank(4), IntLevels(4)],
    ids=["onebit", "topk", "lowrank", "int4"],
)
def test_error_feedback_loses_nothing_but_the_error_it_holds(encoding):
    """After N steps the sum of what was decoded differs from the sum of what was
    given by exactly the error still held: at most one step's loss."""
    feedback = ErrorFeedback(encoding)
    given = np.zeros(3000, np.float64)
    decoded = np.zeros(3000, np.float64)
    for step in range(200):
        v = _values(3000, seed=step)
        given += v
        decoded += feedback.encode("chunk", v)[1]
    error = feedback.error("chunk")
    assert error is not None
    np.testing.assert_allclose(decoded + error, given, atol=1e-3)
    if not isinstance(encoding, (TopK, LowRank)):
        # Sign and levels send something of every value each step: the error stays
        # far below the sum given (which grows as sqrt(steps)).
        assert np.abs(error).max() < 0.2 * np.abs(given).max()


def test_codec_encodes_dense_chunks_lossily_and_everything_else_as_fp32():
    codec = Codec("onebit")
    v = torch.from_numpy(_values(4096))
    encoded = codec.encode_chunk(("m", 0), v)
    assert encoded.dtype == np.uint8 and encoded.nbytes == OneBit().nbytes(4096)
    assert codec.decode(encoded).shape == (4096,)
    assert codec.decode_np(encoded).dtype == np.float32
    # Sparse rows carry no key: fp32, unchanged.
    assert codec.encode(v).dtype == np.float32
    rows = v.numpy()
    assert np.array_equal(codec.encode_np(rows), rows) and codec.as_sent_np(rows) is rows
    # A codec crosses processes without its errors.
    again = pickle_roundtrip(Codec("topk", 0.05))
    assert again.topk_ratio == 0.05 and again.lossy and again.feedback.error("x") is None


def pickle_roundtrip(obj):
    import pickle

    return pickle.loads(pickle.dumps(obj))


def _run_steps(clients, world, steps, numels):
    """Every worker hooks its buckets of every step; rank -> step -> its summed
    stream, and the exact mean of every step's streams, summed over steps."""
    gen = torch.Generator().manual_seed(0)
    grads = [
        [[torch.randn(n, generator=gen) for n in numels] for _ in range(world)]
        for _ in range(steps)
    ]
    results: dict[int, list[torch.Tensor]] = {r: [] for r in range(world)}

    def worker(rank):
        for step in range(steps):
            bufs = [g.clone() for g in grads[step][rank]]
            futs = [clients[rank].hook(None, FakeBucket(i, b)) for i, b in enumerate(bufs)]
            results[rank].append(torch.cat([f.wait().clone() for f in futs]))

    in_threads(worker, world)
    means = sum(torch.cat(grads[s][r]) for s in range(steps) for r in range(world)) / world
    return results, means


def _errors_held(clients, means, later=None):
    """The errors every worker and shard holds, laid out as the stream (keys:
    model, stream offset, whether after the first step: ``later`` picks one kind)."""
    held = torch.zeros_like(means)
    codecs = [c._stream._codec for c in clients] + [s._codec for s in _servers(clients)]
    for codec in codecs:
        for (_model, key, after), error in codec.feedback._errors.items():
            if later is None or after == later:
                held[key // 4 : key // 4 + error.size] += torch.from_numpy(error)
    return held


def _steps_lose_only_the_errors_held(clients, steps, numels):
    """Runs ``steps`` steps: every worker gets the same sums, and their total is the
    total of the exact means less the errors held at the end and the first step's
    (held apart, and dropped when the second begins: DDP lays its buckets out anew
    after the first step)."""
    world = len(clients)
    first, first_means = _run_steps(clients, world, 1, numels)
    dropped = _errors_held(clients, first_means)
    rest, rest_means = _run_steps(clients, world, steps - 1, numels)
    results = {r: first[r] + rest[r] for r in range(world)}
    for step in range(steps):
        for r in range(1, world):
            assert torch.equal(results[0][step], results[r][step])
    codecs = [c._stream._codec for c in clients] + [s._codec for s in _servers(clients)]
    assert all(later for c in codecs for (_m, _k, later) in c.feedback._errors)
    received, means = sum(results[0]), first_means + rest_means
    assert not torch.allclose(received, means, atol=1e-3)  # it did compress
    held = _errors_held(clients, means)
    torch.testing.assert_close(received + held + dropped, means, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("compression", ["onebit", "topk", "lowrank"])
@pytest.mark.parametrize(
    "local",
    [
        pytest.param(lambda r, s: False, id="by-message"),
        # Rank r shares memory with shard r only, as on two nodes of one worker.
        pytest.param(lambda r, s: r == s, id="mixed"),
    ],
)
def test_sync_buckets_through_a_lossy_encoding_lose_only_the_errors_held(loop, compression, local):
    """Over many steps every worker gets the same sums, and their total equals the
    total of the exact means less the errors the workers and shards hold at the end."""
    world, steps, numels = 2, 30, [700, 2500]
    clients, _ = _clients(
        loop,
        world,
        num_servers=2,
        total_bytes=sum(numels) * 4,
        chunk_bytes=1024,
        compression=compression,
        local=local,
    )
    _steps_lose_only_the_errors_held(clients, steps, numels)
    # What the worker counts is what the encoding's arithmetic says.
    stats = clients[1].snapshot()
    encoding = clients[1]._stream._codec.feedback.encoding
    pieces = [p for plan in clients[1]._stream._plans.values() for p in plan.pieces]
    per_step = sum(
        p.numel * 4 if p.shard in clients[1]._stream.lanes else encoding.nbytes(p.numel)
        for p in pieces
    )
    assert stats.bytes_pushed == stats.bytes_pulled == steps * per_step
    for c in clients:
        c.close()


@pytest.mark.parametrize(
    ("worker_nodes", "shard_nodes"),
    [((0, 1), (0, 1)), ((0, 0, 1, 1), (0, 1))],
    ids=["2x1", "2x2-relays"],
)
@pytest.mark.parametrize("compression", ["onebit", "lowrank"])
def test_lossy_sums_across_nodes_and_through_node_relays_lose_only_the_errors_held(
    loop, worker_nodes, shard_nodes, compression
):
    """On the direct path, with a node's relay summing its workers' chunks and
    encoding the partial sum with an error of its own: every worker still gets the
    same sums, and nothing is missing but the errors held."""
    numels = [3000, 700]
    clients, _, topo = direct_clients(
        loop, worker_nodes, shard_nodes, sum(numels), compression=compression
    )
    _steps_lose_only_the_errors_held(clients, 12, numels)
    if topo.has_relays:
        relays = [s for s in _servers(clients) if s._relayed]
        assert relays and all(s._codec.feedback._errors for s in relays)
    for c in clients:
        c.close()


def _servers(clients):
    return clients[0]._transport.servers


def test_lossy_compression_is_validated_by_mode_and_model_dtype():
    assert PSConfig(compression="onebit").compression == "onebit"
    assert PSConfig(compression="topk", topk_ratio=0.05).topk_ratio == 0.05
    with pytest.raises(ValueError, match="compression='onebit' does not apply to mode='async'"):
        PSConfig(mode="async", compression="onebit")
    assert PSConfig(mode="diloco", compression="int4").compression == "int4"
    with pytest.raises(ValueError, match=r"'int4' is for the modes \['diloco'\]"):
        PSConfig(mode="sync", compression="int4")
    with pytest.raises(ValueError, match=r"topk_ratio .* in \(0, 1\]"):
        PSConfig(compression="topk", topk_ratio=2.0)
    with pytest.raises(ValueError, match="topk_ratio"):
        PSConfig(compression="topk", topk_ratio=0)
    assert PSConfig(compression="lowrank", lowrank_rank=2).lowrank_rank == 2
    with pytest.raises(ValueError, match=r"PSConfig\.lowrank_rank must be >= 1"):
        PSConfig(compression="lowrank", lowrank_rank=0)
    with pytest.raises(TypeError, match=r"PSConfig\.lowrank_rank must be an int"):
        PSConfig(compression="lowrank", lowrank_rank=2.0)
    with pytest.raises(ValueError, match="compression='lowrank' does not apply to mode='diloco'"):
        PSConfig(mode="diloco", compression="lowrank")
    half = torch.nn.Linear(2, 2).to(torch.bfloat16)
    with pytest.raises(ValueError, match="compression='topk' encodes fp32 gradients"):
        check_supported(half, "topk")
    check_supported(torch.nn.Linear(2, 2), "onebit")


@pytest.mark.parametrize("compression", ["onebit", "lowrank"])
def test_saved_error_feedback_is_held_again_and_sent_by_the_resumed_run(
    loop, tmp_path, compression
):
    """Ten steps, the state saved (every worker's file, the shards' through rank 0).
    New workers and shards that load it hold exactly what the first ones held, and
    over their next ten steps send it: what they receive plus what they hold at the
    end (and their first step's errors, dropped) is the exact means plus what they
    loaded. Without loading, the loaded part is missing."""
    from ray_ps_plugin._feedback_state import Senders, load_feedback, save_feedback

    world, numels = 2, [700, 2500]
    kw = {"num_servers": 2, "total_bytes": sum(numels) * 4, "chunk_bytes": 1024}
    first, transport = _clients(loop, world, compression=compression, **kw)
    _run_steps(first, world, 10, numels)
    for r, c in enumerate(first):
        save_feedback(tmp_path, [c.feedback_codec()], Senders(r, world, transport, 2, 5.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "meta.json",
        "shard0.npz",
        "shard1.npz",
        "worker0.npz",
        "worker1.npz",
    ]
    saved = _all_held(first)

    def resume(load):
        clients, transport = _clients(loop, world, compression=compression, **kw)
        if load:
            for r, c in enumerate(clients):
                assert load_feedback(
                    tmp_path, [c.feedback_codec()], Senders(r, world, transport, 2, 5.0)
                )
        loaded = _all_held(clients)
        one, one_means = _run_steps(clients, world, 1, numels)
        dropped = _errors_held(clients, one_means, later=False)
        rest, rest_means = _run_steps(clients, world, 9, numels)
        received = sum(one[0]) + sum(rest[0])
        held = _errors_held(clients, one_means)
        missing = one_means + rest_means - (received + held + dropped)
        for c in clients:
            c.close()
        return loaded, missing

    loaded, missing = resume(load=True)
    assert loaded.keys() == saved.keys() and all(np.array_equal(loaded[k], saved[k]) for k in saved)
    held_at_save = _errors_held(first, torch.zeros(sum(numels)))
    torch.testing.assert_close(missing, -held_at_save, atol=1e-4, rtol=1e-4)
    _, cold_missing = resume(load=False)
    torch.testing.assert_close(cold_missing, torch.zeros_like(cold_missing), atol=1e-4, rtol=1e-4)
    assert held_at_save.abs().max() > 1e-2  # the loaded part is not negligible
    for c in first:
        c.close()


def _all_held(clients):
    """Every codec's held errors, by (sender, key)."""
    codecs = [c._stream._codec for c in clients] + [s._codec for s in _servers(clients)]
    return {(i, k): v.copy() for i, c in enumerate(codecs) for k, v in c.feedback._errors.items()}


def test_error_feedback_state_of_another_run_shape_is_left_out_with_a_warning(
    loop, tmp_path, caplog
):
    from ray_ps_plugin._feedback_state import Senders, load_feedback, save_feedback

    clients, transport = _clients(
        loop, 2, num_servers=2, total_bytes=4096, chunk_bytes=1024, compression="onebit"
    )
    _run_steps(clients, 2, 2, [1024])
    for r, c in enumerate(clients):
        save_feedback(tmp_path, [c.feedback_codec()], Senders(r, 2, transport, 2, 5.0))
    codec = clients[0].feedback_codec()
    held = {k: v.copy() for k, v in codec.feedback._errors.items()}
    # Saved by two workers, loaded by a run of four: each error belongs to a sender.
    assert not load_feedback(tmp_path, [codec], Senders(0, 4, transport, 2, 5.0))
    assert "no error-feedback state taken" in caplog.text
    assert all(np.array_equal(codec.feedback._errors[k], v) for k, v in held.items())
    # A checkpoint reported from rank 0 only holds no file of rank 1: a warning.
    (tmp_path / "worker1.npz").unlink()
    codec1 = clients[1].feedback_codec()
    assert not load_feedback(tmp_path, [codec1], Senders(1, 2, transport, 2, 5.0))
    assert "holds no worker1.npz" in caplog.text
    with pytest.raises(ValueError, match="compression='onebit' cannot be loaded into a run"):
        Codec("topk").load_feedback_state(codec.feedback_state())
    for c in clients:
        c.close()
