"""DiLoCo: the outer optimizer's maths, and DilocoClient against real DilocoShards
on a fake transport (no Ray)."""

import asyncio
import dataclasses
import threading

import numpy as np
import pytest
import torch

from ray_ps_plugin._errors import ShardProtocolError, ShardTimeoutError
from ray_ps_plugin._modes import staleness_bound
from ray_ps_plugin._param.diloco_client import DilocoClient
from ray_ps_plugin._param.diloco_shard import DilocoShard
from ray_ps_plugin._param.outer import OuterState
from ray_ps_plugin._param.relay import RoundRelays
from ray_ps_plugin._types import outer_learning_rate
from ray_ps_plugin.config import PSConfig
from tests.unit.fakes import FakeTransport, Settings, in_threads, setup_for, started_clients


# --- the outer optimizer ------------------------------------------------------------
def _rounds_of_changes(world, rounds, numel=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(numel, generator=g) for _ in range(world)] for _ in range(rounds)]


def test_nesterov_rounds_are_torch_sgd_nesterov_on_the_pseudo_gradient():
    world, lr, mu = 3, 0.7, 0.9
    start = torch.randn(6)
    outer = OuterState(6, "nesterov", lr, mu, world)
    params = start.clone()
    ref = start.clone().requires_grad_(True)
    opt = torch.optim.SGD([ref], lr=lr, momentum=mu, nesterov=True)
    for k, changes in enumerate(_rounds_of_changes(world, 4)):
        for c in changes:
            outer.add(c, k + 1)
        outer.close_round(params)
        ref.grad = -torch.stack(changes).mean(0)  # DiLoCo's pseudo-gradient
        opt.step()
    torch.testing.assert_close(params, ref.detach(), rtol=1e-6, atol=1e-6)
    assert outer.rounds == 4 and outer.pending == 0


def test_average_with_lr_one_is_the_mean_of_the_workers_parameters():
    outer = OuterState(6, "average", 1.0, 0.0, 2)
    params = torch.zeros(6)
    a, b = torch.randn(6), torch.randn(6)
    outer.add(a, 1)
    outer.add(b, 1)
    outer.close_round(params)
    torch.testing.assert_close(params, (a + b) / 2)


@pytest.mark.parametrize("kind", ["nesterov", "average"])
def test_async_arrivals_of_whole_rounds_equal_synchronous_rounds(kind):
    """Delayed momentum: W arrivals that are one round of every worker give exactly
    the synchronous step."""
    world = 3
    sync_outer = OuterState(6, kind, 0.7, 0.9, world)
    async_outer = OuterState(6, kind, 0.7, 0.9, world)
    sync_params, async_params = torch.zeros(6), torch.zeros(6)
    for k, changes in enumerate(_rounds_of_changes(world, 5)):
        for c in changes:
            sync_outer.add(c, k + 1)
            async_outer.apply_arrival(async_params, c)
        sync_outer.close_round(sync_params)
    torch.testing.assert_close(async_params, sync_params, rtol=1e-5, atol=1e-6)


def test_a_bf16_slice_keeps_an_fp32_momentum():
    outer = OuterState(4, "nesterov", 0.7, 0.9, 1)
    params = torch.zeros(4)  # the shard's fp32 master of a bf16 model
    outer.add(torch.full((4,), 1e-3, dtype=torch.bfloat16).float(), 1)
    outer.close_round(params)
    assert outer._m is not None and outer._m.dtype == torch.float32
    assert params[0].item() == pytest.approx(0.7 * 1.9e-3, rel=1e-2)


# --- config ---------------------------------------------------------------------------
def test_diloco_defaults_are_the_papers():
    cfg = PSConfig(mode="diloco")
    assert (cfg.local_steps, cfg.outer_optimizer, cfg.outer_momentum) == (32, "nesterov", 0.9)
    assert outer_learning_rate(cfg) == 0.7
    assert outer_learning_rate(PSConfig(mode="diloco", outer_optimizer="average")) == 1.0
    assert staleness_bound(cfg) == 0
    assert staleness_bound(PSConfig(mode="diloco", diloco_rounds="async", staleness=2)) == 2


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"mode": "sync", "local_steps": 8},
            ValueError,
            "local_steps=8 only applies",
        ),
        ({"mode": "async", "outer_lr": 0.5}, ValueError, "outer_lr=0.5 only applies"),
        ({"mode": "diloco", "local_steps": 0}, ValueError, "local_steps must be >= 1"),
        ({"mode": "diloco", "local_steps": 2.0}, TypeError, "local_steps must be an int"),
        ({"mode": "diloco", "outer_optimizer": "adam"}, ValueError, "outer_optimizer='adam'"),
        ({"mode": "diloco", "outer_lr": -1}, ValueError, "outer_lr must be a finite number > 0"),
        (
            {"mode": "diloco", "outer_momentum": 1.0},
            ValueError,
            r"outer_momentum must be in \[0",
        ),
        ({"mode": "diloco", "diloco_rounds": "async"}, ValueError, "needs staleness >= 1"),
        ({"mode": "diloco", "staleness": 1}, ValueError, "diloco_rounds='async'"),
        ({"mode": "sync", "diloco_overlap": True}, ValueError, "diloco_overlap=True only"),
        ({"mode": "diloco", "diloco_overlap": "yes"}, TypeError, "diloco_overlap must be"),
    ],
)
def test_bad_diloco_fields_are_refused_with_the_fix(kwargs, error, match):
    with pytest.raises(error, match=match):
        PSConfig(**kwargs)


