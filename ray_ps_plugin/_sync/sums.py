"""A sync shard's dense sums: one accumulator per chunk and step parity, for each
prepared model, and the shared-memory segments through which the workers of the
shard's node push their chunks and read the sums. The actor
(:class:`~ray_ps_plugin._sync.shard.SumShard`) adds the pushes, waits and relays;
this module holds where the sums live and how a finished one is made readable.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ray_ps_plugin._codec import Codec
from ray_ps_plugin._dtypes import storage
from ray_ps_plugin._errors import ShardProtocolError
from ray_ps_plugin._shm import Segment, SegmentHandle

__all__ = ["ChunkSums", "Slot"]


@dataclass
class Slot:
    """Accumulator of one chunk for one step."""

    step: int
    acc: np.ndarray  # the sum, in the dtype the shard computes in
    expected: frozenset[int]  # the sources whose pushes complete it
    owner: int  # the shard that owns the chunk (another one: this shard relays)
    ranks: set[int] = field(default_factory=set)  # sources that pushed so far
    encoded: np.ndarray | None = None  # the sum in the encoded format, once complete
    shared: bool = False  # whether ``acc`` lies in the model's output segment
    # Where this node's workers read the sum when it is held differently from
    # ``acc`` (bfloat16 patterns in the output segment, while ``acc`` is float32).
    out: np.ndarray | None = None
    by_message: bool = False  # some worker pushed (so pulls) by message, not shared memory
    done: asyncio.Event = field(default_factory=asyncio.Event)
    error: Exception | None = None  # why a relayed sum failed, for every waiter


@dataclass
class _SumState:
    """One prepared model's state on this shard."""

    # Two slots per chunk, by step parity. A worker can push step s+2 only after
    # every worker pushed s+1, i.e. after every worker has received step s's sum,
    # so the slot of step s is free again by then and never reallocated.
    slots: dict[tuple[int, int], Slot] = field(default_factory=dict)
    # Shared memory with workers of this node: one input segment per worker, and
    # the sums in two output segments, by step parity as the slots.
    inputs: dict[int, Segment] = field(default_factory=dict)
    outputs: list[Segment] = field(default_factory=list)
    lo: int = 0  # stream byte at which the segments start

    def output_view(self, step: int, key: int, dtype: np.dtype, size: int) -> np.ndarray:
        return self.outputs[step % 2].view(key - self.lo, dtype, size)


