"""PSDistributedDataParallel in one process (a real gloo group of one): copies of a
prepared model work as DDP's do and never reach the shards."""

import copy
import io
import pickle
import socket

import pytest
import torch
import torch.distributed as dist

from ray_ps_plugin import _ddp, _optim_hooks, _runtime
from ray_ps_plugin._param.shard import ParamShard
from ray_ps_plugin._sync.shard import SumShard
from tests.unit.fakes import FakeTransport, Settings, setup_for


@pytest.fixture(scope="module")
def process_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(params=["sync", "async", "ssp"])
def ps_run(request, process_group, loop, monkeypatch):
    """A PS run on fake shards, as the backend installs it, with no model yet."""
    mode = request.param
    settings = Settings(mode=mode)
    shard = SumShard(0, 1, 5.0) if mode == "sync" else ParamShard(0, 1, None, 5.0)
    transport = FakeTransport(loop, [shard])
    monkeypatch.setattr(_runtime, "_RUN", _runtime.RunInfo(settings, [object()], ["node"]))
    monkeypatch.setattr(_runtime, "client_setup", lambda m, info: setup_for(m, 0, 1, 1, settings))
    monkeypatch.setattr(
        _ddp, "RayTransport", lambda servers, timeout_s, direct=None, replicas=(): transport
    )
    yield mode, transport
    _runtime.close_clients()


@pytest.fixture
def prepared(ps_run):
    """A PS-prepared model on fake shards, as prepare_model would build it."""
    _, transport = ps_run
    torch.manual_seed(0)
    return _ddp.PSDistributedDataParallel(torch.nn.Linear(4, 2)), transport


def _step(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _optim_hooks.ensure_optimizer_hooks()
    try:
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    finally:
        _optim_hooks.remove_optimizer_hooks()


def test_deepcopy_is_usable_and_never_reaches_the_shards(prepared):
    model, transport = prepared
    _step(model)
    calls = len(transport.calls)
    clone = copy.deepcopy(model)
    assert isinstance(clone, torch.nn.parallel.DistributedDataParallel)
    assert clone._ps_client is None
    with torch.no_grad():
        out = clone(torch.randn(3, 4))
    assert out.shape == (3, 2)
    state = clone.module.state_dict()
    clone.module.load_state_dict(state)  # hooks on the copy are inert
    assert torch.equal(state["weight"], model.module.weight.detach())
    assert len(transport.calls) == calls  # the copy made no call at all


def test_pickle_and_torch_save_of_the_prepared_model(prepared):
    model, _ = prepared
    restored = pickle.loads(pickle.dumps(model))
    assert torch.equal(restored.module.weight, model.module.weight)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.equal(loaded.module.bias, model.module.bias)
    module_copy = pickle.loads(pickle.dumps(model.module))
    assert torch.equal(module_copy.weight, model.module.weight)


def test_averaged_model_of_the_prepared_model(prepared):
    model, transport = prepared
    ema = torch.optim.swa_utils.AveragedModel(model)
    _step(model)
    calls = len(transport.calls)
    ema.update_parameters(model)
    with torch.no_grad():
        ema(torch.randn(2, 4))
    assert len(transport.calls) == calls


# --- every DDP built in the training function becomes a PS one -------------------
DDP = torch.nn.parallel.DistributedDataParallel
ORIGINAL_INIT = DDP.__dict__["__init__"]


def test_a_plain_ddp_built_by_a_framework_reaches_the_shards(ps_run):
    mode, transport = ps_run
    torch.manual_seed(0)
    with _ddp.ps_ddp_constructors():
        # As Lightning builds it: keyword module=, the class imported from its module.
        from torch.nn.parallel.distributed import DistributedDataParallel

        model = DistributedDataParallel(module=torch.nn.Linear(4, 2))
    assert DDP.__dict__["__init__"] is ORIGINAL_INIT  # restored on exit
    assert type(model) is _ddp.PSDistributedDataParallel
    assert isinstance(model, DDP) and _runtime.used_models() == 1
    assert model._ps_uses_reducer == (mode == "sync")
    _step(model)
    assert transport.pushes(), "the step went through the shards"
    assert _runtime.used_models() == 1


def test_a_ps_ddp_built_inside_the_context_attaches_once(ps_run):
    _, transport = ps_run
    with _ddp.ps_ddp_constructors():
        model = _ddp.PSDistributedDataParallel(torch.nn.Linear(4, 2))
    assert _runtime.used_models() == 1
    _step(model)
    assert len(transport.pushes()) == 1  # one client, one push per step


def test_constructors_are_restored_after_an_error(ps_run):
    from torch.distributed.fsdp import FullyShardedDataParallel

    fsdp_init = FullyShardedDataParallel.__dict__["__init__"]
    with pytest.raises(ZeroDivisionError), _ddp.ps_ddp_constructors():
        1 / 0
    assert DDP.__dict__["__init__"] is ORIGINAL_INIT
    assert FullyShardedDataParallel.__dict__["__init__"] is fsdp_init


def test_other_ddp_subclasses_and_fsdp_are_refused_before_they_communicate(ps_run):
    from torch.distributed.fsdp import FullyShardedDataParallel

    class OwnDDP(DDP):
        pass

    with _ddp.ps_ddp_constructors():
        with pytest.raises(TypeError, match=r"OwnDDP.*plain DistributedDataParallel"):
            OwnDDP(torch.nn.Linear(4, 2))
        with pytest.raises(TypeError, match=r"FullyShardedDataParallel.*RayDDPStrategy"):
            FullyShardedDataParallel(torch.nn.Linear(4, 2))
    assert _runtime.used_models() == 0


def test_a_framework_comm_hook_is_refused_naming_the_fix(ps_run):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    with _ddp.ps_ddp_constructors():
        model = DDP(torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"fp16_compress_hook.*compression="):
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    with pytest.raises(ValueError, match="ddp_comm_hook"):
        model._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    # A copy is a plain DDP again, free to take a hook.
    copy.deepcopy(model).register_comm_hook(None, default_hooks.allreduce_hook)


def test_a_closure_step_runs_before_step_after_backward(ps_run, monkeypatch):
    """Lightning calls optimizer.step(closure): forward and backward run inside step."""
    _mode, _transport = ps_run
    with _ddp.ps_ddp_constructors():
        model = DDP(torch.nn.Linear(4, 2))
    client = model._ps_client
    events = []
    for name in ("before_step", "after_step", "before_forward"):
        real = getattr(client, name)
        monkeypatch.setattr(
            client, name, lambda real=real, name=name: (events.append(name), real())[1]
        )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)

    def closure():
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        events.append("backward")
        return loss

    _optim_hooks.ensure_optimizer_hooks()
    try:
        before = model.module.weight.detach().clone()
        for _ in range(2):
            opt.step(closure)
        opt.step(closure=closure)
    finally:
        _optim_hooks.remove_optimizer_hooks()
    assert events == ["before_forward", "backward", "before_step", "after_step"] * 3
    assert not torch.equal(before, model.module.weight)
    assert client.snapshot().steps == 3


