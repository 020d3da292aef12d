"""One model's dense gradient stream in sync mode: buckets out to the shards, sums back.

:class:`DenseStream` carries out a bucket's :class:`~ray_ps_plugin._sync.plan.BucketPlan`
in both directions. On the autograd thread :meth:`DenseStream.push` stages the
bucket, writes the pieces for this node's shards into their shared memory with one
notice per group, and sends the others by value (the direct TCP path or a Ray
call). On the client's completion thread :meth:`DenseStream.complete` takes the
answers back in the bucket's byte order and writes the sums into it, or hands DDP
a view of the one shard's output segment that already holds them.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ray_ps_plugin._client import ClientSetup
from ray_ps_plugin._codec import Codec, as_torch
from ray_ps_plugin._dtypes import storage
from ray_ps_plugin._nonfinite import all_finite
from ray_ps_plugin._sparse import sparse_params
from ray_ps_plugin._sync.layout import StreamLayout, plan_layout
from ray_ps_plugin._sync.plan import BucketPlan, Send, plan_bucket
from ray_ps_plugin._sync.topology import Route
from ray_ps_plugin._transport import DirectPath, Handle, Lane, Transport, open_lanes, wait_all

__all__ = ["DenseStream", "Received", "dtype_name"]


def dtype_name(t: torch.Tensor) -> str:
    """The name of a bucket's dtype (one of ``_dtypes.MODEL_DTYPES``)."""
    return str(t.dtype).removeprefix("torch.")


@dataclass
class Received:
    """What a bucket's answers brought: bytes, cross-node bytes, finiteness."""

    nbytes: int = 0
    cross: int = 0
    finite: bool = True


