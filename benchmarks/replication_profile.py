"""Where replication's cost goes: each process's CPU time per step, by part of the work.

Runs the reference MLP of ``step_time.py`` (2 workers, async) once without and once
with ``shard_replicas=1``; in the middle of each run it samples every training
worker and every shard with py-spy (``pip install py-spy``; it reads the processes'
stacks from outside, without pausing them) and sorts each sample by the frames it
holds into a part of the work: the model's compute, the client's own work, the
copy a worker keeps of each update for the replica, a shard's applying and
answering, its forwarding to the replica, and the Ray and asyncio machinery
around them. A shard whose stacks hold a worker's push is a primary, the others
replicas.

Each process's CPU time over the window (from ``/proc``) is split between the
parts in the proportions of its samples (py-spy also counts a thread that waits
for a core as busy, so its samples give proportions, not time).

    python benchmarks/replication_profile.py
    python benchmarks/replication_profile.py --steps 300 --duration 5   # shorter
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray import cloudpickle

sys.path.insert(0, str(Path(__file__).parent))
import _common
import step_time

cloudpickle.register_pickle_by_value(step_time)

VARIANTS = ("ps_async", "ps_async_replicated")

#: (part, frame fragments): a sample goes to the part of its innermost frame that
#: holds one of the fragments (the first such part listed); "Ray and asyncio"
#: takes the rest.
WORKER_PARTS = [
    ("keeps its update for the replica", ("FlatParams.held_part",)),
    ("model: forward, backward, optimizer", ("_engine_run_backward", "torch/nn/", "torch/optim/")),
    ("client: push, pull, copies", ("ray_ps_plugin",)),
]
SHARD_PARTS = [
    ("copies each update for the replica", ("Slots.put",)),
    ("forwards it (a frame or a Ray call)", ("ReplicaLink.forward", "_actor_method_call")),
    ("applies updates", ("ParamShard._apply",)),
    ("answers: copies parameters out", ("ParamShard._answer",)),
    ("direct path: frames in and out", ("ray_ps_plugin/_wire/",)),
    ("other plugin work", ("ray_ps_plugin",)),
]
REST = "Ray and asyncio"


def _py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise SystemExit("py-spy not found: pip install py-spy")
    return found


def _processes() -> list[tuple[int, str]]:
    """(pid, kind) of every training worker and shard process on this machine."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    found = []
    for line in out.splitlines()[1:]:
        pid, _, cmd = line.strip().partition(" ")
        name = cmd.split()[0] if cmd.split() else ""
        if name == "ray::RayTrainWorker" or name.startswith("ray::RayTrainWorker."):
            found.append((int(pid), "worker"))
        elif name.startswith("ray::") and "Shard" in name:
            found.append((int(pid), "shard"))
    return found


