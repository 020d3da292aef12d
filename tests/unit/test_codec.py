"""Codec: 16-bit encodings halve the bytes and round-trip within their precision."""

import numpy as np
import pytest
import torch

from ray_ps_plugin._codec import Codec


@pytest.mark.parametrize(("kind", "rtol"), [("bf16", 1 / 128), ("fp16", 1 / 1024)])
def test_16_bit_halves_the_bytes_and_round_trips(kind, rtol):
    codec = Codec(kind)
    x = torch.randn(1000) * 3
    wire = codec.encode(x)
    assert wire.nbytes == x.numel() * 2
    back = codec.decode(wire)
    assert back.dtype == torch.float32
    torch.testing.assert_close(back, x, rtol=rtol, atol=1e-6)
    # The shard side agrees with the worker side.
    np.testing.assert_array_equal(codec.decode_np(wire), back.numpy())
    np.testing.assert_array_equal(codec.encode_np(back.numpy()), wire)


def test_uncompressed_is_exact_and_zero_copy_on_the_worker():
    codec = Codec(None)
    x = torch.randn(10)
    wire = codec.encode(x)
    assert wire.dtype == np.float32 and np.shares_memory(wire, x.numpy())
    assert torch.equal(codec.decode(wire), x)
    reply = codec.encode_np(wire)
    assert not np.shares_memory(reply, wire)  # shard replies are snapshots


def test_bf16_travels_as_int16_bit_patterns():
    wire = Codec("bf16").encode(torch.tensor([1.0, -2.0, float("inf")]))
    assert wire.dtype == np.int16
    assert torch.isinf(Codec("bf16").decode(wire)[2])


def test_unknown_compression_is_refused():
    with pytest.raises(ValueError):
        Codec("int2")
