"""When a node's link carries each step's bytes: a 1 ms trace of its byte counters.

``net_step_time.py --link-trace`` samples the byte counters of the driver's network
interface (in the test bed: the head node's end of its shaped link) while each
variant runs, cuts the trace into one burst per step (traffic separated by at least
``quiet_s`` without a byte), and reports per step:

- ``skew_ms``: how much later one side started sending than the other (this node's
  first byte out against the first byte in from the other nodes);
- ``later_start_to_end_ms``: from the later side's first byte to the burst's last,
  the part of the step the link cannot shorten by more than the bytes' line-rate
  time;
- ``gap_ms``: the quiet time since the previous step's last byte (optimizer step,
  forward and backward up to the first bucket);
- ``tx_mb`` / ``rx_mb``: the burst's bytes each way.

Only meaningful where the interface carries nothing but the run's traffic, as in
``tools/netbed.py``.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from pathlib import Path
from typing import Any


class LinkSampler:
    """Reads ``ifname``'s byte counters about every ``period_s`` on a thread.

    Reads ``/proc/self/net/dev``, which shows the network namespace of this process.
    """

    def __init__(self, ifname: str, period_s: float = 0.001) -> None:
        self.ifname = ifname.encode() + b":"
        self.period_s = period_s
        self.samples: list[tuple[float, int, int]] = []  # (monotonic s, tx, rx)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="link-sampler", daemon=True)

    def __enter__(self) -> LinkSampler:
        self._read()  # fails early if the interface is not here
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _read(self) -> None:
        for line in Path("/proc/self/net/dev").read_bytes().splitlines():
            if line.strip().startswith(self.ifname):
                fields = line.split(b":", 1)[1].split()
                self.samples.append((time.monotonic(), int(fields[8]), int(fields[0])))
                return
        raise RuntimeError(f"no interface {self.ifname[:-1].decode()!r} in /proc/self/net/dev")

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._read()


def step_bursts(
    samples: list[tuple[float, int, int]], quiet_s: float = 0.010, min_bytes: int = 4096
) -> list[dict[str, float]]:
    """Cuts a trace into bursts of traffic separated by at least ``quiet_s``."""
    bursts: list[dict[str, float]] = []
    cur: dict[str, float] | None = None
    for (t0, tx0, rx0), (t1, tx1, rx1) in itertools.pairwise(samples):
        sent, got = tx1 - tx0 >= min_bytes, rx1 - rx0 >= min_bytes
        if not (sent or got):
            continue
        if cur is None or t0 - cur["end"] > quiet_s:
            cur = {"start": t0, "end": t1, "tx": 0, "rx": 0, "tx_first": None, "rx_first": None}
            bursts.append(cur)
        cur["end"] = t1
        cur["tx"] += tx1 - tx0
        cur["rx"] += rx1 - rx0
        for key, moved in (("tx", sent), ("rx", got)):
            if moved:
                if cur[f"{key}_first"] is None:
                    cur[f"{key}_first"] = t0
                cur[f"{key}_last"] = t1
    return bursts


def summarize(samples: list[tuple[float, int, int]], steps: int) -> dict[str, Any]:
    """Medians over the last ``steps`` bursts that carried both ways (the timed
    steps: nothing large crosses after them)."""
    bursts = step_bursts(samples)
    both = [b for b in bursts if b["tx_first"] is not None and b["rx_first"] is not None]
    big = max((max(b["tx"], b["rx"]) for b in both), default=0)
    steps_b = [b for b in both if max(b["tx"], b["rx"]) >= big / 2][-steps:]
    rows = []
    for prev, b in zip([None, *steps_b], steps_b):
        later = max(b["tx_first"], b["rx_first"])
        rows.append(
            {
                "tx_mb": b["tx"] / 1e6,
                "rx_mb": b["rx"] / 1e6,
                "skew_ms": abs(b["tx_first"] - b["rx_first"]) * 1e3,
                "later_start_to_end_ms": (max(b["tx_last"], b["rx_last"]) - later) * 1e3,
                "gap_ms": (b["start"] - prev["end"]) * 1e3 if prev is not None else None,
            }
        )
    out: dict[str, Any] = {"steps_traced": len(rows)}
    for key in ("tx_mb", "rx_mb", "skew_ms", "later_start_to_end_ms", "gap_ms"):
        vals = [r[key] for r in rows if r[key] is not None]
        out[key] = statistics.median(vals) if vals else None
    return out
