"""Training loops and probes shared by the integration tests (shipped by value)."""

import contextlib
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch
import torch.nn as nn

from ray_ps_plugin import get_ps_context
from ray_ps_plugin._ray_compat import actor_table


class Net(nn.Module):
    """Small MLP with a frozen layer and a parameter unused on odd steps; with
    ``sparse``, also a table with sparse gradients looked up by ids cut from the
    input (each worker's batch touches its own rows, some in every shard's range)."""

    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 4)
        self.aux = nn.Linear(64, 4)  # used only on even steps
        self.bn = nn.BatchNorm1d(64)
        self.table = nn.EmbeddingBag(64, 4, mode="sum", sparse=True) if sparse else None

    def forward(self, x: torch.Tensor, use_aux: bool) -> torch.Tensor:
        h = self.bn(self.body(self.frozen(x)))
        out = self.head(h)
        if self.table is not None:
            out = out + self.table((x[:, 5:8] * 16).long() % 64)
        return out + self.aux(h) if use_aux else out


def dataset(n: int = 512) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].argmax(dim=1) + (x[:, 4] > 0).long()) % 4
    return torch.utils.data.TensorDataset(x, y)


#: Optimizer updates of the equivalence runs (test_sync, test_multinode).
EQUIVALENCE_STEPS = 20


