"""ParamClient (async/ssp worker side) against real ParamShards, no Ray."""

import dataclasses
import logging
import threading

import numpy as np
import pytest
import torch

from ray_ps_plugin._codec import as_torch
from ray_ps_plugin._errors import PSError, PSTimeoutError
from ray_ps_plugin._param.client import ParamClient
from ray_ps_plugin._param.flat import FlatParams
from ray_ps_plugin._param.layout import pieces as _pieces
from ray_ps_plugin._param.layout import split_bounds
from ray_ps_plugin._wire.frames import PARAM_LOCAL
from tests.unit.fakes import (
    FakeDirect,
    FakeTransport,
    LoggedParamShard,
    Settings,
    in_threads,
    setup_for,
    started_clients,
)


def _models(world, seed=0):
    torch.manual_seed(seed)
    template = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    models = [
        torch.nn.Sequential(
            *[
                type(m)(*())
                if isinstance(m, torch.nn.ReLU)
                else torch.nn.Linear(m.in_features, m.out_features)
                for m in template
            ]
        )
        for _ in range(world)
    ]
    for m in models:  # identical start, as after DDP's broadcast
        m.load_state_dict(template.state_dict())
    return models


def _setup(loop, world, shards, staleness, timeout_s=5.0, shared=False, models=None, replicas=0):
    """Real shards on a fake transport; ``shared``: every worker uses shared memory
    (``"frames"``: with its notices as frames on the direct path); ``replicas``:
    ``PSConfig.shard_replicas`` (inputs of two deltas)."""
    servers = [LoggedParamShard(i, world, staleness, timeout_s) for i in range(shards)]
    transport = FakeTransport(loop, servers)
    if shared == "frames":
        transport.direct = FakeDirect(loop, servers)
    models = models or _models(world)
    mode = "async" if staleness is None else "ssp"
    settings = Settings(
        mode=mode, staleness=staleness or 0, ps_timeout_s=timeout_s, shard_replicas=replicas
    )
    clients = started_clients(ParamClient, models, shards, settings, transport, bool(shared))
    return servers, transport, models, clients


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _sgd_step(model, opt, client, x, y):
    client.before_forward()
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    client.before_step()  # the optimizer pre-step hook in a real run
    opt.step()
    client.after_step()


def _constant_gradient_steps(models, clients, opts, steps):
    """Every worker, in its own thread, takes ``steps`` SGD steps with gradient 1 on
    every parameter (whatever its dtype), flushes, then every client syncs."""

    def run(rank):
        model, client, opt = models[rank], clients[rank], opts[rank]
        for _ in range(steps):
            client.before_forward()
            loss = sum(p.float().sum() for p in model.parameters())  # gradient 1
            opt.zero_grad()
            loss.backward()
            client.before_step()
            opt.step()
            client.after_step()
        client.flush()

    in_threads(run, len(models))
    for c in clients:
        c.sync()


def _train_in_threads(models, opts, clients, data):
    """Every worker, in its own thread, takes an SGD step on its batch of each step
    (``data[step][rank]``), then syncs."""

    def run(rank):
        for batches in data:
            _sgd_step(models[rank], opts[rank], clients[rank], *batches[rank])
        clients[rank].sync()

    in_threads(run, len(models))


def _ddp_steps(model, opt, data):
    """DDP's maths on the same batches: one optimizer, the mean gradient over workers."""
    for batches in data:
        opt.zero_grad()
        for x, y in batches:
            (torch.nn.functional.mse_loss(model(x), y) / len(batches)).backward()
        opt.step()


def test_split_bounds_covers_everything_evenly():
    assert split_bounds(10, 3) == [0, 3, 6, 10]
    assert split_bounds(2, 4) == [0, 0, 1, 1, 2]


