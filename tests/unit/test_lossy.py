"""The lossy encodings (onebit, top-k), their error feedback, and sync mode's
buckets through them: what each sends, and that nothing given is ever lost."""

import math

import numpy as np
import pytest
import torch

from ray_ps_plugin import PSConfig
from ray_ps_plugin._codec import Codec
from ray_ps_plugin._ddp import check_supported
from ray_ps_plugin._lossy import BLOCK, ErrorFeedback, IntLevels, OneBit, TopK
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


def test_a_chunk_of_another_encoding_is_refused_by_name():
    with pytest.raises(ValueError, match=r"disagree on PSConfig\.compression"):
        TopK(0.1).decode(OneBit().encode(_values(100)))
    with pytest.raises(ValueError, match="onebit: expected an encoded uint8"):
        OneBit().decode(_values(100))
    with pytest.raises(ValueError, match=r"topk ratio must be in \(0, 1\]"):
        TopK(0.0)


@pytest.mark.parametrize(
    "encoding", [OneBit(), TopK(0.01), IntLevels(4)], ids=["onebit", "topk", "int4"]
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
    if not isinstance(encoding, TopK):
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


def _errors_held(clients, means):
    """The errors every worker and shard holds, laid out as the stream."""
    held = torch.zeros_like(means)
    for c in clients:
        for key, error in c._stream._codec.feedback._errors.items():
            held[key // 4 : key // 4 + error.size] += torch.from_numpy(error)
    for shard in _servers(clients):
        for (_model, key), error in shard._codec.feedback._errors.items():
            held[key // 4 : key // 4 + error.size] += torch.from_numpy(error)
    return held


def _assert_only_the_errors_held_are_missing(clients, results, means):
    world, steps = len(clients), len(results[0])
    for step in range(steps):
        for r in range(1, world):
            assert torch.equal(results[0][step], results[r][step])
    received = sum(results[0])
    assert not torch.allclose(received, means, atol=1e-3)  # it did compress
    held = _errors_held(clients, means)
    torch.testing.assert_close(received + held, means, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("compression", ["onebit", "topk"])
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
    results, means = _run_steps(clients, world, steps, numels)
    _assert_only_the_errors_held_are_missing(clients, results, means)
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
def test_lossy_sums_across_nodes_and_through_node_relays_lose_only_the_errors_held(
    loop, worker_nodes, shard_nodes
):
    """On the direct path, with a node's relay summing its workers' chunks and
    encoding the partial sum with an error of its own: every worker still gets the
    same sums, and nothing is missing but the errors held."""
    numels = [3000, 700]
    clients, _, topo = direct_clients(
        loop, worker_nodes, shard_nodes, sum(numels), compression="onebit"
    )
    results, means = _run_steps(clients, len(worker_nodes), 12, numels)
    _assert_only_the_errors_held_are_missing(clients, results, means)
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
    half = torch.nn.Linear(2, 2).to(torch.bfloat16)
    with pytest.raises(ValueError, match="compression='topk' encodes fp32 gradients"):
        check_supported(half, "topk")
    check_supported(torch.nn.Linear(2, 2), "onebit")
