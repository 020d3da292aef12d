"""Error feedback: what each sender's lossy encoding left out, sent with its next message.

Every encoding of :mod:`ray_ps_plugin._lossy` is biased and loses part of what it
is given, so each sender keeps what its encoding dropped, per chunk, and adds it to
what it sends next time (Seide et al. 2014; Karimireddy et al., ICML 2019): every
value is eventually sent, later, and SGD's convergence holds. A worker keeps the
error of its pushes, a shard the error of its sums, a node relay that of the
partial sums it forwards (dist-EF-SGDM's arrangement).
"""

from __future__ import annotations

from collections.abc import Collection, Hashable

import numpy as np

from ray_ps_plugin._lossy import Lossy

__all__ = ["ErrorFeedback", "FirstStepApart"]

_F32 = np.dtype(np.float32)


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
        encoded = self.encoding.encode(corrected, key)
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
        self.encoding.clear()

    def state(self) -> dict[str, dict[Hashable, np.ndarray]]:
        """Everything held, for a checkpoint: the errors and what the encoding
        learnt (lowrank's factors), each by chunk."""
        return {"errors": dict(self._errors), "learnt": self.encoding.state()}

    def load_state(self, state: dict[str, dict[Hashable, np.ndarray]]) -> None:
        """Holds what :meth:`state` returned instead of what is held now."""
        self._errors = {k: np.asarray(v, _F32) for k, v in state["errors"].items()}
        self.encoding.load_state(state["learnt"])

    def drop(self, keys: Collection[Hashable]) -> None:
        """Drops what is held for the chunks ``keys`` (they will not be sent again)."""
        for key in keys:
            self._errors.pop(key, None)
        self.encoding.forget(keys)

    def held_keys(self) -> list[Hashable]:
        """The chunks something is held for."""
        return list(self._errors)


class FirstStepApart:
    """Keys of a sync sender's chunks that keep its first step's errors apart.

    A chunk's key is its byte offset in the step's gradient stream, and DDP lays
    its buckets out once more after the first step (in the order the gradients
    became ready): from the second step on, an offset may hold other
    parameters. So what the first step's encoding left out is kept under keys of
    its own and dropped when the second step begins, instead of being added to
    other parameters' gradients: once per start, a step's error is lost. Every
    later step shares the second one's layout, and a state restored from a
    checkpoint (saved after the first step) is used from a resumed run's second
    step on.

    Args:
        feedback: The sender's error feedback.
    """

    def __init__(self, feedback: ErrorFeedback) -> None:
        self._feedback = feedback
        self._first: dict[Hashable, int] = {}
        self._settled: set[Hashable] = set()

    def key(self, model: Hashable, step: int, chunk: Hashable) -> tuple[Hashable, Hashable, bool]:
        """The key of ``chunk`` of ``model`` at ``step``; drops the first step's
        errors of ``model`` when its second step asks first.

        Steps must come in order: every chunk of a step before any of the next
        (a sync worker pushes, and a shard sums, step ``s + 1`` only after every
        chunk of step ``s``).
        """
        later = step != self._first.setdefault(model, step)
        if later and model not in self._settled:
            self._settled.add(model)
            self._feedback.drop([k for k in self._feedback.held_keys() if _first_step_of(k, model)])
        return (model, chunk, later)


def _first_step_of(key: Hashable, model: Hashable) -> bool:
    return isinstance(key, tuple) and len(key) == 3 and key[0] == model and key[2] is False
