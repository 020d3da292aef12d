"""Sweep strategies, consistency modes and learning rates side by side with Ray Tune.

Every trial runs the same ordinary Ray Train loop; only the trial config differs:
``ps_config`` picks a (strategy, mode) pair and ``lr`` the learning rate.
``ray_ps_plugin.tune.make_trainable`` turns the loop into a Tune function trainable
(Ray Train V2's pattern: build the trainer in the trial, forward its reports to Tune,
call ``fit()``).

Default task: scikit-learn's bundled 8x8 digits and a small MLP (no download).
``--model resnet18``: torchvision's ResNet-18 on a few CIFAR-shaped ``FakeData``
images (random labels, so its accuracy is chance: it is there to time a model
with 11 M parameters, not to learn).

    python examples/tune_sweep.py                        # ddp/sync, ps/sync x 2 lrs
    python examples/tune_sweep.py --modes sync,async,ssp # compare the PS modes
    python examples/tune_sweep.py --modes sync,diloco --local-steps 8,32 --outer-lrs 0.7,1.0
    python examples/tune_sweep.py --model resnet18 --lrs 0.01 --plot resnet.png

DDP has only one mode, so it runs once per lr whatever ``--modes`` lists;
``diloco`` runs once per (``--local-steps``, ``--outer-lrs``) pair. Prints a ranked
table and saves accuracy against training wall time, one colour per strategy, to
``--plot``. (A DiLoCo worker's accuracy between rounds is that of its own copy; the
last epoch's is taken after ``flush()`` has sent the last round.)
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from collections.abc import Sequence
from typing import Any

# Each ray.train.report waits for the controller's next poll (2 s by default); this
# loop reports every epoch, so poll faster. Set before Ray starts its processes.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")

import ray
import ray.train
import ray.train.torch
import torch
import torch.nn as nn
from ray import tune
from ray.train import ScalingConfig

from ray_ps_plugin import PSConfig, get_ps_context
from ray_ps_plugin.tune import make_trainable


# --- the training loop: an unchanged TorchTrainer loop --------------------------------
def load_data(
    model: str, samples: int
) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
    """Train and test sets: digits (70/30 split) or CIFAR-shaped FakeData."""
    if model == "resnet18":
        import torchvision

        def fake(size: int, offset: int) -> torch.utils.data.Dataset:
            return torchvision.datasets.FakeData(
                size=size,
                image_size=(3, 32, 32),
                num_classes=10,
                transform=torchvision.transforms.ToTensor(),
                random_offset=offset,
            )

        return fake(samples, 0), fake(max(samples // 4, 32), samples)
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x = torch.tensor(x / 16.0, dtype=torch.float32)[order]
    y = torch.tensor(y, dtype=torch.long)[order]
    cut = int(0.7 * len(x))
    return (
        torch.utils.data.TensorDataset(x[:cut], y[:cut]),
        torch.utils.data.TensorDataset(x[cut:], y[cut:]),
    )


def build_model(model: str) -> nn.Module:
    if model == "resnet18":
        import torchvision

        return torchvision.models.resnet18(num_classes=10)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def evaluate(model: nn.Module, loader: torch.utils.data.DataLoader) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            correct += (model(x).argmax(dim=1) == y).sum().item()
            total += len(y)
    model.train()
    return correct / total


def train_loop(config: dict[str, Any]) -> None:
    """prepare_model, prepare_data_loader, SGD, one report per epoch, a final checkpoint.

    Nothing here knows about the strategy: PSConfig decides what prepare_model returns.
    """
    torch.set_num_threads(1)  # one core per worker, so wall times compare fairly
    torch.manual_seed(config["seed"])
    train_set, test_set = load_data(config["model"], config["samples"])
    model = ray.train.torch.prepare_model(build_model(config["model"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    train_loader = ray.train.torch.prepare_data_loader(
        torch.utils.data.DataLoader(train_set, batch_size=config["batch_size"], shuffle=True)
    )
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=256)
    rank = ray.train.get_context().get_world_rank()
    train_s = 0.0  # training only: evaluation and reporting are left out
    for epoch in range(config["epochs"]):
        start = time.perf_counter()
        if ray.train.get_context().get_world_size() > 1:
            train_loader.sampler.set_epoch(epoch)
        for x, y in train_loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        last = epoch + 1 == config["epochs"]
        ps = get_ps_context()
        if last and ps is not None:
            # Every update of this worker reaches the shards before the final
            # checkpoint (async/ssp: the last push; diloco: the last, shorter round).
            ps.flush()
        train_s += time.perf_counter() - start
        metrics = {
            "epoch": epoch + 1,
            "loss": loss.item(),
            "accuracy": evaluate(model, test_loader),
            "train_s": train_s,
        }
        with tempfile.TemporaryDirectory() as d:
            checkpoint = None
            if last and rank == 0:
                torch.save(model.module.state_dict(), os.path.join(d, "model.pt"))
                checkpoint = ray.train.Checkpoint.from_directory(d)
            ray.train.report(metrics, checkpoint=checkpoint)


# --- the sweep ------------------------------------------------------------------------
def strategy_mode_pairs(
    strategies: list[str],
    modes: list[str],
    staleness: int,
    local_steps: Sequence[int] = (32,),
    outer_lrs: Sequence[float] = (0.7,),
) -> list[dict[str, Any]]:
    """One ps_config per (strategy, mode) pair; DDP only once, it has no modes;
    ``diloco`` once per (local steps, outer learning rate)."""
    pairs: list[dict[str, Any]] = []
    for strategy in strategies:
        for mode in modes if strategy == "ps" else ["sync"]:
            base: dict[str, Any] = {"strategy": strategy, "mode": mode}
            if mode == "ssp":
                base["staleness"] = staleness
            variants = [base]
            if mode == "diloco":
                variants = [
                    {**base, "local_steps": h, "outer_lr": lr}
                    for h in local_steps
                    for lr in outer_lrs
                ]
            for pair in variants:
                # Fail here, before Ray starts, for a mode this version does not have.
                PSConfig(**pair)
                pairs.append(pair)
    return pairs


def describe(pair: dict[str, Any]) -> str:
    """``ps/diloco H=32 olr=0.7``, ``ddp/sync``: a trial's strategy and mode."""
    text = f"{pair['strategy']}/{pair['mode']}"
    if pair["mode"] == "diloco":
        text += f" H={pair['local_steps']} olr={pair['outer_lr']:g}"
    return text


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"\n{'rank':>4} {'accuracy':>8} {'train s':>8} {'trial s':>8}  "
        f"{'lr':>7}  {'strategy/mode':<26}"
    )
    for i, r in enumerate(rows, 1):
        print(
            f"{i:>4} {r['accuracy']:>8.4f} {r['train_s']:>8.2f} {r['trial_s']:>8.1f}  "
            f"{r['lr']:>7g}  {r['trial']:<26}"
        )


