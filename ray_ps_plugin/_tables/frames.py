"""Sharded tables' pulls and pushes as bytes, for frames on the direct path.

Through Ray a pull or a push of a sharded table's rows is an actor call whose
arguments and reply go through the object store once they pass about 100 KiB:
across nodes the rows of a batch cost an object's creation, location and transfer
each way. On the sync mode's direct TCP path (:mod:`ray_ps_plugin._wire`) they
are one frame each way instead. These functions give both ends the same layout;
NumPy only, as the shard processes are.

Layouts (little-endian)::

    pull    = table(i64) clock(i64) ids(i64 x n)
    answer  = rows(f32 x n x dim)
    push    = meta_len(i64) meta(JSON, padded to 8 bytes) then per entry: rows
    answer  = per entry: steps(i64) n(i64) dim(i64) rows
              (n > 0 only for a replica table: the rows its update changed)
    rows    = ids(i64 x n) values(f32 x n x dim)   (``_rows.row_bytes``, as every
              message with rows lays them out)

A push's JSON holds each entry's table, clock, row count, width, optimizer,
hyperparameters and whether the worker's backward touched the table: a few
hundred bytes beside the rows, and exact for floats (JSON writes Python's
shortest round-trip repr).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from ray_ps_plugin._errors import ShardProtocolError
from ray_ps_plugin._rows import ByteReader, row_bytes, take_rows
from ray_ps_plugin._tables.optim import OPTIMIZERS
from ray_ps_plugin._tables.spec import PushAnswer, PushEntry

__all__ = [
    "pack_pull",
    "pack_push",
    "pack_push_answer",
    "unpack_pull",
    "unpack_push",
    "unpack_push_answer",
]


def pack_pull(table: int, clock: int, ids: np.ndarray) -> np.ndarray:
    """A pull's payload: the table, the worker's clock and the sorted unique ids."""
    head = np.asarray([table, clock], "<i8")
    return np.concatenate([head, np.ascontiguousarray(ids, "<i8")]).view(np.uint8)


def unpack_pull(payload: np.ndarray) -> tuple[int, int, np.ndarray]:
    """``(table, clock, ids)`` of a pull's payload (``ids`` a view into it).

    Raises:
        ShardProtocolError: If the payload is not a whole pull.
    """
    if payload.nbytes < 16 or payload.nbytes % 8:
        raise ShardProtocolError(f"a table pull of {payload.nbytes} bytes is malformed")
    values = payload.view("<i8")
    return int(values[0]), int(values[1]), values[2:]


def pack_push(entries: Sequence[PushEntry]) -> np.ndarray:
    """A push's payload: one worker's optimizer step on a model's tables (see
    ``TableStore.push_many``)."""
    meta = [
        {
            "table": int(table),
            "clock": int(clock),
            "rows": len(ids),
            "dim": int(grads.shape[1]) if grads.ndim == 2 else 0,
            "optimizer": optimizer,
            "hyper": {k: float(v) for k, v in hyper.items()},
            "touched": bool(touched),
        }
        for table, clock, ids, grads, optimizer, hyper, touched in entries
    ]
    raw = json.dumps(meta).encode()
    padded = np.zeros(8 * -(-len(raw) // 8), np.uint8)
    padded[: len(raw)] = np.frombuffer(raw, np.uint8)
    parts = [np.asarray([len(raw)], "<i8").view(np.uint8), padded]
    for _, _, ids, grads, *_ in entries:
        parts += row_bytes(ids, grads)
    return np.concatenate(parts)


def unpack_push(payload: np.ndarray) -> list[PushEntry]:
    """The entries :func:`pack_push` wrote (ids and gradients are views into it).

    Raises:
        ShardProtocolError: If the payload is not whole entries.
    """
    reader = ByteReader(payload)
    try:
        (size,) = reader.take("<i8", 1)
        meta = json.loads(reader.take(np.uint8, 8 * -(-int(size) // 8))[: int(size)].tobytes())
        out: list[PushEntry] = []
        for m in meta:
            if m["optimizer"] not in OPTIMIZERS:
                raise ValueError(f"bad entry {m}")
            ids, grads = take_rows(reader, int(m["rows"]), int(m["dim"]))
            hyper = {str(k): float(v) for k, v in m["hyper"].items()}
            out.append(
                (int(m["table"]), int(m["clock"]), ids, grads, m["optimizer"], hyper, m["touched"])
            )
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise ShardProtocolError(f"a table push is malformed: {e}") from None
    if reader.left:
        raise ShardProtocolError(f"a table push has {reader.left} bytes after its entries")
    return out


def pack_push_answer(answers: Sequence[PushAnswer]) -> np.ndarray:
    """A push's answer: per entry the step count and the rows it changed, if any."""
    parts: list[np.ndarray] = []
    for steps, ids, rows in answers:
        n, dim = len(ids), int(rows.shape[1]) if rows.ndim == 2 else 0
        parts.append(np.asarray([steps, n, dim], "<i8").view(np.uint8))
        parts += row_bytes(ids, rows)
    return np.concatenate(parts) if parts else np.empty(0, np.uint8)


def unpack_push_answer(answer: np.ndarray | Sequence[PushAnswer]) -> list[PushAnswer]:
    """The answers :func:`pack_push_answer` wrote (views into it); a Ray call's
    answer, already a list, is returned as it is.

    Raises:
        ShardProtocolError: If the payload is not whole answers.
    """
    if not isinstance(answer, np.ndarray):
        return list(answer)
    reader = ByteReader(answer)
    out: list[PushAnswer] = []
    try:
        while reader.left:
            steps, n, dim = (int(v) for v in reader.take("<i8", 3))
            out.append((steps, *take_rows(reader, n, dim)))
    except (ValueError, IndexError) as e:
        raise ShardProtocolError(f"a table push's answer is malformed: {e}") from None
    return out