@pytest.mark.parametrize("shared", [False, True], ids=["object-store", "shared-memory"])
def test_ssp_zero_with_momentum_sgd_is_ddp_maths(loop, shared):
    """Bulk-synchronous (s=0) + SGD momentum: the servers end where DDP would."""
    world, steps, lr = 2, 6, 0.1
    _, _, models, clients = _setup(loop, world, shards=2, staleness=0, shared=shared)
    reference = _models(1)[0]
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr, momentum=0.9)
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for m in models]
    data = [[(torch.randn(4, 5), torch.randn(4, 3)) for _ in range(world)] for _ in range(steps)]

    _train_in_threads(models, opts, clients, data)
    _ddp_steps(reference, ref_opt, data)
    for m in models:
        torch.testing.assert_close(_flat(m), _flat(reference), atol=1e-5, rtol=0)
    assert all(c.snapshot().staleness_max == 0 for c in clients)


def _raw_sgd_step(model, opt, client, x, y):
    """One step as in a real run, returning what the optimizer itself changed (before
    the post-step hook installs anything)."""
    client.before_forward()
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    client.before_step()
    before = _flat(model).clone()
    opt.step()
    raw = _flat(model) - before
    client.after_step()
    return raw


@pytest.mark.parametrize(
    "shared", [False, True, "frames"], ids=["object-store", "shared-memory", "notice-frames"]
)
def test_an_async_worker_counts_its_own_step_as_the_shards_do(loop, shared):
    """Right after its step, before any reply, the worker trains on what the shards
    will hold once the push lands: start + step / W. The reply then changes nothing."""
    _, transport, models, clients = _setup(loop, 2, shards=1, staleness=None, shared=shared)
    model, client = models[0], clients[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 5), torch.randn(4, 3)
    start = _flat(model).clone()
    transport.hold_replies()
    step = _raw_sgd_step(model, opt, client, x, y)  # push of clock 1 held back
    torch.testing.assert_close(_flat(model), start + step / 2)
    client.before_forward()  # reply not back: async does not wait
    transport.release_replies()
    client._inflight.handles[0].result(5)
    client.before_forward()  # a second forward of the same step changes nothing
    client.flush()
    torch.testing.assert_close(_flat(model), start + step / 2)
    stats = client.snapshot()
    assert stats.clock == 1 and stats.clocks == [1, 0]
    numel = sum(p.numel() for p in model.parameters())
    assert stats.bytes_pushed == numel * 4 and stats.bytes_pulled == numel * 4


@pytest.mark.parametrize("shared", [False, True], ids=["object-store", "shared-memory"])
def test_a_reply_is_installed_with_the_workers_next_step(loop, shared):
    """After step 2 the worker trains on the shards' answer to step 1 (which holds
    step 1 / W) plus step 2 / W."""
    _, transport, models, clients = _setup(loop, 2, shards=2, staleness=None, shared=shared)
    model, client = models[0], clients[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 5), torch.randn(4, 3)
    start = _flat(model).clone()
    transport.hold_replies()
    first = _raw_sgd_step(model, opt, client, x, y)
    transport.release_replies()
    second = _raw_sgd_step(model, opt, client, x, y)
    torch.testing.assert_close(_flat(model), start + first / 2 + second / 2, atol=1e-6, rtol=0)
    assert client.snapshot().clock == 2


@pytest.mark.parametrize("shared", [False, True], ids=["object-store", "shared-memory"])
def test_a_lone_async_worker_is_plain_sgd_at_lr_over_w(loop, shared):
    """Rank 0 steps alone (rank 1 never does) on 0.5 * a * |w|^2 with lr * a = 1.8:
    the shards apply lr/W steps, so the worker must follow w <- w (1 - lr a / W)
    exactly. Counting its own step whole between installs (the worker ran ahead by
    (1 - 1/W) of a step and was pulled back one reply later) made this recurrence
    w_k = (1 - lr a) w_{k-1} + (lr a / W) w_{k-2}, which diverges for lr * a > 4/3:
    Ray's linear example (x up to 10, lr 1e-2) did."""
    _, _, models, clients = _setup(loop, 2, shards=2, staleness=None, shared=shared)
    model, client = models[0], clients[0]
    a, lr, steps = 1.0, 1.8, 30
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    start = _flat(model).clone()
    for _ in range(steps):
        client.before_forward()
        loss = 0.5 * a * sum((p**2).sum() for p in model.parameters())
        opt.zero_grad()
        loss.backward()
        client.before_step()
        opt.step()
        client.after_step()
    client.sync()
    expected = start * (1 - lr * a / 2) ** steps
    torch.testing.assert_close(_flat(model), expected, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize(
    "shared", [False, True, "frames"], ids=["object-store", "shared-memory", "notice-frames"]
)
def test_constant_gradients_land_exactly_n_times_w_deltas(loop, shared):
    """Every delta applied once, none lost or doubled around an install: with a
    constant gradient, W workers of N SGD steps each move every parameter by
    N * W * (lr / W), on the shards and on every worker after a sync."""
    world, steps, lr = 3, 17, 0.125
    _, transport, models, clients = _setup(loop, world, shards=2, staleness=None, shared=shared)
    start = _flat(models[0]).clone()
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in models]

    _constant_gradient_steps(models, clients, opts, steps)
    for m in models:
        torch.testing.assert_close(_flat(m), start - steps * lr, atol=1e-5, rtol=0)
    if shared == "frames":  # every notice went as a frame, none as a Ray call
        assert sum(kind == PARAM_LOCAL for _, kind, _ in transport.direct.frames) == 2 * 3 * 17
        assert not [c for c in transport.calls if c[0] == "push_local"]


