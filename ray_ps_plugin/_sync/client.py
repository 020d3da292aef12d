"""The sync-mode worker client: DDP's gradient buckets through the summation shards.

One synchronous step, top to bottom:

1. ``loss.backward()`` fills DDP's gradient buckets; as each bucket becomes ready
   DDP calls :meth:`SumClient.hook` on the autograd thread.
2. The hook divides the bucket by the world size (as DDP's all-reduce hook does),
   cuts it into chunks with :class:`~ray_ps_plugin._sync.layout.StreamLayout` and
   submits one non-blocking push per chunk to the chunk's shard. Backward carries on
   computing the next buckets while the chunks travel.
3. A per-model communication thread waits (with a timeout) for the shards' sums and
   writes them back into the bucket, completing the future DDP holds.
4. At the end of backward DDP copies the summed buckets into ``param.grad``; the
   user's optimizer then steps locally, exactly as under DDP.

A failed round never fails DDP's future: torch would re-raise it from ``backward()``
as a ``RuntimeError`` with a mangled message. The future completes, the error is
kept, and it is raised as the original :class:`~ray_ps_plugin.PSError` at the end
of the same ``backward()`` (an autograd callback) — and again before any optimizer
step or forward pass, so no step is ever taken on a failed sum.
"""

# No ``from __future__ import annotations`` here: DDP inspects the hook's
# annotations at register time and refuses string annotations.
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ray_ps_plugin._client import ClientBase, ClientSetup
from ray_ps_plugin._codec import Codec, as_torch
from ray_ps_plugin._dtypes import storage
from ray_ps_plugin._errors import PSError
from ray_ps_plugin._nonfinite import all_finite
from ray_ps_plugin._sparse import sparse_params
from ray_ps_plugin._sync.layout import Chunk, StreamLayout, plan_layout, relay_groups
from ray_ps_plugin._sync.rows import PendingRows, RowBatch
from ray_ps_plugin._sync.topology import Route, Topology
from ray_ps_plugin._torch_compat import queue_autograd_callback
from ray_ps_plugin._transport import DirectPath, Lane, Transport, open_lanes, wait_all

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

__all__ = ["SumClient"]

logger = logging.getLogger(__name__)


def _np_dtype(t: torch.Tensor) -> str:
    """The name of a bucket's dtype (one of ``_dtypes.MODEL_DTYPES``)."""
    return str(t.dtype).removeprefix("torch.")


@dataclass
class _Pending:
    step: int
    bucket: torch.Tensor
    pieces: tuple[Chunk, ...]
    handles: list[Any]
    future: torch.futures.Future[torch.Tensor]
    started: float
    #: The shard of this node whose output segment holds the whole bucket's sum
    #: (``None``: the sum is assembled in the bucket itself).
    in_place: int | None = None

    @property
    def shards(self) -> list[int]:
        return sorted({p.shard for p in self.pieces})

    def release(self) -> None:
        """Completes the future if it is not yet (DDP must never wait forever)."""
        if not self.future.done():
            self.future.set_result(self.bucket)


@dataclass
class _Received:
    """What a bucket's returned calls brought: bytes, cross-node bytes, finiteness."""

    nbytes: int = 0
    cross: int = 0
    finite: bool = True


