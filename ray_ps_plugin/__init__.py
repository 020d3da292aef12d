"""Parameter-server training for Ray Train and Ray Tune.

``PSConfig(strategy="ps" | "ddp")`` switches an unchanged TorchTrainer loop between
server shards colocated with the workers and DDP's all-reduce.
"""

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
