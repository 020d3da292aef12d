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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ray_ps_plugin._client import ClientBase, ClientSetup
from ray_ps_plugin._codec import Codec
from ray_ps_plugin._errors import PSError
from ray_ps_plugin._nonfinite import all_finite
from ray_ps_plugin._sync.buckets import DenseStream
from ray_ps_plugin._sync.plan import BucketPlan
from ray_ps_plugin._sync.rows import PendingRows, RowBatch
from ray_ps_plugin._torch_compat import queue_autograd_callback
from ray_ps_plugin._transport import DirectPath, Handle, Transport

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

__all__ = ["SumClient"]

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    step: int
    bucket: torch.Tensor
    plan: BucketPlan
    handles: list[Handle[Any]]  # one per send of the plan
    future: torch.futures.Future[torch.Tensor]
    started: float

    @property
    def shards(self) -> list[int]:
        return sorted({p.shard for p in self.plan.pieces})

    def release(self) -> None:
        """Completes the future if it is not yet (DDP must never wait forever)."""
        if not self.future.done():
            self.future.set_result(self.bucket)


class SumClient(ClientBase):
    """Routes one prepared model's DDP gradient buckets through the shards.

    Args:
        setup: The model, its worker and the run (see :class:`ClientSetup`).
        stream: The model's dense buckets' traffic.
        transport: How calls reach the shards.
        rows_direct: The direct path for sparse rows (also on one node), if the run
            has one.
    """

    def __init__(
        self,
        setup: ClientSetup,
        stream: DenseStream,
        transport: Transport,
        rows_direct: DirectPath | None = None,
    ) -> None:
        super().__init__(setup, stream.num_shards, check_local=False)
        self._transport = transport
        self._stream = stream
        self._rows_direct = rows_direct
        self._warned_no_callback = False
        self._round: list[torch.futures.Future[torch.Tensor]] = []  # this step's futures
        self._queue: queue.Queue[_Pending | PendingRows | None] = queue.Queue()
        self._rows = RowBatch(
            setup.module,
            stream.num_shards,
            Codec(setup.settings.compression),
            # The dense chunks' routes: where the node relays, the owners count the
            # relay as one source of rows too.
            stream.routes,
        )
        self._thread = threading.Thread(
            target=self._complete_loop,
            name=f"ps-comm-rank{self.rank}-model{self.model_id}",
            daemon=True,
        )
        self._thread.start()

    @classmethod
    def build(cls, setup: ClientSetup, transport: Transport) -> "SumClient":
        """Lays out the model's gradient stream and attaches the local shards."""
        # Every shard listens when the run has the direct path: dense chunks for
        # other nodes go there, and so do the notices for this node's shards and
        # the sparse rows, on one node too.
        return cls(setup, DenseStream.build(setup, transport), transport, transport.direct)

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
        """Pushes a dense bucket's pieces and counts what its plan sends."""
        step = self._stats.steps
        plan, handles = self._stream.push(step, buf)
        with self._lock:
            for target, nbytes in zip(plan.targets, plan.push_bytes):
                self._count_push(target, nbytes)
            self._stats.pushes += len(plan.sends)
        self._queue.put(_Pending(step, buf, plan, handles, fut, time.perf_counter()))

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
        self._stream.open_round()
        with self._lock:
            self._stats.steps += 1
            self._stats.clock = self._stats.steps
        self._round = []
        self._queue_error_check()

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
            self._export_metrics()

    def _where(self, item: _Pending | PendingRows) -> str:
        return f"rank {self.rank}: model {self.model_id}: step {item.step}"

    def _complete(self, item: _Pending) -> None:
        """Waits for a bucket's sums (see :meth:`DenseStream.complete`), counts them
        and completes DDP's future."""
        bucket, got = self._stream.complete(
            item.step,
            item.bucket,
            item.plan,
            item.handles,
            self._where(item),
            check=self.guard.policy != "ignore",
        )
        if not got.finite:
            # Every worker holds the same sum, so every worker flags the same step.
            self.guard.flag(item.step)
        with self._lock:
            self._stats.bytes_pulled += got.nbytes
            self._stats.bytes_cross_node += got.cross
            self._stats.last_sync_s = time.perf_counter() - item.started
        item.future.set_result(bucket)

    @property
    def next_step(self) -> int:
        """The synchronisation round the optimizer is about to apply."""
        return self._stats.steps

    @property
    def shared_memory_shards(self) -> tuple[int, ...]:
        return tuple(sorted(self._stream.lanes))

    def feedback_codec(self) -> Codec | None:
        codec = self._stream.codec
        return codec if codec.lossy else None

    def close(self) -> None:
        """Stops the communication thread (waits at most ``ps_timeout_s``)."""
        self._queue.put(None)
        self._thread.join(self.settings.ps_timeout_s)
        self._stream.close()
