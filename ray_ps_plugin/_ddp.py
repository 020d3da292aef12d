"""``PSDistributedDataParallel`` and the context that makes prepare_model build it.

The model a PS run's ``ray.train.torch.prepare_model`` returns *is* a
``DistributedDataParallel`` (``isinstance`` checks, ``.module``, ``no_sync()``), so
loops written for DDP keep working; DDP's constructor still broadcasts rank 0's
parameters and buffers, so every worker starts from identical state. What changes
is chosen by the mode (:mod:`ray_ps_plugin._modes`): sync keeps DDP's buckets and
replaces their all-reduce; async/ssp bypass DDP's reducer and keep the parameters
on the shards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ray_ps_plugin import _runtime
from ray_ps_plugin._client import ClientBase
from ray_ps_plugin._modes import MODE_SPECS
from ray_ps_plugin._ray_compat import swap_prepare_model_ddp
from ray_ps_plugin._transport import RayTransport

__all__ = ["PSDistributedDataParallel", "PSTrainFuncContext", "check_supported"]

logger = logging.getLogger(__name__)


def check_supported(module: torch.nn.Module) -> None:
    """Raises early for models the parameter servers cannot synchronise.

    Raises:
        ValueError: If a layer produces sparse gradients.
        TypeError: If a trainable parameter is bfloat16 (NumPy, which carries the
            data between workers and shards, has no such dtype).
    """
    bf16 = [
        n for n, p in module.named_parameters() if p.requires_grad and p.dtype == torch.bfloat16
    ]
    if bf16:
        raise TypeError(
            f"Parameter(s) {bf16[:3]}{'...' if len(bf16) > 3 else ''} are bfloat16, which "
            "the parameter-server strategy cannot carry. Keep the model in float32 (and "
            "use torch.autocast for bf16 compute, PSConfig(compression='bf16') for 16-bit "
            "traffic), or use PSConfig(strategy='ddp')."
        )
    sparse = [
        name
        for name, m in module.named_modules()
        if getattr(m, "sparse", False) is True and any(p.requires_grad for p in m.parameters())
    ]
    if sparse:
        raise ValueError(
            f"Layer(s) {sparse} produce sparse gradients, which the parameter-server "
            "strategy does not support. Build them with sparse=False, or use "
            "PSConfig(strategy='ddp')."
        )


class PSDistributedDataParallel(DistributedDataParallel):
    """``DistributedDataParallel`` whose synchronisation goes through the servers.

    Copies (``copy.deepcopy``, ``pickle``, ``torch.save``) work as they do for DDP
    and are never connected to the shards: a copy of a sync model is a plain DDP of
    the copied module (its backward, if any, all-reduces like a DDP copy would); a
    copy of an async/ssp model runs its module locally.
    """

    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        info = _runtime.current_run()
        check_supported(module)
        super().__init__(module, *args, **kwargs)
        spec = MODE_SPECS[info.settings.mode]
        setup = _runtime.client_setup(module, info)
        transport = RayTransport(info.servers, info.settings.ps_timeout_s)
        client = spec.build_client(setup, transport)
        self._ps_client: ClientBase | None = client
        self._ps_uses_reducer = spec.uses_reducer
        _runtime.register(client)
        client.bind(self)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._ps_client is not None:
            self._ps_client.before_forward()
        if self._ps_uses_reducer:
            return super().forward(*inputs, **kwargs)
        return self.module(*inputs, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        # The client (threads, locks, shared memory) belongs to the original only,
        # and so does the communication hook DDP keeps a reference to (a bound
        # method of the client).
        state = super().__getstate__()
        state["_ps_client"] = None
        state["_comm_hooks"] = []
        return state


class PSTrainFuncContext:
    """Wraps the user's training function on each worker (``train_func_context``).

    On entry it makes ``ray.train.torch.prepare_model`` wrap models in
    :class:`PSDistributedDataParallel` and registers the optimizer hooks; on exit it
    restores the original, confirms every model's last update and releases the
    clients.

    Args:
        base: The context manager TorchConfig would use (CUDA device selection).
    """

    def __init__(self, base: Callable[[], Any]) -> None:
        self._base = base()
        self._swap = swap_prepare_model_ddp(PSDistributedDataParallel)

    def __enter__(self) -> PSTrainFuncContext:
        self._base.__enter__()
        try:
            self._swap.__enter__()
        except BaseException as e:
            self._base.__exit__(type(e), e, e.__traceback__)
            raise
        _runtime.ensure_optimizer_hooks()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._swap.__exit__(exc_type, exc, tb)
        try:
            _warn_if_unused()
            _runtime.finish_clients(raising=exc_type is None)
        finally:
            _runtime.remove_optimizer_hooks()
            _runtime.close_clients()
            self._base.__exit__(exc_type, exc, tb)


def _warn_if_unused() -> None:
    """Says so when a PS run never sent anything through the shards."""
    import ray.train

    if _runtime.used_models() == 0 and ray.train.get_context().get_world_size() > 1:
        logger.warning(
            "PSConfig(strategy='ps') is set, but no model went through "
            "ray.train.torch.prepare_model() on rank %d: the parameter servers were "
            "never used. A DistributedDataParallel built another way (e.g. by a "
            "framework) synchronises with all-reduce.",
            ray.train.get_context().get_world_rank(),
        )
