"""``PSDistributedDataParallel`` and the context that makes every DDP a PS one.

The model a PS run trains *is* a ``DistributedDataParallel`` (``isinstance`` checks,
``.module``, ``no_sync()``), so loops written for DDP keep working; DDP's constructor
still broadcasts rank 0's parameters and buffers, so every worker starts from
identical state. What changes is chosen by the mode (:mod:`ray_ps_plugin._modes`):
sync keeps DDP's buckets and replaces their all-reduce; async/ssp bypass DDP's
reducer and keep the parameters on the shards.

While a PS training function runs, :func:`ps_ddp_constructors` takes over
``DistributedDataParallel.__init__`` itself, so every plain DDP built in the function
comes out connected to the shards, whoever builds it: ``ray.train.torch.
prepare_model``, PyTorch Lightning's ``DDPStrategy`` (``RayDDPStrategy``) or
Hugging Face accelerate (``transformers.Trainer``). The class object is shared by
every import path, so no framework module needs patching.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ray_ps_plugin import _optim_hooks, _ray_compat, _runtime, _torch_compat
from ray_ps_plugin._modes import real_tables, spec_of
from ray_ps_plugin._tables import client as _table_client
from ray_ps_plugin._tables import layers as _table_layers
from ray_ps_plugin._transport import RayTransport
from ray_ps_plugin._types import LOSSY_COMPRESSIONS, Compression

__all__ = [
    "PSDistributedDataParallel",
    "PSTrainFuncContext",
    "attach",
    "check_supported",
    "ps_ddp_constructors",
]

logger = logging.getLogger(__name__)


def check_supported(module: torch.nn.Module, compression: Compression | None = None) -> None:
    """Raises early for models the parameter servers cannot synchronise.

    Args:
        module: The model about to be wrapped.
        compression: The run's ``PSConfig.compression``.

    Raises:
        ValueError: If bfloat16 parameters would travel as fp16
            (``compression="fp16"``: fp16 lacks bf16's range), or a lossy
            compression is given a model whose trained parameters are not fp32.
    """
    if compression in LOSSY_COMPRESSIONS:
        other = [
            f"{n} ({str(p.dtype).removeprefix('torch.')})"
            for n, p in module.named_parameters()
            if p.requires_grad and p.dtype != torch.float32
        ]
        if other:
            raise ValueError(
                f"PSConfig.compression={compression!r} encodes fp32 gradients, and "
                f"parameter(s) {other[:3]}{'...' if len(other) > 3 else ''} are not fp32. "
                "Train the model in fp32 (autocast keeps mixed precision in the "
                "forward pass), or use compression='bf16'."
            )
    bf16 = [
        n for n, p in module.named_parameters() if p.requires_grad and p.dtype == torch.bfloat16
    ]
    if bf16 and compression == "fp16":
        raise ValueError(
            f"Parameter(s) {bf16[:3]}{'...' if len(bf16) > 3 else ''} are bfloat16, and "
            "PSConfig.compression='fp16' would send them as fp16, which overflows beyond "
            "65504 where bf16 does not. bfloat16 parameters already travel as 16-bit: "
            "use compression=None or 'bf16'."
        )


_MISSING_TORCH_NAMES = _torch_compat.missing_names()
if _MISSING_TORCH_NAMES:  # pragma: no cover - only on an unchecked torch
    logger.warning(
        "torch %s lacks %s, which ray_ps_plugin was checked against (torch %s): a "
        "built-in DDP communication hook may not be refused on a PS model, and a "
        "failed sync round may surface only at the next step.",
        torch.__version__,
        ", ".join(_MISSING_TORCH_NAMES),
        _torch_compat.CHECKED_TORCH_VERSION,
    )


class PSDistributedDataParallel(_torch_compat.BuiltinHookGuard, DistributedDataParallel):
    """``DistributedDataParallel`` whose synchronisation goes through the servers.

    Built directly, or made from a plain DDP that a framework constructed while the
    PS training function runs (:func:`ps_ddp_constructors`); both go through
    :func:`attach`.

    The servers own gradient communication: registering another communication hook
    (Lightning's ``ddp_comm_hook``, accelerate's ``comm_hook``, a user's
    ``register_comm_hook``) raises, rather than silently replacing the servers with
    all-reduce (sync) or being silently ignored (async/ssp).

    Copies (``copy.deepcopy``, ``pickle``, ``torch.save``) work as they do for DDP
    and are never connected to the shards: a copy of a sync model is a plain DDP of
    the copied module (its backward, if any, all-reduces like a DDP copy would); a
    copy of an async/ssp model runs its module locally.
    """

    _ps_client: Any = None
    _ps_uses_reducer: bool = True
    _ps_owns_comm: bool = False

    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        _before_ddp(module)
        super().__init__(module, *args, **kwargs)
        attach(self)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._ps_client is not None:
            self._ps_client.before_forward()
        if self._ps_uses_reducer:
            return super().forward(*inputs, **kwargs)
        return self.module(*inputs, **kwargs)

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        self._refuse_comm_hook(getattr(hook, "__qualname__", repr(hook)))
        super().register_comm_hook(state, hook)

    def _refuse_comm_hook(self, name: str) -> None:
        if not self._ps_owns_comm:
            return
        raise ValueError(
            f"A DDP communication hook ({name}) was registered on a model the parameter "
            "servers synchronise; under PSConfig(strategy='ps') the servers are the "
            "gradient communication, so the hook would replace them (sync) or never "
            "run (async/ssp). Remove the hook (Lightning: DDPStrategy/RayDDPStrategy "
            "without ddp_comm_hook; accelerate: DistributedDataParallelKwargs without "
            "comm_hook); for 16-bit traffic use PSConfig(compression='fp16'|'bf16'). "
            "Or use PSConfig(strategy='ddp') to keep the hook with all-reduce."
        )

    def __getstate__(self) -> dict[str, Any]:
        # The client (threads, locks, shared memory) belongs to the original only,
        # and so does the communication hook DDP keeps a reference to (a bound
        # method of the client).
        state = super().__getstate__()
        state["_ps_client"] = None
        state["_ps_owns_comm"] = False
        _torch_compat.drop_comm_hooks(state)
        return state


def attach(ddp: PSDistributedDataParallel) -> None:
    """Connects a constructed DDP to the shards: builds, registers and binds the
    mode's client (the one set-up of every PS model, however it was built)."""
    info = _runtime.current_run()
    spec = spec_of(info.settings)
    setup = _runtime.client_setup(ddp.module, info)

    def open_transport() -> RayTransport:
        direct = spec.direct_path(info.settings, info.topology) if spec.direct_path else None
        return RayTransport(info.servers, info.settings.ps_timeout_s, direct, info.replicas)

    transport = _runtime.shared_transport(open_transport)
    client = spec.build_client(setup, transport)
    ddp._ps_client = client
    ddp._ps_uses_reducer = spec.uses_reducer
    _runtime.register(client)
    client.bind(ddp)  # sync: registers the servers' comm hook
    ddp._ps_owns_comm = True
    if spec.keeps_state and info.settings.replace_lost_workers:
        _ray_compat.redo_reset_reports(client.peers_behind)
    mode = _table_client.TableMode(
        sync=spec.sums_tables, staleness=spec.bound(info.settings), real=real_tables(info.settings)
    )
    if _table_layers.meta_tables(ddp.module) or (
        mode.real != "workers" and _table_layers.replica_tables(ddp.module)
    ):
        tables = _table_client.ShardedTables(
            setup.model_id,
            ddp.module,
            transport,
            info.settings,
            setup.rank,
            setup.world_size,
            setup.num_shards,
            seed=_table_seed(),
            mode=mode,
            local_shards=setup.local_shards,
            joined=setup.joined,
        )
        _runtime.register_tables(tables)


def _before_ddp(module: torch.nn.Module) -> None:
    """What runs before DDP's constructor communicates, on every rank alike: the
    refusals, and keeping the tables trained on the shards out of DDP (meta-device
    embedding layers; with ``sparse_optimizer="shards"`` sparse ones too)."""
    settings = _runtime.current_run().settings
    check_supported(module, settings.compression)
    _check_not_attached(module)
    _table_layers.check_tables(module, spec_of(settings).tables_on_shards, settings.mode)
    names = _table_layers.meta_table_names(module)
    if real_tables(settings) != "workers":
        names += _table_layers.replica_table_names(module)
    if names and settings.shard_replicas:
        raise ValueError(
            f"PSConfig.shard_replicas=1 does not hold the rows of tables kept on the "
            f"shards ({names}) twice yet. Use sparse_optimizer='workers' for sparse "
            "nn.Embedding layers (their weights are then replicated with the other "
            "parameters), or shard_replicas=0."
        )
    if names:
        _torch_compat.ignore_in_ddp(module, names)


def _table_seed() -> int:
    """Rank 0's torch seed, the same on every worker: sharded tables are initialised
    from it, as a seeded ``nn.Embedding`` would be reproducible."""
    seed = [torch.initial_seed() % (1 << 63)]
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.broadcast_object_list(seed, src=0)
    return int(seed[0])


def _check_not_attached(module: torch.nn.Module) -> None:
    """Refuses, in async/ssp, a second DDP around a module the shards already hold.

    The first model's client still owns the module's parameters and optimizer: both
    clients would push every step and install their own shards' parameters into the
    same tensors. (A second ``pl.Trainer.fit`` on the same LightningModule in one
    training function does this.) Sync clients only sum gradients, so a second DDP
    there simply takes over. Raised before DDP's constructor communicates, on every
    rank alike.

    Raises:
        ValueError: Naming the fix.
    """
    info = _runtime.current_run()
    if spec_of(info.settings).uses_reducer or not _runtime.module_attached(module):
        return
    raise ValueError(
        f"{type(module).__name__} is already synchronised by the parameter servers "
        f"(mode={info.settings.mode!r}): it was wrapped in DistributedDataParallel "
        "earlier in this training function. In async/ssp a module can be wrapped once "
        "per training function: keep the first wrapper (e.g. one pl.Trainer.fit() per "
        "LightningModule, one prepare_model() per model), or use mode='sync'."
    )


def _module_argument(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if args else kwargs.get("module")


@contextlib.contextmanager
def ps_ddp_constructors() -> Iterator[None]:
    """Makes every ``DistributedDataParallel`` built meanwhile a PS one.

    A plain DDP is constructed as usual (DDP's parameter broadcast included), then
    becomes a :class:`PSDistributedDataParallel` and is attached to the shards. A
    ``PSDistributedDataParallel`` built directly attaches itself once (its
    constructor runs DDP's, which passes through here untouched). Any other DDP
    subclass, and FSDP, are refused before they communicate: their own
    synchronisation would bypass the servers while the run reports them.

    Restores both constructors on exit, also on error.
    """
    original = DistributedDataParallel.__dict__["__init__"]

    @functools.wraps(original)
    def ddp_init(self: DistributedDataParallel, *args: Any, **kwargs: Any) -> None:
        cls = type(self)
        if cls is DistributedDataParallel:
            _before_ddp(_module_argument(args, kwargs))
            original(self, *args, **kwargs)
            if type(self) is DistributedDataParallel:  # not taken over by an outer context
                self.__class__ = PSDistributedDataParallel
                attach(self)  # type: ignore[arg-type]
            return
        if not issubclass(cls, PSDistributedDataParallel):
            raise TypeError(
                f"{cls.__module__}.{cls.__qualname__} (a DistributedDataParallel "
                "subclass) was built under PSConfig(strategy='ps'), which can only take "
                "over plain DistributedDataParallel: the subclass would synchronise on "
                "its own, not through the parameter servers. Build a plain "
                "DistributedDataParallel (e.g. ray.train.torch.prepare_model), or use "
                "PSConfig(strategy='ddp')."
            )
        original(self, *args, **kwargs)

    fsdp_cls, fsdp_original = _fsdp_init()

    @functools.wraps(fsdp_original or original)
    def fsdp_init(self: Any, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "FullyShardedDataParallel was built under PSConfig(strategy='ps'); FSDP "
            "shards and reduces gradients itself and cannot go through the parameter "
            "servers. Use DistributedDataParallel (Lightning: RayDDPStrategy; Ray: "
            "prepare_model(parallel_strategy='ddp')), or PSConfig(strategy='ddp') to "
            "keep FSDP."
        )

    DistributedDataParallel.__init__ = ddp_init  # type: ignore[method-assign]
    if fsdp_cls is not None:
        fsdp_cls.__init__ = fsdp_init
    try:
        yield
    finally:
        DistributedDataParallel.__init__ = original  # type: ignore[method-assign]
        if fsdp_cls is not None:
            fsdp_cls.__init__ = fsdp_original


def _fsdp_init() -> tuple[Any, Any]:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # torch built without distributed FSDP
        return None, None
    return FullyShardedDataParallel, FullyShardedDataParallel.__dict__["__init__"]


class PSTrainFuncContext:
    """Wraps the user's training function on each worker (``train_func_context``).

    On entry it makes every ``DistributedDataParallel`` built in the function a
    :class:`PSDistributedDataParallel` (:func:`ps_ddp_constructors`) and registers the
    optimizer hooks; on exit it restores DDP, confirms every model's last update and
    releases the clients. A function that returns without any model having reached
    the shards, with more than one worker, fails the run
    (:func:`_check_servers_used`): it trained without them.

    Args:
        base: The context manager TorchConfig would use (CUDA device selection).
    """

    def __init__(self, base: Callable[[], Any]) -> None:
        self._base = base()
        self._swap = ps_ddp_constructors()
        # prepare_model moves the model with .to(): a sharded table's weight stays
        # on the meta device (its rows are materialised on the shards).
        self._keep_tables = _torch_compat.skipping_in_apply(_table_layers.skipped_in_apply)

    def __enter__(self) -> PSTrainFuncContext:
        self._base.__enter__()
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(self._swap)
                stack.enter_context(self._keep_tables)
                self._patches = stack.pop_all()
        except BaseException as e:
            self._base.__exit__(type(e), e, e.__traceback__)
            raise
        _optim_hooks.ensure_optimizer_hooks()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._patches.__exit__(exc_type, exc, tb)
        try:
            _runtime.finish_clients(raising=exc_type is None)
            _check_servers_used(raising=exc_type is None)
        finally:
            _optim_hooks.remove_optimizer_hooks()
            _runtime.close_clients()
            self._base.__exit__(exc_type, exc, tb)


def _check_servers_used(raising: bool) -> None:
    """Fails a PS run whose training function never reached the shards.

    Such a loop trained with something else (a FSDP or DeepSpeed wrapper, manual
    all-reduce, no synchronisation at all) while the run reports parameter servers.
    With one worker there is nothing to synchronise (``prepare_model`` builds no DDP),
    so that case passes. After a failure in the user's code that error matters more,
    so this one is only logged.

    Raises:
        RuntimeError: If no DDP was built on this rank while the world size is above 1.
    """
    import ray.train

    ctx = ray.train.get_context()
    if _runtime.used_models() > 0 or ctx.get_world_size() <= 1:
        return
    message = (
        f"rank {ctx.get_world_rank()}: PSConfig(strategy='ps') is set, but no "
        "DistributedDataParallel was built in the training function, so the parameter "
        "servers were never used and this run did not synchronise through them. Wrap "
        "the model with ray.train.torch.prepare_model(), Lightning's RayDDPStrategy or "
        "transformers.Trainer (accelerate's DDP), or use PSConfig(strategy='ddp')."
    )
    if raising:
        raise RuntimeError(message)
    logger.warning(message)
