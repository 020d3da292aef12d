"""NonFiniteGuard: raise, skip and ignore; and the bfloat16 check."""

import logging

import pytest
import torch

from ray_ps_plugin._ddp import check_supported
from ray_ps_plugin._errors import PSError
from ray_ps_plugin._nonfinite import NonFiniteGuard


def _model_with_grads(bad: bool):
    m = torch.nn.Linear(3, 2)
    m.weight.grad = torch.ones(2, 3)
    m.bias.grad = torch.tensor([float("nan") if bad else 0.0, 1.0])
    return m


def test_raise_names_rank_step_and_the_fix():
    m = _model_with_grads(bad=True)
    guard = NonFiniteGuard("raise", 3, list(m.parameters()), check_local=True)
    with pytest.raises(PSError, match=r"rank 3: step 7: .* NaN or Inf .*nan_policy='skip'"):
        guard.before_step(7)


def test_skip_drops_the_gradients_so_the_optimizer_changes_nothing(caplog):
    m = _model_with_grads(bad=True)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    before = [p.detach().clone() for p in m.parameters()]
    guard = NonFiniteGuard("skip", 0, list(m.parameters()), check_local=True)
    with caplog.at_level(logging.WARNING):
        guard.before_step(1)
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    assert opt.state_dict()["state"] == {}  # no Adam moments polluted
    assert guard.skipped == 1 and "step skipped" in caplog.text


def test_finite_gradients_pass_and_ignore_never_checks():
    fine = _model_with_grads(False)
    guard = NonFiniteGuard("raise", 0, list(fine.parameters()), True)
    guard.before_step(1)
    assert guard.skipped == 0 and fine.bias.grad is not None
    bad = _model_with_grads(True)
    ignoring = NonFiniteGuard("ignore", 0, list(bad.parameters()), True)
    ignoring.flag(1)
    ignoring.before_step(1)
    # Nothing dropped: the NaN gradient reaches the optimizer, as under DDP.
    assert ignoring.skipped == 0 and torch.isnan(bad.bias.grad).any()


def test_sync_mode_acts_on_the_flag_from_the_comm_thread():
    m = _model_with_grads(bad=False)  # local gradients fine; the sum was not
    guard = NonFiniteGuard("raise", 0, list(m.parameters()), check_local=False)
    guard.before_step(1)
    guard.flag(2)
    with pytest.raises(PSError, match="summed over all workers"):
        guard.before_step(2)
    guard.before_step(3)  # the flag is consumed


def test_a_flag_belongs_to_its_step_only():
    """GradScaler skips optimizer.step() on an overflowed step: its flag must not
    fail or drop the next, finite step."""
    m = _model_with_grads(bad=False)
    for policy in ("raise", "skip"):
        guard = NonFiniteGuard(policy, 0, list(m.parameters()), check_local=False)
        guard.flag(4)  # the sum of step 4 overflowed; the optimizer never stepped on it
        guard.before_step(5)
        assert guard.skipped == 0 and m.weight.grad is not None


def test_owns_only_optimizers_of_its_parameters():
    m = torch.nn.Linear(2, 2)
    guard = NonFiniteGuard("raise", 0, list(m.parameters()), check_local=True)
    assert guard.owns(torch.optim.SGD(m.parameters(), lr=1))
    assert not guard.owns(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1))


def test_bfloat16_parameters_pass_except_with_fp16_compression():
    model = torch.nn.Sequential(torch.nn.Linear(4, 2)).to(torch.bfloat16)
    check_supported(model)
    check_supported(model, "bf16")
    with pytest.raises(ValueError, match=r"\['0.weight', '0.bias'\] are bfloat16.*'bf16'"):
        check_supported(model, "fp16")
    model[0].requires_grad_(False)  # frozen bf16 layers are not synchronised: fine
    check_supported(model, "fp16")


def test_all_finite_sees_nan_and_inf_in_tensors_and_arrays():
    from ray_ps_plugin._nonfinite import all_finite

    big = torch.full((1000,), 60000.0, dtype=torch.float16)  # sums past fp16's max
    assert all_finite(big) and all_finite(big.numpy())
    x = torch.zeros(1000)
    assert all_finite(x) and all_finite(x.numpy())
    x[500] = float("inf")
    assert not all_finite(x) and not all_finite(x.numpy())
    x[500], x[3] = 0.0, float("nan")
    assert not all_finite(x) and not all_finite(x.numpy())
