"""Training loops for sharded embedding tables (tables built on the meta device).

The same loop runs with the tables sharded (``meta=True``: the layers are built on
the meta device and live on the shards) and, as the reference, replicated under
DDP (``meta=False``: real tables holding the values the shards initialise, from
``_tables.store.init_rows`` with the same seed).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.nn.functional as F
from torch import nn

from ray_ps_plugin import get_ps_context
from ray_ps_plugin._tables.spec import TableSpec, init_rows
from tests.integration.loops import recsys_step

ROWS = (500, 60)  # the bag table's and the padded table's rows
DIM = 8
SEED = 7


class Recsys(nn.Module):
    """An ``EmbeddingBag`` (mean) and an ``Embedding`` with ``padding_idx``, both
    ``sparse=True``, under a small MLP."""

    def __init__(self, meta: bool) -> None:
        super().__init__()
        torch.manual_seed(SEED)  # the MLP first: real tables draw from torch's stream
        self.mlp = nn.Sequential(nn.Linear(2 * DIM, 16), nn.ReLU(), nn.Linear(16, 1))
        device = "meta" if meta else None
        self.bags = nn.EmbeddingBag(ROWS[0], DIM, mode="mean", sparse=True, device=device)
        self.items = nn.Embedding(ROWS[1], DIM, padding_idx=0, sparse=True, device=device)
        if not meta:  # the values the shards draw for the same seed
            with torch.no_grad():
                for index, (layer, padding) in enumerate([(self.bags, None), (self.items, 0)]):
                    spec = TableSpec(layer.num_embeddings, DIM, padding, SEED, 0, True)
                    rows = init_rows(spec, index, 0, layer.num_embeddings)
                    layer.weight.copy_(torch.from_numpy(rows))

    def forward(self, bag_ids: torch.Tensor, item_ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.bags(bag_ids), self.items(item_ids)], dim=1))


def batch(step: int, rank: int, n: int = 16) -> tuple[torch.Tensor, ...]:
    """Skewed ids and a target that depends on them; at step 0 rank 1's items are
    all ``padding_idx``."""
    g = torch.Generator().manual_seed(9000 * step + rank)
    bag_ids = ((torch.rand(n, 3, generator=g) ** 3) * ROWS[0]).long()
    item_ids = ((torch.rand(n, generator=g) ** 2) * ROWS[1]).long()
    if step == 0 and rank == 1:
        item_ids.zero_()
    y = bag_ids.float().mean(1, keepdim=True) / ROWS[0] - (item_ids[:, None] % 3 == 0).float()
    return bag_ids, item_ids, y


def optimizers(net: Recsys, kind: str) -> list[torch.optim.Optimizer]:
    tables = [net.bags.weight, net.items.weight]
    if kind == "sparse_adam":
        return [
            torch.optim.SparseAdam(tables, lr=0.05),
            torch.optim.Adam(net.mlp.parameters(), 0.01),
        ]
    if kind == "adagrad":
        return [torch.optim.Adagrad(tables, lr=0.3), torch.optim.Adam(net.mlp.parameters(), 0.01)]
    return [torch.optim.SGD(tables, lr=2.0), torch.optim.SGD(net.mlp.parameters(), lr=0.1)]


def table_loop(config: dict[str, Any]) -> None:
    """``steps`` optimizer steps with ``optimizer`` ("sparse_adam", "adagrad", "sgd"),
    a step LR schedule on the tables' optimizer; rank 0 reports the held-out loss
    before and after and a checkpoint with the tables (``save_tables``) or, for the
    DDP reference, the model's state dict.

    Config: ``steps``, ``optimizer``, ``meta``; optional ``plain`` (checkpoint the
    tables as DDP's loop does, with torch's state dicts only), ``resume`` (load the
    tables from the checkpoint Ray Train hands back), ``every`` (checkpoint
    every that many steps, ``crash_after`` a step at which rank 1 exits once,
    ``marker_dir`` for that once) and ``feedback`` (a lossy compression's
    error-feedback state in the checkpoint: every rank reports its own files).
    """
    torch.manual_seed(SEED)
    rank = ray.train.get_context().get_world_rank()
    net = Recsys(meta=config["meta"])
    model = ray.train.torch.prepare_model(net)
    opts = optimizers(net, config["optimizer"])
    schedule = torch.optim.lr_scheduler.StepLR(opts[0], step_size=10, gamma=0.5)
    held_out = [batch(10_000 + i, 0, n=64) for i in range(2)]
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            meta = json.loads((Path(d) / "meta.json").read_text())
            start = meta["step"]
            model.module.mlp.load_state_dict(torch.load(Path(d) / "mlp.pt"))
            for opt, state in zip(opts, torch.load(Path(d) / "opts.pt")):
                opt.load_state_dict(state)
            schedule.load_state_dict(torch.load(Path(d) / "schedule.pt"))
            if config.get("plain"):
                for name in ("bags", "items"):
                    weight = torch.from_numpy(np.load(Path(d) / f"{name}.npy"))
                    getattr(model.module, name).load_state_dict({"weight": weight})
            else:
                get_ps_context().load_tables(Path(d) / "tables")
            if config.get("feedback"):
                get_ps_context().load_compression_state(Path(d) / "compression")

    def loss_of() -> float:
        with torch.no_grad():
            return sum(F.mse_loss(model(b, i), y).item() for b, i, y in held_out)

    initial = loss_of()
    for step in range(start, config["steps"]):
        recsys_step(model, opts, batch(step, rank))
        schedule.step()
        done = step + 1
        if config.get("every") and done % config["every"] == 0 and done < config["steps"]:
            _report(model, opts, schedule, done, {"step": done}, config)
        if done == config.get("crash_after") and rank == 1:
            marker = Path(config["marker_dir"]) / "crashed"
            if not marker.exists():
                marker.touch()
                # What was reported is registered first (Ray Train collects reports
                # from live workers): the restart then always has step 10's.
                with contextlib.suppress(Exception):
                    ray.train.get_all_reported_checkpoints(timeout_s=30)
                os._exit(1)
    metrics = {"initial": initial, "final": loss_of(), "start": start, "step": config["steps"]}
    ctx = get_ps_context()
    if ctx is not None:
        ctx.flush()
        metrics["stats"] = {k: float(v) for k, v in ctx.table_stats().items()}
    _report(model, opts, schedule, config["steps"], metrics, config)


def _report(model: Any, opts: list, schedule: Any, step: int, metrics: dict, config: dict) -> None:
    """Every rank reports; rank 0 attaches a checkpoint: the MLP, the optimizers'
    and the schedule's state, and the tables (sharded: save_tables; DDP, or
    ``plain`` in the config: the tables' weights as .npy, their optimizer's state in
    its state_dict)."""
    rank = ray.train.get_context().get_world_rank()
    ctx = get_ps_context()
    with tempfile.TemporaryDirectory() as d:
        plain = ctx is None or config.get("plain")
        if not plain:
            ctx.save_tables(Path(d) / "tables")  # every rank calls; rank 0 writes
        if config.get("feedback"):
            ctx.save_compression_state(Path(d) / "compression")  # every rank writes
        if rank != 0:
            own = ray.train.Checkpoint.from_directory(d) if config.get("feedback") else None
            ray.train.report({**metrics, "step": step}, checkpoint=own)
            return
        (Path(d) / "meta.json").write_text(json.dumps({"step": step}))
        torch.save(model.module.mlp.state_dict(), Path(d) / "mlp.pt")
        torch.save([o.state_dict() for o in opts], Path(d) / "opts.pt")
        torch.save(schedule.state_dict(), Path(d) / "schedule.pt")
        if plain:  # through state_dict(), as a DDP loop checkpoints its model
            for name in ("bags", "items"):
                weight = getattr(model.module, name).state_dict()["weight"]
                np.save(Path(d) / f"{name}.npy", weight.numpy())
        ray.train.report(
            {**metrics, "step": step}, checkpoint=ray.train.Checkpoint.from_directory(d)
        )


def tables_from_checkpoint(d: Path) -> dict[str, np.ndarray]:
    """The tables' weights a checkpoint holds, whichever strategy wrote it."""
    if (d / "bags.npy").exists():
        return {n: np.load(d / f"{n}.npy") for n in ("bags", "items")}
    out = {}
    for index, name in enumerate(("bags", "items")):
        folder = d / "tables" / "model0" / f"table{index}"
        parts = sorted(folder.glob("rows*.npz"))
        out[name] = np.concatenate([np.load(p)["weight"] for p in parts])
    return out


