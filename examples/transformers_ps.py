"""A Hugging Face ``transformers.Trainer`` loop under DDP, then under parameter servers.

The training function is Ray Train's transformers recipe, unchanged: a ``Trainer``
passed through ``ray.train.huggingface.transformers.prepare_trainer``; accelerate
builds the ``DistributedDataParallel``. Only ``PSConfig(strategy=..., mode=...)``
changes between the runs. The model is a tiny BERT built from a config (no download)
and the data is synthetic; everything runs on an embedded local Ray cluster.

    python examples/transformers_ps.py [--steps 40] [--workers 2] [--modes sync async ssp]
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")

import torch
import transformers
from _side_by_side import compare, parse_args, report, servers_up_to_date
from ray.train.huggingface.transformers import prepare_trainer

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

    servers_up_to_date()
    state = model.state_dict()  # async/ssp: installs the servers' parameters
    model.eval()
    batch = transformers.default_data_collator([data[i] for i in range(len(data))])
    with torch.no_grad():
        final_loss = model(**batch).loss.item()
    report(state, final_loss, timer.times, trainer.state.global_step)


if __name__ == "__main__":
    compare(
        train_fn,
        parse_args(__doc__, steps=40, lr=3e-3),
        "transformers.Trainer (tiny BERT)",
        "transformers",
    )
