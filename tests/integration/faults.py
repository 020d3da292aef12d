"""A resumable loop with failure injection (shipped to workers by value).

Injected faults fire once per run: a marker file in ``config["marker_dir"]`` records
that they happened, so the restarted worker group trains on.
"""

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
import ray.train
import ray.train.collective
import ray.train.torch
import torch
import torch.nn as nn

from ray_ps_plugin import get_ps_context
from tests.integration.loops import report_with_state, unwrap


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g)
    return x, (x[:, :3].argmax(dim=1))


def _once(config: dict[str, Any], name: str) -> bool:
    """True the first time ``name`` is asked for in this run."""
    marker = Path(config["marker_dir"], name)
    if marker.exists():
        return False
    marker.write_text(str(time.time()))
    return True


def resumable_loop(config: dict[str, Any]) -> None:
    """Momentum SGD with deterministic data, checkpointing every ``every`` steps.

    Faults: ``fail_rank``/``fail_step`` kill that worker's process in the middle of
    the step (after backward, before the optimizer step); ``kill_shard``/
    ``kill_step`` make rank 0 kill that server shard actor (in the middle of the
    step: after backward, before the optimizer step); ``stop_shard``/``stop_step``
    make rank 0 stop that shard's process with SIGSTOP before the step's forward,
    so it hangs without dying; ``nan_rank``/``nan_step`` poison that worker's
    gradient; ``lose_node_rank``/``lose_node_step`` make that worker ask the test
    driver (file ``node_to_remove``) to remove its whole node, then wait;
    ``link_fault_step`` makes rank 0 ask the test (file ``link_fault``, holding the
    time) to break a network link, then pause ``link_fault_pause_s`` (1 s) so the
    fault is in place before the step's communication. With ``record_placement``
    the last report also names every worker's node and every shard's node.
    """
    rank = ray.train.get_context().get_world_rank()
    model = _model()
    opt_state, start = None, 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(f"{d}/state.pt", weights_only=True)
        model.load_state_dict(state["model"])  # before prepare_model: seeds the shards
        opt_state, start = state["optimizer"], state["step"]
    model = ray.train.torch.prepare_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    ctx = get_ps_context()
    if checkpoint and ctx is not None and state.get("outer") is not None:
        # DiLoCo: the outer momentum lives on the shards; the checkpoint carries it.
        ctx.load_outer_state_dict(state["outer"])
        ray.train.collective.barrier()  # rank 0 has handed it to the shards
        if rank == 1:
            got, want = ctx.outer_state_dict()[0]["momentum"], state["outer"][0]["momentum"]
            diff = (got - want).abs().max().item()
            Path(config["marker_dir"], "restored_outer_vs_checkpoint").write_text(repr(diff))
    if checkpoint and ctx is not None and ctx.mode != "sync":
        if rank == 1:  # not the rank that seeded the shards
            probe = _server_vs(model, state["model"])
            Path(config["marker_dir"], "restored_server_vs_checkpoint").write_text(repr(probe))
        ray.train.collective.barrier()  # nobody pushes before the probe has read
    preempted_at = None
    for steps_run, step in enumerate(range(start, config["steps"]), 1):
        if rank == 0 and step == config.get("stop_step") and _once(config, "stop"):
            from tests.integration.loops import run_servers

            server = run_servers()[config["stop_shard"]]
            pid = ray.get(server.ready.remote(), timeout=30)["pid"]
            Path(config["marker_dir"], "stopped_at").write_text(repr(time.monotonic()))
            os.kill(pid, signal.SIGSTOP)  # hangs; ray.kill at shutdown still ends it
        if (
            rank == config.get("lose_node_rank")
            and step == config.get("lose_node_step")
            and _once(config, "lose_node")
        ):
            # Ask the test driver to remove this worker's node, and wait to be killed.
            node = ray.get_runtime_context().get_node_id()
            Path(config["marker_dir"], "node_to_remove").write_text(node)
            time.sleep(120)
        if rank == 0 and step == config.get("link_fault_step") and _once(config, "link_fault"):
            time.sleep(config.get("link_fault_pause_s", 1.0))
        x, y = _batch(step, rank)
        loss = nn.functional.cross_entropy(model(x), y)
        if rank == config.get("nan_rank") and step == config.get("nan_step"):
            loss = loss * float("nan")
        opt.zero_grad()
        loss.backward()
        if (
            rank == config.get("fail_rank")
            and step == config.get("fail_step")
            and _once(config, "fail")
        ):
            # The checkpoints reported before are registered first: a worker that
            # dies right after a report could otherwise take the report with it
            # (Ray Train collects reports from live workers), and the restart
            # would find no checkpoint, which is not the failure under test.
            with contextlib.suppress(Exception):  # then it dies anyway
                ray.train.get_all_reported_checkpoints(timeout_s=30)
            os._exit(1)  # the process dies mid-step: no cleanup, no report
        if rank == 0 and step == config.get("kill_step") and _once(config, "kill"):
            from tests.integration.loops import run_servers

            _kill_and_wait(run_servers()[config["kill_shard"]])
        opt.step()
        if preempted_at is not None:  # a step after the preemption checkpoint
            Path(config["marker_dir"], f"steps_after_preempt_{rank}_{step}").touch()
        preempted = config.get("preemption") and _preemption_checkpoint(config, rank, step)
        if preempted or (step + 1) % config["every"] == 0 or step + 1 == config["steps"]:
            ctx = get_ps_context()
            metrics = {"step": step + 1, "steps_run": steps_run, "start": start}
            metrics["world_size"] = ray.train.get_context().get_world_size()
            if ctx is not None:
                metrics["skipped"] = ctx.stats.skipped_steps
                ctx.flush()
            if config.get("record_placement") and step + 1 == config["steps"]:
                metrics["worker_nodes"] = _worker_nodes()
                metrics["server_node_ids"] = list(ctx.server_node_ids) if ctx else None
            report_with_state(
                metrics,
                "state.pt",
                lambda step=step, ctx=ctx: {
                    "model": unwrap(model).state_dict(),
                    "optimizer": opt.state_dict(),
                    "step": step + 1,
                    "outer": ctx.outer_state_dict()
                    if ctx is not None and ctx.mode == "diloco"
                    else None,
                },
            )
        if preempted:
            preempted_at = step + 1
            _after_preemption_checkpoint(config, rank, preempted_at)


