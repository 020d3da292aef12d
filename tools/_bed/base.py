"""What every part of a bed shares: its state, names and addresses, environment, and
running commands in its namespaces."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence

from .host import GCS_PORT, IFNAME, REPO_ROOT, SUBNET
from .shape import LinkShape


class _BedBase:
    """The state of a :class:`~tools.netbed.NetBed` and what needs nothing but it.

    :class:`~tools.netbed.NetBed` sets every attribute below in its ``__init__``; the
    parts of the bed (links, Ray nodes) build on this class.

    Attributes:
        nodes: Number of Ray nodes (namespaces).
        cpus_per_node: Logical CPUs each Ray node advertises.
        object_store_mb: Object store size of each Ray node.
        start_timeout_s: Bound on starting each Ray node and on all of them joining.
        keep_logs: Keep the Ray temp dirs after stop.
        extra_env: Extra environment for the Ray nodes and the driver.
        name: This bed's namespace stem.
    """

    nodes: int
    cpus_per_node: int
    object_store_mb: int
    start_timeout_s: float
    keep_logs: bool
    extra_env: dict[str, str]
    name: str
    _shapes: list[LinkShape]  # shaping of node i's link
    _down: list[bool]  # node i's link unplugged
    _netem: list[bool]  # netem installed on node i's link
    _nft_loss: list[bool]  # nftables drop rules on node i's link
    _has_netem: bool | None  # unknown until first needed
    _made: list[str]  # namespaces created so far, for teardown
    _started: bool
    _token: str

    # -- names and addresses -------------------------------------------------------

    @property
    def switch_ns(self) -> str:
        """The namespace holding the bridge."""
        return f"{self.name}_sw"

    def node_ns(self, i: int) -> str:
        """The namespace of node ``i``."""
        self._check_node(i)
        return f"{self.name}_n{i}"

    def node_ip(self, i: int) -> str:
        """The address of node ``i`` (on interface :data:`IFNAME`)."""
        self._check_node(i)
        return f"{SUBNET}.{i + 1}"

    def temp_dir(self, i: int) -> str:
        """Ray's temp dir of node ``i``; short, as Ray's unix socket paths are limited."""
        return f"/tmp/{self.name}_{i}"

    @property
    def address(self) -> str:
        """The head's GCS address, ``ip:port``."""
        return f"{self.node_ip(0)}:{GCS_PORT}"

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of the bed: nodes first, then the switch."""
        return [self.node_ns(i) for i in range(self.nodes)] + [self.switch_ns]

    def _check_node(self, i: int) -> None:
        if not 0 <= i < self.nodes:
            raise IndexError(f"node {i} out of range: the bed has {self.nodes} node(s)")

    # -- environment ---------------------------------------------------------------

    def ray_env(self) -> dict[str, str]:
        """Environment of the Ray node processes (workers inherit the raylet's)."""
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
        }
        path = [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(":") if p]
        env.update(
            PYTHONPATH=":".join(dict.fromkeys(path)),
            RAY_AUTH_MODE="token",
            # A token of the bed's own, handed over by environment: nothing is written
            # to the user's home, and the bed's nodes and drivers all share it.
            RAY_AUTH_TOKEN=self._token,
            GLOO_SOCKET_IFNAME=IFNAME,
            # No traffic outside the bed: no usage-stats upload attempts.
            RAY_USAGE_STATS_ENABLED="0",
        )
        env.update(self.extra_env)
        return env

    def driver_env(self) -> dict[str, str]:
        """Environment of commands run in the head's namespace.

        Besides ``RAY_ADDRESS``, ``PSBED_*`` variables describe the bed (name, nodes,
        and node 0's link as it was at start) so that benchmarks can record them.
        """
        s = self._shapes[0]
        return {
            **self.ray_env(),
            "RAY_ADDRESS": self.address,
            "PSBED_NAME": self.name,
            "PSBED_NODES": str(self.nodes),
            "PSBED_RATE": s.rate,
            "PSBED_DELAY": s.delay,
            "PSBED_LOSS": str(s.loss),
        }

    # -- running things ------------------------------------------------------------

    def exec(
        self,
        node: int,
        cmd: Sequence[str],
        *,
        timeout: float,
        env: Mapping[str, str] | None = None,
        capture: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """Runs ``cmd`` in node ``node``'s namespace with the Ray nodes' environment.

        Args:
            node: Node index.
            cmd: The command and its arguments.
            timeout: Seconds before the command is killed (raises TimeoutExpired).
            env: Environment; :meth:`ray_env` by default.
            capture: Capture stdout/stderr as text instead of inheriting them.

        Returns:
            The completed process (the return code is not checked).
        """
        return subprocess.run(
            ["ip", "netns", "exec", self.node_ns(node), *cmd],
            check=False,
            env=dict(env) if env is not None else self.ray_env(),
            capture_output=capture,
            text=True,
            timeout=timeout,
        )

    def run(
        self, cmd: Sequence[str], *, timeout: float, capture: bool = False
    ) -> subprocess.CompletedProcess[str]:
        """Runs ``cmd`` as a Ray driver in the head's namespace (``RAY_ADDRESS`` set).

        Args:
            cmd: The command and its arguments.
            timeout: Seconds before the command is killed (raises TimeoutExpired).
            capture: Capture stdout/stderr as text instead of inheriting them.

        Returns:
            The completed process (the return code is not checked).
        """
        return self.exec(0, cmd, timeout=timeout, env=self.driver_env(), capture=capture)
