"""_dtypes: bfloat16 held as int16 patterns, converted in NumPy exactly as torch does."""

import numpy as np
import pytest
import torch

from ray_ps_plugin._codec import Codec, as_torch, to_numpy
from ray_ps_plugin._dtypes import (
    BF16_BITS,
    bf16_to_f32,
    f32_to_bf16,
    model_dtype,
    storage,
    widened,
)


def _specials() -> np.ndarray:
    f = np.finfo(np.float32)
    values = [0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, -np.nan, f.max, -f.max,
              f.tiny, f.tiny / 4, 3.3895314e38, 1.00390625, 1.01171875, 65504.0, 1e-40]
    return np.array(values, dtype=np.float32)


def test_rounding_matches_torch_bit_for_bit():
    rng = np.random.default_rng(0)
    # Random bit patterns cover every exponent, subnormals and ties included.
    bits = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    values = np.concatenate([bits.view(np.float32), _specials()])
    ours = f32_to_bf16(values)
    theirs = torch.from_numpy(values).to(torch.bfloat16)
    nan = np.isnan(values)
    assert ours.dtype == BF16_BITS
    np.testing.assert_array_equal(ours[~nan], theirs.view(torch.int16).numpy()[~nan])
    assert np.isnan(bf16_to_f32(ours[nan])).all()


def test_widening_is_exact_and_round_trips():
    t = torch.randn(1000).to(torch.bfloat16)
    bits = to_numpy(t)
    np.testing.assert_array_equal(bf16_to_f32(bits), t.float().numpy())
    np.testing.assert_array_equal(f32_to_bf16(bf16_to_f32(bits)), bits)
    out = np.empty(1000, np.float32)
    assert bf16_to_f32(bits, out) is out


def test_int16_arrays_are_bfloat16_views_without_a_copy():
    t = torch.arange(4, dtype=torch.bfloat16)
    arr = to_numpy(t)
    assert arr.dtype == np.int16 and np.shares_memory(arr, t.view(torch.int16).numpy())
    back = as_torch(arr)
    assert back.dtype == torch.bfloat16 and back.data_ptr() == t.data_ptr()
    assert model_dtype(arr) == "bfloat16" and model_dtype(np.zeros(1, np.float16)) == "float16"
    assert storage("bfloat16") == BF16_BITS and storage("float64") == np.float64
    assert widened("bfloat16") == "float32" and widened("float16") == "float16"


@pytest.mark.parametrize("compression", [None, "bf16"])
def test_a_bfloat16_model_travels_as_bfloat16_and_shards_compute_in_fp32(compression):
    codec = Codec(compression)
    t = torch.randn(64).to(torch.bfloat16)
    wire = codec.encode(t)
    assert wire.dtype == BF16_BITS and wire.nbytes == 128
    assert codec.converts("bfloat16")
    values = codec.decode_np(wire, "bfloat16")
    assert values.dtype == np.float32
    np.testing.assert_array_equal(values, t.float().numpy())
    np.testing.assert_array_equal(codec.encode_np(values, "bfloat16"), wire)
    assert torch.equal(codec.decode(wire, torch.bfloat16), t)


def test_fp16_compression_on_the_shard_needs_no_torch_and_matches_it():
    codec = Codec("fp16")
    x = (np.random.default_rng(1).standard_normal(10_000) * 100).astype(np.float32)
    np.testing.assert_array_equal(
        codec.encode_np(x), torch.from_numpy(x).to(torch.float16).numpy()
    )
    assert not Codec(None).converts("float16") and Codec(None).converts("bfloat16")
