"""The command line of ``tools/netbed.py``: build a bed, run one command in it, tear
it down."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from .bed import NetBed
from .host import NetBedError, cleanup_stale, require_root
from .shape import LinkShape


def _format_bytes(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


# Signals that end the command and tear the bed down.
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _parser() -> argparse.ArgumentParser:
    """The command line's flags and their defaults."""
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
    return p


def _interrupt(signum: int, _frame: Any) -> None:
    """Signal handler: unwinds like Ctrl-C."""
    raise KeyboardInterrupt(f"signal {signum}")


def _run(bed: NetBed, shape: LinkShape, args: argparse.Namespace, cmd: list[str]) -> int:
    """Starts the bed, runs ``cmd`` in it and prints what each node's link carried.

    Args:
        bed: The bed, not started yet.
        shape: Its links' shape.
        args: The command line.
        cmd: The command to run in the head's namespace.

    Returns:
        The command's exit status.
    """
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
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: build a bed, run one command in it, tear it down."""
    p = _parser()
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
    # SIGINT too: a shell starts background jobs with SIGINT ignored, and Python then
    # keeps ignoring it.
    for sig in _SIGNALS:
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
        rc = _run(bed, shape, args, cmd)
    except KeyboardInterrupt:
        print("netbed: interrupted, tearing down", file=sys.stderr)
        rc = 130
    except (NetBedError, subprocess.TimeoutExpired) as e:
        print(f"netbed: {e}", file=sys.stderr)
        rc = 1
    finally:
        # A second Ctrl-C must not leave namespaces behind.
        for sig in _SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        bed.stop()
    return rc
