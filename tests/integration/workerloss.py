"""A worker killed mid-run: the digits loop with a timeline of every step.

Each worker appends one line per step to ``timeline_rank<R>.jsonl`` in the config's
``out_dir``: the step, the wall time and its process id, so a test (or the
benchmark) can tell which steps ran twice, how long no worker stepped, and when a
replacement took its first step. Rank ``kill_rank`` SIGKILLs its own process at
``kill_step`` once (a marker file makes the replacement live); with
``pace_until_replaced_s`` the other ranks take at least that long per step from
then until the replacement has joined (see ``_pace``). The loop goes on
from ``get_ps_context().start_step`` (where the shards hold its rank), or, for
loops that rely on checkpoints, from the step of the checkpoint Ray Train hands
back. Shipped to workers by value.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import tempfile
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
from tests.integration import digits


def timeline_loop(config: dict[str, Any]) -> None:
    """``steps`` SGD steps of the digits MLP per worker (batch 32, ``sleep_s`` of
    pretend work after each; ``seed``: the model's and the batches'); checkpoints
    every ``every`` steps if set; rank 0
    reports the final model. ``wait_for_all_firsts``: a barrier once every worker
    has recorded its first parameters (not for a lone replacement: the others
    would not be at it)."""
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    xtr, ytr, _, _ = digits.load_digits_split()
    seed = config.get("seed", 0)
    torch.manual_seed(seed)
    model = ray.train.torch.prepare_model(digits.make_model())
    opt = torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.1), momentum=0.9)
    start = _start_step(model, opt)
    first = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.save(
        {"start": start, "params": first},
        Path(config["out_dir"]) / f"first_{rank}_{os.getpid()}.pt",
    )
    if config.get("wait_for_all_firsts"):
        # Every worker has read its first parameters before any steps: otherwise
        # one's first update could reach the shards before another joins them.
        ray.train.collective.barrier()
    out = Path(config["out_dir"]) / f"timeline_rank{rank}.jsonl"
    g = torch.Generator().manual_seed(1000 * rank + start + 100_003 * seed)
    with out.open("a") as log:
        for step in range(start, config["steps"]):
            if rank == config.get("kill_rank") and step == config.get("kill_step"):
                _kill_once(config)
            if step == config.get("raise_step"):
                _raise_once(config, rank)
            if rank == 0 and step == config.get("name_shard_node_step"):
                _name_shard_node_once(config)
            idx = torch.randint(0, len(xtr), (32,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            opt.step()
            log.write(json.dumps({"step": step, "t": time.time(), "pid": os.getpid()}) + "\n")
            log.flush()
            time.sleep(_pace(config, rank, step))
            every = config.get("every")
            if every and (step + 1) % every == 0 and step + 1 < config["steps"]:
                _report(model, opt, step + 1, with_state=True)
    ps = get_ps_context()
    if ps is not None:  # the final checkpoint holds every worker's last update
        ps.flush()
        ray.train.collective.barrier()
        clocks = {"clocks": list(ps.stats.clocks)}
        (Path(config["out_dir"]) / f"clocks_rank{rank}.json").write_text(json.dumps(clocks))
    _report(model, opt, config["steps"], with_state=False)


def _pace(config: dict[str, Any], rank: int, step: int) -> float:
    """The pretend work after ``step``: ``sleep_s``, or ``pace_until_replaced_s`` on
    a rank that was not killed, after the kill, until the replacement has recorded
    its first parameters. Diloco's replacement starts at the round the others are
    in, so a survivor that ends its steps before the replacement's start (seconds
    on 2 busy cores) would leave it none to take; the survivor still steps
    throughout, only slower, as real steps would be."""
    pace = config.get("pace_until_replaced_s")
    kill_rank = config.get("kill_rank")
    if pace is None or rank == kill_rank or step < config.get("kill_step", 0):
        return config.get("sleep_s", 0.0)
    joined = len(list(Path(config["out_dir"]).glob(f"first_{kill_rank}_*.pt"))) > 1
    return config.get("sleep_s", 0.0) if joined else pace


def _start_step(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Where this worker goes on: the shards' clock for its rank when it joined live
    shards; else the step of the checkpoint Ray Train hands back (loading it); else 0."""
    ps = get_ps_context()
    if ps is not None and ps.start_step:
        return ps.start_step
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return 0
    with checkpoint.as_directory() as d:
        state = torch.load(Path(d) / "state.pt", weights_only=True)
    model.module.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    return int(state["step"])


def _kill_once(config: dict[str, Any]) -> None:
    marker = Path(config["out_dir"]) / "killed"
    if not marker.exists():
        marker.write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)


def _name_shard_node_once(config: dict[str, Any]) -> None:
    """Writes shard 0's node id (once) for a benchmark that removes that node."""
    marker = Path(config["out_dir"]) / "victim"
    ps = get_ps_context()
    if ps is not None and not marker.exists():
        marker.write_text(json.dumps({"node_id": ps.server_node_ids[0], "t": time.time()}))


def _raise_once(config: dict[str, Any], rank: int) -> None:
    marker = Path(config["out_dir"]) / f"raised_{rank}"
    if not marker.exists():
        marker.touch()
        raise RuntimeError(f"rank {rank} fails on purpose")


def _report(model: nn.Module, opt: torch.optim.Optimizer, step: int, with_state: bool) -> None:
    """Every rank reports; rank 0 attaches the model (and, mid-run, the optimizer
    and step to resume from)."""
    rank = ray.train.get_context().get_world_rank()
    with tempfile.TemporaryDirectory() as d:
        checkpoint = None
        if rank == 0:
            state = {"model": model.module.state_dict(), "step": step}
            if with_state:
                state["opt"] = opt.state_dict()
            torch.save(state, Path(d) / "state.pt")
            checkpoint = ray.train.Checkpoint.from_directory(d)
        ray.train.report({"step": step}, checkpoint=checkpoint)


def read_timelines(out_dir: str | Path) -> dict[int, list[dict[str, Any]]]:
    """Each rank's step records, in the order they were written."""
    out = {}
    for path in sorted(Path(out_dir).glob("timeline_rank*.jsonl")):
        rank = int(path.stem.removeprefix("timeline_rank"))
        out[rank] = [json.loads(line) for line in path.read_text().splitlines() if line]
    return out


def accuracy(result: ray.train.Result) -> float:
    """Test accuracy of the model rank 0 reported last."""
    _, _, xte, yte = digits.load_digits_split()
    model = digits.make_model()
    with result.checkpoint.as_directory() as d:
        model.load_state_dict(torch.load(Path(d) / "state.pt", weights_only=True)["model"])
    with torch.no_grad():
        return float((model(xte).argmax(1) == yte).float().mean())


# --- a backend that records the shards' kept state (a test probe, not the product) ----
from ray_ps_plugin import PSConfig
from ray_ps_plugin._backend import PSBackend


class _RecordingBackend(PSBackend):
    """Writes the flat parameters of model 0 the shards held when they were stopped
    for a restart (their exported state) to ``kept_params.pt`` in ``kept_dir``."""

    def _export(self, cfg: Any) -> None:
        super()._export(cfg)
        if self._exported:
            states = ray.get(self._exported)
            flat = [torch.from_numpy(s["models"][0]["params"]) for s in states]
            torch.save(torch.cat(flat), Path(cfg.kept_dir) / "kept_params.pt")


@dataclasses.dataclass
class RecordingConfig(PSConfig):
    """A PSConfig whose backend records the state it keeps over a restart."""

    kept_dir: str = ""

    @property
    def backend_cls(self) -> type[PSBackend]:
        return _RecordingBackend
