"""_dtypes and the codec: bfloat16 held as int16 patterns, rounded as the workers round."""

import numpy as np
import pytest
import torch

from ray_ps_plugin._codec import Codec, as_torch, to_numpy
from ray_ps_plugin._dtypes import (
    BF16_BITS,
    bf16_to_f32,
    model_dtype,
    storage,
    widened,
)


def test_widening_is_exact_for_every_pattern():
    bits = np.arange(-(2**15), 2**15, dtype=np.int32).astype(np.int16)  # all 65536
    theirs = torch.from_numpy(bits.copy()).view(torch.bfloat16).float().numpy()
    ours = bf16_to_f32(bits)
    nan = np.isnan(theirs)
    assert ours.dtype == np.float32 and (np.isnan(ours) == nan).all()
    np.testing.assert_array_equal(ours[~nan], theirs[~nan])


def test_shards_round_as_workers_do():
    """A sum rounded to bf16 on a shard equals the same values rounded on a worker,
    ties, overflow to Inf and NaN included."""
    f = np.finfo(np.float32)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, f.max, f.tiny / 4, 1.00390625, 1.01171875]
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [rng.standard_normal(10_000).astype(np.float32) * 1e3, np.array(special, np.float32)]
    )
    held = Codec(None).encode_np(values, "bfloat16")
    assert held.dtype == BF16_BITS
    expect = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy()
    nan = np.isnan(values)
    np.testing.assert_array_equal(held[~nan], expect[~nan])
    assert np.isnan(bf16_to_f32(held[nan])).all()
    out = np.empty_like(held)
    assert Codec(None).encode_np(values, "bfloat16", out=out) is out


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


def test_fp16_compression_on_the_shard_matches_the_workers():
    codec = Codec("fp16")
    x = (np.random.default_rng(1).standard_normal(10_000) * 100).astype(np.float32)
    np.testing.assert_array_equal(codec.encode_np(x), torch.from_numpy(x).to(torch.float16).numpy())
    assert not Codec(None).converts("float16") and Codec(None).converts("bfloat16")
