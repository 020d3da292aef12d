"""Renderers of ``benchmarks/dlrm.py``: DLRM's recipe in every mode."""

from __future__ import annotations

from .fmt import _provenance, _table, _x
from .results import read_json


def dlrm_table(result: str) -> str:
    """Per variant: step time, throughput and held-out loss, against DDP's in the
    same rounds (a result with a straggler: throughput is what it is about)."""
    d = read_json(result)
    rows = []
    sync_loss = d["summary"].get("ps_sync", d["summary"]["ddp"])["held_out_loss"]
    for variant, e in d["summary"].items():
        rows.append(
            [
                f"`{variant}`",
                f"{e['median_step_s'] * 1e3:.1f}",
                _x(e["step_ratio_to_ddp"]),
                f"{e['samples_per_s']:.0f}",
                _x(e["throughput_ratio_to_ddp"]),
                f"{e['held_out_loss']:.4f}",
                f"{(e['held_out_loss'] / sync_loss - 1) * 100:+.1f}%",
            ]
        )
    header = [
        "variant",
        "step (ms)",
        "step vs DDP",
        "samples/s (both workers)",
        "throughput vs DDP",
        "held-out loss",
        "loss vs sync",
    ]
    return _provenance(result, "dlrm", f"{result}.json") + "\n\n" + _table(header, rows)


def dlrm_ratio(variant: str, result: str, field: str = "step") -> str:
    """A variant's step time (``step``) or throughput (``throughput``) as a multiple
    of DDP's in a dlrm result, e.g. ``0.56×``."""
    return _x(read_json(result)["summary"][variant][f"{field}_ratio_to_ddp"])


def dlrm_loss_gap(variant: str, result: str) -> str:
    """A variant's held-out loss against sync's, in percent, e.g. ``+0.3%``."""
    s = read_json(result)["summary"]
    return f"{(s[variant]['held_out_loss'] / s['ps_sync']['held_out_loss'] - 1) * 100:+.1f}%"