@pytest.mark.parametrize("shared", [False, True], ids=["object-store", "shared-memory"])
def test_a_worker_holds_its_last_answered_update_for_each_replicated_shard(loop, shared):
    """With a replica of shard 0 (none of shard 1), each answered push leaves
    exactly what shard 0 applied, to be sent to its successor: the update of the
    last clock once flushed, in the dtype shards compute in. Through shared memory
    it is the half of the worker's two-delta input that clock wrote (no copy);
    otherwise a copy."""
    world, steps, lr = 2, 5, 0.125
    servers, transport, models, clients = _setup(
        loop, world, shards=2, staleness=None, shared=shared, replicas=1
    )
    transport.replica = lambda shard: "a replica" if shard == 0 else None
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in models]
    _constant_gradient_steps(models, clients, opts, steps)

    # The workers share this fake transport: the last one to hold is kept.
    method, (model, rank, clock, values) = transport.held[(0, ("param", 0))]
    assert (method, model, clock, rank in range(world)) == ("mirror", 0, steps, True)
    assert values.dtype == np.float32
    assert values.shape == servers[0].export_state()["models"][0]["params"].shape
    np.testing.assert_allclose(values, -lr, atol=1e-6)  # gradient 1: the step's change
    assert {s for s, _ in transport.held} == {0}
    client = clients[rank]
    if shared:  # the view of the last clock's half: bytes [n, 2n) of the input for odd
        inputs = client._lanes[0].inputs
        half = inputs.view(values.nbytes * (clock % 2), np.float32, values.size)
        assert np.shares_memory(values, half) and inputs.handle.nbytes == 2 * values.nbytes
    else:
        assert not np.shares_memory(values, client._flat.delta_parts[0].numpy())


def test_a_two_delta_input_alternates_halves_by_clock_and_holds_only_in_fp32():
    """``use_half`` picks the half a clock writes; ``held_part`` is the half itself
    for fp32, a widened copy for bf16 (the shard computes in fp32), and a copy for
    an input that holds one delta."""
    from ray_ps_plugin._shm import Segment

    for dtype, two, view in [
        (torch.float32, True, True),
        (torch.bfloat16, True, False),
        (torch.float32, False, False),
    ]:
        params = [torch.zeros(6, dtype=dtype)]
        nbytes = 6 * params[0].element_size()
        seg = Segment.create(nbytes * (2 if two else 1))
        flat = FlatParams(params, [0, 6], {0: seg})
        for clock, value in [(1, 1.0), (2, 2.0)]:
            flat.use_half(clock)
            params[0].fill_(value)
            flat.take_delta(check=False)
            params[0].zero_()
        odd = seg.view(nbytes if two else 0, flat.np_dtype, 6)
        assert as_torch(odd).float().tolist() == [1.0 if two else 2.0] * 6
        held = flat.held_part(0)
        assert held.dtype == np.float32 and held.tolist() == [2.0] * 6
        assert np.shares_memory(held, seg.bytes) == view


