"""PyTorch Lightning and Hugging Face ``transformers.Trainer`` loops (shipped by value).

Neither loop names the plugin: each is the framework's own Ray Train recipe
(Lightning: ``RayDDPStrategy`` + ``RayLightningEnvironment`` + ``prepare_trainer``;
transformers: ``Trainer`` + ``ray.train.huggingface.transformers.prepare_trainer``),
so the same function runs under ``strategy="ddp"`` and ``strategy="ps"``. The models
are tiny and built from code (no download); the data is synthetic and seeded.

Both report, from every rank: the final model's loss on the whole data set, the
median step time, the steps taken, and the PS counters when there is a PS context;
rank 0 attaches the trained module's ``state_dict()`` as ``model.pt``
(:func:`framework_loop` can also run both in one Train run).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import ray.train
import ray.train.collective
import torch
import torch.nn as nn

from ray_ps_plugin import get_ps_context


def framework_loop(config: dict[str, Any]) -> None:
    """Runs ``config["framework"]``'s loop ("lightning" or "transformers"), or each
    framework of a list in turn (``steps`` then maps each framework to its steps).

    One framework: its metrics are the report (see :func:`report`). Several: one
    report at the end holds each framework's metrics under its name and, on rank 0,
    each trained ``state_dict()`` as ``<framework>.pt``; ``ps_num_models`` counts the
    models that framework's own loop prepared.
    """
    torch.set_num_threads(1)
    loops = {"lightning": lightning_loop, "transformers": transformers_loop}
    names = config["framework"]
    if isinstance(names, str):
        steps = config["steps"]
        if isinstance(steps, dict):
            config = {**config, "steps": steps[names]}
        report(*loops[names](config))
        return
    metrics: dict[str, Any] = {}
    states: dict[str, dict[str, torch.Tensor]] = {}
    for name in names:
        ctx = get_ps_context()
        before = ctx.num_models if ctx is not None else 0
        out = loops[name]({**config, "framework": name, "steps": config["steps"][name]})
        metrics[name], states[name] = summarize(*out)
        if ctx is not None:
            metrics[name]["ps_num_models"] -= before
    with tempfile.TemporaryDirectory() as d:
        checkpoint = None
        if ray.train.get_context().get_world_rank() == 0:
            for name, state in states.items():
                torch.save(state, f"{d}/{name}.pt")
            checkpoint = ray.train.Checkpoint.from_directory(d)
        ray.train.report(metrics, checkpoint=checkpoint)


# --- PyTorch Lightning ----------------------------------------------------------------
def classification_data(n: int = 256, dim: int = 16, classes: int = 4) -> Any:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, dim, generator=g)
    y = (x[:, :classes].argmax(dim=1) + (x[:, classes] > 0).long()) % classes
    return torch.utils.data.TensorDataset(x, y)


def ray_lightning_trainer(
    steps: int, callbacks: list[Any], strategy: Any = None, **kwargs: Any
) -> Any:
    """``pl.Trainer`` as Ray Train's Lightning recipe builds it (``RayDDPStrategy``,
    ``RayLightningEnvironment``, ``prepare_trainer``), on CPU, quiet, for ``steps``
    optimizer steps."""
    import pytorch_lightning as pl
    from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, prepare_trainer

    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices="auto",
        strategy=strategy or RayDDPStrategy(),
        plugins=[RayLightningEnvironment()],
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        **kwargs,
    )
    return prepare_trainer(trainer)


def lightning_loop(config: dict[str, Any]) -> Trained:
    """A LightningModule trained by ``pl.Trainer`` with Ray's DDP strategy."""
    import pytorch_lightning as pl
    from ray.train.lightning import RayDDPStrategy

    class TinyClassifier(pl.LightningModule):
        def __init__(self, lr: float) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
            self.lr = lr

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.cross_entropy(self(x), y)
            if self.global_step == config.get("nan_step") and self.global_rank == 0:
                loss = loss * float("nan")  # one worker's gradient goes NaN on this step
            return loss

        def configure_optimizers(self) -> Any:
            if config.get("optimizer", "sgd") == "adam":
                return torch.optim.Adam(self.parameters(), lr=self.lr)
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    timer = StepTimer()
    seen: dict[str, Any] = {}

    class TimeSteps(pl.Callback):
        def on_train_start(self, trainer: Any, *args: Any) -> None:
            seen["wrapper"] = type(trainer.strategy.model).__name__

        def on_train_batch_start(self, *args: Any) -> None:
            timer.start()

        def on_train_batch_end(self, *args: Any) -> None:
            timer.stop()

    torch.manual_seed(config.get("seed", 0))
    model = TinyClassifier(config.get("lr", 0.1))
    data = classification_data()
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
    trainer = ray_lightning_trainer(
        config["steps"],
        [TimeSteps()],
        RayDDPStrategy(**config.get("strategy_kwargs", {})),
        deterministic=True,
    )
    trainer.fit(model, train_dataloaders=loader)
    x, y = data.tensors
    return (
        model,
        lambda: nn.functional.cross_entropy(model(x), y).item(),
        timer,
        trainer.global_step,
        seen,
    )


