"""Encodings of fewer than 16 bits a value.

``PSConfig(compression="onebit" | "topk" | "lowrank")`` sends sync mode's gradient
chunks and sums that cross a message in one of these encodings instead of 32 or 16
bits, ``"int8" | "int4"`` diloco's round changes:

- **onebit** (scaled sign, as BytePS's onebit compressor and EF-SignSGD): one sign
  bit per value and, per block of :data:`BLOCK` values, the block's mean absolute
  value, which is the scale that makes the decoded block closest to the original
  (least squares). 1.25 bits a value: 25.6x fewer bytes than fp32.
- **topk**: the ``k = ceil(ratio * n)`` values of largest magnitude with their
  indices (4 + 4 bytes each); the rest decode as zero.
- **lowrank** (PowerSGD's rank-r approximation, Vogels et al., NeurIPS 2019): the
  chunk laid out as a matrix of about sqrt(n) x sqrt(n) values and sent as two
  thin factors, an orthonormal ``P`` (rows x r) and ``B = M^T P`` (cols x r), found
  by one power iteration warm-started from the chunk's previous ``B``:
  ``r (rows + cols)`` floats instead of ``rows x cols``.
- **int8 / int4** (DiLoCo's round changes, as OpenDiLoCo and torchft quantize
  them): each value rounded to the nearest of 255 or 15 levels spread evenly over
  its block's largest magnitude (a float32 scale per :data:`BLOCK` values).

All of them are biased and lose part of what they are given: they train through
the error feedback of :mod:`ray_ps_plugin._feedback`.

Encoded chunks are ``uint8`` arrays that describe themselves (a header naming the
encoding and the value count), so a receiver needs nothing but the bytes; anything
else that travels (16-bit or fp32 arrays: sparse rows, sums through shared
memory) is not one of these.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Hashable
from typing import Literal

import numpy as np

__all__ = [
    "BLOCK",
    "IntLevels",
    "Lossy",
    "LowRank",
    "OneBit",
    "TopK",
    "lossy_encoding",
]

LossyName = Literal["onebit", "topk", "lowrank", "int8", "int4"]

#: Values per scale in the onebit encoding: 4 bytes of scale per 16 bytes of signs.
#: A bucket's chunk runs across layers whose gradients differ in size by orders of
#: magnitude: a scale shared by a weight matrix's and a bias's gradients fits
#: neither, so blocks are small.
BLOCK = 128
_F32 = np.dtype(np.float32)
# Header: (encoding id, value count), two little-endian uint32s.
_HEADER = 8
_IDS = {"onebit": 1, "topk": 2, "int8": 3, "int4": 4, "lowrank": 5}


class Lossy:
    """An encoding of a float32 vector into fewer bytes, and back.

    Attributes:
        name: The ``PSConfig.compression`` value that selects it.
    """

    name: LossyName

    def encode(self, values: np.ndarray, key: Hashable = None) -> np.ndarray:
        """``values`` (1-D float32) as self-describing ``uint8`` bytes.

        Args:
            values: The values.
            key: The chunk they are (an encoding that learns from a chunk's
                previous values keeps its state by key; the others ignore it).
        """
        raise NotImplementedError

    def decode(self, data: np.ndarray) -> np.ndarray:
        """The float32 values of bytes made by :meth:`encode`."""
        raise NotImplementedError

    def nbytes(self, n: int) -> int:
        """Bytes of the encoding of ``n`` values (what the arithmetic says)."""
        raise NotImplementedError

    def clear(self) -> None:
        """Forgets what was learnt from earlier chunks (nothing, unless stateful)."""

    def state(self) -> dict[Hashable, np.ndarray]:
        """What was learnt from earlier chunks, by chunk (nothing, unless stateful)."""
        return {}

    def load_state(self, state: dict[Hashable, np.ndarray]) -> None:
        """Takes what :meth:`state` returned."""

    def forget(self, keys: Collection[Hashable]) -> None:
        """Forgets what was learnt from the chunks ``keys``."""

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

    def encode(self, values: np.ndarray, key: Hashable = None) -> np.ndarray:
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

    def encode(self, values: np.ndarray, key: Hashable = None) -> np.ndarray:
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


class LowRank(Lossy):
    """A rank-``rank`` approximation of the chunk laid out as a matrix (PowerSGD's).

    A chunk of ``n`` values is padded with zeros to ``rows x cols`` (``cols`` the
    power of two nearest ``sqrt(n)``) and read as the matrix ``M``. With ``Q`` the
    chunk's previous ``B`` (or, the first time, a fixed random matrix), ``P`` is
    ``M Q`` made orthonormal and ``B = M^T P``; ``P B^T``, the projection of ``M``
    on ``P``'s columns, is what decodes. Reusing ``B`` makes each step one more
    power iteration on gradients that change slowly, so ``P`` tracks their leading
    directions (PowerSGD's warm start) at one QR of a ``rows x rank`` matrix.

    Unlike PowerSGD's all-reduce, each sender finds its own factors and sends both
    (``rank (rows + cols)`` floats), so every message decodes alone: shards and
    relays sum decoded chunks as for every other encoding.

    Args:
        rank: Columns of ``P`` and ``B`` (at most ``min(rows, cols)`` are used).
    """

    name: LossyName = "lowrank"

    def __init__(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"lowrank rank must be an int >= 1, got {rank!r}")
        self.rank = rank
        self._warm: dict[Hashable, np.ndarray] = {}

    def shape(self, n: int) -> tuple[int, int, int]:
        """``(rows, cols, rank)`` of a chunk of ``n`` values."""
        if n == 0:
            return 0, 0, 0
        cols = min(n, 2 ** round(math.log2(math.sqrt(n))))
        rows = math.ceil(n / cols)
        return rows, cols, min(self.rank, rows, cols)

    def nbytes(self, n: int) -> int:
        rows, cols, r = self.shape(n)
        return _HEADER + 4 * r * (rows + cols)

    def encode(self, values: np.ndarray, key: Hashable = None) -> np.ndarray:
        n = values.size
        out = self._header(n, self.nbytes(n) - _HEADER)
        if not n:
            return out
        rows, cols, r = self.shape(n)
        flat = np.zeros(rows * cols, _F32)
        flat[:n] = values
        m = flat.reshape(rows, cols)
        q = self._warm.get(key) if key is not None else None
        if q is None or q.shape != (cols, r):
            # The same start everywhere keeps runs repeatable.
            q = np.random.default_rng(0).standard_normal((cols, r)).astype(_F32)
        p, _ = np.linalg.qr(m @ q)
        p = p.astype(_F32, copy=False)
        b = m.T @ p
        if key is not None:
            self._warm[key] = b
        out[_HEADER : _HEADER + 4 * rows * r].view(_F32)[:] = p.reshape(-1)
        out[_HEADER + 4 * rows * r :].view(_F32)[:] = b.reshape(-1)
        return out

    def decode(self, data: np.ndarray) -> np.ndarray:
        n = self._count(data)
        if not n:
            return np.zeros(0, _F32)
        rows, cols, r = self.shape(n)
        p = data[_HEADER : _HEADER + 4 * rows * r].view(_F32).reshape(rows, r)
        b = data[_HEADER + 4 * rows * r :].view(_F32).reshape(cols, r)
        return (p @ b.T).reshape(-1)[:n]

    def clear(self) -> None:
        self._warm.clear()

    def state(self) -> dict[Hashable, np.ndarray]:
        return dict(self._warm)

    def load_state(self, state: dict[Hashable, np.ndarray]) -> None:
        self._warm = {k: np.asarray(v, _F32) for k, v in state.items()}

    def forget(self, keys: Collection[Hashable]) -> None:
        for key in keys:
            self._warm.pop(key, None)


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

    def encode(self, values: np.ndarray, key: Hashable = None) -> np.ndarray:
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


def lossy_encoding(name: str, topk_ratio: float, lowrank_rank: int) -> Lossy | None:
    """The encoding ``PSConfig.compression`` names, or ``None`` for a 16-bit or no
    compression."""
    if name == "onebit":
        return OneBit()
    if name == "topk":
        return TopK(topk_ratio)
    if name == "lowrank":
        return LowRank(lowrank_rank)
    if name in ("int8", "int4"):
        return IntLevels(8 if name == "int8" else 4)
    return None
