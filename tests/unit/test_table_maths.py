"""The shards step table rows with torch's bits, not merely close to them.

Training is chaotic at the last bit: a ReLU input that rounds to the other side of
zero changes a whole sample's backward, so runs that differ by one rounding in one
row can part by 1e-5 a hundred steps later (DLRM's own SGD recipe did). Closeness
after a few steps proves little; these tests ask for equality, over many shapes and
seeds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ray_ps_plugin._param.shard import ParamShard
from ray_ps_plugin._tables import optim as _table_optim
from ray_ps_plugin._tables.client import ShardedTables
from ray_ps_plugin._tables.layers import optimizer_step_spec, sparse_add_rounds_once
from ray_ps_plugin._tables.optim import apply_step, fused_axpy, new_state
from tests.unit.fakes import LoopThread, Settings
from tests.unit.test_tables import COPIES, _TableTransport

_FLOATS = hnp.arrays(
    np.float32,
    st.tuples(st.integers(1, 40), st.integers(1, 20)),
    elements=st.floats(-1e6, 1e6, width=32, allow_subnormal=True),
)


@settings(max_examples=60, deadline=None)
@given(
    y=_FLOATS,
    scale=st.floats(1e-30, 1e3),
    alpha=st.floats(-10.0, 10.0, width=32),
    seed=st.integers(0, 2**32 - 1),
)
def test_fused_axpy_rounds_as_torch_adds_a_sparse_gradient(y, scale, alpha, seed):
    x = (np.random.default_rng(seed).standard_normal(y.shape) * scale).astype(np.float32)
    want = torch.from_numpy(y.copy())
    rows = torch.arange(y.shape[0])[None]
    want.add_(torch.sparse_coo_tensor(rows, torch.from_numpy(x), y.shape), alpha=alpha)
    if not sparse_add_rounds_once("cpu", y.shape[1]):
        pytest.skip("this torch rounds a sparse add twice: the shards do so too")
    np.testing.assert_array_equal(fused_axpy(alpha, x, y), want.numpy())


def test_the_probe_tells_one_rounding_from_two():
    """The probe's values: once rounded and twice rounded differ in the last bit."""
    a = np.float32(1 + 2**-12)
    assert np.float32(a * a) - np.float32(1) == np.float32(2**-11)
    assert fused_axpy(float(a), np.array([a]), np.array([-1.0], np.float32))[0] == 2**-11 + 2**-24
    assert sparse_add_rounds_once("cpu", 16) in (True, False)


_OPTIMIZERS = {
    "sgd": lambda ps, lr: torch.optim.SGD(ps, lr=lr),
    "sgd-maximize": lambda ps, lr: torch.optim.SGD(ps, lr=lr, maximize=True),
    "adagrad": lambda ps, lr: torch.optim.Adagrad(
        ps, lr=lr, lr_decay=0.01, initial_accumulator_value=0.1
    ),
    "sparse_adam": lambda ps, lr: torch.optim.SparseAdam(ps, lr=lr / 10, betas=(0.8, 0.95)),
}


def _torch_sqrt(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x)).sqrt().numpy()


@pytest.mark.parametrize("name", list(_OPTIMIZERS))
def test_apply_step_gives_torchs_optimizers_bits(name, monkeypatch):
    """Forty steps of uneven, repeated rows under a changing learning rate: the rows
    ``apply_step`` writes equal torch's, bit for bit, and so does the state (with
    torch's square root, which is not NumPy's correctly rounded one, for Adagrad
    and SparseAdam)."""
    monkeypatch.setattr(_table_optim, "_sqrt", _torch_sqrt)
    rows, dim = 300, 16
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(rows, dim, generator=gen) * 0.05
    ref = torch.nn.Parameter(weight.clone())
    opt = _OPTIMIZERS[name]([ref], 0.1)
    kind, _ = optimizer_step_spec(opt, opt.param_groups[0], "t")
    mine, state = weight.numpy().copy(), new_state(weight.numpy(), kind)
    if kind == "adagrad":
        state["sum"].fill(0.1)
    for step in range(1, 41):
        opt.param_groups[0]["lr"] = 0.1 * (1 + step % 7) / 7
        ids = (torch.rand(200, generator=gen) ** 4 * rows * 1.2).long().clamp(max=rows - 1)
        values = torch.randn(200, dim, generator=gen) * 10.0 ** -(step % 4)
        # Coalesced, as DDP hands it over (SGD adds an uncoalesced one row by row).
        g = torch.sparse_coo_tensor(ids[None], values, (rows, dim)).coalesce()
        ref.grad = g
        _, hyper = optimizer_step_spec(opt, opt.param_groups[0], "t")
        hyper["fused"] = float(sparse_add_rounds_once("cpu", dim))
        opt.step()
        apply_step(kind, mine, state, g.indices()[0].numpy(), g.values().numpy(), hyper, step)
        np.testing.assert_array_equal(mine, ref.detach().numpy(), err_msg=f"step {step}")
    for n, v in state.items():
        np.testing.assert_array_equal(v, opt.state[ref][n].numpy())