def _cpu_s(pid: int) -> float:
    """The process's CPU time so far (user and system), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _sample(args: argparse.Namespace, spy: str, into: dict[int, Any]) -> None:
    """After ``sample_after`` s, records every worker's and shard's stacks and CPU
    time for ``duration`` s."""
    time.sleep(args.sample_after)
    procs = _processes()
    before = {pid: _cpu_s(pid) for pid, _ in procs}
    with tempfile.TemporaryDirectory() as d:
        runs = {pid: (kind, Path(d, f"{pid}.txt")) for pid, kind in procs}
        spies = [
            subprocess.Popen(
                [
                    spy,
                    "record",
                    "-p",
                    str(pid),
                    "-d",
                    str(args.duration),
                    "-r",
                    str(args.rate),
                    "-f",
                    "raw",
                    "--nonblocking",
                    "-o",
                    str(path),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for pid, (_, path) in runs.items()
        ]
        for p, pid in zip(spies, runs):
            if p.wait(timeout=args.duration + 60) != 0:
                raise RuntimeError(
                    f"py-spy on process {pid}: {p.stderr.read() if p.stderr else ''}"
                )
        cpu = {pid: _cpu_s(pid) - before[pid] for pid in runs}
        for pid, (kind, path) in runs.items():
            stacks = path.read_text().splitlines() if path.exists() else []
            into[pid] = (kind, stacks, cpu[pid])


def _part(frames: list[str], parts: list[tuple[str, tuple[str, ...]]]) -> str:
    """The part of the innermost frame that names one (a copy the client makes
    inside the optimizer's step is the client's, not the optimizer's)."""
    for frame in reversed(frames):
        for part, fragments in parts:
            if any(f in frame for f in fragments):
                return part
    return REST


def _classify(kind: str, stacks: list[str]) -> tuple[str, collections.Counter[str]]:
    """The process's role and its samples by part."""
    parts = WORKER_PARTS if kind == "worker" else SHARD_PARTS
    counts: collections.Counter[str] = collections.Counter()
    for line in stacks:
        stack, _, n = line.rpartition(" ")
        counts[_part(stack.split(";"), parts)] += int(n)
    role = kind
    if kind == "shard" and any("push_local" in s for s in stacks):
        role = "primary shard"
    elif kind == "shard" and any("Replicated.replay" in s for s in stacks):
        role = "replica"
    return role, counts


def profile_variant(name: str, args: argparse.Namespace, spy: str) -> dict[str, Any]:
    """One run of ``name``: its median step and each role's CPU ms per step by part."""
    sampled: dict[int, Any] = {}
    errors: list[BaseException] = []

    def sample() -> None:
        try:
            _sample(args, spy, sampled)
        except BaseException as e:  # re-raised below, in the driver's thread
            errors.append(e)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with tempfile.TemporaryDirectory() as storage:
        metrics = step_time.run_variant(name, args, storage)
    sampler.join(timeout=args.sample_after + args.duration + 60)
    if errors:
        raise errors[0]
    if not sampled:
        raise RuntimeError(f"{name}: no process sampled (a run shorter than --sample-after?)")
    step_s = metrics["median_step_s"]
    steps = args.duration / step_s  # steps taken while the processes were sampled
    roles: dict[str, dict[str, Any]] = {}
    for kind, stacks, cpu_s in sampled.values():
        role, counts = _classify(kind, stacks)
        entry = roles.setdefault(role, {"processes": 0, "ms_per_step": collections.Counter()})
        entry["processes"] += 1
        # The process's CPU time, split between the parts as its samples are.
        total = sum(counts.values()) or 1
        per_step = cpu_s * 1000.0 / steps
        entry["ms_per_step"].update({k: per_step * v / total for k, v in counts.items()})
    for entry in roles.values():
        entry["ms_per_step"] = {k: round(v, 2) for k, v in entry["ms_per_step"].items()}
    if not all(sum(r["ms_per_step"].values()) for r in roles.values()):
        raise RuntimeError(f"{name}: py-spy recorded no sample of a process: {roles}")
    return {"median_step_ms": step_s * 1e3, "roles": roles}


def parse_args() -> argparse.Namespace:
    p = _common.parser(__doc__)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--sample-after", type=float, default=25.0, help="s after each run starts")
    p.add_argument("--duration", type=int, default=10, help="s of sampling per run")
    p.add_argument("--rate", type=int, default=50, help="samples per s")
    p.add_argument("--out", default="benchmarks/results/replication_profile.json")
    args = p.parse_args()
    args.workers = 2
    return args


def main() -> None:
    """Profiles both variants, stores the result and prints each role's CPU per step."""
    args = parse_args()
    spy = _py_spy()
    ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
    variants = {name: profile_variant(name, args, spy) for name in VARIANTS}
    ray.shutdown()
    recorded = {k: v for k, v in vars(args).items() if k != "workers"}
    out = _common.write_json(
        args.out, {**_common.machine_info(), "args": recorded, "variants": variants}
    )
    for name, v in variants.items():
        busy = {r: round(sum(e["ms_per_step"].values()), 1) for r, e in v["roles"].items()}
        print(f"{name}: step {v['median_step_ms']:.1f} ms; CPU ms per step by role: {busy}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
