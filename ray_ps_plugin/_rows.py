"""Rows of embedding tables with sparse gradients: how they are split and summed.

A table whose layer builds sparse gradients (``nn.Embedding`` / ``nn.EmbeddingBag``
with ``sparse=True``) is split by rows across the ``S`` shards: row ``r`` belongs to
shard ``r % S``. Interleaved rather than in ranges because ids are often numbered by
frequency (a vocabulary's most frequent entries first): ranges would give one shard
the hot rows and its node's link most of the traffic. A worker sends each owner only
the rows its batch touched (coalesced indices and their values); the owner answers
with the union of the rows every worker touched. Nothing here imports torch: shard
processes use it.

Sharded tables (``_tables.store``) keep ranges (:func:`row_bounds`): their shards
initialise and checkpoint the table by blocks of rows.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ray_ps_plugin._dtypes import BF16_BITS, MODEL_DTYPES
from ray_ps_plugin._errors import ShardProtocolError, ShardTimeoutError

__all__ = [
    "ByteReader",
    "RowEntry",
    "RowSums",
    "pack",
    "row_bounds",
    "row_bytes",
    "sum_rows",
    "take_rows",
    "unpack",
]

#: One table's rows in a message: ``(table, split, indices, values, dtype)``, the
#: table's index, ``(rows, shards)`` as the sender split the table, sorted unique
#: int64 row indices, their ``(n, row_numel)`` values (encoded) and the table's dtype.
RowEntry = tuple[int, tuple[int, int], np.ndarray, np.ndarray, str]

# The element types values travel in (bfloat16 as int16 bit patterns).
_VALUE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), BF16_BITS, np.dtype(np.float64))
_FIELDS = 7  # table, table rows, shards, rows sent, row_numel, dtype, value dtype


def row_bounds(num_rows: int, num_shards: int) -> list[int]:
    """Row boundaries of a table split into ``num_shards`` near-equal ranges."""
    return [num_rows * s // num_shards for s in range(num_shards + 1)]


def sum_rows(indices: list[np.ndarray], values: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Sums several sets of (row index, row values) into one coalesced set.

    Args:
        indices: One int64 array of row indices per contribution.
        values: The matching ``(len(indices[i]), *row_shape)`` arrays.

    Returns:
        ``(rows, sums)``: the sorted union of the rows and each row's sum, added in
        the order of the contributions (so every caller gets the same bits).
    """
    idx = np.concatenate(indices)
    if idx.size == 0:
        return idx, np.concatenate(values)
    if all(len(i) < 2 or bool(np.all(i[1:] > i[:-1])) for i in indices):
        # Each contribution coalesced (sorted, unique), as every sender's is: add
        # them one after another into the union's rows (0 + a is a, so the bits are
        # those of the general path), without gathering every value in row order.
        rows, inverse = np.unique(idx, return_inverse=True)
        dtype = np.result_type(*values)
        sums = np.zeros((len(rows), *values[0].shape[1:]), dtype)
        at = 0
        for i, v in zip(indices, values):
            sums[inverse[at : at + len(i)]] += v
            at += len(i)
        return rows, sums
    vals = np.concatenate(values)
    order = np.argsort(idx, kind="stable")
    rows, starts = np.unique(idx[order], return_index=True)
    return rows, np.add.reduceat(vals[order], starts, axis=0)


def row_bytes(
    ids: np.ndarray, values: np.ndarray, dtype: npt.DTypeLike = "<f4"
) -> list[np.ndarray]:
    """Rows as bytes, the one layout every message with rows uses: the int64 row
    indices, then the values row after row (in ``dtype``); the message's own header
    says how many rows and how wide."""
    return [
        np.ascontiguousarray(ids, "<i8").view(np.uint8).reshape(-1),
        np.ascontiguousarray(values, dtype).reshape(-1).view(np.uint8),
    ]


