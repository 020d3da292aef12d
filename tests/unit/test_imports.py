"""What a process loads: shard actors start without torch or Ray Train."""

import subprocess
import sys

import pytest

import ray_ps_plugin


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return set(out.stdout.split())


def test_a_sync_shard_process_loads_neither_torch_nor_ray_train():
    # A sync shard only sums NumPy buffers; torch alone took most of its start-up
    # (about 4 s of 4.5 s per run on a 2-core machine before it was kept out).
    loaded = _loaded_after("import ray_ps_plugin._sync.shard")
    assert "torch" not in loaded
    assert "ray.train" not in loaded


def test_an_async_shard_process_does_not_load_ray_train():
    loaded = _loaded_after("import ray_ps_plugin._param.shard")
    assert "ray.train" not in loaded


@pytest.mark.parametrize("name", ray_ps_plugin.__all__)
def test_every_public_name_resolves(name):
    assert getattr(ray_ps_plugin, name).__name__ == name


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'PSTrainr'"):
        ray_ps_plugin.PSTrainr