def lightning_loop(config: dict[str, Any]) -> None:
    """Lightning's own recipe (RayDDPStrategy, manual optimization with SparseAdam on
    the table and Adam on the MLP, 12 steps); rank 0 reports the table's rows as a
    checkpoint (sharded: ``save_tables``; DDP: the weight as ``bags.npy``)."""
    import pytorch_lightning as pl
    import ray.train.lightning as rl

    class Module(pl.LightningModule):
        def __init__(self, meta: bool) -> None:
            super().__init__()
            self.net = Recsys(meta)
            self.automatic_optimization = False

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            bag_ids, item_ids, y = batch
            tables, mlp = self.optimizers()
            tables.zero_grad()
            mlp.zero_grad()
            loss = F.mse_loss(self.net(bag_ids, item_ids), y)
            self.manual_backward(loss)
            tables.step()
            mlp.step()
            return loss

        def configure_optimizers(self) -> list[torch.optim.Optimizer]:
            return optimizers(self.net, "sparse_adam")

    torch.manual_seed(SEED)
    rank = ray.train.get_context().get_world_rank()
    data = [batch(step, rank) for step in range(12)]
    trainer = rl.prepare_trainer(
        pl.Trainer(
            max_steps=12,
            strategy=rl.RayDDPStrategy(),
            plugins=[rl.RayLightningEnvironment()],
            accelerator="cpu",
            devices="auto",
            enable_checkpointing=False,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
    )
    module = Module(config["meta"])
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))
    ctx = get_ps_context()
    with tempfile.TemporaryDirectory() as d:
        if ctx is not None:
            ctx.save_tables(Path(d) / "tables")
        if rank != 0:
            ray.train.report({"step": 12})
            return
        if ctx is None:
            for name in ("bags", "items"):
                np.save(Path(d) / f"{name}.npy", getattr(module.net, name).weight.detach().numpy())
        ray.train.report({"step": 12}, checkpoint=ray.train.Checkpoint.from_directory(d))
