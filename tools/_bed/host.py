"""The host side of the bed: names, errors, and the ``ip``/``tc`` namespace plumbing.

Constants shared by every part of the bed, the checks that tell whether a bed can be
built here, the wrappers that run ``ip`` and ``tc`` with a bound, and the functions that
list, empty and delete network namespaces (also those left by a bed that died).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

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
REPO_ROOT = Path(__file__).resolve().parents[2]

_IP_TIMEOUT_S = 30.0


class NetBedError(RuntimeError):
    """The bed could not be built, started or shaped."""


class _NoNetem(NetBedError):
    """The kernel has no netem qdisc."""


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