def _kill_and_wait(actor: Any) -> None:
    """Kills a shard and returns once it is gone: ``ray.kill`` only asks for it, and
    on a loaded machine the training loop could otherwise run steps (and register a
    checkpoint) past the step the test kills it at."""
    from ray_ps_plugin._ray_compat import ping_actor

    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(ping_actor(actor), timeout=10)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            continue  # a busy machine: ask again
        time.sleep(0.05)
    raise AssertionError("the killed shard still answers after 60 s")


def _worker_nodes() -> list[str]:
    """Every worker's node id, by rank (a collective: every rank calls it)."""
    import torch.distributed as dist

    nodes: list[Any] = [None] * ray.train.get_context().get_world_size()
    dist.all_gather_object(nodes, ray.get_runtime_context().get_node_id())
    return nodes


def _preemption_checkpoint(config: dict[str, Any], rank: int, step: int) -> bool:
    """Whether a preemption was just announced: checkpoint now (once per run).

    Every worker calls ``get_preemption_info()`` once per step (it is a barrier that
    hands all ranks rank 0's value). Rank 1 tells the test driver where it runs on
    the first step, so the driver drains that node with the preemption reason.

    Ray Train learns of a drain by polling every 5 s, and a loaded machine runs the
    whole loop faster than that; so at ``preempt_step`` the workers keep asking
    until the notice is there. The bound is a count of calls, not a clock: every
    rank sees the same answers, so all leave the loop at the same call.
    """
    if rank == 1 and not Path(config["marker_dir"], "node_to_drain").exists():
        node = ray.get_runtime_context().get_node_id()
        Path(config["marker_dir"], "node_to_drain").write_text(node)
    info = ray.train.get_preemption_info()
    if step == config["preempt_step"] and not Path(config["marker_dir"], "preempt_seen_0").exists():
        for _ in range(_PREEMPTION_POLLS):
            if info is not None:
                break
            time.sleep(0.5)
            info = ray.train.get_preemption_info()
        else:
            raise RuntimeError(f"no preemption notice within {_PREEMPTION_POLLS} polls")
    return info is not None and _once(config, f"preempt_seen_{rank}")


_PREEMPTION_POLLS = 240  # 0.5 s apart: two minutes for the drain to reach Ray Train


def _after_preemption_checkpoint(config: dict[str, Any], rank: int, step: int) -> None:
    """The preempted rank waits for its node to go; the others note their steps.

    Ray Train registers a reported checkpoint when its controller next polls the
    workers; rank 1 gives it a few polls (the notice's grace period) before it tells
    the driver to take the node.
    """
    if rank == 1:
        time.sleep(2.0)
    Path(config["marker_dir"], f"preempt_checkpoint_{rank}").write_text(str(step))
    if rank == 1:
        time.sleep(120)  # the node is removed under this worker


def _server_vs(model: nn.Module, state: dict[str, torch.Tensor]) -> float:
    """Largest difference between the shards' parameters and a checkpoint."""
    from tests.integration.loops import run_servers

    replies = [ray.get(s.pull.remote(0, 1, 0), timeout=30) for s in run_servers()]
    server = torch.from_numpy(np.concatenate([r[0] for r in replies]))
    ckpt = torch.cat([v.reshape(-1) for v in state.values()])
    return (server - ckpt).abs().max().item()


def load(result: ray.train.Result) -> dict[str, Any]:
    with result.checkpoint.as_directory() as d:
        return torch.load(f"{d}/state.pt", weights_only=True)


def mismatched_loop(config: dict[str, Any]) -> None:
    """Rank 1 builds a wider model than rank 0."""
    rank = ray.train.get_context().get_world_rank()
    model = nn.Linear(8, 3 if rank == 0 else 4)
    model = ray.train.torch.prepare_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