def take_rows(
    reader: ByteReader, n: int, width: int, dtype: npt.DTypeLike = "<f4"
) -> tuple[np.ndarray, np.ndarray]:
    """The next ``n`` rows of ``width`` values :func:`row_bytes` wrote, as views
    ``(ids, values)``.

    Raises:
        ValueError: If fewer bytes are left, or a count is negative.
    """
    if n < 0 or width < 0:
        raise ValueError(f"{n} rows of {width} values")
    ids = reader.take("<i8", n)
    return ids, reader.take(dtype, n * width).reshape(n, width)


def pack(entries: list[RowEntry]) -> np.ndarray:
    """The bytes of a list of row entries, for a frame on the direct path: a
    header of int64 fields, then each entry's rows."""
    head = [len(entries)]
    for table, (rows, shards), indices, values, dtype in entries:
        row_numel = int(np.prod(values.shape[1:]))
        head += [table, rows, shards, len(indices), row_numel, MODEL_DTYPES.index(dtype)]
        head.append(_VALUE_DTYPES.index(values.dtype))
    parts = [np.asarray(head, "<i8").view(np.uint8)]
    for _, _, indices, values, _ in entries:
        parts += row_bytes(indices, values, values.dtype)
    return np.concatenate(parts)


class ByteReader:
    """Typed views taken one after another from a message's bytes (no copies): the
    reading end of :func:`pack` and of the sharded tables' frames.

    Args:
        payload: The message, ``uint8``.
    """

    def __init__(self, payload: np.ndarray) -> None:
        self._payload = payload
        self._at = 0

    def take(self, dtype: npt.DTypeLike, count: int) -> np.ndarray:
        """The next ``count`` values of ``dtype``.

        Raises:
            ValueError: If fewer bytes are left (or ``count`` is negative).
        """
        dt = np.dtype(dtype)
        end = self._at + count * dt.itemsize
        if count < 0 or end > self._payload.nbytes:
            raise ValueError(
                f"{count} values of {dt} wanted at byte {self._at} of {self._payload.nbytes}"
            )
        out = self._payload[self._at : end].view(dt)
        self._at = end
        return out

    @property
    def left(self) -> int:
        """Bytes not taken yet."""
        return self._payload.nbytes - self._at


def unpack(payload: np.ndarray) -> list[RowEntry]:
    """The row entries :func:`pack` wrote (views into ``payload``).

    Raises:
        ShardProtocolError: If the bytes are not whole entries.
    """
    reader = ByteReader(payload)
    try:
        (count,) = reader.take("<i8", 1)
        head = reader.take("<i8", _FIELDS * int(count)).reshape(-1, _FIELDS)
        out: list[RowEntry] = []
        for table, rows, shards, n, row_numel, dtype, value_dtype in head.tolist():
            indices, values = take_rows(reader, n, row_numel, _VALUE_DTYPES[value_dtype])
            out.append((table, (rows, shards), indices, values, MODEL_DTYPES[dtype]))
    except (ValueError, IndexError) as e:
        raise ShardProtocolError(f"a frame of sparse rows is malformed: {e}") from None
    if reader.left:
        raise ShardProtocolError(
            f"a frame of sparse rows has {reader.left} bytes after its entries"
        )
    return out


@dataclass
class _RowRound:
    """One table's rows of one step on one shard, until every source has sent them."""

    split: tuple[int, int]  # (table rows, shards), as the first worker split the table
    indices: dict[int, np.ndarray] = field(default_factory=dict)  # by source
    values: dict[int, np.ndarray] = field(default_factory=dict)
    answered: set[int] = field(default_factory=set)
    result: tuple[np.ndarray, np.ndarray] | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