class _Bags(torch.nn.Module):
    """Sum-pooled sparse bags of the given sizes, as DLRM builds them."""

    def __init__(self, sizes: list[tuple[int, int]]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bags = torch.nn.ModuleList(
            torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=True) for rows, dim in sizes
        )

    def forward(self, batch):
        return [bag(ids, offsets) for bag, (ids, offsets) in zip(self.bags, batch)]


def _batch(sizes, rng):
    """Per table, bags of 1-3 Zipf ids; ids past the end are clipped to the last row,
    which is then hot (repeated within bags and across workers)."""
    out = []
    for rows, _ in sizes:
        lengths = rng.integers(1, 4, size=16)
        ids = np.minimum(rng.zipf(1.3, size=int(lengths.sum())) - 1, rows - 1)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        out.append((torch.from_numpy(ids), torch.from_numpy(offsets)))
    return out


def _ddp_grads(module, world):
    """What DDP leaves in each weight's ``grad`` after Gloo's sparse all-reduce: each
    rank's gradient divided by the world size, coalesced, the ranks' summed in rank
    order as uncoalesced sparse tensors and coalesced once more."""
    for bag in module.bags:
        parts = [g.div(world).coalesce() for g in bag.weight.held]
        out = torch.sparse_coo_tensor(parts[0].indices(), parts[0].values(), parts[0].shape)
        for p in parts[1:]:
            out = out + torch.sparse_coo_tensor(p.indices(), p.values(), p.shape)
        bag.weight.grad = out.coalesce()
        bag.weight.held = []


@settings(max_examples=12, deadline=None)
@given(
    sizes=st.lists(
        st.tuples(st.integers(2, 400), st.sampled_from([1, 3, 8, 16])), min_size=1, max_size=4
    ),
    world=st.sampled_from([2, 3]),
    shards=st.integers(1, 3),
    kind=st.sampled_from(["sgd", "adagrad", "sparse_adam"]),
    seed=st.integers(0, 2**16),
)
def test_replicas_stepped_on_the_shards_end_with_ddps_bits(sizes, world, shards, kind, seed):
    """Workers with real replica tables, SGD under a warm-up and a decay (or Adagrad,
    SparseAdam), stepped on real shards: after 30 steps every copy equals what DDP's
    ranks hold, bit for bit, for two workers and for three (Adagrad and SparseAdam
    with torch's square root on the shards)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_table_optim, "_sqrt", _torch_sqrt)
        _replicas_against_ddp(sizes, world, shards, kind, seed)


def _replicas_against_ddp(sizes, world, shards, kind, seed):
    lt = LoopThread()
    servers = [ParamShard(s, world, None, 5.0) for s in range(shards)]
    settings_ = Settings(mode="sync", ps_timeout_s=5.0, sparse_optimizer="shards")
    workers = []
    try:
        for rank in range(world):
            module = _Bags(sizes)
            transport = _TableTransport(lt, servers)
            tables = ShardedTables(
                0,
                module,
                transport,
                settings_,
                rank,
                world,
                shards,
                0,
                COPIES,
            )
            opt = _OPTIMIZERS[kind](list(module.parameters()), 0.1)
            workers.append((module, opt, tables))
        ref = _Bags(sizes)
        ref_opt = _OPTIMIZERS[kind](list(ref.parameters()), 0.1)
        for p in ref.parameters():
            p.held = []
        rng = np.random.default_rng(seed)
        for step in range(30):
            lr = 0.1 * min(1.0, (step + 1) / 5) * (1 - step / 40) ** 2  # warm-up, decay
            for module, opt, tables in workers:
                opt.param_groups[0]["lr"] = lr
                batch = _batch(sizes, rng)
                coef = [
                    torch.from_numpy(rng.standard_normal((16, d)).astype(np.float32))
                    for _, d in sizes
                ]
                opt.zero_grad()
                sum((o * c).sum() for o, c in zip(module(batch), coef)).backward()
                tables.before_step(opt)
                opt.step()
                ref.zero_grad()
                sum((o * c).sum() for o, c in zip(ref(batch), coef)).backward()
                for p in ref.parameters():
                    p.held.append(p.grad)
            for *_, tables in workers:
                tables.after_step()
            _ddp_grads(ref, world)
            ref_opt.param_groups[0]["lr"] = lr
            ref_opt.step()
            for rank, (module, _, _) in enumerate(workers):
                for got, want in zip(module.parameters(), ref.parameters()):
                    assert torch.equal(got, want), f"rank {rank}, step {step}"
    finally:
        for *_, tables in workers:
            tables.close()
        lt.stop()
