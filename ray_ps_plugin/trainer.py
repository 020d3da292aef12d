"""``PSTrainer``: a TorchTrainer that takes a ``ps_config``."""

from __future__ import annotations

from typing import Any

from ray.train.torch import TorchTrainer

from ray_ps_plugin.config import PSConfig

__all__ = ["PSTrainer"]


class PSTrainer(TorchTrainer):
    """A ``TorchTrainer`` whose gradient synchronisation is chosen by ``ps_config``.

    Identical to ``TorchTrainer(train_fn, torch_config=ps_config, ...)``; it exists so
    the strategy reads as what it is at the call site.

    Args:
        train_loop_per_worker: The unchanged TorchTrainer training function.
        ps_config: The strategy; defaults to ``PSConfig()`` (synchronous PS).
        **kwargs: Everything else TorchTrainer takes (``train_loop_config``,
            ``scaling_config``, ``run_config``, ``datasets``, ...).

    Raises:
        TypeError: If ``ps_config`` is not a PSConfig, or ``torch_config`` is also given.
    """

    def __init__(
        self,
        train_loop_per_worker: Any,
        *,
        ps_config: PSConfig | None = None,
        **kwargs: Any,
    ) -> None:
        if "torch_config" in kwargs:
            raise TypeError(
                "PSTrainer takes ps_config=PSConfig(...), not torch_config; PSConfig "
                "accepts every TorchConfig field (backend, init_method, timeout_s)."
            )
        if ps_config is None:
            ps_config = PSConfig()
        if not isinstance(ps_config, PSConfig):
            raise TypeError(
                f"PSTrainer(ps_config=...) must be a ray_ps_plugin.PSConfig, got "
                f"{type(ps_config).__name__}."
            )
        super().__init__(train_loop_per_worker, torch_config=ps_config, **kwargs)
