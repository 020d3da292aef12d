"""Tune helper: trial configs are split and validated before anything starts."""

import pytest
from ray.train import ScalingConfig

from ray_ps_plugin.tune import make_trainable, split_trial_config

SCALING = ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5})


def _loop(config):
    pass


def test_trial_config_errors_name_the_field():
    with pytest.raises(ValueError, match="no 'strategy'"):
        split_trial_config({"lr": 0.1})
    with pytest.raises(TypeError, match="stratgy"):
        split_trial_config({"ps_config": {"stratgy": "ps"}})
    with pytest.raises(ValueError, match="'mode' is set twice"):
        split_trial_config({"mode": "sync", "ps_config": {"strategy": "ps", "mode": "sync"}})
    with pytest.raises(ValueError, match="must not set 'strategy'"):
        make_trainable(_loop, SCALING, ps_config_kwargs={"strategy": "ps"})
    with pytest.raises(ValueError, match="must not set 'name'"):
        make_trainable(_loop, SCALING, run_config_kwargs={"name": "x"})
    with pytest.raises(TypeError, match="ScalingConfig"):
        make_trainable(_loop, {"num_workers": 2})
    cfg, loop_config = split_trial_config(
        {"ps_config": {"strategy": "ddp"}, "lr": 0.1, "num_servers": 3}, {"ps_timeout_s": 5}
    )
    assert (cfg.strategy, cfg.mode, cfg.num_servers, cfg.ps_timeout_s) == ("ddp", "sync", 3, 5)
    assert loop_config == {"lr": 0.1}
