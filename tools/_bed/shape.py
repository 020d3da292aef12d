"""How a link is shaped: tc-style rates and times, and :class:`LinkShape`."""

from __future__ import annotations

import re
from dataclasses import dataclass

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


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
