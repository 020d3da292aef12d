"""CPU that a shard's event loop spends per MiB received on the direct path.

A shard's event loop owns all of its state: every sum, every relay hand-off and every
Ray call of the shard run on that one thread. Whatever the loop spends moving bytes
is taken from that work. This benchmark measures it without Ray: a ``WireServer``
echoes ``--frames`` pushes of ``--chunk-bytes`` each (as an owner answers with the
sum), sent by a ``WireStreams`` on 127.0.0.1 from the same process, and reads the
event-loop thread's CPU time (``RUSAGE_THREAD``) around them.

The numbers depend on the ``ray_ps_plugin`` the interpreter imports, so a run
records that checkout's commit; comparing two implementations means running the
script against each checkout::

    python benchmarks/wire_server.py --out benchmarks/results/wire_server.json
    PYTHONPATH=/path/to/other/checkout python benchmarks/wire_server.py \\
        --label before --out benchmarks/results/wire_server.json   # adds a row
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np

import ray_ps_plugin
from ray_ps_plugin._wire.frames import Frame
from ray_ps_plugin._wire.server import WireServer
from ray_ps_plugin._wire.streams import WireStreams

TOKEN = bytes(range(32))


def _thread_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_utime + usage.ru_stime


async def _one(frames: int, chunk_bytes: int) -> tuple[float, float]:
    async def echo(frame: Frame, payload: np.ndarray) -> np.ndarray:
        return payload

    server = WireServer(echo, TOKEN)
    address = await server.start("127.0.0.1")
    streams = WireStreams([address], TOKEN, connect_timeout_s=5.0)
    data = np.ones(chunk_bytes // 4, np.float32)
    try:
        # One frame first, so that the connection and its threads exist.
        await asyncio.wrap_future(streams.push(0, 0, 0, 0, 1, "float32", data))
        wall, cpu = time.perf_counter(), _thread_cpu_s()
        pushes = [streams.push(0, 0, 1, k * chunk_bytes, 1, "float32", data) for k in range(frames)]
        for push in pushes:
            await asyncio.wrap_future(push)
        return time.perf_counter() - wall, _thread_cpu_s() - cpu
    finally:
        streams.close()
        server.close()


def _commit(package_dir: Path) -> str:
    """The checkout's commit, with ``-dirty`` if the package itself has changes."""

    def git(*args: str) -> str:
        out = subprocess.run(
            ["git", "-C", str(package_dir), *args], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()

    try:
        dirty = git("status", "--porcelain", "--", ".")
        return git("rev-parse", "--short", "HEAD") + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=400)
    parser.add_argument("--chunk-bytes", type=int, default=1 << 20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--label", default="current")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    runs = [asyncio.run(_one(args.frames, args.chunk_bytes)) for _ in range(args.repeats)]
    mib = args.frames * args.chunk_bytes / (1 << 20)
    row: dict[str, Any] = {
        "label": args.label,
        "commit": _commit(Path(ray_ps_plugin.__file__).parent),
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "frames": args.frames,
        "chunk_bytes": args.chunk_bytes,
        "repeats": args.repeats,
        "loop_cpu_ms_per_mib": statistics.median(cpu for _, cpu in runs) * 1e3 / mib,
        "wall_ms_per_mib": statistics.median(wall for wall, _ in runs) * 1e3 / mib,
    }
    print(
        f"{row['label']} ({row['commit']}): event loop {row['loop_cpu_ms_per_mib']:.3f} ms "
        f"CPU per MiB, {row['wall_ms_per_mib']:.3f} ms wall per MiB (median of "
        f"{args.repeats} x {args.frames} frames of {args.chunk_bytes} bytes)"
    )
    if args.out is not None:
        rows = json.loads(args.out.read_text())["rows"] if args.out.exists() else []
        rows = [r for r in rows if r["label"] != row["label"]] + [row]
        args.out.write_text(json.dumps({"script": "wire_server", "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