# --- client and shards ----------------------------------------------------------------
def _models(world, seed=0):
    torch.manual_seed(seed)
    template = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    models = []
    for _ in range(world):
        m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
        m.load_state_dict(template.state_dict())  # identical start, as after DDP's broadcast
        models.append(m)
    return models


def _setup(loop, world, shards, *, shared, staleness=0, compression=None, **outer):
    settings = Settings(mode="diloco", staleness=staleness, compression=compression, **outer)
    if staleness:
        settings.diloco_rounds = "async"
    args = (
        staleness_bound(settings),
        5.0,
        compression,
        settings.outer_optimizer,
        outer_learning_rate(settings),
        settings.outer_momentum,
    )
    servers = [DilocoShard(i, world, *args) for i in range(shards)]
    transport = FakeTransport(loop, servers)
    models = _models(world)
    clients = started_clients(DilocoClient, models, shards, settings, transport, shared)
    return servers, models, clients


def _step(model, opt, client, x, y):
    client.before_forward()
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    client.before_step()
    opt.step()
    client.after_step()


def _run_workers(models, clients, opts, data, finish=True):
    """Each worker in its own thread takes its steps (``data[rank]``), then finishes."""
    errors = []

    def run(rank):
        try:
            for x, y in data[rank]:
                _step(models[rank], opts[rank], clients[rank], x, y)
            if finish:
                clients[rank].finish()
        except Exception as e:  # reported below, not lost in the thread
            errors.append(e)

    in_threads(run, len(models))
    assert not errors, errors


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _data(world, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        [(torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)) for _ in range(steps)]
        for _ in range(world)
    ]


@pytest.mark.parametrize("shared", [False, True], ids=["object-store", "shared-memory"])
def test_one_local_step_with_plain_averaging_is_synchronous_sgd(loop, shared):
    world, steps, lr = 2, 5, 0.1
    _, models, clients = _setup(
        loop, world, shards=2, shared=shared, local_steps=1, outer_optimizer="average"
    )
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in models]
    data = _data(world, steps)
    _run_workers(models, clients, opts, data)
    reference = _models(1)[0]
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr)
    for step in range(steps):  # DDP: the mean of the workers' gradients
        ref_opt.zero_grad()
        for rank in range(world):
            x, y = data[rank][step]
            (torch.nn.functional.mse_loss(reference(x), y) / world).backward()
        ref_opt.step()
    for m in models:
        torch.testing.assert_close(_flat(m), _flat(reference), rtol=0, atol=1e-5)


@pytest.mark.parametrize("shared", [False, True], ids=["object-store", "shared-memory"])
def test_rounds_of_local_adam_steps_follow_the_outer_nesterov_step(loop, shared):
    """H = 3 local Adam steps per round, 7 steps (two rounds and a shorter last one
    sent at finish): every worker ends on the global parameters that the rounds,
    computed here by hand, give."""
    world, steps, h = 2, 7, 3
    _, models, clients = _setup(loop, world, shards=3, shared=shared, local_steps=h)
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in models]
    data = _data(world, steps)
    _run_workers(models, clients, opts, data)
    # By hand: each worker's own Adam keeps its state across rounds.
    replicas = _models(world)
    ref_opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in replicas]
    global_params = _flat(replicas[0]).clone()
    outer = OuterState(global_params.numel(), "nesterov", 0.7, 0.9, world)
    for k, lo in enumerate(range(0, steps, h)):
        for rank, m in enumerate(replicas):
            # (vector_to_parameters would make the parameters views of global_params)
            torch.nn.utils.vector_to_parameters(global_params.clone(), m.parameters())
            for x, y in data[rank][lo : lo + h]:
                ref_opts[rank].zero_grad()
                torch.nn.functional.mse_loss(m(x), y).backward()
                ref_opts[rank].step()
            outer.add(_flat(m) - global_params, k + 1)
        outer.close_round(global_params)
    for m in models:
        torch.testing.assert_close(_flat(m), global_params, rtol=0, atol=1e-5)
    stats = clients[0].snapshot()
    assert stats.steps == 7 and stats.clock == 3  # 3 rounds: steps 3, 6 and 7


