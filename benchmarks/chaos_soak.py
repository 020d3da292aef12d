"""Chaos soak: a sync PS run under repeated, seeded faults, against a fault-free run.

Runs on the network test bed (``tools/netbed.py``, root only): two Ray nodes in
network namespaces, one worker and its shard on each, node 1 behind a shaped link.
The same training (an MLP, momentum SGD, deterministic data, a checkpoint every
``--every`` steps, ``FailureConfig(max_failures=--retries)``) runs twice in the bed:
once undisturbed, then while this process injects faults at seeded random moments
(each a random 1 to 6 s of training after the previous fault has healed):

- ``shard_killed``: SIGKILL to a shard actor's process (one of the two, at random).
- ``shard_hung``: SIGSTOP to a shard's process for 0.5 to 2 x ``ps_timeout_s``, then
  SIGCONT if it still exists (a restart kills it first when the hang outlasts the
  timeout).
- ``node_lost``: SIGKILL to every process of node 1 (raylet, object store, workers,
  shard), then a new Ray node is started in its place after 3 s.
- ``link_down``: node 1's link unplugged for ``ps_timeout_s`` + 2 to 12 s.
- ``link_lossy``: 1, 2 or 5% packet loss each way on node 1's link for 20 s
  (netem, else nftables; see ``NetBed.set_link``).

The bed is used for every kind, not ``ray.cluster_utils.Cluster``, so that all faults
hit one and the same cluster and run. Reported (``--out``, rendered into
docs/benchmarks.md by ``render_docs.py``): faults injected, how many made Ray Train
restart the run, steps re-executed (run minus ``--steps``), wall time against the
fault-free run, and the largest difference of the final parameters to it.

    python benchmarks/chaos_soak.py --steps 1000 --seed 0   # about 15 minutes
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tools/

KINDS = ("shard_killed", "shard_hung", "node_lost", "link_down", "link_lossy")


# --- inside the bed: the driver and the training loop ---------------------------------
def soak_loop(config: dict[str, Any]) -> None:
    """Momentum SGD on per-step data; rank 0 logs progress and checkpoints.

    Progress: one line per step in ``progress.log``, ``<attempt> <start> <step> <t>``,
    where ``attempt`` is when this attempt's loop began, so the injector can tell
    restarts apart and count re-executed steps.
    """
    import ray.train
    import ray.train.torch
    import torch
    from torch import nn

    from ray_ps_plugin import get_ps_context

    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    start, opt_state = 0, None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(f"{d}/state.pt", weights_only=True)
        model.load_state_dict(state["model"])
        start, opt_state = state["step"], state["optimizer"]
    model = ray.train.torch.prepare_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    attempt = f"{time.time():.3f}"
    log = Path(config["run_dir"], "progress.log")
    for step in range(start, config["steps"]):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(32, 64, generator=g)
        y = x[:, :10].argmax(dim=1)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        time.sleep(config["step_sleep_s"])  # a step of a size faults can land in
        if rank == 0:
            with log.open("a") as f:
                f.write(f"{attempt} {start} {step + 1} {time.time():.3f}\n")
        if (step + 1) % config["every"] == 0 or step + 1 == config["steps"]:
            ctx = get_ps_context()
            if ctx is not None:
                ctx.flush()
            with tempfile.TemporaryDirectory() as d:
                ckpt = None
                if rank == 0:
                    torch.save(
                        {
                            "model": model.module.state_dict(),
                            "optimizer": opt.state_dict(),
                            "step": step + 1,
                        },
                        f"{d}/state.pt",
                    )
                    ckpt = ray.train.Checkpoint.from_directory(d)
                ray.train.report({"step": step + 1, "start": start}, checkpoint=ckpt)


def drive(args: argparse.Namespace) -> None:
    """One run inside the bed; writes ``run.json`` into ``--run-dir``."""
    import ray
    import torch
    from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError

    from ray_ps_plugin import PSConfig, PSTrainer

    ray.init(log_to_driver=False)
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as storage:
        trainer = PSTrainer(
            soak_loop,
            train_loop_config={
                "steps": args.steps,
                "every": args.every,
                "run_dir": args.run_dir,
                "step_sleep_s": args.step_sleep,
            },
            ps_config=PSConfig(mode="sync", ps_timeout_s=args.ps_timeout),
            # One worker (and its shard) per node: every step crosses node 1's link.
            scaling_config=ScalingConfig(
                num_workers=2, resources_per_worker={"CPU": 1}, placement_strategy="STRICT_SPREAD"
            ),
            run_config=RunConfig(
                storage_path=storage,
                name="soak",
                failure_config=FailureConfig(max_failures=args.retries),
            ),
        )
        try:
            result = trainer.fit()
            with result.checkpoint.as_directory() as d:
                state = torch.load(f"{d}/state.pt", weights_only=True)
            out.update(
                ok=True,
                step=state["step"],
                params={k: v.tolist() for k, v in state["model"].items()},
            )
        except TrainingFailedError as e:
            out.update(ok=False, error=f"{type(e).__name__}: {e}"[:3000])
    out["wall_s"] = time.monotonic() - t0
    ray.shutdown()
    Path(args.run_dir, "run.json").write_text(json.dumps(out))


# --- outside the bed: the injector ---------------------------------------------------
def _progress(run_dir: Path) -> list[tuple[str, int, int, float]]:
    """Every progress line so far: (attempt, start, step, time)."""
    path = run_dir / "progress.log"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 4:
            rows.append((parts[0], int(parts[1]), int(parts[2]), float(parts[3])))
    return rows


def _shard_pids(bed: Any, netbed: Any) -> list[int]:
    """Processes of the bed's shard actors (only the bed's namespaces are searched)."""
    pids = []
    for i in range(bed.nodes):
        for pid in netbed.namespace_pids(bed.node_ns(i)):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if re.match(r"ray::\w*Shard\b", cmd):
                pids.append(pid)
    return pids


class Injector:
    """Injects the planned faults into a running soak, one after another.

    Args:
        bed: The running bed.
        netbed: The netbed module.
        run_dir: Where the run logs its progress.
        plan: Fault kinds in order.
        rng: The seeded random source of moments and durations.
        ps_timeout_s: The run's ``ps_timeout_s``.
    """

    def __init__(
        self,
        bed: Any,
        netbed: Any,
        run_dir: Path,
        plan: list[str],
        rng: random.Random,
        ps_timeout_s: float,
    ) -> None:
        self.bed, self.netbed, self.run_dir = bed, netbed, run_dir
        self.plan, self.rng, self.ps_timeout_s = plan, rng, ps_timeout_s
        self.faults: list[dict[str, Any]] = []
        self.done = threading.Event()
        self.t0 = time.time()

    def _training(self, since: float, min_step: int = 0) -> tuple[int, float] | None:
        """Waits until steps are being logged after ``since`` (bounded by 600 s).

        Returns:
            (step, time) of the newest line, or None if the run ended or never did.
        """
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            rows = [r for r in _progress(self.run_dir) if r[3] > since and r[2] > min_step]
            # Three steps, or the last ones of a run that has ended meanwhile.
            if len(rows) >= 3 or (rows and self.done.is_set()):
                return rows[-1][2], rows[-1][3]
            if self.done.wait(0.2):
                deadline = min(deadline, time.monotonic() + 1.0)  # one last look
        return None

    def run(self) -> None:
        """Thread body: inject each planned fault once training is running again."""
        since = 0.0
        for kind in self.plan:
            if self._training(since) is None or self.done.is_set():
                return
            if self.done.wait(self.rng.uniform(1.0, 6.0)):
                return
            rows = _progress(self.run_dir)
            fault: dict[str, Any] = {
                "kind": kind,
                "at_s": time.time() - self.t0,
                "step": rows[-1][2] if rows else 0,
            }
            t = time.time()
            fault.update(self._inject(kind))
            self.faults.append(fault)
            # Healed: training logs steps beyond the one it had reached.
            healed = self._training(t, min_step=fault["step"])
            fault["healed_after_s"] = healed[1] - t if healed else None
            since = healed[1] if healed else time.time()
            print(f"chaos: {fault}", file=sys.stderr, flush=True)

    def _inject(self, kind: str) -> dict[str, Any]:
        if kind in ("shard_killed", "shard_hung"):
            pids = _shard_pids(self.bed, self.netbed)
            if not pids:
                return {"skipped": "no shard process found"}
            pid = self.rng.choice(sorted(pids))
            if kind == "shard_killed":
                os.kill(pid, signal.SIGKILL)
                return {"pid": pid}
            hold = self.rng.uniform(0.5, 2.0) * self.ps_timeout_s
            os.kill(pid, signal.SIGSTOP)
            self.done.wait(hold)
            with contextlib.suppress(ProcessLookupError):  # a restart killed it
                os.kill(pid, signal.SIGCONT)
            return {"pid": pid, "hung_s": round(hold, 1)}
        if kind == "node_lost":
            killed = self.bed.kill_node(1)
            self.done.wait(3.0)
            self.bed.start_node(1)
            return {"processes_killed": len(killed)}
        if kind == "link_down":
            down = self.ps_timeout_s + self.rng.uniform(2.0, 12.0)
            self.bed.set_link(1, down=True)
            try:
                self.done.wait(down)
            finally:
                self.bed.set_link(1, down=False)
            return {"down_s": round(down, 1)}
        if kind == "link_lossy":
            loss = self.rng.choice([1.0, 2.0, 5.0])
            self.bed.set_link(1, loss=loss)
            try:
                self.done.wait(20.0)
                dropped = self.bed.dropped(1)
            finally:
                self.bed.set_link(1, loss=0.0)
            return {"loss_pct": loss, "lossy_s": 20.0, "packets_dropped": dropped}
        raise ValueError(f"unknown fault kind {kind!r}")


def _run_in_bed(bed: Any, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--driver",
        "--run-dir",
        str(run_dir),
        "--steps",
        str(args.steps),
        "--every",
        str(args.every),
        "--step-sleep",
        str(args.step_sleep),
        "--ps-timeout",
        str(args.ps_timeout),
        "--retries",
        str(args.retries),
    ]
    p = bed.run(cmd, timeout=args.timeout, capture=True)
    if p.returncode != 0:
        raise RuntimeError(f"driver failed ({p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads((run_dir / "run.json").read_text())


def _attempts(run_dir: Path) -> list[dict[str, Any]]:
    """Per attempt: the step it resumed from and the last step it logged."""
    attempts: dict[str, dict[str, Any]] = {}
    for attempt, start, step, _t in _progress(run_dir):
        a = attempts.setdefault(attempt, {"start": start, "last": step, "began": float(attempt)})
        a["last"] = max(a["last"], step)
    return sorted(attempts.values(), key=lambda a: a["began"])


def soak(args: argparse.Namespace) -> dict[str, Any]:
    """Builds the bed, runs fault-free and chaos runs, returns the report."""
    netbed = importlib.import_module("tools.netbed")
    rng = random.Random(args.seed)
    kinds = [k for k in args.kinds.split(",") if k]
    plan = [k for _ in range(args.repeats) for k in kinds]
    rng.shuffle(plan)
    bed = netbed.NetBed(
        nodes=2,
        cpus_per_node=2,
        shape=netbed.LinkShape(rate=args.rate),
        env={"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1"},
        start_timeout_s=120,
    )
    work = Path(tempfile.mkdtemp(prefix="chaos_soak_"))
    try:
        bed.start()
        clean, chaos, injector = _clean_then_chaos(bed, netbed, args, plan, rng, work)
    finally:
        bed.stop()
    return _report(args, plan, clean, chaos, injector, _attempts(work / "chaos"))


def _clean_then_chaos(
    bed: Any,
    netbed: Any,
    args: argparse.Namespace,
    plan: list[str],
    rng: random.Random,
    work: Path,
) -> tuple[dict[str, Any], dict[str, Any], Injector]:
    """The fault-free run, then the chaos run with the injector's thread beside it.

    Args:
        bed: The started bed.
        netbed: The netbed module.
        args: The command line.
        plan: Fault kinds in order.
        rng: The seeded random source of moments and durations.
        work: Where the runs' folders (``clean``, ``chaos``) are made.

    Returns:
        The fault-free run's and the chaos run's ``run.json``, and the injector.
    """
    clean_dir, chaos_dir = work / "clean", work / "chaos"
    clean_dir.mkdir()
    chaos_dir.mkdir()
    print("chaos: fault-free run", file=sys.stderr, flush=True)
    clean = _run_in_bed(bed, args, clean_dir)
    print(
        f"chaos: fault-free run took {clean['wall_s']:.0f} s; chaos run, plan {plan}",
        file=sys.stderr,
        flush=True,
    )
    injector = Injector(bed, netbed, chaos_dir, plan, rng, args.ps_timeout)
    thread = threading.Thread(target=injector.run, daemon=True)
    thread.start()
    try:
        chaos = _run_in_bed(bed, args, chaos_dir)
    finally:
        injector.done.set()
        thread.join(120)
    return clean, chaos, injector


def _mark_restarts(faults: list[dict[str, Any]], attempts: list[dict[str, Any]], t0: float) -> None:
    """Sets each fault's ``restarted``: whether a new attempt began after it and
    before the next fault.

    Args:
        faults: The injected faults (``at_s`` counted from ``t0``).
        attempts: The chaos run's attempts (see :func:`_attempts`).
        t0: When the injector started.
    """
    for f in faults:
        began = f["at_s"] + t0
        nxt = [a for a in attempts if a["began"] > began]
        later = [g["at_s"] + t0 for g in faults if g["at_s"] > f["at_s"]]
        # The fault restarted the run if a new attempt began before the next fault.
        f["restarted"] = bool(nxt) and (not later or nxt[0]["began"] < later[0])


def _max_abs_diff(clean: dict[str, Any], chaos: dict[str, Any]) -> float | None:
    """The largest difference between the two runs' final parameters (None unless
    both succeeded)."""
    import torch

    if not (clean.get("ok") and chaos.get("ok")):
        return None
    return max(
        (torch.tensor(clean["params"][k]) - torch.tensor(chaos["params"][k])).abs().max().item()
        for k in clean["params"]
    )


def _report(
    args: argparse.Namespace,
    plan: list[str],
    clean: dict[str, Any],
    chaos: dict[str, Any],
    injector: Injector,
    attempts: list[dict[str, Any]],
) -> dict[str, Any]:
    """The soak's report: the runs, the faults (each marked restarted or not) and their
    toll.

    Args:
        args: The command line.
        plan: Fault kinds in order.
        clean: The fault-free run's ``run.json``.
        chaos: The chaos run's ``run.json``.
        injector: The injector, with its faults.
        attempts: The chaos run's attempts (see :func:`_attempts`).

    Returns:
        The report, keyed as ``tools/_render`` reads it.
    """
    _common = importlib.import_module("_common")
    executed = sum(a["last"] - a["start"] for a in attempts)
    _mark_restarts(injector.faults, attempts, injector.t0)
    max_diff = _max_abs_diff(clean, chaos)
    injected = [f for f in injector.faults if "skipped" not in f]
    return {
        **_common.machine_info(),
        "args": {k: v for k, v in vars(args).items() if k not in ("driver", "run_dir", "out")},
        "plan": plan,
        "fault_free": {"ok": clean["ok"], "wall_s": clean["wall_s"]},
        "chaos": {
            "ok": chaos["ok"],
            "wall_s": chaos["wall_s"],
            "error": chaos.get("error"),
            "attempts": len(attempts),
            "steps_executed": executed,
            "steps_reexecuted": executed - args.steps,
        },
        "faults": injector.faults,
        "injected": len(injected),
        "survived": len(injected) if chaos["ok"] else 0,
        "restarts": sum(1 for f in injected if f["restarted"]),
        "max_abs_diff": max_diff,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--every", type=int, default=10, help="checkpoint every this many steps")
    p.add_argument("--step-sleep", type=float, default=0.05, help="seconds added to each step")
    p.add_argument("--ps-timeout", type=float, default=10.0)
    p.add_argument("--retries", type=int, default=40, help="FailureConfig.max_failures")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--repeats", type=int, default=2, help="faults of each kind")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--timeout", type=float, default=3600.0, help="bound on each run (s)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "chaos_soak.json"))
    p.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.driver:
        drive(args)
        return 0
    report = soak(args)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "faults"}, indent=1))
    return 0 if report["chaos"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