class ChunkSums:
    """The slots and segments of every prepared model on one shard (each model has its
    own, keyed by its id, so two models with equal shapes never mix their sums).

    Runs on the shard's event loop.

    Args:
        shard_index: The shard's index (error messages).
        codec: The run's codec, whose encoding sums pulled by message travel in.
        describe: A source id in words, for error messages.
    """

    def __init__(self, shard_index: int, codec: Codec, describe: Callable[[int], str]) -> None:
        self.shard_index = shard_index
        self._codec = codec
        self._describe = describe
        self._models: dict[int, _SumState] = {}

    def _model(self, model: int) -> _SumState:
        return self._models.setdefault(model, _SumState())

    def attach(
        self, model: int, rank: int, inputs: SegmentHandle, lo: int, nbytes: int
    ) -> tuple[SegmentHandle, ...]:
        """Opens a worker's input segment; returns the model's two output segments
        (created by the first worker that attaches). See ``SumShard.attach``.

        Raises:
            ShardProtocolError: If workers describe the shard's range differently.
        """
        state = self._model(model)
        if not state.outputs:
            state.lo = lo
            state.outputs = [Segment.create(nbytes), Segment.create(nbytes)]
        elif (lo, nbytes) != (state.lo, state.outputs[0].handle.nbytes):
            raise ShardProtocolError(
                f"shard {self.shard_index}: model {model}: rank {rank} describes the "
                f"shard's range as {nbytes} bytes at {lo}, others as "
                f"{state.outputs[0].handle.nbytes} at {state.lo}; the workers' models differ."
            )
        state.inputs[rank] = Segment.open(inputs)
        return tuple(s.handle for s in state.outputs)

    def input_views(
        self, model: int, rank: int, dtype: str, chunks: Sequence[tuple[int, int, int | None]]
    ) -> list[tuple[int, np.ndarray, int | None]]:
        """``(key, chunk, owner)`` per chunk of a local push: the chunk as the worker
        left it in its input segment (bfloat16 as bit patterns).

        Raises:
            ShardProtocolError: If the worker did not attach, an owner is not a shard
                index, or a chunk lies outside the segment.
        """
        state = self._model(model)
        if rank not in state.inputs:
            raise ShardProtocolError(
                f"shard {self.shard_index}: model {model}: rank {rank} pushed through "
                "shared memory without attaching first."
            )
        segment = state.inputs[rank]
        grads = []
        for key, numel, owner in chunks:
            if owner is not None and not isinstance(owner, int):
                raise ShardProtocolError(
                    f"shard {self.shard_index}: owner {owner!r} is not a shard index."
                )
            # Segment.view refuses a range outside the segment.
            grads.append((key, segment.view(key - state.lo, storage(dtype), numel), owner))
        return grads

    def slot_for(
        self,
        model: int,
        step: int,
        key: int,
        grad: np.ndarray,
        dtype: str,
        owner: int,
        expected: frozenset[int],
    ) -> Slot:
        """The slot a push of chunk ``key`` at ``step`` adds to: the step's, or a new
        one in place of step ``step - 2``'s.

        Args:
            model: The prepared model's id.
            step: The push's synchronisation round.
            key: The chunk's byte offset in the model's gradient stream.
            grad: The pushed values, in the dtype the shard sums in.
            dtype: The model's gradient dtype.
            owner: The shard that owns the chunk.
            expected: The sources whose pushes complete a new slot (empty where
                ``owner`` is another shard and this one relays for no one).

        Raises:
            ShardProtocolError: If the push does not fit the slot's step or shape.
        """
        state = self._model(model)
        slot = state.slots.get((key, step % 2))
        where = f"shard {self.shard_index}: model {model}: step {step}, chunk at byte {key}"
        if slot is not None and slot.step == step:
            if slot.acc.shape != grad.shape or slot.acc.dtype != grad.dtype:
                raise ShardProtocolError(
                    f"{where} got {grad.dtype}{list(grad.shape)} after {slot.acc.dtype}"
                    f"{list(slot.acc.shape)}; the workers' models differ."
                )
            return slot
        if slot is not None and slot.step > step:
            raise ShardProtocolError(
                f"{where}: the push arrived after step {slot.step}; the workers are out of step."
            )
        if slot is not None and not slot.done.is_set():
            missing = ", ".join(self._describe(s) for s in sorted(slot.expected - slot.ranks))
            raise ShardProtocolError(
                f"{where} started while step {slot.step} still waits for "
                f"{missing or 'the owner shard'}."
            )
        # The sum is accumulated in the output segment itself where the segment holds
        # it in the dtype the shard computes in (not bfloat16 patterns).
        shared = bool(state.outputs) and storage(dtype) == grad.dtype
        if shared:
            acc = state.output_view(step, key, grad.dtype, grad.size)
        elif slot is not None and slot.acc.shape == grad.shape and slot.acc.dtype == grad.dtype:
            acc = slot.acc  # reuse the buffer: no allocation in the steady state
        else:
            acc = np.empty_like(grad)
        if owner != self.shard_index and not expected:
            raise ShardProtocolError(
                f"{where} is owned by shard {owner}, and this shard relays for no one."
            )
        slot = Slot(step=step, acc=acc, expected=expected, owner=owner, shared=shared)
        state.slots[(key, step % 2)] = slot
        return slot

    def share(self, model: int, slot: Slot, key: int, dtype: str) -> None:
        """Places a finished slot's sum where this node's workers read it: moves the
        accumulator into the model's output segment, or, where the segment holds the
        sum in another form (bfloat16 patterns), points ``slot.out`` at its place.

        Moving is needed when the slot began before a worker attached (only possible
        in step 1).
        """
        state = self._models[model]
        if not state.outputs or slot.shared or slot.out is not None:
            return
        held = storage(dtype)
        out = state.output_view(slot.step, key, held, slot.acc.size)
        if held == slot.acc.dtype:
            np.copyto(out, slot.acc)
            slot.acc, slot.shared = out, True
        else:
            slot.out = out

    def complete(self, model: int, slot: Slot, key: int, dtype: str) -> None:
        """Makes the finished sum readable by every worker, then releases them."""
        self.share(model, slot, key, dtype)
        if slot.out is not None:
            # bfloat16: the patterns go into the output segment, and are the encoded
            # format as well (bfloat16 travels as bfloat16).
            self._codec.encode_np(slot.acc, dtype, out=slot.out)
            slot.encoded = slot.out
        elif self._codec.converts(dtype) and slot.by_message:
            # Some workers receive the sum by message: round it once, in place, so a
            # worker reading shared memory gets exactly the values they decode. (When
            # every worker shares memory, nothing is encoded and nothing rounded.)
            # A lossy encoding keeps this shard's error for the chunk's next sum.
            feedback_key = self._codec.chunk_key(model, slot.step, key)
            slot.encoded = self._codec.encode_rounded(slot.acc, dtype, feedback_key)
        slot.done.set()