def test_an_optimizer_that_ignores_its_closure_is_a_clear_error(ps_run):
    class Lazy(torch.optim.SGD):
        def step(self, closure=None):
            return super().step()

    with _ddp.ps_ddp_constructors():
        model = DDP(torch.nn.Linear(4, 2))
    opt = Lazy(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    _optim_hooks.ensure_optimizer_hooks()
    try:
        with pytest.raises(RuntimeError, match="did not call it"):
            opt.step(lambda: None)
    finally:
        _optim_hooks.remove_optimizer_hooks()


def test_a_second_ddp_around_the_same_module(ps_run):
    """A second pl.Trainer.fit() in one training function wraps the module again."""
    mode, _ = ps_run
    module = torch.nn.Linear(4, 2)
    with _ddp.ps_ddp_constructors():
        DDP(module)
        if mode == "sync":  # the new wrapper's hook takes over; the old one idles
            _step(DDP(module))
            assert _runtime.used_models() == 2
        else:
            with pytest.raises(ValueError, match=r"already synchronised.*once per training"):
                DDP(module)
            assert _runtime.used_models() == 1


class _FakeTrainContext:
    def __init__(self, world_size):
        self._world_size = world_size

    def get_world_size(self):
        return self._world_size

    def get_world_rank(self):
        return 1


def test_a_run_that_never_reached_the_shards_fails(monkeypatch, caplog):
    import ray.train

    assert _runtime.used_models() == 0
    monkeypatch.setattr(ray.train, "get_context", lambda: _FakeTrainContext(2))
    with pytest.raises(RuntimeError, match=r"rank 1: .*servers were never used.*RayDDPStrategy"):
        _ddp._check_servers_used(raising=True)
    _ddp._check_servers_used(raising=False)  # after the user's own error: only logged
    assert "never used" in caplog.text
    monkeypatch.setattr(ray.train, "get_context", lambda: _FakeTrainContext(1))
    _ddp._check_servers_used(raising=True)  # one worker: prepare_model builds no DDP


def test_models_of_a_process_share_one_transport_closed_with_the_clients():
    """One direct path per worker process: connections grow with the shards, not
    with the models; the next training function opens its own."""

    class Opened:
        direct = None
        closed = 0

        def close(self):
            self.closed += 1

    opened = []

    def open_transport():
        opened.append(Opened())
        return opened[-1]

    first = _runtime.shared_transport(open_transport)
    assert _runtime.shared_transport(open_transport) is first and len(opened) == 1
    _runtime.close_clients()
    assert first.closed == 1
    assert _runtime.shared_transport(open_transport) is not first
    _runtime.close_clients()
    assert [t.closed for t in opened] == [1, 1]
