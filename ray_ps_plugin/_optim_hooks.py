"""The process-wide optimizer step hooks: where a PS model's step is taken.

Torch calls the pre-hook right before any optimizer's ``step()`` changes the
parameters and the post-hook right after; the hooks hand the step to the clients
(and table sets) whose parameters that optimizer steps, so the user's loop calls
nothing of ours.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ray_ps_plugin import _runtime

__all__ = ["ensure_optimizer_hooks", "remove_optimizer_hooks"]

_OPTIMIZER_HOOKS: list[Any] = []


def ensure_optimizer_hooks() -> None:
    """Registers the process-wide optimizer step hooks (once)."""
    if not _OPTIMIZER_HOOKS:
        _OPTIMIZER_HOOKS.append(register_optimizer_step_pre_hook(_before_optimizer_step))
        _OPTIMIZER_HOOKS.append(register_optimizer_step_post_hook(_after_optimizer_step))


def remove_optimizer_hooks() -> None:
    while _OPTIMIZER_HOOKS:
        _OPTIMIZER_HOOKS.pop().remove()
    _PENDING_CLOSURES.clear()


def _before_optimizer_step(
    optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Runs the owning clients' ``before_step`` right before the parameters change.

    Without a closure that is now. With one (``optimizer.step(closure)``, as PyTorch
    Lightning's automatic optimization calls it) the forward and backward passes
    happen inside ``step()``, after this hook: the closure is wrapped so that
    ``before_step`` runs once it returns, on this step's gradients and on the
    parameters its forward pass used, before the optimizer touches them.
    """
    clients, tables = _runtime.owners(optimizer)
    steps: list[Callable[[], None]] = [c.before_step for c in clients]
    steps += [functools.partial(t.before_step, optimizer) for t in tables]
    if not steps:
        return None
    closure = kwargs.get("closure") if "closure" in kwargs else (args[1] if len(args) > 1 else None)
    if closure is None:
        for step in steps:
            step()
        return None
    wrapped = _StepClosure(closure, steps)
    _PENDING_CLOSURES[optimizer] = wrapped
    if "closure" in kwargs:
        return args, {**kwargs, "closure": wrapped}
    return (args[0], wrapped, *args[2:]), kwargs


def _after_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    wrapped = _PENDING_CLOSURES.pop(optimizer, None)
    if wrapped is not None and not wrapped.called:
        raise RuntimeError(
            f"{type(optimizer).__name__}.step() was given a closure but did not call it; "
            "the parameter servers need the step's gradients before the parameters "
            "change. Call the closure inside step() (as torch's optimizers do), or run "
            "forward/backward before optimizer.step() without a closure."
        )
    clients, tables = _runtime.owners(optimizer)
    for client in clients:
        client.after_step()
    for table_set in tables:
        table_set.after_step()


class _StepClosure:
    """An optimizer closure that runs the clients' ``before_step`` (``steps``) after
    its first call (LBFGS calls it again after changing the parameters: those calls
    are the step's own business)."""

    def __init__(self, closure: Any, steps: list[Callable[[], None]]) -> None:
        self._closure = closure
        self._steps = steps
        self.called = False

    def __call__(self) -> Any:
        out = self._closure()
        if not self.called:
            self.called = True
            for step in self._steps:
                step()
        return out


_PENDING_CLOSURES: weakref.WeakKeyDictionary[torch.optim.Optimizer, _StepClosure] = (
    weakref.WeakKeyDictionary()
)