@pytest.mark.parametrize("shared", [False, True], ids=["object-store", "shared-memory"])
def test_bf16_models_train_on_fp32_masters_and_stay_bf16(loop, shared):
    """bf16 weights in async: every worker ends with the shards' fp32 masters rounded
    to bf16, and the masters moved by N * W * (lr / W) within bf16's rounding of
    each worker's step."""
    world, steps, lr = 2, 12, 0.125
    models = [m.to(torch.bfloat16) for m in _models(world)]
    servers, _, models, clients = _setup(
        loop, world, shards=2, staleness=None, shared=shared, models=models
    )
    start = _flat(models[0]).float().clone()
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in models]

    _constant_gradient_steps(models, clients, opts, steps)
    masters = torch.cat([s._models[0].params for s in servers])
    assert masters.dtype == torch.float32
    for m in models:
        assert all(p.dtype == torch.bfloat16 for p in m.parameters())
        assert torch.equal(_flat(m), masters.to(torch.bfloat16))
    # Each bf16 step p - lr is rounded to bf16 on the worker (as under DDP): at most
    # half a bf16 ulp (|p| <= 3 here: 2**-7) per step.
    torch.testing.assert_close(masters, start - steps * lr, atol=steps * 2**-7, rtol=0)


def test_ssp_waits_for_the_slowest_and_records_no_gap_beyond_the_bound(loop):
    servers, _, models, clients = _setup(loop, 2, shards=1, staleness=1)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    x, y = torch.randn(4, 5), torch.randn(4, 3)
    for _ in range(2):  # rank 0 runs two steps ahead
        _sgd_step(models[0], opts[0], clients[0], x, y)
    blocked = threading.Thread(target=clients[0].before_forward)
    blocked.start()  # clock 2, slowest 0: must wait
    blocked.join(0.3)
    assert blocked.is_alive()
    _sgd_step(models[1], opts[1], clients[1], x, y)
    blocked.join(5)
    assert not blocked.is_alive()
    assert clients[0].snapshot().staleness_max <= 1
    assert servers[0].reads and all(c - m <= 1 for _, c, m in servers[0].reads)


def test_ssp_wait_is_bounded_and_names_the_rank(loop):
    _, _, models, clients = _setup(loop, 2, shards=1, staleness=0, timeout_s=0.3)
    opt = torch.optim.SGD(models[0].parameters(), lr=0.1)
    x, y = torch.randn(4, 5), torch.randn(4, 3)
    _sgd_step(models[0], opt, clients[0], x, y)
    with pytest.raises(PSTimeoutError, match="rank 0: model 0: clock 1"):
        clients[0].before_forward()


@pytest.mark.parametrize("staleness", [None, 2], ids=["async", "ssp"])
def test_a_worker_has_at_most_one_unconfirmed_push_per_shard(loop, staleness):
    """The most a dying shard can take with it from a worker: that worker's newest
    update. With the replies held back, the next optimizer step waits for them
    (bounded by ps_timeout_s) rather than sending a second push."""
    _, transport, models, clients = _setup(loop, 2, shards=2, staleness=staleness, timeout_s=0.3)
    opt = torch.optim.SGD(models[0].parameters(), lr=0.1)
    x, y = torch.randn(4, 5), torch.randn(4, 3)
    transport.hold_replies()
    _sgd_step(models[0], opt, clients[0], x, y)  # clock 1 sent, unconfirmed
    assert sorted((c[1], c[4]) for c in transport.pushes()) == [(0, 1), (1, 1)]
    with pytest.raises(PSTimeoutError, match="rank 0: model 0: clock 1"):
        _sgd_step(models[0], opt, clients[0], x, y)
    assert len(transport.pushes()) == 2  # no push of clock 2 while clock 1 is open
    transport.release_replies()