def test_bf16_compression_halves_a_rounds_bytes_and_keeps_the_result_close(loop):
    results, sent = {}, {}
    for compression in (None, "bf16"):
        _, models, clients = _setup(
            loop, 2, shards=2, shared=False, compression=compression, local_steps=2
        )
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
        _run_workers(models, clients, opts, _data(2, 4))
        results[compression] = _flat(models[0])
        sent[compression] = clients[0].snapshot().bytes_pushed
    assert sent["bf16"] * 2 == sent[None]
    torch.testing.assert_close(results["bf16"], results[None], rtol=0, atol=2e-2)


def test_a_finished_worker_does_not_hold_a_round_back(loop):
    """Rank 1 stops after one round; rank 0's later rounds apply its change alone."""
    world, h = 2, 2
    servers, models, clients = _setup(
        loop, world, shards=1, shared=False, local_steps=h, outer_optimizer="average"
    )
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    data = _data(world, 6)
    data[1] = data[1][:2]
    _run_workers(models, clients, opts, data)
    assert clients[0].snapshot().clock == 3 and clients[1].snapshot().clock == 1
    assert servers[0].stats()["rounds"] == {0: 3}


def test_asynchronous_rounds_let_a_worker_run_ahead_within_the_bound(loop):
    """Staleness 1: rank 0's round 1 is answered at once (no wait for rank 1), its
    round 2 only once rank 1 has sent round 1."""
    servers, models, clients = _setup(loop, 2, shards=1, shared=True, staleness=1, local_steps=1)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    data = _data(2, 2)
    _step(models[0], opts[0], clients[0], *data[0][0])
    assert clients[0].snapshot().clock == 1  # round 1 done alone: it ran ahead
    fast = threading.Thread(target=_step, args=(models[0], opts[0], clients[0], *data[0][1]))
    fast.start()
    fast.join(0.5)
    assert fast.is_alive(), "round 2 must wait for rank 1's round 1"
    _step(models[1], opts[1], clients[1], *data[1][0])
    fast.join(10)
    assert not fast.is_alive() and clients[0].snapshot().clock == 2
    assert servers[0].stats()["max_read_gap"] == 1


def test_a_checkpoint_between_rounds_keeps_the_local_steps(loop):
    _, models, clients = _setup(loop, 1, shards=1, shared=False, local_steps=4)
    clients[0].bind(None)
    opt = torch.optim.SGD(models[0].parameters(), lr=0.1)
    for x, y in _data(1, 2)[0]:
        _step(models[0], opt, clients[0], x, y)
    before = _flat(models[0]).clone()
    models[0].state_dict()  # its pre-hook must not pull the older global parameters
    torch.testing.assert_close(_flat(models[0]), before, rtol=0, atol=0)
    assert clients[0].snapshot().clock == 0


def test_a_restore_with_the_outer_state_continues_exactly(loop):
    """Two rounds, then a checkpoint of the parameters and the outer state; fresh
    shards restored from both take the third round exactly as the first run does."""
    world, h = 2, 2
    data = _data(world, 3 * h)
    first = [[b for b in d[: 2 * h]] for d in data]
    third = [[b for b in d[2 * h :]] for d in data]
    _, models, clients = _setup(loop, world, shards=2, shared=False, local_steps=h)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    _run_workers(models, clients, opts, first, finish=False)
    params = _flat(models[0]).clone()
    outer = clients[0].outer_state_dict()
    assert outer["rounds"] == 2 and outer["momentum"].abs().sum() > 0
    _run_workers(models, clients, opts, third)
    uninterrupted = _flat(models[0])

    _, restored, clients2 = _setup(loop, world, shards=2, shared=False, local_steps=h)
    for m in restored:
        torch.nn.utils.vector_to_parameters(params.clone(), m.parameters())
    for c in clients2:
        c._flat.snapshot()
    clients2[0].reseed()  # rank 0's loaded parameters reach the new shards
    for c in clients2:
        c.load_outer_state_dict(outer)
    opts2 = [torch.optim.SGD(m.parameters(), lr=0.1) for m in restored]
    _run_workers(restored, clients2, opts2, third)
    torch.testing.assert_close(_flat(restored[0]), uninterrupted, rtol=0, atol=1e-6)


