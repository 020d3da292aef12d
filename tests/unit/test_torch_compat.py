"""Every torch-private name the plugin relies on still exists where _torch_compat says.

A torch release that renames one fails here, by name, rather than by letting a
communication hook bypass the shards.
"""

import socket

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ray_ps_plugin import _ddp, _torch_compat


def test_checked_against_the_installed_torch():
    assert torch.__version__.split("+")[0] == _torch_compat.CHECKED_TORCH_VERSION, (
        "torch changed: re-check every name in ray_ps_plugin/_torch_compat.py, then bump "
        "CHECKED_TORCH_VERSION"
    )


def test_the_private_names_exist_and_the_subclass_overrides_the_hook_method():
    assert _torch_compat.missing_names() == []
    name = _torch_compat.BUILTIN_COMM_HOOK_METHOD
    assert name in vars(_torch_compat.BuiltinHookGuard), "the override was renamed"
    mro = _ddp.PSDistributedDataParallel.__mro__
    assert mro.index(_torch_compat.BuiltinHookGuard) < mro.index(DistributedDataParallel)


def test_a_ddp_keeps_its_hooks_under_the_attribute_that_is_dropped_on_pickling():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(torch.nn.Linear(2, 2))
        ddp.register_comm_hook(None, lambda state, bucket: torch.futures.Future())
        assert len(getattr(ddp, _torch_compat.COMM_HOOKS_ATTR)) == 1
        state = ddp.__getstate__()
        _torch_compat.drop_comm_hooks(state)
        assert state[_torch_compat.COMM_HOOKS_ATTR] == []
    finally:
        dist.destroy_process_group()


def test_an_autograd_callback_runs_after_the_whole_backward_pass():
    ran = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2

    def hook(grad):
        # Queued during backward; must run after every other gradient is computed.
        assert _torch_compat.queue_autograd_callback(lambda: ran.append(x.grad is not None))
        return grad

    y.register_hook(hook)
    y.sum().backward()
    assert ran == [True]
    assert _torch_compat.queue_autograd_callback(lambda: None) is False  # not in backward


def test_the_version_counter_counts_load_state_dict_and_not_reads():
    """A replica table is re-sent to the shards when its counter moved since the
    plugin last wrote it: load_state_dict must move it, a forward must not."""
    layer = torch.nn.Embedding(4, 2)
    before = _torch_compat.version_counter(layer.weight)
    layer(torch.tensor([1, 2]))
    assert _torch_compat.version_counter(layer.weight) == before
    layer.load_state_dict({"weight": torch.ones(4, 2)})
    assert _torch_compat.version_counter(layer.weight) > before