def test_only_optimizers_of_the_model_trigger_a_push(loop):
    """Through the real process-wide optimizer hooks: stepping another model's
    optimizer sends nothing; stepping this model's sends one push per shard."""
    from ray_ps_plugin import _optim_hooks, _runtime

    _, transport, models, clients = _setup(loop, 1, shards=2, staleness=None)
    _runtime.register(clients[0])
    _optim_hooks.ensure_optimizer_hooks()
    try:
        other = torch.nn.Linear(2, 2)
        other(torch.randn(3, 2)).sum().backward()
        torch.optim.SGD(other.parameters(), lr=0.1).step()
        assert transport.pushes() == []
        mine = torch.optim.SGD(models[0].parameters(), lr=0.1)
        models[0](torch.randn(4, 5)).sum().backward()
        mine.step()
        assert [(c[0], c[1]) for c in transport.pushes()] == [("push_pull", 0), ("push_pull", 1)]
    finally:
        _optim_hooks.remove_optimizer_hooks()
        _runtime._CLIENTS.clear()


def test_mixed_dtypes_are_refused_with_the_fix(loop):
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.zeros(2))
    model.b = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"single floating dtype.*model\.float"):
        ParamClient.build(
            setup_for(model, 0, 1, 1, Settings(mode="async")), FakeTransport(loop, [])
        )


def test_forward_without_optimizer_step_warns_at_finish(loop, caplog):
    _, _, _, clients = _setup(loop, 1, shards=1, staleness=None)
    clients[0].before_forward()
    with caplog.at_level(logging.WARNING):
        clients[0].finish()
    assert "no optimizer.step()" in caplog.text


def test_pieces_cut_parameters_at_shard_bounds():
    # Parameters of 4, 3 and 5 elements over shard slices [0, 6) and [6, 12).
    pieces = _pieces([4, 3, 5], [0, 6, 12])
    assert [(pc.param, pc.p0, pc.p1, pc.shard, pc.s0, pc.flat0) for pc in pieces] == [
        (0, 0, 4, 0, 0, 0),
        (1, 0, 2, 0, 4, 4),
        (1, 2, 3, 1, 0, 6),
        (2, 0, 5, 1, 1, 7),
    ]


def test_flat_offsets_count_empty_parameters():
    # An empty parameter has no piece; the offsets must still line up with the list.
    params = [torch.zeros(3), torch.zeros(0), torch.zeros(2)]
    flat = FlatParams(params, [0, 5], {})
    flat.base.copy_(torch.arange(5.0))
    flat.write_params()
    assert [p.tolist() for p in params] == [[0.0, 1.0, 2.0], [], [3.0, 4.0]]
    assert [h.tolist() for h in flat.host_params()] == [[0.0, 1.0, 2.0], [], [3.0, 4.0]]


def test_load_state_dict_after_prepare_reaches_the_shards(loop):
    """The usual DDP resume (load after prepare_model, on every worker) must not be
    overwritten by the shards' older parameters at the next install."""
    _, _, models, clients = _setup(loop, 2, shards=2, staleness=None)
    for c in clients:
        c.bind(None)  # registers the state-dict hooks (seeding is done by _setup)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    x, y = torch.randn(4, 5), torch.randn(4, 3)
    for m, o, c in zip(models, opts, clients):
        _sgd_step(m, o, c, x, y)
    checkpoint = {k: torch.full_like(v, 0.5) for k, v in models[0].state_dict().items()}
    in_threads(lambda r: models[r].load_state_dict(checkpoint), len(models), timeout_s=10)
    clients[1].sync()  # pulls the shards' parameters into rank 1's model
    torch.testing.assert_close(_flat(models[1]), torch.full_like(_flat(models[1]), 0.5))


def test_unfreezing_a_parameter_after_prepare_is_refused(loop):
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    model[0].requires_grad_(False)
    _, _, _, (client,) = _setup(loop, 1, shards=1, staleness=None, models=[model])
    client.before_step()  # unchanged: fine
    model[0].weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"\['0.weight'\] changed requires_grad after prepare"):
        client.before_step()