def test_an_outer_state_loads_onto_another_number_of_workers_and_shards(loop):
    """A checkpoint's outer state is one flat vector: 2 workers on 2 shards save it,
    3 workers on 3 shards load it (cut at the new shards' bounds) and hold it whole."""
    h = 2
    _, models, clients = _setup(loop, 2, shards=2, shared=False, local_steps=h)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    _run_workers(models, clients, opts, _data(2, 2 * h), finish=False)
    outer = clients[0].outer_state_dict()
    _, _, bigger = _setup(loop, 3, shards=3, shared=False, local_steps=h)
    for c in bigger:
        c.load_outer_state_dict(outer)
    loaded = bigger[1].outer_state_dict()
    assert loaded["rounds"] == outer["rounds"] == 2
    torch.testing.assert_close(loaded["momentum"], outer["momentum"], rtol=0, atol=0)


def test_an_outer_state_of_another_model_is_refused(loop):
    _, _, clients = _setup(loop, 1, shards=1, shared=False)
    with pytest.raises(ValueError, match="belongs to another model"):
        clients[0].load_outer_state_dict({"momentum": torch.zeros(3), "rounds": 0})
    with pytest.raises(ValueError, match="takes what outer_state_dict"):
        clients[0].load_outer_state_dict({"m": 1})


def test_with_overlap_a_round_does_not_wait_for_its_answer(loop):
    """One round of delay: while the shards' answers are held back, the worker keeps
    stepping through the next round; it waits only at the end of that round."""
    servers, models, clients = _setup(
        loop, 1, shards=1, shared=False, local_steps=2, diloco_overlap=True
    )
    transport = clients[0]._transport
    opt = torch.optim.SGD(models[0].parameters(), lr=0.1)
    data = _data(1, 6)[0]
    transport.hold_replies()
    worker = threading.Thread(
        target=lambda: [_step(models[0], opt, clients[0], x, y) for x, y in data[:3]]
    )
    worker.start()
    worker.join(5)
    assert not worker.is_alive(), "round 1's push must not block the next local steps"
    assert clients[0].snapshot().clock == 1
    transport.release_replies()
    for x, y in data[3:]:
        _step(models[0], opt, clients[0], x, y)
    clients[0].flush()
    # After flush() the model holds the shards' parameters: every step is in them.
    reply = loop.run(servers[0].pull(0, 0, clients[0].snapshot().clock)).result(5)
    torch.testing.assert_close(_flat(models[0]), torch.from_numpy(reply.params))
    assert clients[0].snapshot().clock == 3


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
def test_overlapped_rounds_end_with_every_worker_on_the_global_parameters(loop, overlap):
    world = 2
    _, models, clients = _setup(
        loop, world, shards=2, shared=True, local_steps=3, diloco_overlap=overlap
    )
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    data = _data(world, 10)
    x, y = torch.cat([b[0] for d in data for b in d]), torch.cat([b[1] for d in data for b in d])
    before = torch.nn.functional.mse_loss(models[0](x), y).item()
    _run_workers(models, clients, opts, data)
    torch.testing.assert_close(_flat(models[0]), _flat(models[1]), rtol=0, atol=0)
    assert torch.nn.functional.mse_loss(models[0](x), y).item() < before
    assert [c.snapshot().clock for c in clients] == [4, 4]  # steps 3, 6, 9 and 10


# --- node-level aggregation -------------------------------------------------------------
class _Peer:
    """A shard as a relay sees another: ``peer.method.remote(...)`` is awaitable."""

    def __init__(self, server):
        self._server = server

    def __getattr__(self, method):
        call = getattr(self._server, method)
        return type("Remote", (), {"remote": staticmethod(lambda *a: call(*a))})


def _two_nodes(loop, *, relays, data, finish_early=None):
    """4 workers and 2 shards on two nodes (ranks 0, 1 and shard 0 on one; ranks 2, 3
    and shard 1 on the other), 3 local SGD steps a round; returns the shards, the
    models and the transport's calls."""
    world, shards = 4, 2
    settings = Settings(mode="diloco", local_steps=3)
    args = (0, 5.0, None, "nesterov", outer_learning_rate(settings), 0.9)
    servers = [DilocoShard(i, world, *args) for i in range(shards)]
    transport = FakeTransport(loop, servers)
    node_of = [0, 0, 1, 1]
    topology = RoundRelays(relay_of_rank=tuple(node_of)) if relays else None
    if relays:
        for s in range(shards):
            servers[s].configure_relay(
                [_Peer(x) for x in servers], [r for r in range(world) if node_of[r] == s]
            )
    models = _models(world)
    clients = []
    for r, m in enumerate(models):
        setup = setup_for(m, r, world, shards, settings, [node_of[r]], {1 - node_of[r]})
        clients.append(DilocoClient.build(dataclasses.replace(setup, topology=topology), transport))
    for c in clients:
        c._start()
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    _run_workers(models, clients, opts, data)
    return servers, models, clients, transport.calls