class SumClient(ClientBase):
    """Routes one prepared model's DDP gradient buckets through the shards.

    Args:
        setup: The model, its worker and the run (see :class:`ClientSetup`).
        layout: Where each chunk goes (and so how many shards there are).
        transport: How calls reach the shards.
        lanes: Shards of this node reached through shared memory, by shard index;
            the others are reached through the object store or the direct path.
        routes: Where the chunks of each owner shard go (see
            :class:`~ray_ps_plugin._sync.topology.Topology`); by default each to its
            owner.
        direct: The direct data path to other nodes' shards, if the run has one.
        rows_direct: The direct path for sparse rows (also on one node).
    """

    def __init__(
        self,
        setup: ClientSetup,
        layout: StreamLayout,
        transport: Transport,
        lanes: dict[int, Lane],
        routes: list[Route] | None = None,
        direct: DirectPath | None = None,
        rows_direct: DirectPath | None = None,
    ) -> None:
        super().__init__(setup, layout.num_shards, check_local=False)
        self._transport = transport
        self._layout = layout
        self._lanes = dict(lanes)
        self._routes = routes or [
            Route(s, direct=s in setup.remote_shards) for s in range(layout.num_shards)
        ]
        # The direct path to other nodes' shards (the process's, shared by its
        # models and closed with its transport); where it exists, the notices for
        # this node's shards go on it too (else they are Ray calls).
        self._direct = direct
        self._rows_direct = rows_direct if rows_direct is not None else direct
        self._codec = Codec(setup.settings.compression)
        self._stream_offset = 0
        self._warned_no_callback = False
        self._round: list[torch.futures.Future[torch.Tensor]] = []  # this step's futures
        self._queue: queue.Queue[_Pending | PendingRows | None] = queue.Queue()
        self._rows = RowBatch(setup.module, layout.num_shards, self._codec)
        self._thread = threading.Thread(
            target=self._complete_loop,
            name=f"ps-comm-rank{self.rank}-model{self.model_id}",
            daemon=True,
        )
        self._thread.start()

    @classmethod
    def build(cls, setup: ClientSetup, transport: Transport) -> "SumClient":
        """Lays out the model's gradient stream and attaches the local shards."""
        # Sparse tables travel as their touched rows, outside the dense stream.
        sparse = {id(p) for p in sparse_params(setup.module)}
        total = sum(p.numel() * p.element_size() for p in setup.params if id(p) not in sparse)
        if total == 0 and sparse:
            # Sparse tables only: a stream of one element that no bucket ever cuts, so
            # the layout (and its checks) stay as for every other model.
            total = 4
        topology: Topology | None = setup.topology
        relay = None
        if topology is not None:
            relay = topology.relay_of(topology.worker_nodes[setup.rank])
        # Whether any chunk of the run crosses nodes on the direct path; the same
        # answer on every worker, so every worker cuts the stream alike.
        direct = topology is not None and topology.dense_direct
        layout = plan_layout(
            total,
            setup.num_shards,
            setup.settings.chunk_bytes,
            setup.world_size,
            relays=topology is not None and topology.has_relays,
            direct=direct,
        )
        # The segment covers the shard's byte range plus slack: a chunk's last
        # element may end a few bytes past the range when the range is not aligned.
        # The node's relay also receives every other node's range: the whole stream.
        spans = {
            s: (0, layout.total_bytes + 16)
            if s == relay
            else (layout.bounds[s], layout.bounds[s + 1] - layout.bounds[s] + 16)
            for s in setup.local_shards
        }
        lanes = open_lanes(transport, setup.model_id, spans, setup.rank)
        routes = None
        if topology is not None:
            # Without shared memory with the relay, chunks still go to it (through
            # the object store): the owners count this node's partial sum, not ranks.
            routes = [topology.route(setup.rank, s) for s in range(layout.num_shards)]
        # Every shard listens when the run has the direct path: chunks for other
        # nodes go there, and so do the notices for this node's shards. On one node
        # only the sparse rows take it.
        return cls(
            setup,
            layout,
            transport,
            lanes,
            routes,
            transport.direct if direct else None,
            rows_direct=transport.direct,
        )

    def bind(self, ddp: "DistributedDataParallel") -> None:
        """Replaces DDP's all-reduce with :meth:`hook`; DDP keeps its buckets."""
        ddp.register_comm_hook(None, self.hook)

    def hook(
        self,
        state: object,
        bucket: torch.distributed.GradBucket,  # type: ignore[name-defined]
    ) -> torch.futures.Future[torch.Tensor]:
        """DDP communication hook: push this bucket's chunks, return the sum's future."""
        buf = bucket.buffer()
        if bucket.index() == 0:
            self._open_round()
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._round.append(fut)
        if buf.is_sparse:
            (param,) = bucket.parameters()  # DDP gives a sparse parameter a bucket of its own
            self._rows.hold(param, buf, fut)
        elif buf.numel() == 0:
            # A bucket of empty parameters carries nothing to synchronise.
            fut.set_result(buf)
        else:
            self._push_dense(buf, fut)
        if self._rows and bucket.is_last():
            self._push_rows()
        return fut

    def _push_dense(self, buf: torch.Tensor, fut: torch.futures.Future[torch.Tensor]) -> None:
        """Pushes a dense bucket's chunks to their shards, by their routes."""
        step = self._stats.steps
        pieces = self._layout.cut(self._stream_offset, buf.numel(), buf.element_size())
        self._stream_offset += buf.numel() * buf.element_size()
        routes = [self._routes[p.shard] for p in pieces]
        remote = sum(1 for r in routes if r.target not in self._lanes)
        dtype = _np_dtype(buf)
        handles: list[Any] = [None] * len(pieces)
        staged, host = self._stage(buf, remote, len(pieces))
        # Chunks for other nodes first: their pushes only enter a queue, and the
        # network is the slow part. Then one notice per shard of this node.
        local = self._push_remote(step, buf, dtype, host, pieces, routes, handles)
        calls = self._push_local(step, buf, dtype, staged, pieces, local, handles)
        self._count_bucket(buf, dtype, pieces, routes, messages=remote + calls)
        # A CPU bucket summed entirely by one shard of this node (always so under a
        # relay, which covers the whole stream) lies contiguous in that shard's
        # output segment: DDP reads it there, and the worker copies nothing.
        in_place = None
        if not buf.is_cuda and len(local) == 1 and not remote:
            (in_place,) = local
        self._queue.put(_Pending(step, buf, pieces, handles, fut, time.perf_counter(), in_place))

    def _push_rows(self) -> None:
        """Sends the step's sparse tables' rows, all tables in one call per shard."""
        pending, sent = self._rows.send(
            self._transport,
            self._rows_direct,
            self.model_id,
            self._stats.steps,
            self.rank,
            self.world_size,
        )
        if pending is None:
            return
        with self._lock:
            for shard, nbytes in enumerate(sent):
                self._count_push(shard, nbytes)
            self._stats.pushes += len(sent)
        self._queue.put(pending)

    def _complete_rows(self, item: PendingRows) -> None:
        """Waits for every shard's summed rows and hands DDP the summed sparse gradients."""
        sums, received = self._rows.complete(
            self._transport, item, self.settings.ps_timeout_s, self._where(item)
        )
        if self.guard.policy != "ignore" and not all(all_finite(g) for g in sums):
            self.guard.flag(item.step)  # every worker holds the same sums and flags alike
        with self._lock:
            self._stats.bytes_pulled += sum(received)
            self._stats.bytes_cross_node += sum(
                n for s, n in enumerate(received) if s in self.remote_shards
            )
            self._stats.last_sync_s = time.perf_counter() - item.started
        for fut, grad in zip(item.futures, sums):
            fut.set_result(grad)

    def _open_round(self) -> None:
        """Starts a synchronisation round (DDP hands buckets over in index order, so
        bucket 0 comes first)."""
        self._stream_offset = 0
        with self._lock:
            self._stats.steps += 1
            self._stats.clock = self._stats.steps
        self._round = []
        self._queue_error_check()

    def _stage(
        self, buf: torch.Tensor, remote: int, num_pieces: int
    ) -> tuple[torch.Tensor | None, np.ndarray | None]:
        """Divides a GPU bucket by the world size on the device and stages it on the
        host: ``(staged, host)``, the full-precision copy for shared memory and the
        encoded one for the network, each ``None`` where no chunk needs it.

        Workers divide by the world size before pushing, as DDP's all-reduce hook
        does. A CPU bucket is not staged: a chunk bound for shared memory is divided
        straight into it (one pass instead of two), a chunk for the network in place
        just before it is sent, so the first bytes leave while later chunks are
        still being divided.
        """
        if not buf.is_cuda:
            return None, None
        buf.div_(self.world_size)
        staged = buf.cpu() if remote < num_pieces else None
        # Compression encodes 16-bit values for the network only: shared memory
        # carries full precision, since no network is involved.
        host = self._codec.encode(buf) if remote else None  # one host copy
        return staged, host

    def _push_remote(
        self,
        step: int,
        buf: torch.Tensor,
        dtype: str,
        host: np.ndarray | None,
        pieces: Sequence[Chunk],
        routes: Sequence[Route],
        handles: list[Any],
    ) -> dict[int, list[int]]:
        """Sends the chunks for shards without shared memory (on the direct path or
        as Ray calls) into ``handles``; returns the others' indices per local shard."""
        local: dict[int, list[int]] = {}
        for i, (p, route) in enumerate(zip(pieces, routes)):
            if route.target in self._lanes:
                local.setdefault(route.target, []).append(i)
                continue
            # The owner rides along only to a relay (the shard itself by default).
            relayed = () if route.target == p.shard else (p.shard,)
            chunk = (
                self._codec.encode(buf[p.start : p.stop].div_(self.world_size))
                if host is None
                else host[p.start : p.stop]
            )
            if route.direct and self._direct is not None:
                handles[i] = self._direct.push(
                    route.target, self.model_id, step, p.key, self.rank, dtype, chunk
                )
            else:
                handles[i] = self._transport.call(
                    route.target,
                    "push_pull",
                    self.model_id,
                    step,
                    p.key,
                    self.rank,
                    chunk,
                    dtype,
                    *relayed,
                )
        return local

    def _push_local(
        self,
        step: int,
        buf: torch.Tensor,
        dtype: str,
        staged: torch.Tensor | None,
        pieces: Sequence[Chunk],
        local: dict[int, list[int]],
        handles: list[Any],
    ) -> int:
        """Writes the chunks for shards of this node into their shared memory and
        sends each one notice per group (a frame on the shard's socket where the run
        has the direct path, else a Ray call); returns the number of notices."""
        calls = 0
        for target, indices in local.items():
            lane = self._lanes[target]
            # A relay's chunks for other nodes go first and in growing groups (see
            # relay_groups); the shard's own chunks wait for nobody on the link.
            forwarded = [i for i in indices if pieces[i].shard != target]
            own = [i for i in indices if pieces[i].shard == target]
            sizes = [pieces[i].numel * buf.element_size() for i in forwarded]
            groups = [[forwarded[j] for j in g] for g in relay_groups(sizes)]
            for group in [*groups, own] if own else groups:
                chunks = []
                for i in group:
                    p = pieces[i]
                    dst = as_torch(lane.inputs.view(p.key - lane.lo, storage(dtype), p.numel))
                    if staged is None:
                        torch.div(buf[p.start : p.stop], self.world_size, out=dst)
                    else:
                        dst.copy_(staged[p.start : p.stop])
                    chunks.append((p.key, p.numel, None if target == p.shard else p.shard))
                if self._direct is not None and self._direct.reaches(target):
                    # A Ray call and its reply sit at the start and at the end of the
                    # step's transfer, where on a loaded machine they cost far more
                    # than a frame on this open socket (docs/benchmarks.md, 2 nodes ×
                    # 2 workers, 1 Gbit/s).
                    call = self._direct.push_local(
                        target, self.model_id, step, self.rank, dtype, chunks
                    )
                else:
                    call = self._transport.call(
                        target, "push_local", self.model_id, step, self.rank, dtype, chunks
                    )
                calls += 1
                for i in group:
                    handles[i] = call  # one reply for all of them
        return calls

    def _count_bucket(
        self,
        buf: torch.Tensor,
        dtype: str,
        pieces: Sequence[Chunk],
        routes: Sequence[Route],
        messages: int,
    ) -> None:
        """Adds a bucket's bytes per shard and its messages (one per chunk sent
        elsewhere, one per notice to a shard of this node) to the counters."""
        encoded_itemsize = np.dtype(self._codec.encoded_np_dtype(dtype)).itemsize
        with self._lock:
            for p, route in zip(pieces, routes):
                by_message = route.target not in self._lanes
                self._count_push(
                    route.target, p.numel * (encoded_itemsize if by_message else buf.element_size())
                )
            self._stats.pushes += messages

    def _queue_error_check(self) -> None:
        """Raises a failed round's error from this ``backward()`` itself.

        The callback runs once the whole graph has run, so every bucket of the round
        has been handed to the hook. It waits for the round's futures (the comm
        thread completes each within ``ps_timeout_s`` plus the pings, whatever
        happens; DDP waits for the same futures next) and raises a kept error, which
        autograd passes to the caller of ``backward()`` unchanged.
        """
        round_ = self._round

        def check() -> None:
            for fut in round_:
                fut.wait()
            self.raise_pending()

        if not queue_autograd_callback(check) and not self._warned_no_callback:
            self._warned_no_callback = True
            logger.warning(
                "rank %d: could not queue a callback on autograd's engine (torch %s); a "
                "failed synchronisation round surfaces at the next step or forward pass "
                "instead of in backward().",
                self.rank,
                torch.__version__,
            )

    def _complete_loop(self) -> None:
        """Completes bucket futures in submission order (the order DDP waits in).

        Every future is completed whatever happens, or DDP would wait forever at the
        end of backward; a failure is kept and raised by :meth:`raise_pending`.
        """
        while (item := self._queue.get()) is not None:
            try:
                if isinstance(item, PendingRows):
                    self._complete_rows(item)
                else:
                    self._complete(item)
            except PSError as e:
                self.fail(e)
            except Exception as e:
                self.fail(
                    PSError(f"{self._where(item)}: server shard(s) {item.shards} failed: {e}")
                )
            finally:
                item.release()
            try:
                if self._metrics is not None and self._metrics.due():
                    self._metrics.export(self.snapshot())
            except Exception:
                logger.debug("metrics export failed", exc_info=True)

    def _where(self, item: _Pending | PendingRows) -> str:
        return f"rank {self.rank}: model {self.model_id}: step {item.step}"

    def _complete(self, item: _Pending) -> None:
        """Waits for a bucket's sums and writes them into it, call by call.

        The sums of one call (a chunk on the network, or a group of chunks through
        shared memory) are copied and checked as soon as that call returns, while
        later ones still travel: for the bucket that closes backward — most of a
        small model — the copy is then off the step's critical path. The whole
        bucket stays bounded by one ``ps_timeout_s``.
        """
        targets = [self._routes[p.shard].target for p in item.pieces]
        calls: dict[int, list[int]] = {}  # one entry per distinct call, in order
        for i, h in enumerate(item.handles):
            calls.setdefault(id(h), []).append(i)
        groups = list(calls.values())
        deadline = time.monotonic() + self.settings.ps_timeout_s
        got = _Received()
        for k, indices in enumerate(groups):
            result = self._wait_call(item, groups[k:], targets, deadline)
            self._take_sums(item, indices, targets[indices[0]], result, got)
        bucket = item.bucket if item.in_place is None else self._in_place_sum(item, got)
        if not got.finite:
            # Every worker holds the same sum, so every worker flags the same step.
            self.guard.flag(item.step)
        with self._lock:
            self._stats.bytes_pulled += got.nbytes
            self._stats.bytes_cross_node += got.cross
            self._stats.last_sync_s = time.perf_counter() - item.started
        item.future.set_result(bucket)

    def _wait_call(
        self, item: _Pending, groups: list[list[int]], targets: list[int], deadline: float
    ) -> Any:
        """The result of the call of ``groups[0]`` (its pieces' indices), by ``deadline``.

        On a timeout or failure the culprit is named among every call still
        outstanding (a stuck shard may be a later one that this call's shard waits
        for), within the bucket's one bound.
        """
        first = groups[0][0]
        try:
            (result,) = self._transport.wait(
                [item.handles[first]], max(0.0, deadline - time.monotonic())
            )
        except Exception:
            rest = [g[0] for g in groups]
            (result, *_) = wait_all(
                self._transport,
                [item.handles[i] for i in rest],
                [targets[i] for i in rest],
                self.settings.ps_timeout_s,
                self._where(item),
                deadline,
            )
        return result

    def _take_sums(
        self, item: _Pending, indices: list[int], target: int, result: Any, got: _Received
    ) -> None:
        """Copies the sums of one returned call into the bucket (unless DDP reads
        them in place) and counts and checks them."""
        bucket = item.bucket
        dtype = _np_dtype(bucket)
        held, encoded = storage(dtype), self._codec.encoded_np_dtype(dtype)
        lane = self._lanes.get(target)
        for i in indices:
            p = item.pieces[i]
            if lane is not None and item.in_place is not None:
                got.nbytes += p.numel * bucket.element_size()  # DDP reads it in place
                continue
            if lane is not None:
                r = lane.outputs[item.step % 2].view(p.key - lane.lo, held, p.numel)
                bucket[p.start : p.stop].copy_(as_torch(r))
            else:
                r = result.view(encoded) if result.dtype == np.uint8 else result
                bucket[p.start : p.stop].copy_(self._codec.decode(r, bucket.dtype))
            if self.guard.policy != "ignore" and got.finite:
                got.finite = all_finite(bucket[p.start : p.stop])
            got.nbytes += r.nbytes
            if target in self.remote_shards:
                got.cross += r.nbytes

    def _in_place_sum(self, item: _Pending, got: _Received) -> torch.Tensor:
        """The bucket's sum as a view of the one shard's output segment (checked).

        The shard writes this parity's segment again only for step + 2, which no
        worker pushes before every worker's DDP has read this sum.
        """
        assert item.in_place is not None
        lane = self._lanes[item.in_place]
        first = item.pieces[0]
        held = storage(_np_dtype(item.bucket))
        view = lane.outputs[item.step % 2].view(first.key - lane.lo, held, item.bucket.numel())
        bucket = as_torch(view)
        if self.guard.policy != "ignore":
            got.finite = all_finite(bucket)
        return bucket

    @property
    def next_step(self) -> int:
        """The synchronisation round the optimizer is about to apply."""
        return self._stats.steps

    @property
    def shared_memory_shards(self) -> tuple[int, ...]:
        return tuple(sorted(self._lanes))

    def close(self) -> None:
        """Stops the communication thread (waits at most ``ps_timeout_s``)."""
        self._queue.put(None)
        self._thread.join(self.settings.ps_timeout_s)
        lanes, self._lanes = self._lanes, {}
        for lane in lanes.values():
            lane.close()