# --- Hugging Face transformers.Trainer ------------------------------------------------
class TokenData(torch.utils.data.Dataset):
    """Sequences of token ids; the label says whether token 7 occurs in the first half."""

    def __init__(self, n: int = 128, length: int = 8, vocab: int = 50) -> None:
        g = torch.Generator().manual_seed(4321)
        self.ids = torch.randint(1, vocab, (n, length), generator=g)
        self.labels = (self.ids[:, : length // 2] < 10).any(dim=1).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.ids[i],
            "attention_mask": torch.ones_like(self.ids[i]),
            "labels": self.labels[i],
        }


def tiny_bert() -> Any:
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(cfg)


def transformers_loop(config: dict[str, Any]) -> Trained:
    """``transformers.Trainer`` (accelerate builds the DDP) with Ray's prepare_trainer."""
    import transformers
    from ray.train.huggingface.transformers import prepare_trainer

    timer = StepTimer()

    class TimeSteps(transformers.TrainerCallback):
        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            timer.start()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            timer.stop()

    torch.manual_seed(config.get("seed", 0))
    model = tiny_bert()
    data = TokenData()
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out,
            max_steps=config["steps"],
            per_device_train_batch_size=8,
            learning_rate=config.get("lr", 1e-2),
            optim=config.get("optim", "adamw_torch"),
            use_cpu=True,
            seed=0,
            save_strategy="no",
            logging_strategy="no",
            report_to="none",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=data, callbacks=[TimeSteps()]
        )
        trainer = prepare_trainer(trainer)
        trainer.train()
    wrapper = type(trainer.model_wrapped).__name__
    model.eval()
    batch = transformers.default_data_collator([data[i] for i in range(len(data))])
    return (
        model,
        lambda: model(**batch).loss.item(),
        timer,
        trainer.state.global_step,
        {"wrapper": wrapper},
    )


# --- shared ---------------------------------------------------------------------------
class StepTimer:
    """Wall time of each training step (forward, backward, synchronisation, update)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t0 = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        self.times.append(time.perf_counter() - self._t0)

    def median_ms(self) -> float:
        return 1e3 * statistics.median(self.times) if self.times else float("nan")


# What a framework's loop hands back: the trained module, its loss on the whole data
# set, the step timer, the steps taken, and extra metrics.
Trained = tuple[nn.Module, Callable[[], float], StepTimer, int, dict[str, Any]]


def summarize(
    module: nn.Module,
    loss: Callable[[], float],
    timer: StepTimer,
    steps: int,
    extra: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """This rank's metrics and a copy of ``module.state_dict()``.

    Under PS every worker first flushes, then waits for the others (the documented
    recipe for a final checkpoint holding every worker's last update); in async/ssp
    ``state_dict()`` then installs the servers' parameters, which ``loss`` evaluates.
    """
    ctx = get_ps_context()
    if ctx is not None:
        ctx.flush()
        ray.train.collective.barrier()
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    with torch.no_grad():
        final_loss = loss()
    metrics: dict[str, Any] = {
        "final_loss": final_loss,
        "step_ms": timer.median_ms(),
        "steps": steps,
        "finite": all(bool(torch.isfinite(v).all()) for v in state.values()),
        "has_ps_context": ctx is not None,
        **extra,
    }
    if ctx is not None:
        st = ctx.stats
        metrics.update(
            ps_mode=ctx.mode,
            ps_num_models=ctx.num_models,
            ps_steps=st.steps,
            ps_bytes_pushed=st.bytes_pushed,
            ps_bytes_pulled=st.bytes_pulled,
            ps_skipped_steps=st.skipped_steps,
        )
    return metrics, state


def report(*trained: Any) -> None:
    """Every rank reports :func:`summarize`'s metrics; rank 0 attaches the state as
    model.pt."""
    metrics, state = summarize(*trained)
    with tempfile.TemporaryDirectory() as d:
        checkpoint = None
        if ray.train.get_context().get_world_rank() == 0:
            torch.save(state, f"{d}/model.pt")
            checkpoint = ray.train.Checkpoint.from_directory(d)
        ray.train.report(metrics, checkpoint=checkpoint)
