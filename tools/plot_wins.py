"""The README's picture: where the parameter server wins against DDP, and where not.

Reads the stored results (nothing is measured here) and draws one bar per setting:
the PS's speed relative to DDP in the same run (DDP's step time over the PS's, or the
PS's throughput over DDP's), so 1.0 is a tie and higher is better.

    python tools/plot_wins.py       # writes docs/img/where_ps_wins.png
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "img" / "where_ps_wins.png"


def _json(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def _net_speed(name: str, variant: str = "ps_sync") -> float:
    """The inverse of the step-time ratio the docs quote (median of rounds)."""
    return 1 / _json(name)["ratio_to_ddp"][variant]


def bars() -> list[tuple[str, float]]:
    step = _json("step_time")
    one_node = 1 / statistics.median(
        r["ps_sync"]["median_step_s"] / r["ddp"]["median_step_s"] for r in step["rounds"]
    )
    straggler = _json("straggler")["throughput_ratio_to_ddp"]
    sleep = _json("straggler")["args"]["sleep_ms"]
    return [
        ("one node,\nsync PS", one_node),
        (f"one node, one worker\n{sleep:g} ms slow, async PS", straggler["ps_async+straggler"]),
        ("2 nodes x 1 worker,\n1 Gbit/s, sync PS", _net_speed("net_2x1_1gbit")),
        ("2 nodes x 2 workers,\n1 Gbit/s, sync PS", _net_speed("net_2x2_1gbit")),
        (
            "2 nodes x 2 workers,\n1 Gbit/s, DiLoCo H=32",
            _net_speed("net_2x2_1gbit_diloco", "ps_diloco_h32"),
        ),
    ]


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = bars()
    fig, ax = plt.subplots(figsize=(9, 3.6))
    labels = [k for k, _ in data]
    values = [v for _, v in data]
    colors = ["#2a7" if v > 1.03 else ("#c44" if v < 0.97 else "#888") for v in values]
    ax.bar(labels, values, color=colors)
    ax.axhline(1.0, color="black", linewidth=1)
    ax.text(len(values) - 0.5, 1.01, "DDP", ha="right", va="bottom", fontsize=8)
    for i, v in enumerate(values):
        ax.text(i, v + 0.02, f"{v:.2f}x", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("speed vs DDP, same run\n(higher is better)")
    ax.set_ylim(0, max(values) * 1.2)
    ax.tick_params(axis="x", labelsize=8)
    ax.set_title("Where the parameter server wins (2-core machine; bed: shaped links)", fontsize=10)
    fig.tight_layout()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=110)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
