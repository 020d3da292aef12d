"""ResNet-18 on CIFAR-shaped images: DDP against the PS modes, throughput and loss.

By default the images come from ``torchvision.datasets.FakeData`` (random 3x32x32
images, 10 classes; no download), so the loss shows that training runs, not that it
learns. With ``--download`` (and a network) it uses real CIFAR-10.

    python examples/resnet18.py                       # ddp, ps sync, ps async
    python examples/resnet18.py --variants ddp,ps_sync --steps 50
    python examples/resnet18.py --download --data ./data

Prints one row per variant: samples per second over all workers, median step time
and the mean loss of the last steps. ``--out`` also writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")

import ray
import ray.train
import ray.train.torch
import torch
import torch.nn as nn
from ray.train import RunConfig, ScalingConfig

from ray_ps_plugin import PSConfig, PSTrainer

VARIANTS = {
    "ddp": PSConfig(strategy="ddp"),
    "ps_sync": PSConfig(strategy="ps", mode="sync"),
    "ps_async": PSConfig(strategy="ps", mode="async"),
    "ps_ssp": PSConfig(strategy="ps", mode="ssp", staleness=2),
    "ps_sync_bf16": PSConfig(strategy="ps", mode="sync", compression="bf16"),
}


def dataset(config: dict[str, Any]) -> torch.utils.data.Dataset:
    import torchvision
    import torchvision.transforms as T

    transform = T.Compose([T.ToTensor(), T.Normalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))])
    if config["download"]:
        return torchvision.datasets.CIFAR10(
            config["data"], train=True, download=True, transform=transform
        )
    return torchvision.datasets.FakeData(
        size=config["samples"], image_size=(3, 32, 32), num_classes=10, transform=transform
    )


def train_fn(config: dict[str, Any]) -> None:
    import torchvision

    torch.set_num_threads(config["threads"])
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(torchvision.models.resnet18(num_classes=10))
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    loader = torch.utils.data.DataLoader(dataset(config), batch_size=config["batch"], shuffle=True)
    loader = ray.train.torch.prepare_data_loader(loader)
    times, losses, step = [], [], 0
    while step < config["steps"]:
        for x, y in loader:
            t0 = time.perf_counter()
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
            step += 1
            if step >= config["steps"]:
                break
    warm = min(3, len(times) - 1)
    metrics = {
        "median_step_s": statistics.median(times[warm:]),
        "loss_last": statistics.mean(losses[-5:]),
        "loss_first": statistics.mean(losses[:5]),
    }
    # Ray Train V2 keeps the metrics reported together with a checkpoint.
    with tempfile.TemporaryDirectory() as d:
        Path(d, "metrics.json").write_text(json.dumps(metrics))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))


def run(name: str, args: argparse.Namespace) -> dict[str, Any]:
    result = PSTrainer(
        train_fn,
        ps_config=VARIANTS[name],
        train_loop_config={
            "steps": args.steps,
            "batch": args.batch,
            "threads": 1,
            "lr": args.lr,
            "samples": args.samples,
            "download": args.download,
            "data": args.data,
        },
        scaling_config=ScalingConfig(num_workers=args.workers, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=args.storage, name=f"resnet18-{name}-{time.time_ns()}"),
    ).fit()
    m = result.metrics
    return {
        "variant": name,
        "samples_per_s": args.workers * args.batch / m["median_step_s"],
        "median_step_ms": m["median_step_s"] * 1e3,
        "loss_first": m["loss_first"],
        "loss_last": m["loss_last"],
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--variants", default="ddp,ps_sync,ps_async")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--samples", type=int, default=512, help="FakeData size")
    p.add_argument("--download", action="store_true", help="real CIFAR-10 (needs a network)")
    p.add_argument("--data", default="./data")
    p.add_argument("--storage", default=str(Path.home() / "ray_results"))
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = p.parse_args()
    args.data = str(Path(args.data).resolve())

    ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
    rows = [run(name, args) for name in args.variants.split(",")]
    ray.shutdown()
    ddp = next((r for r in rows if r["variant"] == "ddp"), None)
    print("\n| variant | samples/s | vs DDP | median step (ms) | loss first 5 -> last 5 |")
    print("|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['samples_per_s'] / ddp['samples_per_s']:.2f}x" if ddp else "-"
        print(
            f"| {r['variant']} | {r['samples_per_s']:.1f} | {ratio} | {r['median_step_ms']:.0f} | "
            f"{r['loss_first']:.3f} -> {r['loss_last']:.3f} |"
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
