"""Every use of a torch name that is not public API, in one place.

The plugin subclasses torch's ``DistributedDataParallel`` and relies on two of its
private members: the method through which DDP registers its built-in (C++)
communication hooks, which the subclass overrides to refuse them on a model the
shards synchronise, and the attribute holding registered hooks, which a pickled or
deep-copied model must not carry. (The optimizer step hooks in ``_runtime.py`` are
public ``torch.optim`` API.) ``tests/unit/test_torch_compat.py`` checks each name
against the installed torch, so a release that renames one fails there, by name,
instead of letting a hook through silently.
"""

from __future__ import annotations

from typing import Any

from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "BUILTIN_COMM_HOOK_METHOD",
    "CHECKED_TORCH_VERSION",
    "COMM_HOOKS_ATTR",
    "drop_comm_hooks",
    "missing_names",
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


def missing_names() -> list[str]:
    """The private names above that this torch's DDP lacks (empty when all exist)."""
    missing = []
    if not callable(getattr(DistributedDataParallel, BUILTIN_COMM_HOOK_METHOD, None)):
        missing.append(f"DistributedDataParallel.{BUILTIN_COMM_HOOK_METHOD}")
    return missing
