"""PSDistributedDataParallel in one process (a real gloo group of one): copies of a
prepared model work as DDP's do and never reach the shards."""

import copy
import io
import pickle
import socket

import pytest
import torch
import torch.distributed as dist

from ray_ps_plugin import _ddp, _runtime
from ray_ps_plugin._param.shard import ParamShard
from ray_ps_plugin._sync.shard import SumShard
from tests.unit.fakes import FakeTransport, LoopThread, Settings, setup_for


@pytest.fixture(scope="module")
def process_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def loop():
    lt = LoopThread()
    yield lt
    lt.stop()


@pytest.fixture(params=["sync", "async", "ssp"])
def prepared(request, process_group, loop, monkeypatch):
    """A PS-prepared model on fake shards, as prepare_model would build it."""
    mode = request.param
    settings = Settings(mode=mode)
    shard = SumShard(0, 1, 5.0) if mode == "sync" else ParamShard(0, 1, None, 5.0)
    transport = FakeTransport(loop, [shard])
    monkeypatch.setattr(_runtime, "_RUN", _runtime.RunInfo(settings, [object()], ["node"]))
    monkeypatch.setattr(
        _runtime, "client_setup", lambda m, info: setup_for(m, 0, 1, 1, settings)
    )
    monkeypatch.setattr(_ddp, "RayTransport", lambda servers, timeout_s: transport)
    torch.manual_seed(0)
    model = _ddp.PSDistributedDataParallel(torch.nn.Linear(4, 2))
    yield model, transport
    _runtime.close_clients()


def _step(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _runtime.ensure_optimizer_hooks()
    try:
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    finally:
        _runtime.remove_optimizer_hooks()


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
