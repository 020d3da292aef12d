"""A Hugging Face ``transformers.Trainer`` loop under DDP, then under parameter servers.

The training function is Ray Train's transformers recipe, unchanged: a ``Trainer``
passed through ``ray.train.huggingface.transformers.prepare_trainer``; accelerate
builds the ``DistributedDataParallel``. Only ``PSConfig(strategy=..., mode=...)``
changes between the runs. The model is a tiny BERT built from a config (no download)
and the data is synthetic; everything runs on an embedded local Ray cluster.

    python examples/transformers_ps.py [--steps 40] [--workers 2] [--modes sync async ssp]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")

import ray
import ray.train
import ray.train.collective
import torch
import transformers
from ray.train import RunConfig, ScalingConfig
from ray.train.huggingface.transformers import prepare_trainer

from ray_ps_plugin import PSConfig, PSTrainer, get_ps_context

VOCAB, LENGTH = 64, 16


class Sequences(torch.utils.data.Dataset):
    """Token sequences; the label says whether a token below 8 occurs in the first half."""

    def __init__(self, n: int = 512) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
        self.labels = (self.ids[:, : LENGTH // 2] < 8).any(dim=1).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.ids[i],
            "attention_mask": torch.ones_like(self.ids[i]),
            "labels": self.labels[i],
        }


class StepTimer(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._t0 = 0.0

    def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
        self._t0 = time.perf_counter()

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        self.times.append(time.perf_counter() - self._t0)


def train_fn(config: dict[str, Any]) -> None:
    """Ray Train's transformers recipe; nothing here names the plugin but the report."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(
        transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=LENGTH,
            num_labels=2,
        )
    )
    data = Sequences()
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out:
        trainer = transformers.Trainer(
            model=model,
            args=transformers.TrainingArguments(
                output_dir=out,
                max_steps=config["steps"],
                per_device_train_batch_size=16,
                learning_rate=config["lr"],
                use_cpu=True,
                save_strategy="no",
                logging_strategy="no",
                report_to="none",
                disable_tqdm=True,
            ),
            train_dataset=data,
            callbacks=[timer],
        )
        trainer = prepare_trainer(trainer)
        trainer.train()

    ctx = get_ps_context()  # None under strategy="ddp"
    if ctx is not None:
        # Every worker's last update on the servers before the final evaluation.
        ctx.flush()
        ray.train.collective.barrier()
    state = model.state_dict()  # async/ssp: installs the servers' parameters
    model.eval()
    batch = transformers.default_data_collator([data[i] for i in range(len(data))])
    with torch.no_grad():
        final_loss = model(**batch).loss.item()
    metrics = {
        "final_loss": final_loss,
        "step_ms": 1e3 * statistics.median(timer.times),
        "kb_pushed": ctx.stats.bytes_pushed / 1e3 if ctx else 0.0,
        "steps": trainer.state.global_step,
    }
    with tempfile.TemporaryDirectory() as d:
        checkpoint = None
        if ray.train.get_context().get_world_rank() == 0:
            torch.save(state, os.path.join(d, "model.pt"))
            checkpoint = ray.train.Checkpoint.from_directory(d)
        ray.train.report(metrics, checkpoint=checkpoint)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--modes", nargs="+", default=["sync", "async"])
    args = parser.parse_args()

    # address="local": always a fresh embedded cluster, never one found on the machine.
    ray.init(address="local", num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
    runs = [("ddp", "sync")] + [("ps", mode) for mode in args.modes]
    rows, states = {}, {}
    with tempfile.TemporaryDirectory() as storage:
        for strategy, mode in runs:
            trainer = PSTrainer(
                train_fn,
                train_loop_config={"steps": args.steps, "lr": args.lr},
                ps_config=PSConfig(strategy=strategy, mode=mode),
                scaling_config=ScalingConfig(
                    num_workers=args.workers, resources_per_worker={"CPU": 1}
                ),
                run_config=RunConfig(storage_path=storage, name=f"transformers-{strategy}-{mode}"),
            )
            label = "ddp" if strategy == "ddp" else f"ps/{mode}"
            result = trainer.fit()
            with result.checkpoint.as_directory() as d:
                states[label] = torch.load(os.path.join(d, "model.pt"), weights_only=True)
            rows[label] = result.metrics
    ray.shutdown()

    print(f"\ntransformers.Trainer (tiny BERT), {args.workers} workers, {args.steps} steps")
    print(
        f"{'strategy':<10} {'final loss':>10} {'step (ms)':>10} {'kB pushed':>10} "
        f"{'max |param - DDP param|':>24}"
    )
    for label, m in rows.items():
        diff = max(
            (states[label][k].double() - states["ddp"][k].double()).abs().max().item()
            for k in states["ddp"]
            if states["ddp"][k].is_floating_point()
        )
        print(
            f"{label:<10} {m['final_loss']:>10.4f} {m['step_ms']:>10.2f} "
            f"{m['kb_pushed']:>10.1f} {diff:>24.3g}"
        )
    print("\nSame Trainer code in every row; ps/sync ends with DDP's parameters.")


if __name__ == "__main__":
    main()