def plot(results: tune.ResultGrid, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    colours = {"ddp": "tab:blue", "ps": "tab:orange"}
    styles = {"sync": "-", "async": "--", "ssp": ":", "diloco": "-."}
    lrs = sorted({r.config["lr"] for r in results})
    markers = dict(zip(lrs, "osD^v<>p*"))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        if r.error or r.metrics_dataframe is None:
            continue
        pair, df = r.config["ps_config"], r.metrics_dataframe.sort_values("epoch")
        ax.plot(
            df["train_s"],
            df["accuracy"],
            marker=markers.get(r.config["lr"], "o"),
            color=colours.get(pair["strategy"], "tab:gray"),
            linestyle=styles.get(pair["mode"], "-"),
            label=f"{describe(pair)} lr={r.config['lr']:g}",
        )
    ax.set_xlabel("training wall time (s)")
    ax.set_ylabel("test accuracy")
    ax.set_title("Accuracy against wall time, per strategy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    """Parses the command line."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--strategies", default="ddp,ps", help="comma-separated: ddp,ps")
    parser.add_argument(
        "--modes",
        default="sync",
        help="comma-separated PS modes: sync (default), async, ssp, diloco. DDP has "
        "one mode and runs once per lr whatever this lists.",
    )
    parser.add_argument("--local-steps", default="32", help="comma-separated H of diloco trials")
    parser.add_argument(
        "--outer-lrs", default="0.7", help="comma-separated outer learning rates of diloco trials"
    )
    parser.add_argument("--staleness", type=int, default=1, help="staleness of ssp trials")
    parser.add_argument("--lrs", default="0.05,0.2", help="comma-separated learning rates")
    parser.add_argument("--model", choices=("mlp", "resnet18"), default="mlp")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--samples", type=int, default=128, help="FakeData training images (resnet18)"
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--cpus-per-worker",
        type=float,
        default=0.5,
        help="logical CPUs each worker reserves (a bundle of the run's placement group)",
    )
    parser.add_argument(
        "--driver-cpus",
        type=float,
        default=0.25,
        help="logical CPUs each trial's driver reserves (it only waits on its run)",
    )
    parser.add_argument(
        "--max-concurrent",
        type=int,
        default=None,
        help="trials at once; default: as many as the cluster's CPUs hold whole",
    )
    parser.add_argument(
        "--storage", default=None, help="Tune storage_path (default: Ray's, ~/ray_results)"
    )
    parser.add_argument("--plot", default="tune_sweep.png", help="where to save the PNG")
    return parser.parse_args()