class RowSums:
    """A sync shard's sums of sparse rows, step by step (runs on the shard's event loop).

    Args:
        shard_index: The shard's index (error messages).
        num_workers: Workers whose rows make up one step.
        timeout_s: How long a worker's rows wait for the other workers'.
        describe: A source id in words (error messages); by default a rank.

    Attributes:
        sources: The senders whose rows complete a table's step: every worker, or,
            where nodes relay (``_sync.topology``), this node's workers and the other
            nodes' relays. Their sums are added in the order of their ids.
    """

    def __init__(
        self,
        shard_index: int,
        num_workers: int,
        timeout_s: float,
        describe: Callable[[int], str] | None = None,
    ) -> None:
        self.shard_index = shard_index
        self.sources = frozenset(range(num_workers))
        self.timeout_s = timeout_s
        self._describe = describe or (lambda source: f"worker {source}")
        self._rounds: dict[tuple[int, int, int], _RowRound] = {}

    def _check(
        self,
        round_: _RowRound,
        table: int,
        split: tuple[int, int],
        indices: np.ndarray,
        values: np.ndarray,
    ) -> None:
        rows, shards = round_.split
        where = f"shard {self.shard_index}: sparse table {table}"
        if (rows, shards) != split:
            raise ShardProtocolError(
                f"{where}: one worker split a table of {rows} rows over {shards} shards, "
                f"another {split[0]} rows over {split[1]}; the workers disagree on the "
                "table's size or on the number of shards."
            )
        if indices.ndim != 1 or indices.dtype != np.int64 or len(values) != len(indices):
            raise ShardProtocolError(
                f"{where}: expected int64 row indices and one row of values per index, got "
                f"indices {indices.dtype}{indices.shape} and values {values.shape}."
            )
        if indices.size and (
            indices[0] < 0 or indices[-1] >= rows or np.any(indices % shards != self.shard_index)
        ):
            raise ShardProtocolError(
                f"{where}: rows that are not this shard's (row r belongs to shard "
                f"r % {shards}, within {rows} rows); the workers disagree on the table's "
                "size or on the number of shards."
            )

    async def push(
        self,
        model: int,
        step: int,
        table: int,
        rank: int,
        split: tuple[int, int],
        indices: np.ndarray,
        values: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Adds one source's rows; returns every worker's summed rows once every
        source sent theirs.

        Args:
            model: The prepared model's id.
            step: The worker's synchronisation round.
            table: The table's index among the model's sparse tables.
            rank: The sender: a worker's world rank, or a relay's source id (it has
                summed its node's workers' rows).
            split: ``(rows, shards)``, the table's size and the number of shards as
                the worker split it (every worker must send the same).
            indices: Sorted, unique row indices of this shard (may be empty).
            values: Their values, already divided by the world size.

        Raises:
            ShardTimeoutError: If the other sources do not send within the timeout.
            ShardProtocolError: If the rows do not belong to this shard, or the sender
                is not one of its sources.
        """
        if rank not in self.sources:
            raise ShardProtocolError(
                f"shard {self.shard_index}: sparse table {table}: {self._describe(rank)} "
                "does not send rows to this shard itself; the workers disagree on the "
                "topology."
            )
        key = (model, table, step)
        split = (int(split[0]), int(split[1]))
        round_ = self._rounds.setdefault(key, _RowRound(split=split))
        self._check(round_, table, split, indices, values)
        if rank not in round_.indices:
            round_.indices[rank], round_.values[rank] = indices, values
            if len(round_.indices) == len(self.sources):
                ranks = sorted(round_.indices)
                round_.result = sum_rows(
                    [round_.indices[r] for r in ranks], [round_.values[r] for r in ranks]
                )
                round_.done.set()
        try:
            await asyncio.wait_for(round_.done.wait(), self.timeout_s)
        except asyncio.TimeoutError:
            self._rounds.pop(key, None)
            missing = ", ".join(
                self._describe(s) for s in sorted(self.sources - set(round_.indices))
            )
            raise ShardTimeoutError(
                f"shard {self.shard_index}: model {model}: step {step}, sparse table "
                f"{table} waited {self.timeout_s:g}s for the rows of {missing}; a "
                "worker is stuck, dead or its model differs. Raise PSConfig.ps_timeout_s "
                "if steps are slow."
            ) from None
        assert round_.result is not None
        round_.answered.add(rank)
        if len(round_.answered) == len(self.sources):
            self._rounds.pop(key, None)
        return round_.result