def test_a_nodes_relay_sends_one_sum_per_round_and_gives_the_same_rounds(loop):
    """With relays each round crosses between the nodes as one message per shard
    (from each node's relay), not one per worker, and every worker ends on the
    parameters the rounds give without relays (fp32 sums in another order)."""
    data = _data(4, 7)
    _, direct_models, direct_clients, _ = _two_nodes(loop, relays=False, data=data)
    servers, models, clients, calls = _two_nodes(loop, relays=True, data=data)
    for m, ref in zip(models, direct_models):
        torch.testing.assert_close(_flat(m), _flat(ref), rtol=0, atol=1e-6)
    methods = [c[0] for c in calls]
    # 3 rounds (steps 3, 6 and the last at finish), 4 workers: every change for the
    # other node's shard goes to the worker's own node's shard.
    assert methods.count("relay_push") == 12 and "push_pull" not in methods
    assert all(c[1] == (0 if c[3] < 2 else 1) for c in calls if c[0] == "relay_push")
    assert [s.stats()["rounds"] for s in servers] == [{0: 3}, {0: 3}]
    # The relayed workers count no bytes across nodes: their relay sends them.
    assert all(c.snapshot().bytes_cross_node == 0 for c in clients)
    assert direct_clients[0].snapshot().bytes_cross_node > 0


def test_a_relay_sends_on_without_a_finished_worker(loop):
    """Rank 1 stops after one round; its node's relay sends rank 0's later rounds
    alone instead of waiting for it."""
    data = _data(4, 9)
    data[1] = data[1][:3]
    servers, _, clients, _ = _two_nodes(loop, relays=True, data=data)
    assert clients[0].snapshot().clock == 3 and clients[1].snapshot().clock == 1
    assert [s.stats()["rounds"] for s in servers] == [{0: 3}, {0: 3}]


def test_a_relay_refuses_a_worker_of_another_node(loop):
    settings = Settings(mode="diloco")
    shard = DilocoShard(0, 2, 0, 5.0, None, "nesterov", outer_learning_rate(settings), 0.9)
    shard.configure_relay([_Peer(shard)], [0])
    loop.run(shard.init(0, np.zeros(4, np.float32))).result(5)
    with pytest.raises(ShardProtocolError, match="relays for ranks \\[0\\]"):
        loop.run(shard.relay_push(0, 1, 1, 0, np.zeros(4, np.float32))).result(5)


def test_a_relay_whose_owner_does_not_answer_names_the_owner(loop):
    """Every worker of the node sent; the owner never answers: the waiters get the
    owner's timeout, not a list of missing workers."""

    class Hung:
        class push_pull_many:  # named as the Ray method
            @staticmethod
            def remote(*args):
                return asyncio.sleep(60)

    settings = Settings(mode="diloco")
    shard = DilocoShard(0, 1, 0, 0.3, None, "nesterov", outer_learning_rate(settings), 0.9)
    shard.configure_relay([shard, Hung()], [0])
    loop.run(shard.init(0, np.zeros(4, np.float32))).result(5)
    with pytest.raises(ShardTimeoutError, match=r"shard 1 did not answer within 0.3s"):
        loop.run(shard.relay_push(0, 0, 1, 1, np.zeros(4, np.float32))).result(5)


def test_a_worker_in_a_round_sees_a_peer_whose_replacement_restarts_the_round(loop):
    """Rounds of 4 steps, asynchronous (bound 2): rank 0 at step 9 (two rounds in),
    rank 1 at step 5 (one round): a replacement of rank 1 would start at step 4,
    before rank 0's step, so a report there would be made again. Counted in steps,
    not rounds."""
    _, models, clients = _setup(loop, 2, 1, shared=False, staleness=2, local_steps=4)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    data = _data(2, 9)
    _run_workers(models, clients, opts, [data[0], data[1][:5]], finish=False)
    assert (clients[0].loop_step, clients[1].loop_step) == (9, 5)
    assert clients[0].step_of(1) == 4
    assert clients[0].peers_behind() and not clients[1].peers_behind()
