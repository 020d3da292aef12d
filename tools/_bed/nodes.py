"""The Ray nodes of the bed: starting them in their namespaces, waiting for them to
join, and losing one the way a machine dies."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from .base import _BedBase
from .host import GCS_PORT, NetBedError, namespace_pids


class _RayNodes(_BedBase):
    """The Ray nodes of a :class:`~tools.netbed.NetBed`, one per node namespace."""

    def _start_ray(self) -> None:
        for i in range(self.nodes):
            self.start_node(i)
        self._wait_for_nodes()

    def start_node(self, i: int) -> None:
        """Starts the Ray node of namespace ``i`` (the head for ``i == 0``).

        Also starts a node again after :meth:`kill_node`: it joins as a new node.

        Raises:
            NetBedError: If ``ray start`` fails or exceeds ``start_timeout_s``.
        """
        ray_bin = Path(sys.executable).with_name("ray")
        ray_cmd = str(ray_bin) if ray_bin.exists() else shutil.which("ray")
        if not ray_cmd:
            raise NetBedError("cannot find the `ray` command next to this Python or on PATH")
        common = [
            f"--num-cpus={self.cpus_per_node}",
            f"--object-store-memory={self.object_store_mb * 1024 * 1024}",
            "--disable-usage-stats",
        ]
        role = (
            ["--head", f"--port={GCS_PORT}", "--include-dashboard=false"]
            if i == 0
            else [f"--address={self.address}"]
        )
        cmd = [
            ray_cmd,
            "start",
            *role,
            f"--node-ip-address={self.node_ip(i)}",
            f"--temp-dir={self.temp_dir(i)}",
            *common,
        ]
        try:
            p = self.exec(i, cmd, timeout=self.start_timeout_s, capture=True)
        except subprocess.TimeoutExpired as e:
            raise NetBedError(f"ray start on node {i} took over {self.start_timeout_s} s") from e
        if p.returncode != 0:
            raise NetBedError(
                f"ray start on node {i} failed ({p.returncode}):\n{p.stdout[-3000:]}"
                f"\n{p.stderr[-3000:]}"
            )

    def kill_node(self, i: int) -> list[int]:
        """Loses node ``i`` the way a machine dies: SIGKILL to every process in its
        namespace (raylet, object store, workers), with no shutdown of any kind.

        The namespace and its link stay, so :meth:`start_node` can bring a new Ray
        node up in its place.

        Returns:
            The ids of the processes killed.
        """
        pids = namespace_pids(self.node_ns(i))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while namespace_pids(self.node_ns(i)) and time.monotonic() < deadline:
            time.sleep(0.1)
        return pids

    def _wait_for_nodes(self) -> None:
        # One short-lived driver in the head namespace: also proves auth and routing.
        probe = (
            "import ray, sys, time\n"
            "ray.init(log_to_driver=False)\n"
            f"deadline = time.monotonic() + {self.start_timeout_s}\n"
            "while time.monotonic() < deadline:\n"
            "    alive = [n for n in ray.nodes() if n['Alive']]\n"
            f"    if len(alive) >= {self.nodes}:\n"
            "        print(sorted(n['NodeManagerAddress'] for n in alive)); sys.exit(0)\n"
            "    time.sleep(0.5)\n"
            "sys.exit(f'only {len(alive)} node(s) joined')\n"
        )
        p = self.run([sys.executable, "-c", probe], timeout=self.start_timeout_s + 30, capture=True)
        if p.returncode != 0:
            raise NetBedError(f"Ray nodes did not all join:\n{p.stdout}\n{p.stderr[-3000:]}")
