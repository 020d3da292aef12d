"""Encodings of fewer than 16 bits a value, and the error feedback that makes them train.

``PSConfig(compression="onebit" | "topk")`` sends sync mode's gradient chunks and
sums that cross a message in one of these encodings instead of 32 or 16 bits:

- **onebit** (scaled sign, as BytePS's onebit compressor and EF-SignSGD): one sign
  bit per value and, per block of :data:`BLOCK` values, the block's mean absolute
  value, which is the scale that makes the decoded block closest to the original
  (least squares). 1.25 bits a value: 25.6x fewer bytes than fp32.
- **topk**: the ``k = ceil(ratio * n)`` values of largest magnitude with their
  indices (4 + 4 bytes each); the rest decode as zero.
- **int8 / int4** (DiLoCo's round changes, as OpenDiLoCo and torchft quantize
  them): each value rounded to the nearest of 255 or 15 levels spread evenly over
  its block's largest magnitude (a float32 scale per :data:`BLOCK` values).

All of them are biased and lose part of what they are given, so each sender keeps
what its encoding dropped and adds it to what it sends next time (*error feedback*:
Seide et al. 2014, Karimireddy et al., ICML 2019): every value is eventually sent,
later, and SGD's convergence holds. A worker keeps the error of its pushes, a shard
the error of its sums (dist-EF-SGDM's arrangement), each per chunk.

Encoded chunks are ``uint8`` arrays that describe themselves (a header naming the
encoding and the value count), so a receiver needs nothing but the bytes; anything
else that travels (16-bit or fp32 arrays: sparse rows, sums through shared
memory) is not one of these.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Literal

import numpy as np

__all__ = ["BLOCK", "ErrorFeedback", "IntLevels", "Lossy", "OneBit", "TopK", "lossy_encoding"]

LossyName = Literal["onebit", "topk", "int8", "int4"]

#: Values per scale in the onebit encoding: 4 bytes of scale per 16 bytes of signs.
#: A bucket's chunk runs across layers whose gradients differ in size by orders of
#: magnitude: a scale shared by a weight matrix's and a bias's gradients fits
#: neither, so blocks are small.
BLOCK = 128
_F32 = np.dtype(np.float32)
# Header: (encoding id, value count), two little-endian uint32s.
_HEADER = 8
_IDS = {"onebit": 1, "topk": 2, "int8": 3, "int4": 4}


class Lossy:
    """An encoding of a float32 vector into fewer bytes, and back.

    Attributes:
        name: The ``PSConfig.compression`` value that selects it.
    """

    name: LossyName

    def encode(self, values: np.ndarray) -> np.ndarray:
        """``values`` (1-D float32) as self-describing ``uint8`` bytes."""
        raise NotImplementedError

    def decode(self, data: np.ndarray) -> np.ndarray:
        """The float32 values of bytes made by :meth:`encode`."""
        raise NotImplementedError

    def nbytes(self, n: int) -> int:
        """Bytes of the encoding of ``n`` values (what the arithmetic says)."""
        raise NotImplementedError

    def _header(self, n: int, body: int) -> np.ndarray:
        out = np.empty(_HEADER + body, np.uint8)
        out[:_HEADER].view("<u4")[:] = (_IDS[self.name], n)
        return out

    def _count(self, data: np.ndarray) -> int:
        """The value count of ``data``, checked to be this encoding's."""
        if data.dtype != np.uint8 or data.ndim != 1 or data.size < _HEADER:
            raise ValueError(
                f"{self.name}: expected an encoded uint8 vector, got {data.dtype}{list(data.shape)}"
            )
        kind, n = (int(x) for x in data[:_HEADER].view("<u4"))
        if kind != _IDS[self.name] or data.size != self.nbytes(n):
            raise ValueError(
                f"{self.name}: {data.size} bytes of encoding id {kind} for {n} values do not "
                "make one of this encoding's chunks; the workers and shards disagree on "
                "PSConfig.compression."
            )
        return n


class OneBit(Lossy):
    """Scaled sign: a bit per value and a float32 scale per :data:`BLOCK` values."""

    name: LossyName = "onebit"

    def nbytes(self, n: int) -> int:
        return _HEADER + 4 * math.ceil(n / BLOCK) + math.ceil(n / 8)

    def encode(self, values: np.ndarray) -> np.ndarray:
        n = values.size
        blocks = math.ceil(n / BLOCK)
        out = self._header(n, self.nbytes(n) - _HEADER)
        scales = out[_HEADER : _HEADER + 4 * blocks].view(_F32)
        if n:
            np.add.reduceat(np.abs(values), np.arange(0, n, BLOCK), out=scales)
            scales /= _block_sizes(n)
        out[_HEADER + 4 * blocks :] = np.packbits(values < 0)
        return out

    def decode(self, data: np.ndarray) -> np.ndarray:
        n = self._count(data)
        blocks = math.ceil(n / BLOCK)
        scales = data[_HEADER : _HEADER + 4 * blocks].view(_F32)
        negative = np.unpackbits(data[_HEADER + 4 * blocks :], count=n)
        values = np.repeat(scales, BLOCK)[:n]
        # 1 - 2 * bit is +1 for a positive sign and -1 for a negative one.
        return values * (1.0 - 2.0 * negative.astype(_F32))


