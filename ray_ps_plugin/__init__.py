"""Parameter-server training for Ray Train and Ray Tune.

``PSConfig(strategy="ps" | "ddp")`` switches an unchanged TorchTrainer loop between
server shards colocated with the workers and DDP's all-reduce.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray_ps_plugin._errors import PSError, PSTimeoutError
    from ray_ps_plugin._runtime import PSContext, get_ps_context
    from ray_ps_plugin._stats import PSStats
    from ray_ps_plugin.config import PSConfig
    from ray_ps_plugin.trainer import PSTrainer

__all__ = [
    "PSConfig",
    "PSContext",
    "PSError",
    "PSStats",
    "PSTimeoutError",
    "PSTrainer",
    "get_ps_context",
]
__version__ = "0.1.0"

# The public names load on first use. A shard actor's process imports only its own
# module (ray_ps_plugin._sync.shard or _param.shard), and importing this package
# eagerly would make every shard load Ray Train and, through it, pandas: about a
# second more of start-up per shard on every run.
_HOMES = {
    "PSError": "_errors",
    "PSTimeoutError": "_errors",
    "PSContext": "_runtime",
    "get_ps_context": "_runtime",
    "PSStats": "_stats",
    "PSConfig": "config",
    "PSTrainer": "trainer",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'ray_ps_plugin' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ray_ps_plugin.{home}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