class DenseStream:
    """Plans, sends and completes one model's dense gradient buckets.

    Args:
        setup: The model, its worker and the run (see :class:`ClientSetup`).
        layout: Where each chunk goes (and so how many shards there are).
        transport: How calls reach the shards.
        lanes: Shards of this node reached through shared memory, by shard index.
        routes: Where the chunks of each owner shard go (see
            :class:`~ray_ps_plugin._sync.topology.Topology`).
        direct: The run's direct path, if it has one: chunks for other nodes'
            shards and the notices for this node's take it.
    """

    def __init__(
        self,
        setup: ClientSetup,
        layout: StreamLayout,
        transport: Transport,
        lanes: dict[int, Lane],
        routes: Sequence[Route],
        direct: DirectPath | None,
    ) -> None:
        self._layout = layout
        self._transport = transport
        self.lanes = dict(lanes)
        self._routes = list(routes)
        self._direct = direct
        self._codec = Codec.of(setup.settings)
        self._model_id = setup.model_id
        self._rank = setup.rank
        self._world_size = setup.world_size
        self._remote_shards = setup.remote_shards
        self._timeout_s = setup.settings.ps_timeout_s
        self._offset = 0  # the next bucket's byte offset in this step's stream
        # Keyed by (stream offset, elements, dtype, on GPU): DDP keeps a handful of
        # buckets (it rebuilds them once, after the first step).
        self._plans: dict[tuple[int, int, str, bool], BucketPlan] = {}

    @classmethod
    def build(cls, setup: ClientSetup, transport: Transport) -> DenseStream:
        """Lays out the model's gradient stream and attaches this node's shards."""
        # Sparse tables travel as their touched rows, outside the dense stream.
        sparse = {id(p) for p in sparse_params(setup.module)}
        total = sum(p.numel() * p.element_size() for p in setup.params if id(p) not in sparse)
        if total == 0 and sparse:
            # Sparse tables only: a stream of one element that no bucket ever cuts, so
            # the layout (and its checks) stay as for every other model.
            total = 4
        topology = setup.topology
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
        if topology is not None:
            # Without shared memory with the relay, chunks still go to it (through
            # the object store): the owners count this node's partial sum, not ranks.
            routes = [topology.route(setup.rank, s) for s in range(layout.num_shards)]
        else:
            routes = [Route(s, direct=s in setup.remote_shards) for s in range(layout.num_shards)]
        # The notices to this node's shards take the direct path whenever the run
        # has one, on one node too: a frame on an open socket costs a fraction of a
        # Ray call and its reply. Only the layout depends on whether chunks cross.
        return cls(setup, layout, transport, lanes, routes, transport.direct)

    @property
    def codec(self) -> Codec:
        """How the chunks are encoded (with their error feedback, if lossy)."""
        return self._codec

    @property
    def num_shards(self) -> int:
        return self._layout.num_shards

    @property
    def routes(self) -> list[Route]:
        """Where this worker sends what each owner shard sums (by owner)."""
        return self._routes

    def open_round(self) -> None:
        """Starts a step's stream: the next bucket is the first."""
        self._offset = 0

    def push(self, step: int, buf: torch.Tensor) -> tuple[BucketPlan, list[Handle[Any]]]:
        """Sends a bucket's pieces as its plan says; returns the plan and one
        handle per send."""
        plan = self._plan(buf)
        self._offset += buf.numel() * buf.element_size()
        staged, host = self._stage(buf, plan)
        handles = [
            self._send_notice(step, buf, send, staged)
            if send.notice
            else self._send_piece(step, buf, send, host)
            for send in plan.sends
        ]
        return plan, handles

    def _plan(self, buf: torch.Tensor) -> BucketPlan:
        """The bucket's plan, made on its first step."""
        dtype = dtype_name(buf)
        key = (self._offset, buf.numel(), dtype, buf.is_cuda)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = plan_bucket(
                self._layout,
                self._routes,
                frozenset(self.lanes),
                self._direct.reaches if self._direct is not None else None,
                self._offset,
                buf.numel(),
                buf.element_size(),
                functools.partial(self._codec.encoded_nbytes, dtype),
                buf.is_cuda,
            )
        return plan

    def _stage(
        self, buf: torch.Tensor, plan: BucketPlan
    ) -> tuple[torch.Tensor | None, np.ndarray | None]:
        """Divides a GPU bucket by the world size on the device and stages it on the
        host: ``(staged, host)``, the full-precision copy for shared memory and the
        encoded one for messages, each ``None`` where no piece needs it.

        Workers divide by the world size before pushing, as DDP's all-reduce hook
        does. A CPU bucket is not staged: a piece bound for shared memory is divided
        straight into it (one pass instead of two), one sent by value in place just
        before it is sent, so the first bytes leave while later pieces are still
        being divided.
        """
        if not buf.is_cuda:
            return None, None
        buf.div_(self._world_size)
        if not plan.has_local:
            # Narrowed on the device first when compressed: half the bytes cross.
            return None, self._codec.encode(buf)
        # One copy to the host serves both: shared memory carries full precision
        # (no network is involved), messages its encoded form.
        staged = buf.cpu()
        return staged, self._codec.encode(staged) if plan.by_value else None

    def _send_piece(self, step: int, buf: torch.Tensor, send: Send, host: np.ndarray | None) -> Any:
        """Sends one piece by value, on the direct path or as a Ray call."""
        (p,) = send.pieces
        key = self._codec.chunk_key(self._model_id, step, p.key)
        if host is None:
            chunk = self._codec.encode_chunk(key, buf[p.start : p.stop].div_(self._world_size))
        else:
            # Staged on the host already divided (and narrowed where 16-bit); a
            # lossy encoding is applied per piece, where each piece's error is kept.
            chunk = self._codec.encode_chunk(key, host[p.start : p.stop])
        dtype = dtype_name(buf)
        if send.direct:
            assert self._direct is not None
            return self._direct.push(
                send.target, self._model_id, step, p.key, self._rank, dtype, chunk
            )
        return self._transport.call(
            send.target,
            "push_pull",
            self._model_id,
            step,
            p.key,
            self._rank,
            chunk,
            dtype,
            *send.relayed,
        )

    def _send_notice(
        self, step: int, buf: torch.Tensor, send: Send, staged: torch.Tensor | None
    ) -> Any:
        """Writes pieces into a shard of this node's shared memory and sends it one
        notice: a frame on the shard's socket where the run has the direct path (a
        Ray call and its reply cost far more on a loaded machine), else a Ray call."""
        lane = self.lanes[send.target]
        dtype = dtype_name(buf)
        for p in send.pieces:
            dst = as_torch(lane.inputs.view(p.key - lane.lo, storage(dtype), p.numel))
            if staged is None:
                torch.div(buf[p.start : p.stop], self._world_size, out=dst)
            else:
                dst.copy_(staged[p.start : p.stop])
        entries = list(send.entries)
        if send.direct:
            assert self._direct is not None
            return self._direct.push_local(
                send.target, self._model_id, step, self._rank, dtype, entries
            )
        return self._transport.call(
            send.target, "push_local", self._model_id, step, self._rank, dtype, entries
        )

    def complete(
        self,
        step: int,
        bucket: torch.Tensor,
        plan: BucketPlan,
        handles: list[Handle[Any]],
        where: str,
        check: bool,
    ) -> tuple[torch.Tensor, Received]:
        """Waits for a bucket's sums and writes them into it, send by send; returns
        the summed bucket (a view of shared memory where DDP reads it in place) and
        what came back (``check``: whether every value is finite).

        The sums of one send (a piece by value, or a notice's group) are copied and
        checked as soon as it returns, while later ones still travel: for the bucket
        that closes backward — most of a small model — the copy is then off the
        step's critical path. The whole bucket stays bounded by one ``ps_timeout_s``.
        """
        deadline = time.monotonic() + self._timeout_s
        got = Received()
        order = plan.wait_order
        for k, s in enumerate(order):
            result = self._wait_send(plan, handles, order[k:], where, deadline)
            self._take_sums(step, bucket, plan, plan.sends[s], result, got, check)
        if plan.in_place is not None:
            bucket = self._in_place_sum(step, bucket, plan, got, check)
        return bucket, got

    def _wait_send(
        self,
        plan: BucketPlan,
        handles: list[Handle[Any]],
        outstanding: Sequence[int],
        where: str,
        deadline: float,
    ) -> Any:
        """The answer to send ``outstanding[0]``, by ``deadline``.

        On a timeout or failure the culprit is named among every send still
        outstanding (a stuck shard may be a later one that this send's shard waits
        for), within the bucket's one bound.
        """
        try:
            (result,) = self._transport.wait(
                [handles[outstanding[0]]], max(0.0, deadline - time.monotonic())
            )
        except Exception:
            (result, *_) = wait_all(
                self._transport,
                [handles[s] for s in outstanding],
                [plan.sends[s].target for s in outstanding],
                self._timeout_s,
                where,
                deadline,
            )
        return result

    def _take_sums(
        self,
        step: int,
        bucket: torch.Tensor,
        plan: BucketPlan,
        send: Send,
        result: Any,
        got: Received,
        check: bool,
    ) -> None:
        """Copies the sums of one answered send into the bucket (unless DDP reads
        them in place) and counts and checks them."""
        dtype = dtype_name(bucket)
        held, encoded = storage(dtype), self._codec.encoded_np_dtype(dtype)
        lane = self.lanes.get(send.target) if send.notice else None
        for p in send.pieces:
            if lane is not None and plan.in_place is not None:
                got.nbytes += p.numel * bucket.element_size()  # DDP reads it in place
                continue
            if lane is not None:
                r = lane.outputs[step % 2].view(p.key - lane.lo, held, p.numel)
                bucket[p.start : p.stop].copy_(as_torch(r))
            else:
                r = result.view(encoded) if result.dtype == np.uint8 else result
                bucket[p.start : p.stop].copy_(self._codec.decode(r, bucket.dtype))
            if check and got.finite:
                got.finite = all_finite(bucket[p.start : p.stop])
            got.nbytes += r.nbytes
            if send.target in self._remote_shards:
                got.cross += r.nbytes

    def _in_place_sum(
        self, step: int, bucket: torch.Tensor, plan: BucketPlan, got: Received, check: bool
    ) -> torch.Tensor:
        """The bucket's sum as a view of the one shard's output segment (checked).

        The shard writes this parity's segment again only for step + 2, which no
        worker pushes before every worker's DDP has read this sum.
        """
        assert plan.in_place is not None
        lane = self.lanes[plan.in_place]
        held = storage(dtype_name(bucket))
        view = lane.outputs[step % 2].view(plan.pieces[0].key - lane.lo, held, bucket.numel())
        summed = as_torch(view)
        if check:
            got.finite = all_finite(summed)
        return summed

    def close(self) -> None:
        """Detaches from the shards' shared memory."""
        lanes, self.lanes = self.lanes, {}
        for lane in lanes.values():
            lane.close()
