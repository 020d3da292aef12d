"""The public bed: :class:`NetBed`, its construction and its lifecycle."""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Mapping
from typing import TYPE_CHECKING

from .host import PREFIX, NetBedError, kill_namespaces, require_root
from .links import _Links
from .nodes import _RayNodes
from .shape import LinkShape

if TYPE_CHECKING:
    from typing_extensions import Self


class NetBed(_Links, _RayNodes):
    """Ray nodes in network namespaces, joined through a switch by shaped links.

    Use it as a context manager (``with NetBed(...) as bed:``) or call
    :meth:`start` and :meth:`stop` in a ``try/finally``. Node 0 runs the Ray head and
    is where :meth:`run` executes commands.

    Args:
        nodes: Number of Ray nodes (namespaces), at least 1.
        cpus_per_node: Logical CPUs each Ray node advertises.
        shape: Shaping of every node's link.
        object_store_mb: Object store size of each Ray node.
        env: Extra environment for the Ray nodes and the driver.
        start_timeout_s: Bound on starting each Ray node and on waiting for all of
            them to join.
        keep_logs: Keep the Ray temp dirs (``/tmp/<prefix><pid>_<i>``) after stop.
        prefix: Namespace name prefix.

    Attributes:
        name: This bed's namespace stem, ``<prefix><pid>`` (plus a counter when one
            process builds several beds).
    """

    _count = 0

    def __init__(
        self,
        nodes: int = 2,
        cpus_per_node: int = 2,
        shape: LinkShape | None = None,
        *,
        object_store_mb: int = 300,
        env: Mapping[str, str] | None = None,
        start_timeout_s: float = 120.0,
        keep_logs: bool = False,
        prefix: str = PREFIX,
    ) -> None:
        if nodes < 1 or nodes > 250:
            raise ValueError(f"nodes must be in [1, 250], got {nodes}")
        if cpus_per_node < 1:
            raise ValueError(f"cpus_per_node must be >= 1, got {cpus_per_node}")
        self.nodes = nodes
        self.cpus_per_node = cpus_per_node
        self.object_store_mb = object_store_mb
        self.start_timeout_s = start_timeout_s
        self.keep_logs = keep_logs
        self.extra_env = dict(env or {})
        NetBed._count += 1
        suffix = "" if NetBed._count == 1 else f"x{NetBed._count}"
        self.name = f"{prefix}{os.getpid()}{suffix}"
        self._shapes = [shape or LinkShape()] * nodes
        self._down = [False] * nodes
        self._netem = [False] * nodes  # netem installed on node i's link
        self._nft_loss = [False] * nodes  # nftables drop rules on node i's link
        self._has_netem: bool | None = None  # unknown until first needed
        self._made: list[str] = []  # namespaces created so far, for teardown
        self._started = False
        self._token = secrets.token_hex(32)

    # -- lifecycle -----------------------------------------------------------------

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Builds the namespaces and links, then starts and waits for the Ray nodes.

        On any failure everything created so far is torn down before re-raising.

        Raises:
            NetBedError: If not root, ``ip``/``tc`` are missing, or a step fails.
        """
        require_root()
        if self._started:
            raise NetBedError(f"bed {self.name} is already started")
        self._started = True
        try:
            self._build_network()
            self._start_ray()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Ends the bed's processes and deletes its namespaces and links.

        Safe to call more than once and after a partial start.
        """
        # Nodes before the switch (deleting a node's namespace also deletes its link).
        kill_namespaces(sorted(self._made, key=lambda ns: ns == self.switch_ns))
        self._made.clear()
        if not self.keep_logs:
            for i in range(self.nodes):
                shutil.rmtree(self.temp_dir(i), ignore_errors=True)
        self._started = False
