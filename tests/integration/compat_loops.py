"""Real-world training-loop patterns for the DDP/PS compatibility matrix.

Every loop is deterministic (seeded models, synthetic data drawn per step and rank
from a fixed ``torch.Generator``) and ends with :func:`finish`, which writes the
parameters that matter into a checkpoint (rank 0) and each rank's metrics into
``rank{r}.json`` of the same checkpoint (Ray Train merges the workers' directories),
so that tests/integration/test_compat.py can compare a DDP run with a PS run of the
same unchanged loop. :func:`cases_loop` runs several loops one after another in one
Train run; each then writes into its own subdirectory (``config["case"]``) of the
checkpoint of its final report.

Loops that exercise several patterns in one run record each pattern's failure
(``errors[pattern]``: exception type, first line of the message and the innermost
frame) and carry on, so that one run tells which patterns break. A pattern that
hangs still fails the whole run after ``ps_timeout_s``.

Shipped to the workers by value (see conftest.py).
"""

import copy
import importlib
import importlib.util
import json
import os
import pickle
import re
import sys
import tempfile
import time
import traceback
import types
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import ray
import ray.train
import ray.train.collective
import ray.train.torch
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from ray_ps_plugin import get_ps_context
from tests.integration.loops import recsys_step, report_with_state, unwrap

T = TypeVar("T")

# --- harness ----------------------------------------------------------------------


def rank_and_world() -> tuple[int, int]:
    """This worker's rank and the number of workers."""
    ctx = ray.train.get_context()
    return ctx.get_world_rank(), ctx.get_world_size()


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ERROR_LINE = re.compile(r"^\s*[\w.]*(?:Error|Exception)\b[^:]*:")


def describe(exc: BaseException) -> str:
    """``Type: first line of the message [<- innermost SomethingError line] (at
    file:line in function)``; the innermost line shows what a remote actor raised."""
    lines = [ln for ln in _ANSI.sub("", str(exc)).strip().splitlines() if ln.strip()]
    text = lines[0][:300] if lines else ""
    inner = [ln.strip() for ln in lines[1:] if _ERROR_LINE.match(ln)]
    if inner:
        text += f" <- {inner[-1][:300]}"
    frames = traceback.extract_tb(exc.__traceback__)
    where = ""
    if frames:
        f = frames[-1]
        where = f" (at {Path(f.filename).name}:{f.lineno} in {f.name})"
    return f"{type(exc).__name__}: {text}{where}"


