"""Models, data, machine facts and driver steps shared by the benchmarks (shipped to
workers by value)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Collection
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
from torch.nn.parallel import DistributedDataParallel


def reference_mlp(width: int = 2048) -> nn.Module:
    """The reference model: MLP 784-2048-2048-10 (5.8 M parameters)."""
    return nn.Sequential(
        nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )


def digits_mlp() -> nn.Module:
    """A small MLP for scikit-learn's 8x8 digits."""
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def digits_split(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Digits (bundled with scikit-learn, no download): 70/30 train/test tensors."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(x))
    x = torch.tensor(x[order] / 16.0, dtype=torch.float32)
    y = torch.tensor(y[order], dtype=torch.long)
    cut = int(0.7 * len(x))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def prepared_digits(seed: int, lr: float) -> tuple[Any, ...]:
    """Inside a Train worker: this rank's share of the digits training split, the
    test split, and the prepared digits MLP with SGD (momentum 0.9).

    Returns:
        ``(rank, xtr, ytr, xte, yte, model, optimizer)``.
    """
    import ray.train
    import ray.train.torch

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    xtr, ytr, xte, yte = digits_split()
    model = ray.train.torch.prepare_model(digits_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return rank, xtr[rank::world], ytr[rank::world], xte, yte, model, opt


def code_commit() -> str:
    """The commit the benchmark runs (``-dirty`` when the package, the benchmarks or
    the examples differ from it), or ``"unknown"`` outside a git checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", root, *args], capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        # Stored results are outputs, not code: a run that follows another before
        # its results are committed still measures the commit.
        dirty = git(
            "status",
            "--porcelain",
            "--",
            "ray_ps_plugin",
            "benchmarks",
            "examples",
            ":(exclude)benchmarks/results",
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def machine_info() -> dict[str, Any]:
    """Where and on what code a result was measured (stored with every result)."""
    import ray

    return {
        "date": date.today().isoformat(),
        "commit": code_commit(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "torch": torch.__version__,
        "ray": ray.__version__,
    }


def prepared_mlp_steps(
    config: dict[str, Any], lr: float, on_timed_start: Callable[[], Any] | None = None
) -> tuple[nn.Module, list[float]]:
    """Inside a Train worker: prepares the reference MLP and times SGD steps on one batch.

    Config keys: ``width``, ``sync`` (False: no DDP wrap, the compute floor),
    ``warmup``, ``steps`` and optionally ``comm_hook`` (``"bf16"``: torch's
    ``bf16_compress_hook`` on a plain DDP model). Returns the prepared model and the
    timed steps' seconds (``zero_grad`` + forward + backward + ``optimizer.step()``,
    warm-up dropped). ``on_timed_start`` is called once, right before the first timed
    step (e.g. to read byte counters).
    """
    import ray.train.torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(
        reference_mlp(config["width"]), parallel_strategy="ddp" if config["sync"] else None
    )
    # Only a plain DDP takes the hook: the PS wrapper (a DDP subclass) installs its
    # own, and a single worker is not wrapped at all.
    if config.get("comm_hook") == "bf16" and type(model) is DistributedDataParallel:
        model.register_comm_hook(None, bf16_compress_hook)
    elif config.get("comm_hook") not in (None, "bf16"):
        raise ValueError(f"unknown comm_hook {config['comm_hook']!r}; use None or 'bf16'")
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = torch.randn(32, 784), torch.randint(0, 10, (32,))
    times = []
    for step in range(config["warmup"] + config["steps"]):
        if step == config["warmup"] and on_timed_start is not None:
            on_timed_start()
        t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if step >= config["warmup"]:
            times.append(time.perf_counter() - t0)
    return model, times


def link_bytes(ifname: str | None) -> int | None:
    """Bytes sent plus received so far on ``ifname`` (``None`` if unreadable).

    In the test bed each worker runs in its node's network namespace, so this is
    exactly the traffic of that node's shaped link.
    """
    if not ifname:
        return None
    try:
        base = Path("/sys/class/net", ifname, "statistics")
        return int((base / "tx_bytes").read_text()) + int((base / "rx_bytes").read_text())
    except (OSError, ValueError):
        return None


def check_placement(name: str, workers: list[dict[str, Any]], args: Any) -> None:
    """Refuses a run whose workers did not land ``args.workers_per_node`` on each of
    ``args.nodes`` nodes (each worker reports its ``node_id``)."""
    per_node: dict[str, int] = {}
    for w in workers:
        per_node[w["node_id"]] = per_node.get(w["node_id"], 0) + 1
    wanted = [args.workers_per_node] * args.nodes
    if sorted(per_node.values()) != wanted:
        raise RuntimeError(
            f"{name}: workers landed {per_node} (node id: count), not {args.workers_per_node} "
            f"on each of {args.nodes} nodes; give each node enough CPUs"
        )


# --- the drivers' shared steps: command line, rounds of variants, results -------------
def parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's argument parser, its help led by ``doc`` with line breaks kept.

    Args:
        doc: The script's docstring.

    Returns:
        The parser, without arguments yet.
    """
    return argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def check_variants(p: argparse.ArgumentParser, names: list[str], known: Collection[str]) -> None:
    """Exits through ``p.error`` when ``names`` holds a variant that is not in ``known``.

    Args:
        p: The parser whose error message and exit status are used.
        names: The variants asked for.
        known: The benchmark's variants (their names, or a dict keyed by them).
    """
    unknown = set(names) - set(known)
    if unknown:
        p.error(f"unknown variant(s) {sorted(unknown)}; choose from {list(known)}")


def run_rounds(
    names: list[str], rounds: int, run: Callable[[str], dict[str, Any]], key: str
) -> list[dict[str, dict[str, Any]]]:
    """Runs every variant once per round, in the order of ``names``, and prints each
    round's step times as it ends.

    Args:
        names: The variants.
        rounds: How many rounds.
        run: Runs one variant and returns its metrics.
        key: The metrics' step time in seconds, shown in milliseconds.

    Returns:
        Per round, every variant's metrics.
    """
    out: list[dict[str, dict[str, Any]]] = []
    for r in range(rounds):
        out.append({name: run(name) for name in names})
        print(round_line(r + 1, out[-1], key), flush=True)
    return out


def run_rotated(
    variants: list[str], i: int, run: Callable[[str], dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Round ``i``: runs every variant once, starting ``i`` variants later than round 0.

    Args:
        variants: The variants, in their listed order.
        i: The round's index.
        run: Runs one variant and returns its result.

    Returns:
        Every variant's result, in the listed order (not the order run).
    """
    # Each round starts one variant later: a drift of the machine within a round
    # (another process, the page cache) does not always favour the same variant.
    order = variants[i % len(variants) :] + variants[: i % len(variants)]
    ran = {name: run(name) for name in order}
    return {name: ran[name] for name in variants}


def round_line(number: int, row: dict[str, dict[str, Any]], key: str) -> str:
    """One round's step times, e.g. ``round 2: ddp 41.3 ms, ps_sync failed``.

    Args:
        number: The round's number, from 1.
        row: Every variant's metrics in that round (``{"failed": ...}`` if it failed).
        key: The metrics' step time in seconds, shown in milliseconds.

    Returns:
        The line, without its newline.
    """
    return f"round {number}: " + ", ".join(
        f"{k} {v[key] * 1e3:.1f} ms" if "failed" not in v else f"{k} failed" for k, v in row.items()
    )


def round_median(rounds: list[dict[str, dict[str, Any]]], name: str, key: str) -> float:
    """The median over rounds of variant ``name``'s metric ``key``."""
    return statistics.median(x[name][key] for x in rounds)


def round_ratio(rounds: list[dict[str, dict[str, Any]]], name: str, base: str, key: str) -> float:
    """The median over rounds of ``name``'s metric ``key`` divided by ``base``'s in the
    same round."""
    return statistics.median(x[name][key] / x[base][key] for x in rounds)


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    """Writes ``data`` as JSON indented by 2 to ``path``, creating its folder.

    Args:
        path: The file to write.
        data: The results.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2))
    return out


def loss_figures(
    killed: list[dict[str, Any]], clean: list[float], measure: Callable[[dict[str, Any]], dict]
) -> dict[str, Any]:
    """A failure benchmark's figures for one variant: ``measure`` of the first seed's
    killed run, and the accuracy of every seed's killed and uninterrupted runs with
    their means."""
    figures = measure(killed[0])
    figures["accuracy_by_seed"] = [r["accuracy"] for r in killed]
    figures["accuracy_uninterrupted_by_seed"] = clean
    figures["accuracy"] = statistics.mean(figures["accuracy_by_seed"])
    figures["accuracy_uninterrupted"] = statistics.mean(clean)
    print({k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()})
    return figures
