"""PSConfig / PSTrainer validation: clear, early errors naming the field."""

import math

import pytest
from ray.train.torch import TorchConfig, TorchTrainer
from ray.train.torch.config import TorchConfigContextManager, _TorchBackend

from ray_ps_plugin import PSConfig, PSTrainer
from ray_ps_plugin._backend import PSBackend


def test_defaults_are_sync_ps_and_a_torch_config():
    cfg = PSConfig()
    assert isinstance(cfg, TorchConfig)
    assert (cfg.strategy, cfg.mode, cfg.staleness, cfg.num_servers) == ("ps", "sync", 0, None)
    assert cfg.backend_cls is PSBackend
    assert cfg.to_dict()["strategy"] == "ps"


def test_ddp_strategy_is_stock_torch_config():
    cfg = PSConfig(strategy="ddp")
    assert cfg.backend_cls is _TorchBackend
    assert cfg.train_func_context is TorchConfigContextManager


@pytest.mark.parametrize(
    "kwargs, exc, field",
    [
        (dict(strategy="allreduce"), ValueError, "strategy"),
        (dict(strategy=1), TypeError, "strategy"),
        (dict(mode="eventual"), ValueError, "mode"),
        (dict(staleness=-1, mode="ssp"), ValueError, "staleness"),
        (dict(staleness=1.5), TypeError, "staleness"),
        (dict(staleness=2), ValueError, "staleness"),  # staleness without ssp
        (dict(num_servers=0), ValueError, "num_servers"),
        (dict(num_servers=True), TypeError, "num_servers"),
        (dict(num_servers="2"), TypeError, "num_servers"),
        (dict(chunk_bytes=10), ValueError, "chunk_bytes"),
        (dict(chunk_bytes=1024.0), TypeError, "chunk_bytes"),
        (dict(ps_timeout_s=0), ValueError, "ps_timeout_s"),
        (dict(ps_timeout_s=math.inf), ValueError, "ps_timeout_s"),
        (dict(ps_timeout_s="10"), TypeError, "ps_timeout_s"),
        (dict(ps_start_timeout_s=-1), ValueError, "ps_start_timeout_s"),
        (dict(data_path="rdma"), ValueError, "data_path"),
        (dict(data_path=None), TypeError, "data_path"),
        (dict(node_aggregation="yes"), TypeError, "node_aggregation"),
        (dict(shared_memory=1), TypeError, "shared_memory"),
        (dict(sparse_optimizer="server"), ValueError, "sparse_optimizer"),
        (dict(sparse_optimizer=1), TypeError, "sparse_optimizer"),
        # Diloco's workers step their own copies between rounds.
        (
            dict(mode="diloco", sparse_optimizer="shards"),
            ValueError,
            "does not apply to mode='diloco'",
        ),
    ],
)
def test_bad_fields_name_the_field(kwargs, exc, field):
    with pytest.raises(exc, match=field):
        PSConfig(**kwargs)


def test_pstrainer_rejects_torch_config_and_wrong_types():
    def loop():
        pass

    with pytest.raises(TypeError, match="ps_config"):
        PSTrainer(loop, torch_config=TorchConfig())
    with pytest.raises(TypeError, match="PSConfig"):
        PSTrainer(loop, ps_config=TorchConfig())


def test_pstrainer_is_a_torch_trainer_with_the_config():
    trainer = PSTrainer(lambda: None, ps_config=PSConfig(num_servers=3))
    assert isinstance(trainer, TorchTrainer)
    assert trainer.backend_config.num_servers == 3


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_every_mode_is_available(mode):
    cfg = PSConfig(mode=mode, staleness=2 if mode == "ssp" else 0)
    assert cfg.to_dict()["mode"] == mode


def test_nan_policy_is_validated():
    assert PSConfig(nan_policy="skip").to_dict()["nan_policy"] == "skip"
    with pytest.raises(ValueError, match="nan_policy='drop' is unknown"):
        PSConfig(nan_policy="drop")