def attempt(errors: dict[str, str], name: str, fn: Callable[[], T]) -> T | None:
    """Runs one pattern; records its first failure under ``name`` instead of raising."""
    try:
        return fn()
    except Exception as e:
        errors.setdefault(name, describe(e))
        return None


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of parameters and buffers, read directly (no state_dict hooks run)."""
    out = {n: p.detach().clone() for n, p in module.named_parameters()}
    out.update({n: b.detach().clone() for n, b in module.named_buffers()})
    return out


def finish(
    models: dict[str, nn.Module],
    metrics: dict[str, Any],
    extra_states: dict[str, Any] | None = None,
    final_eval: Callable[[], dict[str, Any]] | None = None,
    case: str = "",
) -> None:
    """The harness's last report, written so that a failure here does not hide what
    the loop recorded before.

    As PSContext.flush() documents for a final checkpoint: every worker flushes its
    last update (PS only), all meet at a barrier, then rank 0 saves ``state_dict()``
    of each model (under async/ssp this pulls the servers' parameters) with
    ``extra_states`` in ``states.pt``; every rank writes its metrics to
    ``rank{r}.json``. A failing flush or ``state_dict()`` is recorded in
    ``errors["finish"]`` and rank 0 then saves the parameters as they are. ``final_eval``
    runs on every rank after the states are taken; its metrics join that rank's.
    Under :func:`cases_loop` both files go into the subdirectory ``case``.
    """
    rank, _ = rank_and_world()
    ctx = get_ps_context()
    metrics = dict(metrics)
    errors = metrics.setdefault("errors", {})
    healthy = ctx is None or attempt(errors, "finish", lambda: ctx.flush() or True) is not None
    ray.train.collective.barrier()

    def state(m: nn.Module) -> dict[str, Any]:
        if healthy:
            out = attempt(errors, "finish", lambda: unwrap(m).state_dict())
            if out is not None:
                return out
        return snapshot(unwrap(m))

    with tempfile.TemporaryDirectory() as d:
        out = Path(d, case)
        out.mkdir(exist_ok=True)
        if rank == 0:
            states = {name: state(m) for name, m in models.items()}
            states.update(extra_states or {})
            torch.save(states, out / "states.pt")
        if final_eval is not None:
            metrics.update(final_eval())
        metrics["rank"] = rank
        metrics["has_ps_context"] = ctx is not None
        (out / f"rank{rank}.json").write_text(json.dumps(metrics))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))


def train_phases(
    config: dict[str, Any],
    models: dict[str, nn.Module],
    step: Callable[[str, nn.Module, int], None],
    loss_of: Callable[[nn.Module], float],
) -> None:
    """One phase per model, in order: ``steps_per_phase`` calls of ``step(name, model,
    i)``, a failure recorded under the model's name; rank 0 keeps each model's
    parameters after its phase (``after_{name}``). Ends with :func:`finish`, each
    model's held-out loss (``loss_of`` of the unwrapped model) before and after."""
    rank, _ = rank_and_world()
    errors: dict[str, str] = {}
    initial = {name: loss_of(unwrap(m)) for name, m in models.items()}
    states: dict[str, Any] = {}
    for name, model in models.items():

        def phase(name: str = name, model: nn.Module = model) -> None:
            for i in range(config["steps_per_phase"]):
                step(name, model, i)

        attempt(errors, name, phase)
        if rank == 0:
            states[f"after_{name}"] = snapshot(unwrap(model))
    finish(
        models,
        {"errors": errors, "initial": initial},
        extra_states=states,
        final_eval=lambda: {"final": {n: loss_of(unwrap(m)) for n, m in models.items()}},
        case=config.get("case", ""),
    )


def final_checkpoint_dir(run_dir: Path, case: str = "") -> Path | None:
    """Where the newest checkpoint of a run holds :func:`finish`'s ``states.pt`` for
    ``case`` (also when ``fit()`` raised afterwards), or None."""
    pattern = f"checkpoint_*/{case}/states.pt" if case else "checkpoint_*/states.pt"
    found = sorted(p.parent for p in Path(run_dir).glob(pattern))
    return found[-1] if found else None


def cases_loop(config: dict[str, Any]) -> None:
    """Several loops in one Train run, one after another: ``config["cases"]`` is a
    list of ``(case, loop, loop_config)``; each loop ends with its own :func:`finish`
    report, written under ``case``. Models prepared by an earlier loop stay
    prepared (the run's later loops train beside them). A loop that raises fails
    the run, and with it every later case of the list.
    """
    for case, loop, loop_config in config["cases"]:
        loop({**loop_config, "case": case})


def load_states(checkpoint_dir: Path) -> dict[str, Any]:
    """The states rank 0 saved in :func:`finish`."""
    return torch.load(checkpoint_dir / "states.pt", weights_only=False, map_location="cpu")


def load_rank_metrics(checkpoint_dir: Path) -> list[dict[str, Any]]:
    """Every rank's metrics from :func:`finish`, by rank."""
    files = sorted(checkpoint_dir.glob("rank*.json"))
    return [json.loads(f.read_text()) for f in files]


def regression_batch(step: int, rank: int, n: int = 16, d_in: int = 8) -> tuple[torch.Tensor, ...]:
    """A fixed regression batch for (step, rank): y = x @ w + 0.5, four outputs."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, d_in, generator=g)
    w = torch.linspace(-1.0, 1.0, d_in * 4).reshape(d_in, 4)
    return x, x @ w + 0.5


def eval_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """A held-out batch, the same on every rank and in the driver."""
    return regression_batch(999_999, 0, n=64)


def eval_loss(module: nn.Module) -> float:
    """MSE of ``module`` (the unwrapped one: no DDP/PS forward side effects) on
    :func:`eval_batch`, in eval mode; restores the module's train/eval mode."""
    x, y = eval_batch()
    was_training = module.training
    module.eval()
    with torch.no_grad():
        loss = F.mse_loss(module(x).float(), y).item()
    module.train(was_training)
    return loss


# --- Ray's own example loops ----------------------------------------------------------

EXAMPLES = ("linear", "regression", "fashion_mnist", "quick_start")


def _synthetic_images(n: int, seed: int) -> torch.utils.data.TensorDataset:
    """FashionMNIST-shaped data ((n, 1, 28, 28) images, 10 classes), learnable: the
    label is the brightest of ten horizontal bands."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    for i in range(n):  # brighten the label's band
        x[i, 0, 2 * int(y[i]) + 4 : 2 * int(y[i]) + 6] += 1.0
    return torch.utils.data.TensorDataset(x, y)


def _stub_tqdm() -> None:
    """torch_fashion_mnist_example imports tqdm, which this environment lacks; a
    pass-through stand-in (progress bars only) lets the example import."""
    if "tqdm" in sys.modules or importlib.util.find_spec("tqdm") is not None:
        return
    stub = types.ModuleType("tqdm")
    stub.tqdm = lambda iterable, *args, **kwargs: iterable  # type: ignore[attr-defined]
    sys.modules["tqdm"] = stub


@contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _example(name: str, cfg: dict[str, Any]) -> tuple[Callable[[], Any], Any, Callable[..., Any]]:
    """(call, data patch, eval) for one of Ray's examples.

    ``call`` runs the example's training function unchanged; the data patch
    (``(module, attribute, replacement)`` or None) swaps a download for synthetic
    data of the same shape; ``eval(module)`` is a loss on held-out data.
    """
    base = "ray.train.examples.pytorch."
    if name == "linear":
        ex = importlib.import_module(base + "torch_linear_example")
        val = ex.LinearDataset(2, 5, size=cfg.get("val_size", 400))

        def lin_eval(m: nn.Module) -> float:
            with torch.no_grad():
                return F.mse_loss(m(val.x[:, None]), val.y[:, None]).item()

        return (lambda: ex.train_func(cfg)), None, lin_eval
    if name == "regression":
        ex = importlib.import_module(base + "torch_regression_example")
        xv, yv = regression_rows(32, seed=7, as_tensors=True)

        def reg_eval(m: nn.Module) -> float:
            with torch.no_grad():
                return F.l1_loss(m(xv), yv[:, None]).item()

        return (lambda: ex.train_func(cfg)), None, reg_eval
    test = _synthetic_images(64, seed=2)

    def ce_eval(m: nn.Module) -> float:
        was = m.training
        m.eval()
        with torch.no_grad():
            loss = F.cross_entropy(m(test.tensors[0]), test.tensors[1]).item()
        m.train(was)
        return loss

    if name == "fashion_mnist":
        _stub_tqdm()
        ex = importlib.import_module(base + "torch_fashion_mnist_example")
        train_set = _synthetic_images(128, seed=1)

        def loaders(batch_size: int) -> tuple[Any, Any]:
            dl = torch.utils.data.DataLoader
            return dl(train_set, batch_size=batch_size, shuffle=True), dl(
                test, batch_size=batch_size
            )

        return (lambda: ex.train_func_per_worker(cfg)), (ex, "get_dataloaders", loaders), ce_eval
    if name == "quick_start":
        ex = importlib.import_module(base + "torch_quick_start")
        train_set = _synthetic_images(256, seed=1)
        return ex.train_func_distributed, (ex, "get_dataset", lambda: train_set), ce_eval
    raise ValueError(f"unknown example {name!r}; use one of {EXAMPLES}")


def regression_rows(n: int, seed: int, as_tensors: bool = False) -> Any:
    """Rows for torch_regression_example: ``x`` (100 floats) and ``y``, y linear in x."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 100, generator=g)
    y = x[:, :10].sum(dim=1) * 0.3 + 1.0
    if as_tensors:
        return x, y
    return [{"x": x[i].tolist(), "y": float(y[i])} for i in range(n)]


def ray_example_loop(config: dict[str, Any]) -> None:
    """Runs one of Ray's example training functions unchanged and records what it did.

    Config: ``example`` (one of :data:`EXAMPLES`) and ``example_config`` (the
    example's own ``config``). The harness wraps ``ray.train.torch.prepare_model`` and
    ``ray.train.report`` (calling the real ones) to capture the prepared model, its
    loss on held-out data right after preparation, and every metrics dict the example
    reports; examples that download data get synthetic data of the same shape.
    """
    call, data_patch, evaluate = _example(config["example"], config.get("example_config", {}))
    prepared: list[nn.Module] = []
    reported: list[dict[str, Any]] = []
    initial: list[float] = []
    real_prepare, real_report = ray.train.torch.prepare_model, ray.train.report

    def prepare(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        out = real_prepare(model, *args, **kwargs)
        prepared.append(out)
        initial.append(evaluate(unwrap(out)))
        return out

    def report(metrics: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        reported.append({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
        return real_report(metrics, *args, **kwargs)

    # The examples build their models unseeded; seed the process so that the DDP
    # reference is deterministic.
    torch.manual_seed(0)
    with _patched(ray.train.torch, "prepare_model", prepare), _patched(ray.train, "report", report):
        if data_patch is not None:
            with _patched(*data_patch):
                call()
        else:
            call()
    model = prepared[0]
    finish(
        {"model": model},
        {"example_reports": reported, "initial_loss": initial[0]},
        final_eval=lambda: {"final_loss": evaluate(unwrap(model))},
        case=config.get("case", ""),
    )


# --- one model: a training recipe in phases, snapshots, torch.compile ------------------


def mlp(seed: int = 0, d_in: int = 8, d_out: int = 4) -> nn.Module:
    """A small MLP, initialised from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, 32), nn.Tanh(), nn.Linear(32, d_out))


def recipe_net() -> nn.Sequential:
    """An MLP with dropout and a layer frozen at prepare time (unfrozen in the last
    phase of :func:`single_model_loop`). Only torch classes: ``torch.save`` and
    ``pickle`` of the whole model must find them by import on a worker."""
    torch.manual_seed(0)
    net = nn.Sequential(
        OrderedDict(
            fc1=nn.Linear(8, 32),
            act1=nn.ReLU(),
            drop=nn.Dropout(0.1),
            fc2=nn.Linear(32, 16),
            act2=nn.ReLU(),
            frozen_layer=nn.Linear(16, 16),
            out=nn.Linear(16, 4),
        )
    )
    net.frozen_layer.requires_grad_(False)
    return net


SINGLE_MODEL_PHASES = (
    # First: both ranks compile at once, so neither waits on the other's compile for
    # longer than the difference of their compile times.
    "torch_compile",  # torch.compile(model) of the prepared model, steps through it
    "lr_scheduler_set_to_none",  # LambdaLR; zero_grad(set_to_none=True/False) alternating
    "clip_grad_norm",  # clip_grad_norm_ with an active clip; the norms are compared
    "accumulate_no_sync",  # 2 micro-batches per step, the first under model.no_sync()
    "accumulate_plain",  # 2 micro-batches per step, both backward passes synchronised
    "two_forwards_one_backward",  # siamese: model(x1), model(x2), one loss, one backward
    "eval_and_module_access",  # eval()/no_grad() through the wrapper, model.module reads
    "snapshots",  # training steps with every SNAPSHOT_PATTERNS pattern around them
    "amp_scaler_skip",  # bf16 autocast + GradScaler("cpu"); one step has an inf loss
    "unfreeze_mid_run",  # frozen_layer.requires_grad_(True) mid-run (last)
)

SNAPSHOT_PATTERNS = (
    "ema_averaged_model",  # AveragedModel(model): deep-copies the prepared model
    "ema_averaged_module",  # AveragedModel(model.module)
    "ema_deepcopy_model",  # hand-written EMA on copy.deepcopy(model)
    "best_deepcopy_model",  # best = copy.deepcopy(model) when the eval loss improves
    "best_state_dict_copy",  # best = copy.deepcopy(model.state_dict())
    "torch_save_model",  # torch.save(model) / torch.load: loaded == original
    "torch_save_module",  # torch.save(model.module) / torch.load
    "pickle_module",  # pickle.dumps(model.module) / pickle.loads
)
ROUNDTRIP_PATTERNS = ("torch_save_model", "torch_save_module", "pickle_module")


def has_c_compiler() -> bool:
    """Whether torch.compile's CPU backend (inductor) can build its kernels here."""
    import shutil

    return any(shutil.which(c) for c in (os.environ.get("CC", "cc"), "gcc", "clang"))


def _roundtrip_diff(original: nn.Module, restored: nn.Module) -> float:
    a, b = snapshot(unwrap(original)), snapshot(unwrap(restored))
    if a.keys() != b.keys():
        raise AssertionError(f"restored keys differ: {sorted(a)} vs {sorted(b)}")
    return max((a[k] - b[k]).abs().max().item() for k in a)


def single_model_loop(config: dict[str, Any]) -> None:
    """One prepared :func:`recipe_net` and one momentum SGD optimizer through the
    phases of :data:`SINGLE_MODEL_PHASES`, in order (``steps_per_phase`` optimizer
    steps each, twice that for ``snapshots``).

    Rank 0 snapshots the parameters after each phase (``after_<phase>`` in the
    checkpoint), so a sync/DDP mismatch points at the first phase that diverged; the
    ``snapshots`` phase also saves each EMA / best-model copy under its pattern name.
    Recorded: failures by phase and snapshot pattern (``errors``), ``clip_norms``,
    ``amp_scales``, ``amp_skipped`` (optimizer steps the scaler skipped; the inf is
    injected on rank 1 only, which a synchronised sum spreads to every rank),
    ``roundtrip`` (largest difference between a saved-and-loaded model and the
    original), ``compile_skipped`` (why torch.compile did not run, if it did not) and,
    under PS, ``ps_clock_after`` (this worker's clock after each phase).

    Config: ``steps_per_phase``, ``phases`` (default: all).
    """
    rank, _ = rank_and_world()
    torch.manual_seed(100 + rank)  # dropout masks differ per rank, same on every run
    errors: dict[str, str] = {}
    model = ray.train.torch.prepare_model(recipe_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    initial = eval_loss(unwrap(model))
    n = config["steps_per_phase"]
    step = 0
    info: dict[str, Any] = {"clip_norms": [], "amp_scales": [], "amp_skipped": 0, "roundtrip": {}}
    states: dict[str, Any] = {}

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal step
        step += 1
        return regression_batch(step, rank)

    def plain_step(set_to_none: bool = True, forward: Callable[..., Any] = model) -> None:
        x, y = batch()
        loss = F.mse_loss(forward(x), y)
        opt.zero_grad(set_to_none=set_to_none)
        loss.backward()
        opt.step()

    def lr_scheduler_set_to_none() -> None:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.5 * s))
        for i in range(n):
            plain_step(set_to_none=i % 2 == 0)
            sched.step()
        info["lr_after_scheduler"] = opt.param_groups[0]["lr"]

    def clip_grad_norm() -> None:
        for _ in range(n):
            x, y = batch()
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
            info["clip_norms"].append(norm.item())
            opt.step()

    def accumulate(no_sync: bool) -> None:
        for _ in range(n):
            opt.zero_grad()
            x, y = batch()
            if no_sync:
                with model.no_sync():
                    (F.mse_loss(model(x), y) / 2).backward()
            else:
                (F.mse_loss(model(x), y) / 2).backward()
            x, y = batch()
            (F.mse_loss(model(x), y) / 2).backward()
            opt.step()

    def two_forwards_one_backward() -> None:
        for _ in range(n):
            x1, y1 = batch()
            x2, y2 = batch()
            a = model(x1)
            # Work between the two forwards (loading the pair's second half, a
            # generator pass...) takes time; here a pause, so that under async/ssp the
            # reply to the previous step's push is back before the second forward.
            time.sleep(0.2)
            b = model(x2)
            loss = F.mse_loss(a - b, y1 - y2)
            opt.zero_grad()
            loss.backward()
            opt.step()

    def eval_and_module_access() -> None:
        xe, ye = eval_batch()
        for _ in range(n):
            plain_step()
            model.eval()
            with torch.no_grad():
                info.setdefault("eval_losses", []).append(F.mse_loss(model(xe), ye).item())
            model.train()
            info.setdefault("out_weight_norms", []).append(model.module.out.weight.norm().item())

    def snapshots() -> None:
        ema_fn = get_ema_multi_avg_fn(0.8)
        emas: dict[str, Any] = {
            "ema_averaged_model": attempt(
                errors, "ema_averaged_model", lambda: AveragedModel(model, multi_avg_fn=ema_fn)
            ),
            "ema_averaged_module": attempt(
                errors,
                "ema_averaged_module",
                lambda: AveragedModel(unwrap(model), multi_avg_fn=ema_fn),
            ),
            "ema_deepcopy_model": attempt(
                errors, "ema_deepcopy_model", lambda: copy.deepcopy(model)
            ),
        }

        def update(name: str, ema: Any) -> None:
            if name == "ema_averaged_model":
                ema.update_parameters(model)
            elif name == "ema_averaged_module":
                ema.update_parameters(unwrap(model))
            else:  # hand-written
                with torch.no_grad():
                    for pe, pm in zip(ema.parameters(), model.parameters()):
                        pe.lerp_(pm.detach(), 0.2)

        best: dict[str, Any] = {}
        best_loss = float("inf")
        xe, ye = eval_batch()
        for _ in range(2 * n):
            plain_step()
            for name, ema in emas.items():
                if ema is not None and name not in errors:
                    attempt(errors, name, lambda n=name, e=ema: update(n, e))
            model.eval()
            with torch.no_grad():
                val = F.mse_loss(model(xe), ye).item()
            model.train()
            if val < best_loss:
                best_loss = val
                best["best_deepcopy_model"] = attempt(
                    errors, "best_deepcopy_model", lambda: copy.deepcopy(model)
                )
                best["best_state_dict_copy"] = attempt(
                    errors, "best_state_dict_copy", lambda: copy.deepcopy(model.state_dict())
                )
        with tempfile.TemporaryDirectory() as d:

            def save_load(obj: nn.Module, path: str) -> nn.Module:
                torch.save(obj, path)
                return torch.load(path, weights_only=False)

            for name, fn in (
                ("torch_save_model", lambda: save_load(model, f"{d}/model.pt")),
                ("torch_save_module", lambda: save_load(unwrap(model), f"{d}/module.pt")),
                ("pickle_module", lambda: pickle.loads(pickle.dumps(unwrap(model)))),
            ):
                restored = attempt(errors, name, fn)
                if restored is not None:
                    diff = attempt(errors, name, lambda r=restored: _roundtrip_diff(model, r))
                    if diff is not None:
                        info["roundtrip"][name] = diff
        if rank != 0:
            return
        for name, ema in emas.items():
            if ema is not None and name not in errors:
                # AveragedModel(m).module is the copy of m; unwrap twice for the module.
                states[name] = snapshot(unwrap(unwrap(ema)))
        for name, obj in best.items():
            if obj is not None and name not in errors:
                states[name] = (
                    {k.removeprefix("module."): v.clone() for k, v in obj.items()}
                    if isinstance(obj, dict)
                    else snapshot(unwrap(obj))
                )

    def amp_scaler_skip() -> None:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        for i in range(n):
            x, y = batch()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            loss = F.mse_loss(out.float(), y)
            if i == 1 and rank == 1:
                loss = loss * float("inf")  # the scaler must skip this step
            opt.zero_grad()
            scaler.scale(loss).backward()
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            info["amp_scales"].append(scaler.get_scale())
            info["amp_skipped"] += int(scaler.get_scale() < before)

    def torch_compile() -> None:
        if not has_c_compiler():
            info["compile_skipped"] = "no C compiler for inductor's CPU kernels"
            return
        compiled = torch.compile(model)
        for _ in range(n):
            plain_step(forward=compiled)

    def unfreeze_mid_run() -> None:
        # The optimizer was built from model.parameters(), frozen ones included (the
        # usual way), so unfreezing is all it takes for them to train.
        layer = model.module.frozen_layer
        layer.requires_grad_(True)
        for _ in range(n):
            plain_step()
        info["frozen_layer_sum"] = layer.weight.sum().item()

    phases: dict[str, Callable[[], None]] = {
        "lr_scheduler_set_to_none": lr_scheduler_set_to_none,
        "clip_grad_norm": clip_grad_norm,
        "accumulate_no_sync": lambda: accumulate(no_sync=True),
        "accumulate_plain": lambda: accumulate(no_sync=False),
        "two_forwards_one_backward": two_forwards_one_backward,
        "eval_and_module_access": eval_and_module_access,
        "snapshots": snapshots,
        "amp_scaler_skip": amp_scaler_skip,
        "torch_compile": torch_compile,
        "unfreeze_mid_run": unfreeze_mid_run,
    }
    ctx = get_ps_context()
    for name in config.get("phases", SINGLE_MODEL_PHASES):
        attempt(errors, name, phases[name])
        if rank == 0:
            states[f"after_{name}"] = snapshot(unwrap(model))
        if ctx is not None:  # this worker's PS clock (sync rounds, or async/ssp updates)
            info.setdefault("ps_clock_after", {})[name] = ctx.stats.clock
    finish(
        {"model": model},
        {"errors": errors, "initial_loss": initial, **info},
        extra_states=states,
        final_eval=lambda: {"final_loss": eval_loss(unwrap(model))},
        case=config.get("case", ""),
    )


# --- two prepared models ------------------------------------------------------------


def gan_models() -> tuple[nn.Module, nn.Module]:
    """A tiny generator (4 -> 2) and discriminator (2 -> 1): different shapes."""
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    d = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    return g, d


REAL_MEAN = torch.tensor([2.0, -1.0])


def gan_gap(g: nn.Module) -> float:
    """Distance between the generator's sample mean and the real data's mean."""
    z = torch.randn(256, 4, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return (g(z).mean(dim=0) - REAL_MEAN).norm().item()


GAN_PHASES = ("d_two_forwards_one_backward", "d_two_backwards_one_step")


def gan_loop(config: dict[str, Any]) -> None:
    """A GAN: G and D prepared separately, one Adam each, alternating updates.

    Phase ``d_two_forwards_one_backward``: D's loss sums D(real) and
    D(fake.detach()), one backward. Phase ``d_two_backwards_one_step`` (DCGAN
    style): two backward passes, then one D step. In both, G's loss goes through D
    (D gets gradients it does not step on). Convergence: the generator's sample
    mean approaches the real mean (``initial_gap``/``final_gap``).

    Config: ``steps_per_phase``.
    """
    rank, _ = rank_and_world()
    errors: dict[str, str] = {}
    g_raw, d_raw = gan_models()
    g = ray.train.torch.prepare_model(g_raw)
    d = ray.train.torch.prepare_model(d_raw)
    opt_g = torch.optim.Adam(g.parameters(), lr=0.02, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(d.parameters(), lr=0.02, betas=(0.5, 0.999))
    initial_gap = gan_gap(unwrap(g))
    bce = nn.BCEWithLogitsLoss()
    states: dict[str, Any] = {}
    step = 0
    d_losses: list[float] = []

    def one_step(two_backwards: bool) -> None:
        nonlocal step
        step += 1
        gen = torch.Generator().manual_seed(1000 * step + rank)
        real = REAL_MEAN + 0.3 * torch.randn(32, 2, generator=gen)
        z = torch.randn(32, 4, generator=gen)
        ones, zeros = torch.ones(32, 1), torch.zeros(32, 1)
        fake = g(z)
        opt_d.zero_grad()
        if two_backwards:
            loss_real = bce(d(real), ones)
            loss_real.backward()
            loss_fake = bce(d(fake.detach()), zeros)
            loss_fake.backward()
            d_losses.append(loss_real.item() + loss_fake.item())
        else:
            loss_d = bce(d(real), ones) + bce(d(fake.detach()), zeros)
            loss_d.backward()
            d_losses.append(loss_d.item())
        opt_d.step()
        opt_g.zero_grad()
        bce(d(fake), ones).backward()
        opt_g.step()

    for name in GAN_PHASES:

        def phase(two: bool = name == "d_two_backwards_one_step") -> None:
            for _ in range(config["steps_per_phase"]):
                one_step(two)

        attempt(errors, name, phase)
        if rank == 0:
            states[f"after_{name}"] = {"g": snapshot(unwrap(g)), "d": snapshot(unwrap(d))}
    finish(
        {"g": g, "d": d},
        {"errors": errors, "initial_gap": initial_gap, "d_losses": d_losses},
        extra_states=states,
        final_eval=lambda: {"final_gap": gan_gap(unwrap(g))},
        case=config.get("case", ""),
    )


def twin_models() -> tuple[nn.Module, nn.Module]:
    """Two networks of EQUAL shapes (twin critics), initialised differently."""
    return mlp(seed=1, d_out=1), mlp(seed=2, d_out=1)


def twin_targets(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Different targets for the twins: a mixed-up update cannot fit both."""
    return x[:, :4].sum(dim=1, keepdim=True), -x[:, 4:].sum(dim=1, keepdim=True) + 1.0


def twin_losses(q1: nn.Module, q2: nn.Module) -> dict[str, float]:
    """Each twin's held-out loss on its own target and on the other's."""
    x, _ = eval_batch()
    t1, t2 = twin_targets(x)
    with torch.no_grad():
        a, b = q1(x), q2(x)
        return {
            "q1_own": F.mse_loss(a, t1).item(),
            "q2_own": F.mse_loss(b, t2).item(),
            "q1_cross": F.mse_loss(a, t2).item(),
            "q2_cross": F.mse_loss(b, t1).item(),
        }


TWIN_PHASES = ("separate_optimizers", "shared_optimizer")


def twins_loop(config: dict[str, Any]) -> None:
    """Two prepared models with equal shapes (the case where a mix-up of their
    gradients or parameters would raise no shape error).

    Phase ``separate_optimizers``: one Adam per twin, one backward per loss, steps
    in turn. Phase ``shared_optimizer`` (SAC-style critics): one Adam over both,
    the summed loss, one backward.

    Config: ``steps_per_phase``.
    """
    rank, _ = rank_and_world()
    errors: dict[str, str] = {}
    r1, r2 = twin_models()
    q1 = ray.train.torch.prepare_model(r1)
    q2 = ray.train.torch.prepare_model(r2)
    initial = twin_losses(unwrap(q1), unwrap(q2))
    opt1 = torch.optim.Adam(q1.parameters(), lr=0.02)
    opt2 = torch.optim.Adam(q2.parameters(), lr=0.02)
    states: dict[str, Any] = {}
    step = 0

    def separate() -> None:
        nonlocal step
        for _ in range(config["steps_per_phase"]):
            step += 1
            x, _ = regression_batch(step, rank)
            t1, t2 = twin_targets(x)
            opt1.zero_grad()
            F.mse_loss(q1(x), t1).backward()
            opt1.step()
            opt2.zero_grad()
            F.mse_loss(q2(x), t2).backward()
            opt2.step()

    def shared() -> None:
        nonlocal step
        opt = torch.optim.Adam([*q1.parameters(), *q2.parameters()], lr=0.02)
        for _ in range(config["steps_per_phase"]):
            step += 1
            x, _ = regression_batch(step, rank)
            t1, t2 = twin_targets(x)
            opt.zero_grad()
            (F.mse_loss(q1(x), t1) + F.mse_loss(q2(x), t2)).backward()
            opt.step()

    for name, fn in (("separate_optimizers", separate), ("shared_optimizer", shared)):
        attempt(errors, name, fn)
        if rank == 0:
            states[f"after_{name}"] = {"q1": snapshot(unwrap(q1)), "q2": snapshot(unwrap(q2))}
    finish(
        {"q1": q1, "q2": q2},
        {"errors": errors, "initial": initial},
        extra_states=states,
        final_eval=lambda: {"final": twin_losses(unwrap(q1), unwrap(q2))},
        case=config.get("case", ""),
    )


# --- bfloat16 weights ------------------------------------------------------------------

BF16_PHASES = ("adamw", "sgd_momentum")


def bf16_loop(config: dict[str, Any]) -> None:
    """Weights loaded in bfloat16 (``model.to(torch.bfloat16)``, what
    ``from_pretrained(..., torch_dtype=torch.bfloat16)`` gives): two models, one
    with AdamW (LLM fine-tuning's optimizer), one with momentum SGD, inputs cast to
    bf16, the loss taken in fp32. Records each model's held-out loss before and
    after, and its parameters after each phase.

    Config: ``steps_per_phase``.
    """
    rank, _ = rank_and_world()
    nets = {name: mlp(seed=10 + i).to(torch.bfloat16) for i, name in enumerate(BF16_PHASES)}
    models = {name: ray.train.torch.prepare_model(net) for name, net in nets.items()}
    opts = {
        "adamw": torch.optim.AdamW(models["adamw"].parameters(), lr=1e-2),
        "sgd_momentum": torch.optim.SGD(models["sgd_momentum"].parameters(), lr=2e-2, momentum=0.9),
    }

    def loss_of(module: nn.Module) -> float:
        x, y = eval_batch()
        with torch.no_grad():
            return F.mse_loss(module(x.to(torch.bfloat16)).float(), y).item()

    def step(name: str, model: nn.Module, i: int) -> None:
        x, y = regression_batch(i, rank)
        opts[name].zero_grad()
        F.mse_loss(model(x.to(torch.bfloat16)).float(), y).backward()
        opts[name].step()

    train_phases(config, models, step, loss_of)


# --- sparse embedding tables ------------------------------------------------------------

SPARSE_PHASES = ("sparse_adam", "sgd", "adagrad")
SPARSE_ROWS = (200, 40)  # the bag table's and the padded table's rows


class SparseRecsys(nn.Module):
    """A recommendation model in miniature: an ``EmbeddingBag`` and an ``Embedding``
    with ``padding_idx`` (both ``sparse=True``), a dense MLP over their features."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.bags = nn.EmbeddingBag(SPARSE_ROWS[0], 6, mode="mean", sparse=True)
        self.items = nn.Embedding(SPARSE_ROWS[1], 6, padding_idx=0, sparse=True)
        self.mlp = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, bag_ids: torch.Tensor, item_ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.bags(bag_ids), self.items(item_ids)], dim=1))


def sparse_batch(step: int, rank: int, n: int = 16) -> tuple[torch.Tensor, ...]:
    """Skewed ids (a few rows are hit often) and a target that depends on them. At
    step 0 rank 1's items are all ``padding_idx``: its padded table touches no row."""
    g = torch.Generator().manual_seed(5000 * step + rank)
    skew = torch.rand(n, 4, generator=g) ** 3
    bag_ids = (skew * SPARSE_ROWS[0]).long()
    item_ids = (torch.rand(n, generator=g) ** 2 * SPARSE_ROWS[1]).long()
    if step == 0 and rank == 1:
        item_ids.zero_()
    y = (bag_ids.float().mean(1, keepdim=True) / SPARSE_ROWS[0]) - (
        item_ids[:, None] % 3 == 0
    ).float()
    return bag_ids, item_ids, y


def sparse_loop(config: dict[str, Any]) -> None:
    """Sparse-gradient embeddings with each optimizer torch gives them: SparseAdam on
    the tables beside Adam on the MLP (the usual split), plain SGD (a larger learning
    rate for the tables, in a parameter group of their own), and Adagrad on
    everything. Records each phase's parameters and the held-out loss.

    Config: ``steps_per_phase``.
    """
    rank, _ = rank_and_world()
    nets = {name: SparseRecsys(seed=20 + i) for i, name in enumerate(SPARSE_PHASES)}
    models = {name: ray.train.torch.prepare_model(net) for name, net in nets.items()}

    def optimizers(name: str, net: SparseRecsys) -> list[torch.optim.Optimizer]:
        if name == "sparse_adam":
            tables = [net.bags.weight, net.items.weight]
            return [
                torch.optim.SparseAdam(tables, lr=3e-2),
                torch.optim.Adam(net.mlp.parameters(), lr=1e-2),
            ]
        if name == "sgd":
            tables = [net.bags.weight, net.items.weight]
            return [
                # The MLP's 0.2: at 0.5 sync still learns, but a step or two of delay
                # (async, ssp) makes plain SGD oscillate on this MLP, and whether
                # the loss then ends above its start depended on the run's timing.
                torch.optim.SGD(
                    [{"params": tables, "lr": 2.0}, {"params": net.mlp.parameters()}], lr=0.2
                )
            ]
        return [torch.optim.Adagrad(net.parameters(), lr=0.1)]

    opts = {name: optimizers(name, nets[name]) for name in SPARSE_PHASES}
    held_out = [sparse_batch(10_000 + i, 0, n=64) for i in range(2)]

    def loss_of(module: nn.Module) -> float:
        with torch.no_grad():
            return sum(F.mse_loss(module(b, i), y).item() for b, i, y in held_out)

    def step(name: str, model: nn.Module, i: int) -> None:
        recsys_step(model, opts[name], sparse_batch(i, rank))

    train_phases(config, models, step, loss_of)


# --- resume after a worker dies -----------------------------------------------------


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


def resume_loop(config: dict[str, Any]) -> None:
    """The usual DDP resume pattern: ``prepare_model`` first, then
    ``model.module.load_state_dict`` (and the optimizer's) from
    ``ray.train.get_checkpoint()``; rank 0 checkpoints every ``every`` steps.

    Config: ``steps``, ``every``; ``crash_after`` (a step) and ``marker_dir``: rank 1
    calls ``os._exit(1)`` right after that optimizer step, once per run.
    Metrics: ``start`` (the step resumed from), ``losses_since_start`` (training
    losses from ``start`` on) and, after a restart, ``resume_drift``: for each of the
    first three optimizer steps, how far the parameters are from the checkpoint,
    relative to how far the checkpoint is from the restarted worker's fresh model
    (a run that trains on from the checkpoint stays near 0; one that fell back to
    the fresh model is near 1). In async, ssp and diloco "the checkpoint" is what
    the model holds after loading it: the kept shards' newer parameters.
    """
    rank, _ = rank_and_world()
    checkpoint = ray.train.get_checkpoint()
    net = mlp(seed=0)
    initial = eval_loss(net)
    if checkpoint:
        # A restarted worker builds a fresh model, as user code does; this one is
        # far from any trained state (another seed, weights x10), so training on from
        # it instead of from the checkpoint cannot pass for a few ordinary steps.
        net = mlp(seed=1)
        with torch.no_grad():
            for p in net.parameters():
                p.mul_(10.0)
    # The fresh model as built (prepare_model broadcasts rank 0's, the same here; in
    # async, ssp and diloco a restarted worker takes the kept shards' instead).
    fresh = _flat(net)
    model = ray.train.torch.prepare_model(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = 0
    ckpt_flat = None
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(f"{d}/resume.pt", weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
        ckpt_flat = _flat(unwrap(model))
    losses, drift = [], []
    for step in range(start, config["steps"]):
        x, y = regression_batch(step, rank)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if ckpt_flat is not None and len(drift) < 3:
            now = _flat(unwrap(model))
            drift.append(((now - ckpt_flat).norm() / (ckpt_flat - fresh).norm()).item())
        if (step + 1) % config["every"] == 0 and step + 1 < config["steps"]:
            report_with_state(
                {"step": step + 1},
                "resume.pt",
                lambda step=step: {
                    "model": model.module.state_dict(),
                    "optimizer": opt.state_dict(),
                    "step": step + 1,
                },
            )
        if step + 1 == config.get("crash_after") and rank == 1:
            marker = Path(config["marker_dir"], "crashed")
            if not marker.exists():
                marker.write_text("once")
                os._exit(1)
    finish(
        {"model": model},
        {
            "start": start,
            "losses_since_start": losses,
            "resume_drift": drift,
            "initial_loss": initial,
        },
        final_eval=lambda: {"final_loss": eval_loss(unwrap(model))},
        case=config.get("case", ""),
    )
