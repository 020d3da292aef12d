"""Error-feedback state in checkpoints: what every worker and shard has not sent yet.

With a lossy compression each worker and each shard (node relays included) holds,
per chunk, what its encoding left out so far, and ``"lowrank"`` the factors it
learnt. Restarting without it drops all of that once. :func:`save_feedback`
writes it beside a checkpoint: every worker its own file (Ray Train merges the
files every worker reports into one checkpoint directory), rank 0 the shards'
too. :func:`load_feedback` gives it back, so a resumed run goes on as the
uninterrupted one would.

Layout under the folder: ``meta.json`` (world size, shard count, compression),
``worker<rank>.npz`` (one state per prepared model, in preparation order) and
``shard<s>.npz``. In each ``.npz``, ``arr_0`` is a JSON header: each entry's
compression (``null`` for a model with nothing lossy) and, for every further
array ``arr_<i>``, its ``[entry, part, key]`` (``part`` is ``"errors"`` or
``"learnt"``; tuple keys are stored as lists).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ray_ps_plugin._transport import Transport, wait_all

if TYPE_CHECKING:
    from ray_ps_plugin._codec import Codec

__all__ = ["Senders", "load_feedback", "save_feedback"]

logger = logging.getLogger(__name__)

State = dict[str, Any]


@dataclass(frozen=True)
class Senders:
    """Who holds a run's error feedback, seen from one worker.

    Attributes:
        rank: This worker's rank (rank 0 also speaks for the shards).
        world_size: The run's number of workers.
        transport: How calls reach the shards.
        num_shards: The run's number of shards.
        timeout_s: Bound on every wait for a shard (``ps_timeout_s``).
    """

    rank: int
    world_size: int
    transport: Transport
    num_shards: int
    timeout_s: float

    def shape(self, codecs: Sequence[Codec | None]) -> dict[str, Any]:
        """What a saved state must have been saved by to be loaded here."""
        compression = next((c.compression for c in codecs if c is not None), None)
        return {
            "world_size": self.world_size,
            "num_shards": self.num_shards,
            "compression": compression,
        }


def save_feedback(path: Path, codecs: Sequence[Codec | None], senders: Senders) -> None:
    """Writes this worker's state (every model's ``codecs``) under ``path``; rank 0
    also each shard's and ``meta.json``.

    Raises:
        PSError: A shard did not answer within ``timeout_s``.
    """
    rank, transport = senders.rank, senders.transport
    path.mkdir(parents=True, exist_ok=True)
    _write(path / f"worker{rank}.npz", [c.feedback_state() if c else None for c in codecs])
    if rank != 0:
        return
    shards = list(range(senders.num_shards))
    calls = [transport.call(s, "feedback_state") for s in shards]
    where = "reading error-feedback state"
    states = wait_all(transport, calls, shards, senders.timeout_s, where)
    for s, state in zip(shards, states):
        _write(path / f"shard{s}.npz", [state])
    (path / "meta.json").write_text(json.dumps(senders.shape(codecs)))


def load_feedback(path: Path, codecs: Sequence[Codec | None], senders: Senders) -> bool:
    """Holds what :func:`save_feedback` wrote under ``path`` (rank 0 hands the
    shards theirs); whether this worker's own state was there. A state saved by a
    run of another world size, shard count or compression is left out with a
    warning (each chunk's error belongs to one sender and one chunk layout), and so
    is a worker's file missing from the checkpoint.

    Raises:
        PSError: A shard did not answer within ``timeout_s``.
    """
    rank, transport, now = senders.rank, senders.transport, senders.shape(codecs)
    meta_file = path / "meta.json"
    saved = json.loads(meta_file.read_text()) if meta_file.exists() else None
    if saved != now:
        logger.warning(
            "rank %d: no error-feedback state taken from %s (%s; this run: %s): the "
            "errors start empty, and what the saved run held is dropped once.",
            rank,
            path,
            f"saved by a run with {saved}" if saved else "none saved there",
            now,
        )
        return False
    own = path / f"worker{rank}.npz"
    if own.exists():
        for codec, state in zip(codecs, _read(own, len(codecs))):
            if state is not None and codec is not None:
                codec.load_feedback_state(state)
    else:
        # Rank 0 wrote meta.json, but this worker's file is not in the checkpoint:
        # its loop reported the directory from rank 0 only.
        logger.warning(
            "rank %d: %s holds no %s: this worker's errors start empty. Every worker "
            "writes its own file: report the checkpoint directory from every worker, "
            "not from rank 0 only.",
            rank,
            path,
            own.name,
        )
    if rank == 0:
        shards = list(range(senders.num_shards))
        calls = [
            transport.call(s, "load_feedback_state", _read(path / f"shard{s}.npz", 1)[0])
            for s in shards
        ]
        wait_all(transport, calls, shards, senders.timeout_s, "restoring error-feedback state")
    return own.exists()


def _write(file: Path, states: Sequence[State | None]) -> None:
    arrays: list[np.ndarray] = []
    index: list[list[Any]] = []
    for entry, state in enumerate(states):
        if state is None:
            continue
        for part in ("errors", "learnt"):
            for key, value in state[part].items():
                index.append([entry, part, _key_to_json(key)])
                arrays.append(value)
    compressions = [s["compression"] if s else None for s in states]
    header = json.dumps({"index": index, "compressions": compressions})
    np.savez(file, np.array(header), *arrays)


def _read(file: Path, entries: int) -> list[State | None]:
    with np.load(file) as data:
        header = json.loads(str(data["arr_0"]))
        states: list[State | None] = [
            {"compression": c, "errors": {}, "learnt": {}} if c else None
            for c in header["compressions"]
        ]
        for i, (entry, part, key) in enumerate(header["index"]):
            state = states[entry]
            assert state is not None
            state[part][_key_from_json(key)] = data[f"arr_{i + 1}"]
    if len(states) != entries:
        raise ValueError(
            f"{file} holds error-feedback state for {len(states)} model(s), but "
            f"{entries} are prepared: prepare the same models as the saved run first."
        )
    return states


def _key_to_json(key: Hashable) -> Any:
    return [_key_to_json(k) for k in key] if isinstance(key, tuple) else key


def _key_from_json(key: Any) -> Hashable:
    return tuple(_key_from_json(k) for k in key) if isinstance(key, list) else key