def test_compression_and_server_placement_are_validated():
    cfg = PSConfig(compression="bf16", server_placement="node")
    assert cfg.to_dict()["compression"] == "bf16"
    with pytest.raises(ValueError, match="compression='int2' is unknown"):
        PSConfig(compression="int2")
    with pytest.raises(ValueError, match="compression='int8' does not apply to mode='sync'"):
        PSConfig(compression="int8")
    with pytest.raises(ValueError, match="server_placement='rack' is unknown"):
        PSConfig(server_placement="rack")
    with pytest.raises(ValueError, match="cannot be combined with num_servers=2"):
        PSConfig(server_placement="node", num_servers=2)


def test_auto_placement_is_one_shard_per_node_only_where_nodes_relay():
    from types import SimpleNamespace

    from ray_ps_plugin._placement import _per_node

    def group(*nodes):
        workers = [SimpleNamespace(metadata=SimpleNamespace(node_id=n)) for n in nodes]
        return SimpleNamespace(get_workers=lambda: workers)

    two_by_two, two_by_one, one_node = group("a", "a", "b", "b"), group("a", "b"), group("a", "a")
    assert PSConfig().server_placement == "auto"
    assert _per_node(two_by_two, PSConfig())
    assert not _per_node(two_by_one, PSConfig()) and not _per_node(one_node, PSConfig())
    for cfg in (
        PSConfig(num_servers=4),
        PSConfig(mode="async"),
        PSConfig(node_aggregation=False),
        PSConfig(data_path="object_store"),
        PSConfig(server_placement="worker"),
    ):
        assert not _per_node(two_by_two, cfg), cfg
    assert _per_node(one_node, PSConfig(server_placement="node"))


def test_server_resources_are_checked_early_naming_the_field():
    assert PSConfig(server_resources={"ps_server": 1, "CPU": 0.5}).server_resources
    with pytest.raises(TypeError, match="non-empty dict"):
        PSConfig(server_resources={})
    with pytest.raises(TypeError, match="non-empty dict"):
        PSConfig(server_resources=["ps_server"])
    with pytest.raises(ValueError, match=r"server_resources\['ps_server'\] must be a finite"):
        PSConfig(server_resources={"ps_server": 0})
    with pytest.raises(TypeError, match="resource names are strings"):
        PSConfig(server_resources={1: 1})
    with pytest.raises(ValueError, match="GPUs"):
        PSConfig(server_resources={"GPU": 1})
    with pytest.raises(ValueError, match="cannot be combined with server_resources"):
        PSConfig(server_resources={"ps_server": 1}, server_placement="node")


def test_shards_with_server_resources_ask_for_them_and_spread(monkeypatch):
    from types import SimpleNamespace

    from ray_ps_plugin import _placement

    workers = [SimpleNamespace(metadata=SimpleNamespace(node_id=n)) for n in "aab"]
    group = SimpleNamespace(get_workers=lambda: workers)
    cfg = PSConfig(server_resources={"ps_server": 1, "CPU": 0.25})
    placements = _placement.place_shards(group, cfg)
    assert len(placements) == 3  # one per worker unless num_servers says
    assert placements[0].options() == {
        "scheduling_strategy": "SPREAD",
        "num_cpus": 0.25,
        "resources": {"ps_server": 1.0},
    }
    assert (
        len(_placement.place_shards(group, PSConfig(server_resources={"x": 1}, num_servers=5))) == 5
    )
    # A restart keeps the shards' count.
    assert len(_placement.place_shards(group, cfg, num_servers=2)) == 2


def test_shards_that_found_no_node_say_which_resource_is_missing(monkeypatch):
    from ray_ps_plugin import _placement

    nodes = [{"NodeID": "a" * 40, "Alive": True, "Resources": {"CPU": 2.0}}]
    monkeypatch.setattr(_placement.ray, "nodes", lambda: nodes)
    message = _placement.unplaced_shards_message({"ps_server": 1})
    assert "No live node carries the resource(s) ['ps_server']" in message
    assert "ray start --resources" in message
    nodes.append({"NodeID": "b" * 40, "Alive": True, "Resources": {"ps_server": 1.0}})
    assert "Nodes ['bbbbbbbbbbbb'] carry ['ps_server']" in _placement.unplaced_shards_message(
        {"ps_server": 1}
    )
    assert _placement.unplaced_shards_message(None) == ""