class TopK(Lossy):
    """The ``ceil(ratio * n)`` values of largest magnitude, with their indices.

    Args:
        ratio: The fraction of values sent, in (0, 1].
    """

    name: LossyName = "topk"

    def __init__(self, ratio: float) -> None:
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"topk ratio must be in (0, 1], got {ratio!r}")
        self.ratio = ratio

    def k(self, n: int) -> int:
        """How many values a chunk of ``n`` sends (at least one)."""
        return min(n, max(1, math.ceil(self.ratio * n)))

    def nbytes(self, n: int) -> int:
        return _HEADER + 8 * self.k(n) if n else _HEADER

    def encode(self, values: np.ndarray) -> np.ndarray:
        n = values.size
        out = self._header(n, self.nbytes(n) - _HEADER)
        if not n:
            return out
        k = self.k(n)
        # argpartition is linear; sorting only the k chosen keeps decoding's writes
        # in order.
        chosen = np.sort(np.argpartition(np.abs(values), n - k)[n - k :])
        out[_HEADER : _HEADER + 4 * k].view("<i4")[:] = chosen
        out[_HEADER + 4 * k :].view(_F32)[:] = values[chosen]
        return out

    def decode(self, data: np.ndarray) -> np.ndarray:
        n = self._count(data)
        values = np.zeros(n, _F32)
        if n:
            k = self.k(n)
            values[data[_HEADER : _HEADER + 4 * k].view("<i4")] = data[_HEADER + 4 * k :].view(_F32)
        return values


class IntLevels(Lossy):
    """Signed integers of ``bits`` bits (8 or 4) with a float32 scale per
    :data:`BLOCK` values: the block's largest magnitude over the largest level.

    Args:
        bits: 8 (levels -127..127, one byte each) or 4 (levels -7..7, two a byte).
    """

    def __init__(self, bits: Literal[8, 4]) -> None:
        if bits not in (8, 4):
            raise ValueError(f"integer levels of 8 or 4 bits, got {bits!r}")
        self.bits = bits
        self.name = "int8" if bits == 8 else "int4"
        self._top = 127 if bits == 8 else 7

    def nbytes(self, n: int) -> int:
        return _HEADER + 4 * math.ceil(n / BLOCK) + math.ceil(n * self.bits / 8)

    def encode(self, values: np.ndarray) -> np.ndarray:
        n = values.size
        blocks = math.ceil(n / BLOCK)
        out = self._header(n, self.nbytes(n) - _HEADER)
        scales = out[_HEADER : _HEADER + 4 * blocks].view(_F32)
        if not n:
            return out
        np.maximum.reduceat(np.abs(values), np.arange(0, n, BLOCK), out=scales)
        scales /= self._top
        # A block of zeros keeps scale 0 and levels 0 (no division by it).
        per_value = np.repeat(np.where(scales > 0, scales, 1.0).astype(_F32), BLOCK)[:n]
        levels = np.rint(values / per_value).clip(-self._top, self._top).astype(np.int8)
        body = out[_HEADER + 4 * blocks :]
        if self.bits == 8:
            body[:] = levels.view(np.uint8)
        else:
            # Two levels a byte, each stored + 8 (1..15), the first in the low nibble.
            biased = (levels + 8).astype(np.uint8)
            if n % 2:
                biased = np.append(biased, np.uint8(8))
            body[:] = biased[0::2] | (biased[1::2] << 4)
        return out

    def decode(self, data: np.ndarray) -> np.ndarray:
        n = self._count(data)
        blocks = math.ceil(n / BLOCK)
        scales = data[_HEADER : _HEADER + 4 * blocks].view(_F32)
        body = data[_HEADER + 4 * blocks :]
        if self.bits == 8:
            levels = body.view(np.int8).astype(_F32)
        else:
            pairs = np.empty(2 * body.size, np.uint8)
            pairs[0::2], pairs[1::2] = body & 0x0F, body >> 4
            levels = pairs[:n].astype(_F32) - 8.0
        return levels * np.repeat(scales, BLOCK)[:n]


def _block_sizes(n: int) -> np.ndarray:
    sizes = np.full(math.ceil(n / BLOCK), BLOCK, _F32)
    sizes[-1] = n - BLOCK * (sizes.size - 1)
    return sizes


def lossy_encoding(name: str, topk_ratio: float) -> Lossy | None:
    """The encoding ``PSConfig.compression`` names, or ``None`` for a 16-bit or no
    compression."""
    if name == "onebit":
        return OneBit()
    if name == "topk":
        return TopK(topk_ratio)
    if name in ("int8", "int4"):
        return IntLevels(8 if name == "int8" else 4)
    return None


class ErrorFeedback:
    """One sender's error feedback: per chunk, what its encoding dropped last time.

    ``encode(key, values)`` sends ``values + error[key]`` and keeps the new error,
    so the sum of everything decoded after ``N`` calls differs from the sum of
    everything given by exactly the error still held (for onebit and the integer
    levels about one call's loss; top-k's small values wait longer).

    Args:
        encoding: The lossy encoding.
    """

    def __init__(self, encoding: Lossy) -> None:
        self.encoding = encoding
        self._errors: dict[Hashable, np.ndarray] = {}

    def encode(self, key: Hashable, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(encoded, decoded)`` of ``values`` plus the chunk's held error; holds the
        new error.

        Args:
            key: The chunk (its byte offset in the stream, with its model).
            values: The chunk's values (any float dtype; read, not written).
        """
        error = self._errors.get(key)
        corrected = values.astype(_F32, copy=True).reshape(-1)
        if error is not None and error.shape == corrected.shape:
            corrected += error
        encoded = self.encoding.encode(corrected)
        decoded = self.encoding.decode(encoded)
        # What was not sent is sent next time: corrected becomes the new error.
        np.subtract(corrected, decoded, out=corrected)
        self._errors[key] = corrected
        return encoded, decoded

    def error(self, key: Hashable) -> np.ndarray | None:
        """The error held for chunk ``key`` (``None`` before its first encoding)."""
        return self._errors.get(key)

    def clear(self) -> None:
        """Drops every held error (a new run of the same model starts clean)."""
        self._errors.clear()