def equivalence_loop(config: dict[str, Any]) -> None:
    """The kind of loop Ray's docs show, plus the awkward cases DDP users rely on.

    Adam + StepLR, prepare_data_loader, find_unused_parameters, frozen parameters,
    BatchNorm buffers, no_sync() gradient accumulation, checkpoint of
    model.module.state_dict().
    """
    torch.manual_seed(config.get("seed", 0) + ray.train.get_context().get_world_rank())
    net = Net(sparse=config.get("sparse", False))
    model = ray.train.torch.prepare_model(
        net, parallel_strategy_kwargs={"find_unused_parameters": True}
    )
    dense = [p for n, p in net.named_parameters() if not n.startswith("table.")]
    # With the table, SGD on the dense part: Adam divides a gradient element near zero
    # by its own size, so an addition order differing from the ring's (rounding, 1e-7)
    # can move a weight by 1e-4 within a few steps (seen in test_multinode's 2 x 2 run).
    opt = (
        torch.optim.SGD(dense, lr=0.05, momentum=0.9)
        if net.table is not None
        else torch.optim.Adam(dense, lr=1e-2)
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    # A sparse table takes SparseAdam, as users split them (Adam refuses sparse grads).
    tables = [torch.optim.SparseAdam([net.table.weight], lr=1e-2)] if net.table is not None else []
    loader = torch.utils.data.DataLoader(dataset(), batch_size=16, shuffle=True)
    loader = ray.train.torch.prepare_data_loader(loader)
    accumulate = config.get("accumulate", 2)
    step, updates = 0, 0
    epoch = 0
    while updates < config["steps"]:
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            use_aux = updates % 2 == 0
            last_micro = (step + 1) % accumulate == 0
            if last_micro:
                loss = nn.functional.cross_entropy(model(x, use_aux), y)
                loss.backward()
                for o in (opt, *tables):
                    o.step()
                    o.zero_grad()
                sched.step()
                updates += 1
            else:
                with model.no_sync():
                    nn.functional.cross_entropy(model(x, use_aux), y).backward()
            step += 1
            if updates >= config["steps"]:
                break
        epoch += 1
    report_state(model, {"loss": loss.item(), "updates": updates})


def report_state(model: nn.Module, metrics: dict[str, Any]) -> None:
    """Rank 0 checkpoints the model; every rank reports its PS context."""
    ctx = get_ps_context()
    metrics = dict(metrics)
    metrics["is_ddp_instance"] = isinstance(model, nn.parallel.DistributedDataParallel)
    if ctx is not None:
        st = ctx.stats
        metrics.update(
            ps_mode=ctx.mode,
            ps_num_servers=ctx.num_servers,
            ps_server_nodes=list(ctx.server_node_ids),
            ps_shared_memory_shards=list(ctx.shared_memory_shards),
            ps_steps=st.steps,
            ps_bytes_pushed=st.bytes_pushed,
            ps_bytes_pulled=st.bytes_pulled,
            ps_per_shard=st.bytes_pushed_per_shard,
            ps_cross_node=st.bytes_cross_node,
            worker_node=ray.get_runtime_context().get_node_id(),
        )
    metrics["has_ps_context"] = ctx is not None
    metrics["trainable_bytes"] = sum(
        p.numel() * p.element_size() for p in model.parameters() if p.requires_grad
    )
    report_with_model(model, metrics)


def report_with_model(model: nn.Module, metrics: dict[str, Any]) -> None:
    """Every rank reports; rank 0 attaches ``model.module.state_dict()`` as model.pt.

    Result.metrics of Ray Train V2 are those reported with the latest checkpoint.
    """
    report_with_state(metrics, "model.pt", lambda: model.module.state_dict())


def report_with_state(metrics: dict[str, Any], filename: str, state: Callable[[], Any]) -> None:
    """Every rank reports ``metrics``; rank 0 attaches ``state()`` saved as ``filename``.

    ``state`` runs on rank 0 only: under async/ssp a ``state_dict()`` is a pull from
    the shards, of no use to the other ranks.
    """
    with tempfile.TemporaryDirectory() as d:
        checkpoint = None
        if ray.train.get_context().get_world_rank() == 0:
            torch.save(state(), f"{d}/{filename}")
            checkpoint = ray.train.Checkpoint.from_directory(d)
        ray.train.report(metrics, checkpoint=checkpoint)


def recsys_step(model: nn.Module, opts: list[torch.optim.Optimizer], batch: tuple) -> None:
    """One step of a recommendation model on ``(bag_ids, item_ids, y)``: an MSE loss,
    then a step of every optimizer in ``opts`` (tables and dense part may each have
    their own)."""
    bag_ids, item_ids, y = batch
    for opt in opts:
        opt.zero_grad()
    nn.functional.mse_loss(model(bag_ids, item_ids), y).backward()
    for opt in opts:
        opt.step()


def failing_loop(config: dict[str, Any]) -> None:
    model = ray.train.torch.prepare_model(nn.Linear(4, 4))
    model(torch.randn(2, 4)).sum().backward()
    raise ValueError("user code failed on purpose")


def slow_rank_loop(config: dict[str, Any]) -> None:
    """Rank 1 stalls before its third backward for longer than ps_timeout_s.

    Not the second: DDP's forward of the second iteration rebuilds its buckets with a
    gloo collective, which is bounded by TorchConfig.timeout_s, not by the servers.
    """
    model = ray.train.torch.prepare_model(nn.Linear(4, 4))
    for step in range(4):
        if step == 2 and ray.train.get_context().get_world_rank() == 1:
            time.sleep(config["stall_s"])
        model(torch.randn(2, 4)).sum().backward()


def load_state(result: ray.train.Result) -> dict[str, torch.Tensor]:
    with result.checkpoint.as_directory() as d:
        return torch.load(f"{d}/model.pt", weights_only=True, map_location="cpu")


def live_shards() -> int:
    """Shard actors that are not dead, cluster-wide (GCS table; no dashboard needed)."""
    return sum(
        1 for a in actor_table() if a["ActorClassName"].endswith("Shard") and a["State"] != "DEAD"
    )


def live_placement_groups() -> int:
    return sum(1 for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED")


def wait_until(pred, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.2)
    return pred()


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP (or PS) wrapper; a lone worker's model (an
    elastic run of one) is not wrapped."""
    return model.module if hasattr(model, "module") else model


@contextlib.contextmanager
def a_node_goes(
    ray_cluster,
    marker_dir: Path,
    marker: str,
    graceful: bool = False,
    before: Callable[[str], bool] | None = None,
) -> Iterator[list[str]]:
    """Adds two slot nodes; a background thread removes the one a worker names.

    A worker writes its node id to ``marker_dir / marker``; the thread then calls
    ``before(node_id)`` (if given; it returns whether to go on) and removes that node.
    On exit the thread is joined (bounded) and the surviving fresh node is removed.

    Yields:
        The ids of the removed nodes (empty, or the one node).
    """
    nodes = [ray_cluster.add_node(num_cpus=2, resources={"slot": 2}) for _ in range(2)]
    ray_cluster.wait_for_nodes()
    removed: list[str] = []

    def remove() -> None:
        target = marker_dir / marker
        if not wait_until(target.exists, timeout_s=240):
            return
        node_id = target.read_text()
        if before is not None and not before(node_id):
            return
        for node in nodes:
            if node.node_id == node_id:
                ray_cluster.remove_node(node, allow_graceful=graceful)
                removed.append(node_id)

    thread = threading.Thread(target=remove, daemon=True)
    thread.start()
    try:
        yield removed
        thread.join(10)
    finally:
        for node in nodes:
            if node.node_id not in removed:
                ray_cluster.remove_node(node)


# --- failure injection in the backend -------------------------------------------
from ray_ps_plugin import PSConfig
from ray_ps_plugin._backend import PSBackend
from ray_ps_plugin._param.diloco_shard import DilocoShard
from ray_ps_plugin._param.shard import ParamShard


class _FailAfterServersBackend(PSBackend):
    def _start_servers(self, worker_group: Any, cfg: PSConfig) -> None:
        super()._start_servers(worker_group, cfg)
        raise RuntimeError("injected on_start failure after the shards started")


class FailingStartConfig(PSConfig):
    """A PSConfig whose backend fails in on_start once its shards are up."""

    @property
    def backend_cls(self) -> type[PSBackend]:
        return _FailAfterServersBackend


# --- Tune sweeps (tests/integration/test_tune.py) ---------------------------------
def tune_loop(config: dict[str, Any]) -> None:
    """A tiny loop that reports ``iterations`` times, each with a rank-0 checkpoint.

    Config: lr, iterations, quality (scales the reported ``score``, so an ASHA test
    can decide deterministically which trials are worse), report_sleep_s, and
    expect_live_shards with rendezvous_dir: under PS, rank 0 of each trial waits
    (bounded) until that many shards are alive cluster-wide or another trial has
    already seen them (a marker file), then reports who owns the live shards.
    """
    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(rank)
    model = ray.train.torch.prepare_model(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    )
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"])
    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
    ctx = get_ps_context()
    ownership: dict[str, Any] = {}
    for i in range(config["iterations"]):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if i == 0 and ctx is not None and rank == 0 and config.get("expect_live_shards"):
            ownership = _rendezvous(config["expect_live_shards"], config["rendezvous_dir"])
        metrics: dict[str, Any] = {
            "loss": loss.item(),
            "score": config.get("quality", 1.0) * (i + 1),
        }
        if ctx is not None:
            metrics.update(
                ps_num_servers=ctx.num_servers,
                ps_server_nodes=list(ctx.server_node_ids),
                ps_steps=ctx.stats.steps,
                ps_bytes_pushed=ctx.stats.bytes_pushed,
                worker_node=ray.get_runtime_context().get_node_id(),
                **ownership,
            )
        report_with_model(model, metrics)
        time.sleep(config.get("report_sleep_s", 0.0))


def _rendezvous(expected: int, marker_dir: str) -> dict[str, Any]:
    """Waits for `expected` live shards unless a peer trial already saw them.

    The first trial to see them leaves a marker, so the trials that start later do
    not wait for peers that have finished.
    """
    import os

    wait_until(lambda: live_shards() >= expected or bool(os.listdir(marker_dir)), timeout_s=60)
    ownership = shards_per_controller()
    if sum(ownership["shards_per_controller"]) + ownership["orphan_shards"] >= expected:
        open(os.path.join(marker_dir, ray.get_runtime_context().get_actor_id()), "w").close()
    return ownership


def shards_per_controller() -> dict[str, Any]:
    """Live shards grouped by owner: each live Train controller's count, and orphans.

    A shard's owner is the controller actor that created it, so the actor table's
    owner address tells which run a shard belongs to.
    """
    alive = [a for a in actor_table() if a["State"] != "DEAD"]

    def addr(a: dict[str, Any], key: str) -> tuple[str, int]:
        return a[key]["IPAddress"], a[key]["Port"]

    owners: dict[tuple[str, int], int] = {}
    for a in alive:
        if a["ActorClassName"].endswith("Shard"):
            owners[addr(a, "OwnerAddress")] = owners.get(addr(a, "OwnerAddress"), 0) + 1
    controllers = [addr(a, "Address") for a in alive if a["ActorClassName"] == "TrainController"]
    per_controller = sorted(owners.pop(c, 0) for c in controllers)
    return {"shards_per_controller": per_controller, "orphan_shards": sum(owners.values())}


def live_reapers() -> int:
    """Placement-group reapers of ray_ps_plugin.tune still alive (each exits with its run)."""
    return sum(
        1 for a in actor_table() if a["ActorClassName"].endswith("_Reaper") and a["State"] != "DEAD"
    )


# --- a trial whose Tune session reads Train reports late ------------------------------
class _LateEmptyReplies:
    """Tune's view of Ray's Train-report queue on a loaded machine: an empty reply that
    reaches Tune's main thread only after a report went in (if one does within
    ``_REPORT_WAIT_S``), and ``late_s`` later.

    Ray's ``TuneReportCallback`` puts each report on this queue (``queue``, unchanged);
    Tune's session polls it with ``get`` (Ray 2.60.0: ``_TrainSession.
    _get_result_from_queues``), then its own result queue.
    """

    # Bounds each late reply when no report comes (before the first, after the last).
    _REPORT_WAIT_S = 10.0

    def __init__(self, queue: Any, late_s: float) -> None:
        self.queue = queue
        self._late_s = late_s

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        from ray.util.queue import Empty

        try:
            return self.queue.get(block=block, timeout=timeout)
        except Empty:
            if block:
                deadline = time.monotonic() + self._REPORT_WAIT_S
                while self.queue.empty() and time.monotonic() < deadline:
                    time.sleep(0.05)
                if not self.queue.empty():
                    time.sleep(self._late_s)
            raise


def with_late_tune_report_replies(
    trainable: Callable[[dict[str, Any]], None], late_s: float = 3.0
) -> Callable[[dict[str, Any]], None]:
    """``trainable``, run in a trial whose Tune session reads the Train-report queue
    of Ray's ``TuneReportCallback`` late (see :class:`_LateEmptyReplies`).

    A trainable that forwards reports through that queue loses a run's last report
    when the run ends within ``late_s`` of it and Tune had taken every earlier report
    (so the queue was empty when Tune asked): Tune reads the end-of-function marker
    first. Fails the trial if Ray no longer has the hook, so the injection
    cannot silently stop injecting.
    """

    def late_replies(config: dict[str, Any]) -> None:
        from ray.train._internal.session import _TrainSession
        from ray.util.queue import Queue

        assert hasattr(_TrainSession, "_get_or_create_inter_actor_queue")

        def queue_with_late_replies(session: Any) -> Any:
            if session._inter_actor_queue is None:
                queue = Queue(1, actor_options={"num_cpus": 0})
                session._inter_actor_queue = _LateEmptyReplies(queue, late_s)
            # The Train callback gets the queue itself; only Tune's reads are late.
            return session._inter_actor_queue.queue

        _TrainSession._get_or_create_inter_actor_queue = queue_with_late_replies
        trainable(config)

    late_replies.__name__ = late_replies.__qualname__ = trainable.__name__
    return late_replies


# --- instrumented shards (test probes live here, not in the product) -----------------
class _ReadLog:
    """Logs every read a parameter shard answers: (rank, reader's clock, slowest)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reads: list[tuple[int, int, int]] = []

    def record_read(self, rank: int, clock: int, slowest: int) -> None:
        self._reads.append((rank, clock, slowest))

    def reads(self) -> list[tuple[int, int, int]]:
        return list(self._reads)


class LoggedParamShard(_ReadLog, ParamShard):
    """An async/ssp shard that logs its reads."""


class LoggedDilocoShard(_ReadLog, DilocoShard):
    """A DiLoCo shard that logs its reads."""


class _LoggedBackend(PSBackend):
    def shard_class(self, cfg: PSConfig) -> type:
        if cfg.mode == "diloco":
            return LoggedDilocoShard
        return LoggedParamShard if cfg.mode != "sync" else super().shard_class(cfg)


class LoggedReadsConfig(PSConfig):
    """A PSConfig whose async/ssp shards log their reads (see LoggedParamShard)."""

    @property
    def backend_cls(self) -> type[PSBackend]:
        return _LoggedBackend


def run_servers() -> list[Any]:
    """The shard actor handles of the current run (inside the training function)."""
    from ray_ps_plugin import _runtime

    return list(_runtime.current_run().servers)


def worker_errors(error: BaseException) -> list[BaseException]:
    """The exceptions the workers raised, from the error ``Trainer.fit()`` raised."""
    failures = getattr(error, "worker_failures", None)
    return list(failures.values()) if failures else [error]
