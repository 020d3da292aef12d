"""Every use of a torch name that is not public API, in one place.

The plugin subclasses torch's ``DistributedDataParallel`` and relies on two of its
private members: the method through which DDP registers its built-in (C++)
communication hooks, which the subclass overrides to refuse them on a model the
shards synchronise, and the attribute holding registered hooks, which a pickled or
deep-copied model must not carry. The sync client also queues a callback on
autograd's engine (``Variable._execution_engine``, as DDP itself does) to raise a
failed round's error from ``backward()``. (The optimizer step hooks in ``_runtime.py`` are
public ``torch.optim`` API.) ``tests/unit/test_torch_compat.py`` checks each name
against the installed torch, so a release that renames one fails there, by name,
instead of letting a hook through silently.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "BUILTIN_COMM_HOOK_METHOD",
    "CHECKED_TORCH_VERSION",
    "COMM_HOOKS_ATTR",
    "drop_comm_hooks",
    "missing_names",
    "queue_autograd_callback",
]

CHECKED_TORCH_VERSION = "2.14.1"

# Checked against torch 2.14.1: DistributedDataParallel._register_builtin_comm_hook
# (torch/nn/parallel/distributed.py), called by register_comm_hook's built-in path.
BUILTIN_COMM_HOOK_METHOD = "_register_builtin_comm_hook"

# Checked against torch 2.14.1: DistributedDataParallel._comm_hooks, the list of
# (hook, state) pairs registered so far, kept in the pickled state.
COMM_HOOKS_ATTR = "_comm_hooks"


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
    return missing