def test_a_model_smaller_than_the_shard_count_trains_through_shared_memory(loop):
    """Ray's linear example (Linear(1, 1): 2 values) on 4 shards: two shards own an
    empty slice, whose segments are empty, and ssp(0) still does DDP's maths."""
    world, steps, lr = 2, 3, 0.1
    torch.manual_seed(0)
    template = torch.nn.Linear(1, 1)
    models = [torch.nn.Linear(1, 1) for _ in range(world)]
    for m in models:
        m.load_state_dict(template.state_dict())
    _, _, models, clients = _setup(loop, world, shards=4, staleness=0, shared=True, models=models)
    assert all(c.shared_memory_shards == (0, 1, 2, 3) for c in clients)
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in models]
    data = [[(torch.randn(4, 1), torch.randn(4, 1)) for _ in range(world)] for _ in range(steps)]

    _train_in_threads(models, opts, clients, data)
    _ddp_steps(template, torch.optim.SGD(template.parameters(), lr=lr), data)
    for m in models:
        torch.testing.assert_close(_flat(m), _flat(template), atol=1e-6, rtol=0)


@pytest.mark.parametrize("shared", [False, True], ids=["object-store", "shared-memory"])
def test_a_nan_update_raises_before_it_reaches_any_shard(loop, shared):
    """nan_policy='raise' (the default) checks the update inside the delta pass: a
    NaN gradient fails the step naming rank and clock, and no shard applies it."""
    servers, _, models, clients = _setup(loop, 2, shards=2, staleness=None, shared=shared)
    model, client = models[0], clients[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(4, 5), torch.randn(4, 3)
    _sgd_step(model, opt, client, x, y)
    client.flush()
    on_shards = [s._models[0].params.clone() for s in servers]
    client.before_forward()
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    next(model.parameters()).grad[0, 0] = float("nan")
    client.before_step()  # the gradients are not scanned before the step any more
    opt.step()
    with pytest.raises(PSError, match=r"rank 0: step 2: the update of this worker .* NaN"):
        client.after_step()
    for s, before in zip(servers, on_shards):
        assert s._models[0].clocks[0] == 1
        torch.testing.assert_close(s._models[0].params, before, atol=0, rtol=0)


def test_a_joining_worker_fills_in_a_push_its_predecessor_sent_to_some_shards_only(loop):
    """Rank 1 dies with its update of clock 2 taken by shard 1 and not shard 0 (each
    shard takes a push whole or not at all). Its replacement goes on from clock 1,
    the lowest: its update of clock 2 is applied on shard 0 and ignored by shard
    1, and its next is clock 3 on both, not refused as a gap on shard 0."""
    servers, transport, models, clients = _setup(loop, 2, shards=2, staleness=None)
    for rank in (0, 1):
        _sgd_step(
            models[rank],
            torch.optim.SGD(models[rank].parameters(), lr=0.1),
            clients[rank],
            torch.randn(4, 5),
            torch.randn(4, 3),
        )
        clients[rank].sync()
    size = servers[1]._models[0].params.numel()
    loop.run(servers[1].push_pull(0, 1, 2, np.zeros(size, np.float32))).result(5)
    joined = dataclasses.replace(clients[1].setup, joined=True)
    replacement = ParamClient.build(joined, transport)
    replacement._join()
    assert replacement.start_step == 1
    opt = torch.optim.SGD(models[1].parameters(), lr=0.1)
    for _ in range(2):
        _sgd_step(models[1], opt, replacement, torch.randn(4, 5), torch.randn(4, 3))
    replacement.sync()
    assert [s._models[0].clocks[1] for s in servers] == [3, 3]
    assert servers[1]._duplicates == 1


def test_a_worker_knows_whether_another_has_yet_to_reach_its_step(loop):
    """What decides whether a report the barrier reset is made again: rank 0 three
    steps in, rank 1 one (and its second step on shard 1 only, as a push cut short
    by a death): rank 1, or its replacement, still has steps 1 and 2 to take."""
    servers, _, models, clients = _setup(loop, 2, shards=2, staleness=None)
    steps = {0: 3, 1: 1}
    for rank, n in steps.items():
        opt = torch.optim.SGD(models[rank].parameters(), lr=0.1)
        for _ in range(n):
            _sgd_step(models[rank], opt, clients[rank], torch.randn(4, 5), torch.randn(4, 3))
        clients[rank].flush()
    size = servers[1]._models[0].params.numel()
    loop.run(servers[1].push_pull(0, 1, 2, np.zeros(size, np.float32))).result(5)
    assert clients[0].peers_behind()  # the lowest of rank 1's clocks, 1, counts
    assert not clients[1].peers_behind()
