"""Every use of a torch name that is not public API, in one place.

The plugin subclasses torch's ``DistributedDataParallel`` and relies on two of its
private members: the method through which DDP registers its built-in (C++)
communication hooks, which the subclass overrides to refuse them on a model the
shards synchronise, and the attribute holding registered hooks, which a pickled or
deep-copied model must not carry. The sync client also queues a callback on
autograd's engine (``Variable._execution_engine``, as DDP itself does) to raise a
failed round's error from ``backward()``. Sharded embedding tables, whose weight stays
on the meta device, are kept out of DDP (its list of parameters to ignore) and out of
``Module.to()`` (through ``Module._apply``). (The optimizer step hooks in ``_runtime.py`` are
public ``torch.optim`` API.) ``tests/unit/test_torch_compat.py`` checks each name
against the installed torch, so a release that renames one fails there, by name,
instead of letting a hook through silently.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "APPLY_METHOD",
    "BUILTIN_COMM_HOOK_METHOD",
    "CHECKED_TORCH_VERSION",
    "COMM_HOOKS_ATTR",
    "DDP_IGNORE_ATTR",
    "DDP_IGNORE_METHOD",
    "BuiltinHookGuard",
    "ddp_ignored",
    "drop_comm_hooks",
    "ignore_in_ddp",
    "missing_names",
    "queue_autograd_callback",
    "skipping_in_apply",
    "version_counter",
]

CHECKED_TORCH_VERSION = "2.14.1"

# Checked against torch 2.14.1: DistributedDataParallel._register_builtin_comm_hook
# (torch/nn/parallel/distributed.py), called by register_comm_hook's built-in path.
BUILTIN_COMM_HOOK_METHOD = "_register_builtin_comm_hook"

# Checked against torch 2.14.1: DistributedDataParallel._comm_hooks, the list of
# (hook, state) pairs registered so far, kept in the pickled state.
COMM_HOOKS_ATTR = "_comm_hooks"


# Checked against torch 2.14.1: the static method that sets the parameters and
# buffers DDP leaves alone (no broadcast, no bucket), by qualified name.
DDP_IGNORE_METHOD = "_set_params_and_buffers_to_ignore_for_model"

# Checked against torch 2.14.1: torch.nn.Module._apply(fn, recurse=True), through
# which to(), cuda(), cpu(), half() and friends convert every parameter.
APPLY_METHOD = "_apply"


# Checked against torch 2.14.1: where that method keeps the names on the module.
DDP_IGNORE_ATTR = "_ddp_params_and_buffers_to_ignore"


class BuiltinHookGuard:
    """Mixed into a ``DistributedDataParallel`` subclass: DDP's built-in C++ hooks are
    registered through a torch-private method that ``register_comm_hook`` does not
    see; this routes them through the subclass's ``_refuse_comm_hook(name)`` too."""

    def _refuse_comm_hook(self, name: str) -> None:
        raise NotImplementedError

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        self._refuse_comm_hook(str(comm_hook_type))
        getattr(super(), BUILTIN_COMM_HOOK_METHOD)(comm_hook_type)


def ddp_ignored(module: torch.nn.Module) -> frozenset[str]:
    """The names of the parameters and buffers a DDP around ``module`` leaves alone."""
    return frozenset(getattr(module, DDP_IGNORE_ATTR, ()))


def ignore_in_ddp(module: torch.nn.Module, names: Sequence[str]) -> None:
    """Makes a DDP built around ``module`` also leave the named parameters alone."""
    kept = list(getattr(module, DDP_IGNORE_ATTR, []))
    getattr(DistributedDataParallel, DDP_IGNORE_METHOD)(
        module, kept + [n for n in names if n not in kept]
    )


@contextlib.contextmanager
def skipping_in_apply(skip: Callable[[torch.nn.Module], list[str]]) -> Iterator[None]:
    """While inside, ``Module.to()`` (and every conversion through ``_apply``) leaves
    alone the parameters that ``skip(module)`` names for each module of the tree.

    Restores ``Module._apply`` on exit, also on error.
    """
    original = getattr(torch.nn.Module, APPLY_METHOD)
    inside = threading.local()  # _apply recurses into children: the outermost call acts

    @functools.wraps(original)
    def apply(self: torch.nn.Module, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(inside, "active", False):
            return original(self, fn, *args, **kwargs)
        held = [(m, name, m._parameters.pop(name)) for m in self.modules() for name in skip(m)]
        inside.active = True
        try:
            return original(self, fn, *args, **kwargs)
        finally:
            inside.active = False
            for m, name, param in held:
                m._parameters[name] = param

    setattr(torch.nn.Module, APPLY_METHOD, apply)
    try:
        yield
    finally:
        setattr(torch.nn.Module, APPLY_METHOD, original)


def drop_comm_hooks(state: dict[str, Any]) -> None:
    """Empties the registered hooks in a DDP's pickled state (``__getstate__``)."""
    state[COMM_HOOKS_ATTR] = []


def _engine_queue() -> Callable[[Callable[[], None]], None] | None:
    """Autograd's ``queue_callback``, or ``None`` where this torch has none.

    Checked against torch 2.14.1: ``torch.autograd.Variable._execution_engine``
    (what DDP's reducer uses for the same purpose).
    """
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    return queue if callable(queue) else None


def queue_autograd_callback(callback: Callable[[], None]) -> bool:
    """Runs ``callback`` once the current backward pass has run its whole graph.

    Returns False where this torch has no such engine method (see
    :func:`_engine_queue`), or when called outside a backward pass.
    """
    queue = _engine_queue()
    if queue is None:
        return False
    try:
        queue(callback)
    except RuntimeError:  # not inside a backward pass
        return False
    return True


def missing_names() -> list[str]:
    """The private names above that this torch lacks (empty when all exist)."""
    missing = []
    if not callable(getattr(DistributedDataParallel, BUILTIN_COMM_HOOK_METHOD, None)):
        missing.append(f"DistributedDataParallel.{BUILTIN_COMM_HOOK_METHOD}")
    if _engine_queue() is None:
        missing.append("torch.autograd.Variable._execution_engine.queue_callback")
    if not callable(getattr(DistributedDataParallel, DDP_IGNORE_METHOD, None)):
        missing.append(f"DistributedDataParallel.{DDP_IGNORE_METHOD}")
    if not callable(getattr(torch.nn.Module, APPLY_METHOD, None)):
        missing.append(f"torch.nn.Module.{APPLY_METHOD}")
    return missing


def version_counter(tensor: torch.Tensor) -> int:
    """How many in-place changes autograd has counted on ``tensor`` (checked against
    torch 2.14.1: ``Tensor._version``, bumped by every in-place op, ``copy_`` of
    ``load_state_dict`` included)."""
    return int(tensor._version)
