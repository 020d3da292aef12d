"""The sync-mode shard: BytePS's summation server, one Ray actor per shard.

Every worker pushes its chunk ``key`` of step ``step``; the shard sums the pushes
into one accumulator and, once all workers have pushed, answers every one of them
with the sum. Workers divide by the world size *before* pushing, exactly as DDP's
default hook does before its all-reduce, so the result is DDP's arithmetic.

Each prepared model of the run has its own accumulators and shared-memory segments
on the shard (:mod:`ray_ps_plugin._sync.sums`, keyed by the model's id), so two
models with equal shapes never mix their sums.

Across nodes (see :mod:`ray_ps_plugin._sync.topology`) a shard also listens on a
direct TCP data path (:mod:`ray_ps_plugin._wire`) and, if it is its node's
relay, first sums its node's workers' chunks for other nodes' shards and sends one
partial sum per chunk to the owner; likewise their sparse rows, one message per owner
and step (:mod:`ray_ps_plugin._sync.row_relay`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np

from ray_ps_plugin._codec import Codec
from ray_ps_plugin._dtypes import BF16_BITS, bf16_to_f32
from ray_ps_plugin._errors import ShardProtocolError, ShardTimeoutError
from ray_ps_plugin._rows import RowEntry, RowSums, pack, unpack
from ray_ps_plugin._shm import SegmentHandle
from ray_ps_plugin._sync.row_relay import RowRelay
from ray_ps_plugin._sync.sums import ChunkSums, Slot
from ray_ps_plugin._sync.topology import Topology
from ray_ps_plugin._tables.host import TableHost
from ray_ps_plugin._types import DEFAULT_LOWRANK_RANK, DEFAULT_TOPK_RATIO, Compression
from ray_ps_plugin._wire.frames import LOCAL, ROWS, Frame, rows_owner, unpack_local
from ray_ps_plugin._wire.streams import WireStreams, await_answer, relay_failure

__all__ = ["SumShard"]

#: The answer to a local push: the sums are in shared memory.
_NO_DATA = np.empty(0, np.uint8)


class SumShard(TableHost):
    """Sums one shard's gradient chunks across workers (sync mode).

    Args:
        shard_index: This shard's index, used in error messages.
        num_workers: Number of workers whose pushes make up one step.
        timeout_s: How long a push waits for the other workers before it fails.
        compression: The encoding of pushes and sums in messages.
        topk_ratio: The fraction of values ``compression="topk"`` sends.
        lowrank_rank: The rank of ``compression="lowrank"``'s factors.
    """

    def __init__(
        self,
        shard_index: int,
        num_workers: int,
        timeout_s: float,
        compression: Compression | None = None,
        topk_ratio: float = DEFAULT_TOPK_RATIO,
        lowrank_rank: int = DEFAULT_LOWRANK_RANK,
    ) -> None:
        super().__init__(shard_index, num_workers, timeout_s)
        self._codec = Codec(compression, topk_ratio, lowrank_rank)
        self._topology: Topology | None = None
        self._own_sources = frozenset(range(num_workers))
        self._relayed: frozenset[int] = frozenset()
        self._relay_streams: WireStreams | None = None
        self._sums = ChunkSums(shard_index, self._codec, self._describe)
        self._rows = RowSums(shard_index, num_workers, timeout_s, self._describe)
        self._row_relay: RowRelay | None = None

    async def configure(self, topology: Topology) -> None:
        """Learns the run's topology: which sources complete its chunks, for which
        workers it relays, and where the other shards listen."""
        if topology.num_workers != self.num_workers:
            raise ShardProtocolError(
                f"shard {self.shard_index}: topology of {topology.num_workers} workers, "
                f"expected {self.num_workers}."
            )
        self._topology = topology
        self._own_sources = topology.sources(self.shard_index)
        self._rows.sources = self._own_sources
        self._relayed = topology.relayed_ranks(self.shard_index)
        if self._relayed and topology.addresses:
            self._relay_streams = WireStreams(topology.addresses, topology.token, self.timeout_s)
            self._row_relay = RowRelay(
                self.shard_index, self._relayed, self._codec, self.timeout_s, self._forward_rows
            )

    def _describe(self, source: int) -> str:
        if self._topology is None:
            return f"worker {source}"
        return self._topology.describe(source)

    async def _on_frame(self, frame: Frame, payload: np.ndarray) -> np.ndarray:
        """A push that came on the direct path: from a worker of another node
        that has no relay, or from another node's relay; or a local push, from a
        worker of this node whose chunks lie in shared memory; or a worker's sparse
        rows, or its pull or push of a sharded table's rows."""
        if frame.kind == ROWS:
            entries = unpack(payload)
            owner = rows_owner(frame.key)
            if owner is not None:
                return await self._relay_rows(frame, owner, entries)
            answers = await self.push_rows(frame.model, frame.step, frame.source, entries)
            return pack([(e[0], e[1], r, v, e[4]) for e, (r, v) in zip(entries, answers)])
        answer = await self.table_frame(frame, payload)
        if answer is not None:
            return answer
        if frame.kind == LOCAL:
            chunks = unpack_local(payload)
            await self.push_local(frame.model, frame.step, frame.source, frame.dtype, chunks)
            return _NO_DATA
        # A frame's source is a rank or a relay's id; it is checked against the
        # topology instead of the rank range.
        self._check(frame.model, None, frame.dtype)
        if frame.source not in self._own_sources:
            raise ShardProtocolError(
                f"shard {self.shard_index}: source {frame.source} "
                f"({self._describe(frame.source)}) does not push to this shard directly."
            )
        encoded = payload.view(self._codec.encoded_np_dtype(frame.dtype))
        values = self._codec.decode_np(encoded, frame.dtype)
        with self._queued():
            out = await self._push_pull(
                frame.model,
                frame.step,
                frame.key,
                frame.source,
                values,
                frame.dtype,
                payload.nbytes,
                True,
            )
        assert out is not None
        return out

    def attach(
        self, model: int, rank: int, inputs: SegmentHandle, lo: int, nbytes: int
    ) -> tuple[SegmentHandle, ...]:
        """Connects a worker of this node through shared memory, for one model.

        From then on the worker writes its chunks into its ``inputs`` segment and
        calls :meth:`push_local` with only the chunks' coordinates; it reads the sum
        from the returned output segments (byte ``key - lo`` of segment
        ``step % 2``).

        Args:
            model: The prepared model's id.
            rank: The worker's world rank.
            inputs: The worker's segment for this shard's range of the stream.
            lo: Stream byte at which the segments start.
            nbytes: Size of this shard's segments.

        Returns:
            Handles of the two output segments (even steps, odd steps).

        Raises:
            ShardProtocolError: If workers describe the shard's range differently.
        """
        self._check(model, rank)
        return self._sums.attach(model, rank, inputs, lo, nbytes)

    async def push_local(
        self,
        model: int,
        step: int,
        rank: int,
        dtype: str,
        chunks: Sequence[tuple[int, int, int | None]],
    ) -> None:
        """Like :meth:`push_pull` for a worker attached through shared memory, for
        every chunk of one bucket that the worker sends to this shard.

        One call per (bucket, shard) rather than one per chunk: the chunks are small
        where they cross nodes on the direct path (1 MiB), and every Ray call costs
        the worker's backward pass its submission (see docs/benchmarks.md). Where the run has the
        direct path the same call arrives as a local push frame on the shard's
        socket (:meth:`_on_frame`) instead of through Ray. Each chunk is read from
        the worker's input segment; its sum is left in the output segment of
        ``step % 2``; the reply, once every chunk is summed, carries no data.

        Args:
            model: The prepared model's id.
            step: The worker's synchronisation round, counted from 1.
            rank: The pushing worker's world rank.
            dtype: The model's gradient dtype.
            chunks: ``(key, numel, owner)`` of each chunk: its byte offset in the
                stream, its element count, and the shard that owns it when this
                shard relays it (``None``: this one).

        Raises:
            ShardTimeoutError: If a chunk's other pushes do not come in time.
            ShardProtocolError: If an argument is out of range, or the worker did not
                attach.
        """
        self._check(model, rank, dtype)
        grads = self._sums.input_views(model, rank, dtype, chunks)
        with self._queued():
            await asyncio.gather(
                *(
                    self._push_pull(
                        model, step, key, rank, _values(grad), dtype, grad.nbytes, False, owner
                    )
                    for key, grad, owner in grads
                )
            )

    async def push_pull(
        self,
        model: int,
        step: int,
        key: int,
        rank: int,
        grad: np.ndarray,
        dtype: str,
        owner: int | None = None,
    ) -> np.ndarray:
        """Adds one worker's chunk and returns the sum once all workers pushed it.

        A second push of the same (step, key) by the same rank — a retried or
        duplicated message — is not added again; it just receives the sum.

        Args:
            model: The prepared model's id.
            step: The worker's synchronisation round, counted from 1.
            key: The chunk's byte offset in the model's gradient stream.
            rank: The pushing worker's world rank.
            grad: The chunk, already divided by the world size, in the encoded format.
            dtype: The model's gradient dtype, in which the shard sums.
            owner: The shard that owns the chunk, when this shard is the pushing
                worker's relay for it (``None``: this one).

        Returns:
            The sum of all workers' chunks for this step, in the encoded format.

        Raises:
            ShardTimeoutError: If the other workers do not push within the timeout.
            ShardProtocolError: If the step does not follow the chunk's current
                step, or an argument is out of range.
        """
        self._check(model, rank, dtype)
        with self._queued():
            values = self._codec.decode_np(grad, dtype)  # sums in the model's dtype
            out = await self._push_pull(
                model, step, key, rank, values, dtype, grad.nbytes, True, owner
            )
        assert out is not None  # a push by message is answered by message
        return out

    async def _push_pull(
        self,
        model: int,
        step: int,
        key: int,
        rank: int,
        grad: np.ndarray,
        dtype: str,
        nbytes: int,
        by_message: bool,
        owner: int | None = None,
    ) -> np.ndarray | None:
        owner = self.shard_index if owner is None else owner
        expected = self._own_sources if owner == self.shard_index else self._relayed
        slot = self._sums.slot_for(model, step, key, grad, dtype, owner, expected)
        if rank not in slot.expected:
            raise ShardProtocolError(
                f"shard {self.shard_index}: model {model}: step {step}, chunk at byte {key}: "
                f"{self._describe(rank)} is not one of the sources of this chunk "
                f"(owner shard {owner}); the workers disagree on the topology."
            )
        slot.by_message = slot.by_message or by_message
        if rank in slot.ranks:
            self._duplicates += 1
        else:
            if slot.ranks:
                np.add(slot.acc, grad, out=slot.acc)
            else:
                np.copyto(slot.acc, grad)
            slot.ranks.add(rank)
            self._pushes += 1
            self._bytes_in += nbytes
            if len(slot.ranks) == len(slot.expected):
                if owner == self.shard_index:
                    self._sums.complete(model, slot, key, dtype)
                else:
                    await self._relay(model, slot, key, dtype)
        if not slot.done.is_set():
            try:
                await asyncio.wait_for(slot.done.wait(), self.timeout_s)
            except asyncio.TimeoutError:
                missing = ", ".join(self._describe(s) for s in sorted(slot.expected - slot.ranks))
                raise ShardTimeoutError(
                    f"shard {self.shard_index}: model {model}: step {step}, chunk at byte "
                    f"{key} waited {self.timeout_s:g}s for {missing or 'the owner shard'}; "
                    "a worker is stuck, dead or its model differs. Raise "
                    "PSConfig.ps_timeout_s if steps are slow."
                ) from None
        if slot.error is not None:
            raise slot.error
        if not by_message:
            self._bytes_out += slot.acc.nbytes if slot.out is None else slot.out.nbytes
            return None  # shared memory: the worker reads it there
        # A converted sum is in ``encoded`` (set on completion: this push came by message).
        answer = slot.acc if slot.encoded is None else slot.encoded
        self._bytes_out += answer.nbytes
        return answer

    async def push_rows(
        self, model: int, step: int, rank: int, tables: list[RowEntry]
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Adds one worker's touched rows of the model's sparse tables; returns, per
        table, the union of every worker's rows and their sums
        (see :class:`~ray_ps_plugin._rows.RowSums`).

        Args:
            model: The prepared model's id.
            step: The worker's synchronisation round.
            rank: The sending worker's world rank, or the source id of another
                node's relay (its node's rows, summed).
            tables: Per table of the step, a :data:`~ray_ps_plugin._rows.RowEntry`:
                the worker's sorted unique touched rows of this shard and their
                gradient rows (divided by the world size, encoded).

        Returns:
            ``(rows, sums)`` per table, the sums encoded.

        Raises:
            ShardProtocolError: If the sender is not one of this shard's sources
                (:class:`~ray_ps_plugin._rows.RowSums` names it), or an argument is
                out of range.
        """
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise ShardProtocolError(f"shard {self.shard_index}: rank {rank!r} is not an int.")
        for entry in tables:
            self._check(model, None, entry[4])
        with self._queued():
            self._pushes += 1
            self._bytes_in += sum(i.nbytes + v.nbytes for _, _, i, v, _ in tables)
            results = await asyncio.gather(
                *(
                    self._rows.push(
                        model, step, table, rank, split, indices, self._codec.decode_np(values, dt)
                    )
                    for table, split, indices, values, dt in tables
                )
            )
        answers = [
            (rows, self._codec.as_sent_np(sums, dt))
            for (rows, sums), (*_, dt) in zip(results, tables)
        ]
        self._bytes_out += sum(r.nbytes + v.nbytes for r, v in answers)
        return answers

    async def _relay_rows(self, frame: Frame, owner: int, entries: list[RowEntry]) -> np.ndarray:
        """A local worker's rows for another node's shard: summed with the node's
        other workers', sent on once; the owner's packed answer comes back."""
        self._check(frame.model, frame.source)
        for entry in entries:
            self._check(frame.model, None, entry[4])
        if self._row_relay is None or self._topology is None:
            raise ShardProtocolError(
                f"shard {self.shard_index} got rows to relay to shard {owner} but relays "
                "for no one; the workers disagree on the topology."
            )
        if not 0 <= owner < len(self._topology.shard_nodes) or owner == self.shard_index:
            raise ShardProtocolError(
                f"shard {self.shard_index}: rows to relay to shard {owner}, which is not "
                "another shard of the run."
            )
        with self._queued():
            self._pushes += 1
            self._bytes_in += sum(i.nbytes + v.nbytes for _, _, i, v, _ in entries)
            answer = await self._row_relay.push(
                frame.model, frame.step, owner, frame.source, entries
            )
        self._bytes_out += answer.nbytes
        return answer

    async def _forward_rows(
        self, owner: int, model: int, step: int, payload: np.ndarray
    ) -> np.ndarray:
        """Sends this node's summed rows to their owner (see :class:`RowRelay`)."""
        assert self._relay_streams is not None and self._topology is not None
        source = self._topology.relay_source(self.shard_index)
        return await asyncio.wrap_future(
            self._relay_streams.push_rows(owner, model, step, source, payload)
        )

    async def _relay(self, model: int, slot: Slot, key: int, dtype: str) -> None:
        """Sends this node's partial sum to the owner; leaves the answer for every
        local waiter. A failure fails all of them with the same error."""
        self._sums.share(model, slot, key, dtype)
        converts = self._codec.converts(dtype)
        try:
            if self._relay_streams is None or self._topology is None:
                raise ShardProtocolError(
                    f"shard {self.shard_index} got chunks to relay to shard {slot.owner} "
                    "but has no direct path to it."
                )
            push = asyncio.wrap_future(
                self._relay_streams.push(
                    slot.owner,
                    model,
                    slot.step,
                    key,
                    self._topology.relay_source(self.shard_index),
                    dtype,
                    # A lossy partial sum keeps its error here, per chunk, as a
                    # worker does for its pushes.
                    self._codec.encode_np(
                        slot.acc, dtype, key=self._codec.chunk_key(model, slot.step, key)
                    )
                    if converts
                    else slot.acc,
                    # Unconverted, the answer lands in the accumulator itself.
                    None if converts else slot.acc,
                )
            )
            raw = await await_answer(
                push,
                self.timeout_s,
                f"shard {self.shard_index}: model {model}: step {slot.step}, chunk at "
                f"byte {key}: owner shard {slot.owner} did not answer this node's "
                f"partial sum within {self.timeout_s:g}s.",
            )
            answer = raw.view(self._codec.encoded_np_dtype(dtype))
            if slot.out is not None:
                np.copyto(slot.out, answer)  # bfloat16 patterns, as this node reads them
            elif answer.ctypes.data != slot.acc.ctypes.data:
                np.copyto(slot.acc, self._codec.decode_np(answer, dtype))
            if converts and slot.by_message:
                slot.encoded = answer
        except Exception as e:
            slot.error = relay_failure(
                e, f"shard {self.shard_index}: relaying to shard {slot.owner}"
            )
        finally:
            slot.done.set()


def _values(held: np.ndarray) -> np.ndarray:
    """Values a worker left in shared memory, in the dtype the shard sums in."""
    return bf16_to_f32(held) if held.dtype == BF16_BITS else held
