"""Network test bed: Ray nodes in Linux network namespaces behind rate-limited links.

Every node is a network namespace holding one Ray node (head or worker). The nodes
hang off a bridge that lives in a namespace of its own (the "switch"); each node's
link is a veth pair, shaped in both directions (a token bucket, with netem delay/loss
under it when asked for and the kernel has netem; without netem, loss is an nftables
egress drop rule on each end), so whatever leaves or enters a node
crosses a link of the given rate. Nothing is configured in the host's namespace: the
bed's addresses (198.18.0.0/24, from the range reserved for network benchmarks) exist
only inside its own namespaces, and no route leads out of them.

Command line (root only)::

    python tools/netbed.py --nodes 2 --cpus-per-node 2 --rate 1gbit \\
        [--delay 0ms] [--loss 0] [--probe] -- python benchmarks/net_step_time.py ...

creates the bed, starts the Ray head and workers, runs the command in the head's
namespace with ``RAY_ADDRESS``, ``RAY_AUTH_MODE``, ``GLOO_SOCKET_IFNAME`` and
``PYTHONPATH`` set, prints the bytes each node's link carried during the command,
then tears everything down (also on error, Ctrl-C or SIGTERM).

Library::

    with NetBed(nodes=2, shape=LinkShape(rate="1gbit")) as bed:
        bed.run(["python", "driver.py"], timeout=120)
        bed.set_link(1, rate="100mbit")   # reshape node 1's link while running
        bed.set_link(1, loss=1.0)         # drop 1% each way (netem, else nftables)
        bed.set_link(1, down=True)        # unplug it (delay=... needs netem)

Processes are ended by id: the bed kills exactly what ``ip netns pids`` lists for its
own namespaces, and never runs ``ray stop`` (that would end every Ray on the machine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self

#: Prefix of every namespace a bed creates; the bed's pid follows, so runs don't collide.
PREFIX = "psbed"
#: Name of each node's end of its link (the same in every node, so that one
#: GLOO_SOCKET_IFNAME fits all of them).
IFNAME = "psnet0"
#: The bed's /24, inside 198.18.0.0/15 (RFC 2544 benchmarking range); node i is .(i + 1).
SUBNET = "198.18.0"
GCS_PORT = 6379
#: Stem of the nftables tables that emulate loss where the kernel has no netem.
NFT_TABLE = "psbed_loss"
REPO_ROOT = Path(__file__).resolve().parent.parent

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_IP_TIMEOUT_S = 30.0


class NetBedError(RuntimeError):
    """The bed could not be built, started or shaped."""


class _NoNetem(NetBedError):
    """The kernel has no netem qdisc."""


def parse_rate(rate: str) -> int:
    """Bits per second of a tc-style rate (``"1gbit"``, ``"100mbit"``, ``"500000"``).

    Args:
        rate: A number with an optional unit among bit, kbit, mbit, gbit, tbit.

    Returns:
        The rate in bits per second.

    Raises:
        ValueError: On an unknown unit or a rate that is not positive. tc's ``bps``
            units (bytes per second) are refused on purpose: they are a classic source
            of 8x mistakes.
    """
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)([a-zA-Z]*)", rate)
    unit = m.group(2).lower() if m else ""
    if not m or (unit and unit not in _RATE_UNITS):
        raise ValueError(f"rate {rate!r}: use a number with one of {list(_RATE_UNITS)}")
    bits = int(float(m.group(1)) * _RATE_UNITS.get(unit, 1))
    if bits <= 0:
        raise ValueError(f"rate {rate!r} must be > 0")
    return bits


def parse_time(value: str) -> float:
    """Seconds of a tc-style time (``"5ms"``, ``"100us"``, ``"1s"``; bare numbers are us).

    Raises:
        ValueError: If ``value`` is not a number with one of those units.
    """
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)(us|usec|ms|msec|s|sec)?", value)
    if not m:
        raise ValueError(f"time {value!r}: use a number with us, ms or s")
    scale = {"us": 1e-6, "usec": 1e-6, "ms": 1e-3, "msec": 1e-3, "s": 1.0, "sec": 1.0}
    return float(m.group(1)) * scale[m.group(2) or "us"]


@dataclass(frozen=True)
class LinkShape:
    """How one node's link is shaped (both directions alike).

    Attributes:
        rate: Token-bucket rate in tc syntax (``"1gbit"``).
        delay: One-way netem delay added in each direction (``"0ms"``, ``"5ms"``).
        loss: Percentage of packets dropped in each direction (0 to 100): by netem,
            or by an nftables rule where the kernel has no netem.
        queue: tbf ``latency``: the longest a packet may wait in the bucket's queue,
            which sets the queue's size. A few milliseconds, like a switch port's
            buffer, rather than tc's customary 50 ms that bloats every RTT.
    """

    rate: str = "1gbit"
    delay: str = "0ms"
    loss: float = 0.0
    queue: str = "5ms"

    def __post_init__(self) -> None:
        parse_rate(self.rate)
        parse_time(self.delay)
        parse_time(self.queue)
        if not 0.0 <= float(self.loss) <= 100.0:
            raise ValueError(f"loss must be a percentage in [0, 100], got {self.loss}")

    def delay_s(self) -> float:
        """The delay in seconds."""
        return parse_time(self.delay)

    def burst_bytes(self) -> int:
        """Bucket size: 1 ms of traffic, at least 64 KiB (a GSO super-packet)."""
        return max(64 * 1024, parse_rate(self.rate) // 8 // 1000)


def require_root() -> None:
    """Raises if the bed cannot work here (not root, or ``ip``/``tc`` missing).

    Raises:
        NetBedError: With the reason.
    """
    reason = unavailable_reason(probe=False)
    if reason:
        raise NetBedError(reason)


def unavailable_reason(probe: bool = True) -> str | None:
    """Why a bed cannot be built on this machine, or ``None`` if it can.

    Args:
        probe: Also create and delete a throw-away namespace, to catch containers
            where root lacks CAP_NET_ADMIN or CAP_SYS_ADMIN.

    Returns:
        A sentence naming what is missing, or ``None``.
    """
    if os.geteuid() != 0:
        return "the network test bed needs root (network namespaces, veth links, tc)"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return f"the network test bed needs {' and '.join(missing)} (package iproute2)"
    if probe:
        name = f"{PREFIX}{os.getpid()}_probe"
        try:
            _ip("netns", "add", name)
        except NetBedError as e:
            return f"cannot create network namespaces here: {e}"
        finally:
            subprocess.run(
                ["ip", "netns", "del", name],
                check=False,
                capture_output=True,
                timeout=_IP_TIMEOUT_S,
            )
    return None


def _ip(*args: str, ns: str | None = None) -> str:
    """Runs ``ip [-n NS] ARGS`` and returns its stdout."""
    return _run_tool("ip", *(("-n", ns) if ns else ()), *args)


def _tc(*args: str, ns: str) -> str:
    """Runs ``tc -n NS ARGS`` and returns its stdout."""
    return _run_tool("tc", "-n", ns, *args)


def _run_tool(*cmd: str) -> str:
    try:
        p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise NetBedError(f"{' '.join(cmd)} timed out after {_IP_TIMEOUT_S} s") from e
    if p.returncode != 0:
        raise NetBedError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()}")
    return p.stdout


def list_namespaces() -> list[str]:
    """Names of all network namespaces ``ip netns`` knows."""
    out = _ip("netns", "list")
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(ns: str) -> list[int]:
    """Ids of the processes living in network namespace ``ns``."""
    try:
        out = _ip("netns", "pids", ns)
    except NetBedError:
        return []  # the namespace is gone, and so are its processes
    return [int(x) for x in out.split()]


def kill_namespaces(namespaces: Sequence[str], grace_s: float = 3.0) -> list[int]:
    """Ends every process of the given namespaces, then deletes the namespaces.

    All processes get SIGTERM at once (Ray's daemons shut down cleanly on it), those
    still alive after ``grace_s`` get SIGKILL. Only processes that ``ip netns pids``
    lists for these namespaces are signalled, by id.

    Args:
        namespaces: Namespaces this bed (or a crashed earlier bed) created.
        grace_s: Seconds between SIGTERM and SIGKILL.

    Returns:
        The ids of the processes that were signalled.
    """

    def alive() -> list[int]:
        return [pid for ns in namespaces for pid in namespace_pids(ns)]

    signalled: list[int] = []
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        pids = alive()
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        signalled.extend(p for p in pids if p not in signalled)
        deadline = time.monotonic() + wait_s
        while alive() and time.monotonic() < deadline:
            time.sleep(0.1)
    for ns in namespaces:
        subprocess.run(
            ["ip", "netns", "del", ns], check=False, capture_output=True, timeout=_IP_TIMEOUT_S
        )
    return signalled


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Deletes namespaces left by beds whose process has died (e.g. a SIGKILLed run).

    Only namespaces named ``<prefix><pid>_...`` whose ``pid`` no longer runs are
    touched, so concurrent live beds are left alone.

    Returns:
        The namespaces removed.
    """
    removed = []
    for ns in list_namespaces():
        m = re.fullmatch(rf"{re.escape(prefix)}(\d+)(?:x\d+)?_\w+", ns)
        if not m or Path(f"/proc/{m.group(1)}").exists():
            continue
        kill_namespaces([ns])
        removed.append(ns)
        # A dead bed's Ray temp dirs follow the same naming: /tmp/<stem>_<i>.
        stem = ns.rsplit("_", 1)[0]
        for d in Path("/tmp").glob(f"{stem}_*"):
            if re.fullmatch(rf"{re.escape(stem)}_\d+", d.name):
                shutil.rmtree(d, ignore_errors=True)
    return removed


class NetBed:
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

    def _build_network(self) -> None:
        sw = self.switch_ns
        self._add_ns(sw)
        _ip("link", "add", "br0", "type", "bridge", ns=sw)
        _ip("link", "set", "br0", "up", ns=sw)
        for i in range(self.nodes):
            ns, port = self.node_ns(i), f"n{i}"
            self._add_ns(ns)
            # Both ends are created inside the bed's namespaces: nothing ever appears
            # in the host's, so names cannot clash with the host or with other beds.
            _ip("link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", ns, ns=sw)
            _ip("link", "set", port, "master", "br0", ns=sw)
            _ip("link", "set", port, "up", ns=sw)
            _ip("addr", "add", f"{self.node_ip(i)}/24", "dev", IFNAME, ns=ns)
            _ip("link", "set", IFNAME, "up", ns=ns)
            self._apply_shape(i, new=True)

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("link", "set", "lo", "up", ns=ns)
        # IPv6 would only add router solicitations and DAD to the byte counters.
        _run_tool(
            "ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1"
        )

    def _apply_shape(self, i: int, new: bool = False) -> None:
        """Installs (or changes) node ``i``'s shaping on both ends of its link.

        A token bucket is the root qdisc. Delay and loss need netem, added as the
        bucket's child the first time they are asked for (not before: some kernels
        are built without netem, and rate limiting alone must work there). Where the
        kernel has no netem, loss (not delay) falls back to nftables: a netdev egress
        chain on each end drops that share of the packets leaving it.
        """
        s = self._shapes[i]
        for ns, dev in self._ends(i):
            verb = "add" if new else "change"
            tbf = f"rate {s.rate} burst {s.burst_bytes()} latency {s.queue}"
            _tc(*f"qdisc {verb} dev {dev} root handle 1: tbf {tbf}".split(), ns=ns)
        if self._netem[i] or s.delay_s() > 0 or (s.loss > 0 and self._has_netem is not False):
            try:
                self._apply_netem(i)
                return
            except _NoNetem as e:
                if s.delay_s() > 0:
                    raise NetBedError(
                        "this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so delay "
                        "cannot be emulated; rate limits, down links and loss (through "
                        "nftables) still work"
                    ) from e
        if s.loss > 0 or self._nft_loss[i]:
            self._apply_nft_loss(i)

    def _ends(self, i: int) -> tuple[tuple[str, str], tuple[str, str]]:
        """(namespace, device) of both ends of node ``i``'s link: node, then switch."""
        return (self.node_ns(i), IFNAME), (self.switch_ns, f"n{i}")

    def _apply_netem(self, i: int) -> None:
        """Adds or changes netem (delay and loss) under node ``i``'s token buckets.

        Raises:
            _NoNetem: The kernel has no netem (remembered for the bed's lifetime).
        """
        s = self._shapes[i]
        for ns, dev in self._ends(i):
            verb = "change" if self._netem[i] else "add"
            # A queue deep enough for a bandwidth-delay product of TSO super-packets.
            netem = f"delay {s.delay} loss {float(s.loss)}% limit 100000"
            try:
                _tc(*f"qdisc {verb} dev {dev} parent 1:1 handle 10: netem {netem}".split(), ns=ns)
            except NetBedError as e:
                if "unknown" in str(e).lower():
                    self._has_netem = False
                    raise _NoNetem(str(e)) from e
                raise
        self._has_netem = True
        self._netem[i] = True

    def _apply_nft_loss(self, i: int) -> None:
        """Drops ``loss`` percent of the packets leaving each end of node ``i``'s link.

        One netdev table per end, replaced atomically (declare, delete, define in one
        ``nft -f``); loss 0 removes it. The tables live in the bed's namespaces, so
        they go with them. The counter lets :meth:`dropped` report what was dropped.
        """
        if shutil.which("nft") is None:
            raise NetBedError(
                "packet loss needs netem (CONFIG_NET_SCH_NETEM), which this kernel lacks, "
                "or the nft command (package nftables) for a netdev egress drop rule"
            )
        s = self._shapes[i]
        # numgen draws a uniform integer per packet: keep [0, loss * 100) of 10000.
        threshold = round(float(s.loss) * 100)
        for ns, dev in self._ends(i):
            table = f"table netdev {NFT_TABLE}_{dev}"
            script = f"{table}\ndelete {table}\n"
            if threshold > 0:
                script += (
                    f"{table} {{\n chain egress {{\n"
                    f'  type filter hook egress device "{dev}" priority 0; policy accept;\n'
                    f"  numgen random mod 10000 < {threshold} counter drop\n }}\n}}\n"
                )
            self._nft(ns, script)
        self._nft_loss[i] = threshold > 0

    def _nft(self, ns: str, script: str) -> str:
        """Runs an nft script in namespace ``ns``."""
        try:
            p = subprocess.run(
                ["ip", "netns", "exec", ns, "nft", "-f", "-"],
                input=script,
                check=False,
                capture_output=True,
                text=True,
                timeout=_IP_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired as e:
            raise NetBedError(f"nft in {ns} timed out after {_IP_TIMEOUT_S} s") from e
        if p.returncode != 0:
            raise NetBedError(
                f"nft in {ns} failed ({p.returncode}): {p.stderr.strip()} (a netdev egress "
                "hook needs Linux 5.16 or later)"
            )
        return p.stdout

    def dropped(self, node: int) -> int:
        """Packets the emulated loss dropped on node ``node``'s link, both directions.

        Counts netem's drops or the nftables rule's, whichever emulates the loss.
        """
        total = 0
        for ns, dev in self._ends(node):
            if self._netem[node]:
                for q in json.loads(_tc("-s", "-j", "qdisc", "show", "dev", dev, ns=ns)):
                    if q.get("kind") == "netem":
                        total += int(q.get("drops", 0))
            elif self._nft_loss[node]:
                out = self._nft(ns, f"list table netdev {NFT_TABLE}_{dev}\n")
                total += sum(int(n) for n in re.findall(r"counter packets (\d+)", out))
        return total

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

    # -- shaping and counters ------------------------------------------------------

    def shape(self, node: int) -> LinkShape:
        """The current shaping of node ``node``'s link."""
        self._check_node(node)
        return self._shapes[node]

    def set_link(
        self,
        node: int,
        *,
        rate: str | None = None,
        delay: str | None = None,
        loss: float | None = None,
        down: bool | None = None,
    ) -> LinkShape:
        """Changes node ``node``'s link while the bed runs; unset arguments stay.

        Args:
            node: Node index.
            rate: New token-bucket rate (tc syntax).
            delay: New one-way delay per direction (tc syntax).
            loss: New loss percentage per direction.
            down: ``True`` unplugs the link (the switch's port goes down, so the node
                loses carrier); ``False`` plugs it back.

        Returns:
            The link's shaping now.
        """
        self._check_node(node)
        changes = {
            k: v for k, v in (("rate", rate), ("delay", delay), ("loss", loss)) if v is not None
        }
        if changes:
            old = self._shapes[node]
            self._shapes[node] = replace(old, **changes)
            try:
                self._apply_shape(node)
            except NetBedError:
                self._shapes[node] = old  # what the link still has
                raise
        if down is not None and down != self._down[node]:
            _ip("link", "set", f"n{node}", "down" if down else "up", ns=self.switch_ns)
            self._down[node] = down
        return self._shapes[node]

    def link_bytes(self, node: int) -> dict[str, int]:
        """Byte counters of node ``node``'s end of its link.

        Returns:
            ``{"tx": bytes the node sent, "rx": bytes it received}`` since creation.
        """
        out = _ip("-j", "-s", "link", "show", "dev", IFNAME, ns=self.node_ns(node))
        stats = json.loads(out)[0]["stats64"]
        return {"tx": int(stats["tx"]["bytes"]), "rx": int(stats["rx"]["bytes"])}

    def probe(self, src: int, dst: int, nbytes: int = 32 << 20, timeout: float = 60.0) -> float:
        """Measures the throughput of one TCP stream from node ``src`` to ``dst``.

        Args:
            src: Sending node.
            dst: Receiving node.
            nbytes: Bytes to send.
            timeout: Bound on the whole measurement.

        Returns:
            Bits per second seen by the receiver (first to last byte).
        """
        port = 5999
        recv = (
            "import socket, time\n"
            "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            f"s.bind(('{self.node_ip(dst)}', {port})); s.listen(1); s.settimeout({timeout})\n"
            "print('ready', flush=True)\n"
            "c, _ = s.accept(); c.settimeout(" + str(timeout) + "); n = 0; t0 = None\n"
            "while True:\n"
            "    b = c.recv(1 << 20)\n"
            "    if not b: break\n"
            "    t0 = t0 or time.perf_counter(); n += len(b)\n"
            "print(n * 8 / (time.perf_counter() - t0), flush=True)\n"
        )
        send = (
            "import socket\n"
            f"c = socket.create_connection(('{self.node_ip(dst)}', {port}), timeout={timeout})\n"
            f"buf = bytes(1 << 20)\n"
            f"for _ in range({max(1, nbytes >> 20)}): c.sendall(buf)\n"
            "c.close()\n"
        )
        rx = subprocess.Popen(
            ["ip", "netns", "exec", self.node_ns(dst), sys.executable, "-c", recv],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert rx.stdout is not None
            # Bounded wait for the receiver's "ready" line (readline alone could block).
            readable, _, _ = select.select([rx.stdout], [], [], timeout)
            if not readable or rx.stdout.readline().strip() != "ready":
                raise NetBedError("throughput probe: receiver did not start")
            self.exec(src, [sys.executable, "-c", send], timeout=timeout, capture=True)
            out, _ = rx.communicate(timeout=timeout)
            return float(out.strip())
        finally:
            if rx.poll() is None:
                rx.kill()
                rx.wait(timeout=10)


def _format_bytes(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: build a bed, run one command in it, tear it down."""
    p = argparse.ArgumentParser(
        description="Run a command against Ray nodes in network namespaces joined by "
        "rate-limited links (root only).",
        usage="%(prog)s [options] -- COMMAND [ARGS...]",
    )
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--cpus-per-node", type=int, default=2)
    p.add_argument("--rate", default="1gbit", help="per-link rate, each direction (tc syntax)")
    p.add_argument("--delay", default="0ms", help="one-way delay added in each direction")
    p.add_argument("--loss", type=float, default=0.0, help="loss percentage in each direction")
    p.add_argument("--queue", default="5ms", help="token-bucket queue, as a waiting time")
    p.add_argument("--object-store-mb", type=int, default=300)
    p.add_argument("--timeout", type=float, default=3600.0, help="bound on the command (s)")
    p.add_argument("--start-timeout", type=float, default=120.0)
    p.add_argument(
        "--probe",
        action="store_true",
        help="measure one TCP stream node 1 -> node 0 before the command",
    )
    p.add_argument("--keep-logs", action="store_true", help="keep the Ray temp dirs")
    p.add_argument(
        "--cleanup-stale",
        action="store_true",
        help="only delete namespaces left by dead beds, then exit",
    )
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command

    try:
        require_root()
    except NetBedError as e:
        print(f"netbed: {e}", file=sys.stderr)
        return 2
    if args.cleanup_stale:
        print("removed:", " ".join(cleanup_stale()) or "nothing")
        return 0
    if not cmd:
        p.error("give the command to run after --")

    # SIGTERM and SIGHUP unwind like Ctrl-C, so the finally below always tears down.
    def _interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    # SIGINT too: a shell starts background jobs with SIGINT ignored, and Python then
    # keeps ignoring it.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)

    shape = LinkShape(rate=args.rate, delay=args.delay, loss=args.loss, queue=args.queue)
    bed = NetBed(
        args.nodes,
        args.cpus_per_node,
        shape,
        object_store_mb=args.object_store_mb,
        start_timeout_s=args.start_timeout,
        keep_logs=args.keep_logs,
    )
    rc = 1
    try:
        t0 = time.monotonic()
        bed.start()
        print(
            f"netbed {bed.name}: {args.nodes} node(s) x {args.cpus_per_node} CPU, links "
            f"{shape.rate} delay {shape.delay} loss {shape.loss}%, head {bed.address} "
            f"(up in {time.monotonic() - t0:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
        if args.probe and args.nodes > 1:
            print(
                f"netbed: probe node 1 -> node 0: {bed.probe(1, 0) / 1e6:.0f} Mbit/s",
                file=sys.stderr,
                flush=True,
            )
        before = [bed.link_bytes(i) for i in range(args.nodes)]
        rc = bed.run(cmd, timeout=args.timeout).returncode
        after = [bed.link_bytes(i) for i in range(args.nodes)]
        for i, (b, a) in enumerate(zip(before, after, strict=True)):
            print(
                f"netbed: node {i} link during the command: sent "
                f"{_format_bytes(a['tx'] - b['tx'])}, received "
                f"{_format_bytes(a['rx'] - b['rx'])}",
                file=sys.stderr,
            )
    except KeyboardInterrupt:
        print("netbed: interrupted, tearing down", file=sys.stderr)
        rc = 130
    except (NetBedError, subprocess.TimeoutExpired) as e:
        print(f"netbed: {e}", file=sys.stderr)
        rc = 1
    finally:
        # A second Ctrl-C must not leave namespaces behind.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        bed.stop()
    return rc


if __name__ == "__main__":
    sys.exit(main())
