"""A shard (or its node) lost mid-run with ``PSConfig(shard_replicas=1)``.

Each worker trains two prepared models side by side, as a user with several models
would: the digits MLP (SGD with momentum; its accuracy says whether training went
on well) and a *probe* whose gradient is a constant (a ``Linear`` from zeros, input
ones, SGD at ``PROBE_LR``). The probe's every delta is exactly ``-PROBE_LR`` and
every value it passes through is a multiple of ``PROBE_LR / 2`` (exact in fp32), so
its final weight is ``-steps * PROBE_LR`` exactly if and only if every update of
every worker was applied once: a lost or doubled update shows as a different value.

At ``kill_step`` rank 0 writes where shard 0's primary runs (``kill_marker``: its
node id and process id) for the test to kill; at ``second_kill_step``, once every
shard has a live replica again, the node of shard 0's first replica
(``kill_marker_2``). Every worker logs one line per step (the wall time), so the
test can tell how long no worker stepped. Shipped to workers by value.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

import ray
import ray.train
import ray.train.collective
import ray.train.torch
import torch
import torch.nn as nn

from ray_ps_plugin import get_ps_context
from tests.integration import digits, frameworks
from tests.integration.loops import report_with_state

PROBE_LR = 2.0**-6
PROBE_SIZE = 64


def two_models_loop(config: dict[str, Any]) -> None:
    """``steps`` steps of the digits MLP and the probe per worker (see the module)."""
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    out_dir = Path(config["out_dir"])
    xtr, ytr, _, _ = digits.load_digits_split()
    torch.manual_seed(config.get("seed", 0))
    model = ray.train.torch.prepare_model(digits.make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    probe = nn.Linear(PROBE_SIZE, 1, bias=False)
    nn.init.zeros_(probe.weight)
    probe = ray.train.torch.prepare_model(probe)
    probe_opt = torch.optim.SGD(probe.parameters(), lr=PROBE_LR)
    ones = torch.ones(1, PROBE_SIZE)
    g = torch.Generator().manual_seed(1000 * rank + config.get("seed", 0))
    with (out_dir / f"timeline_rank{rank}.jsonl").open("a") as log:
        for step in range(config["steps"]):
            if rank == 0 and step == config.get("kill_step"):
                _name_the_victim(out_dir / "kill_marker")
            if rank == 0 and step == config.get("second_kill_step"):
                _name_the_second_victim(out_dir)
            idx = torch.randint(0, len(xtr), (32,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            opt.step()
            probe_opt.zero_grad()
            probe(ones).sum().backward()
            probe_opt.step()
            log.write(json.dumps({"step": step, "t": time.time()}) + "\n")
            log.flush()
            time.sleep(config.get("sleep_s", 0.0))
    ps = _flushed()
    report_with_state(
        {"replica_node_ids": list(ps.replica_node_ids), "pid": os.getpid()},
        "state.pt",
        lambda: {"model": model.module.state_dict(), "probe": probe.module.state_dict()},
    )


def _flushed() -> Any:
    """The PS context once every worker's updates are on the shards (each flushes,
    then all meet at a barrier), so a state read from here on holds all of them."""
    ps = get_ps_context()
    assert ps is not None
    ps.flush()
    ray.train.collective.barrier()
    return ps


def lightning_loop(config: dict[str, Any]) -> None:
    """The same two parts in one ``LightningModule`` (the digits MLP, and the probe as
    a parameter of its own optimizer param group), trained by Lightning's ``Trainer``
    under Ray's recipe (``RayDDPStrategy``, ``RayLightningEnvironment``,
    ``prepare_trainer``) for ``steps`` optimizer steps; a callback names shard 0's
    primary at ``kill_step``. Rank 0 reports whether its transport moved shard 0 to
    the replica, and the checkpoint :func:`final_state` reads."""
    import pytorch_lightning as pl

    from ray_ps_plugin import _runtime

    rank = ray.train.get_context().get_world_rank()
    xtr, ytr, _, _ = digits.load_digits_split()
    torch.manual_seed(config.get("seed", 0))

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = digits.make_model()
            self.probe = nn.Parameter(torch.zeros(1, PROBE_SIZE))

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            x, y = batch
            # The probe's gradient is ones, whatever the batch.
            return nn.functional.cross_entropy(self.net(x), y) + self.probe.sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(
                [
                    {"params": self.net.parameters(), "lr": 0.1, "momentum": 0.9},
                    {"params": [self.probe], "lr": PROBE_LR},
                ]
            )

    class NameTheVictim(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
            if rank == 0 and trainer.global_step == config["kill_step"]:
                _name_the_victim(Path(config["out_dir"]) / "kill_marker")

    data = torch.utils.data.TensorDataset(xtr, ytr)
    module = Module()
    frameworks.ray_lightning_trainer(config["steps"], [NameTheVictim()]).fit(
        module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=32, shuffle=True)
    )
    _flushed()

    def state() -> dict[str, Any]:
        params = module.state_dict()  # pulls the shards' parameters first
        net = {k.removeprefix("net."): v for k, v in params.items() if k.startswith("net.")}
        return {"model": net, "probe": {"weight": params["probe"]}}

    moved = _runtime._TRANSPORT is not None and _runtime._TRANSPORT.moved(0)
    report_with_state({"moved": moved}, "state.pt", state)


def _name_the_victim(marker: Path) -> None:
    """Writes shard 0's primary's node and process for the test, which kills it
    while the workers train on."""
    from ray_ps_plugin import _runtime

    ps = get_ps_context()
    assert ps is not None
    info = ray.get(_runtime.current_run().servers[0].ready.remote(), timeout=30)
    marker.write_text(json.dumps({"node_id": ps.server_node_ids[0], "pid": info["pid"]}))


def _name_the_second_victim(out_dir: Path) -> None:
    """Once this worker knows a live replica of every shard (the controller made new
    ones after the first loss and told the workers), writes the node of shard 0's
    first replica, which serves shard 0 since then."""
    from ray_ps_plugin import _runtime

    ps = get_ps_context()
    assert ps is not None
    deadline = time.monotonic() + 120
    while not _every_shard_replicated(_runtime._TRANSPORT, ps.num_servers):
        assert time.monotonic() < deadline, "the shards got no new replicas within 120 s"
        time.sleep(0.2)
    (out_dir / "kill_marker_2").write_text(json.dumps({"node_id": ps.replica_node_ids[0]}))


def _every_shard_replicated(transport: Any, num_shards: int) -> bool:
    """Whether shard 0 moved to its replica and every shard has a replica that
    answers (a replica lost with the first node does not) on another node than the
    actor serving the shard: the second loss must leave every shard a copy."""
    if transport is None or not transport.moved(0):
        return False
    for shard in range(num_shards):
        replica = transport.replica(shard)
        if replica is None:
            return False
        try:
            here, there = ray.get(
                [transport.server(shard).ready.remote(), replica.ready.remote()], timeout=2
            )
        except Exception:
            return False
        if here["node_id"] == there["node_id"]:
            return False
    return True


def final_state(result: ray.train.Result) -> dict[str, Any]:
    """The digits model's test accuracy and the probe's final weight."""
    _, _, xte, yte = digits.load_digits_split()
    model = digits.make_model()
    with result.checkpoint.as_directory() as d:
        state = torch.load(Path(d) / "state.pt", weights_only=True)
    model.load_state_dict(state["model"])
    with torch.no_grad():
        acc = float((model(xte).argmax(1) == yte).float().mean())
    return {"accuracy": acc, "probe": state["probe"]["weight"]}


def longest_gap_s(out_dir: str | Path) -> float:
    """The longest time no worker took a step, over the run."""
    times = sorted(
        json.loads(line)["t"]
        for path in Path(out_dir).glob("timeline_rank*.jsonl")
        for line in path.read_text().splitlines()
        if line
    )
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)