def trials_at_once(args: argparse.Namespace) -> tuple[int, float]:
    """How many trials run at once on the connected cluster.

    Returns:
        ``--max-concurrent`` (else as many as its CPUs hold whole), and the CPUs
        one trial holds.
    """
    # A trial holds its driver's CPUs and, once its run starts, all its workers' CPUs;
    # the PS shards hold none (num_cpus=0 inside the workers' bundles). Admit only as
    # many trials as fit whole, or drivers could hold CPUs their own workers wait for.
    per_trial = args.driver_cpus + args.workers * args.cpus_per_worker
    fit_whole = max(1, math.floor(ray.cluster_resources()["CPU"] / per_trial))
    return args.max_concurrent or fit_whole, per_trial


def build_tuner(
    args: argparse.Namespace, pairs: list[dict[str, Any]], lrs: list[float], max_concurrent: int
) -> tune.Tuner:
    """The Tuner: a grid over (strategy, mode) pairs and learning rates.

    Args:
        args: The command line.
        pairs: The trials' ps_configs.
        lrs: The learning rates.
        max_concurrent: Trials at once.

    Returns:
        The Tuner, not run yet.
    """
    trainable = make_trainable(
        train_loop,
        ScalingConfig(num_workers=args.workers, resources_per_worker={"CPU": args.cpus_per_worker}),
    )
    return tune.Tuner(
        tune.with_resources(trainable, {"CPU": args.driver_cpus}),
        param_space={
            "ps_config": tune.grid_search(pairs),
            "lr": tune.grid_search(lrs),
            "model": args.model,
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "samples": args.samples,
            "seed": 0,
        },
        tune_config=tune.TuneConfig(max_concurrent_trials=max_concurrent),
        run_config=tune.RunConfig(
            name=f"tune_sweep_{args.model}", storage_path=args.storage, verbose=0
        ),
    )


def ranked_rows(results: tune.ResultGrid) -> list[dict[str, Any]]:
    """The finished trials, best accuracy first (then fastest); prints the failed ones."""
    rows = []
    for r in results:
        if r.error:
            print(f"trial {r.config['ps_config']} lr={r.config['lr']} failed: {r.error}")
            continue
        rows.append(
            {
                "trial": describe(r.config["ps_config"]),
                "lr": r.config["lr"],
                "accuracy": r.metrics["accuracy"],
                "train_s": r.metrics["train_s"],
                "trial_s": r.metrics["time_total_s"],
            }
        )
    rows.sort(key=lambda row: (-row["accuracy"], row["train_s"]))
    return rows


def main() -> None:
    """Runs the sweep, prints the ranked table and saves the plot."""
    args = parse_args()
    pairs = strategy_mode_pairs(
        args.strategies.split(","),
        args.modes.split(","),
        args.staleness,
        [int(v) for v in args.local_steps.split(",")],
        [float(v) for v in args.outer_lrs.split(",")],
    )
    lrs = [float(v) for v in args.lrs.split(",")]

    ray.init(log_to_driver=False)
    max_concurrent, per_trial = trials_at_once(args)
    tuner = build_tuner(args, pairs, lrs, max_concurrent)
    n = len(pairs) * len(lrs)
    print(f"{n} trials ({args.model}), {max_concurrent} at a time, {per_trial:g} CPUs each ...")
    t0 = time.perf_counter()
    results = tuner.fit()
    wall = time.perf_counter() - t0

    print_table(ranked_rows(results))
    plot(results, args.plot)
    print(f"\nSweep took {wall:.0f}s. Plot: {os.path.abspath(args.plot)}")
    print(f"Train runs and checkpoints: {results.experiment_path}")
    ray.shutdown()


if __name__ == "__main__":
    main()
