"""``PSConfig.nan_policy``: what a step with NaN or Inf gradients does.

``"raise"`` fails the step with an error naming the rank and step; ``"skip"`` drops
the step (the optimizer sees no gradients, so neither parameters nor optimizer state
change) and logs a warning; ``"ignore"`` does nothing, like DDP.

Where the check happens depends on the mode. In sync mode every worker holds the
same summed gradient, so the communication thread checks the sums it receives and
every worker reaches the same decision. In async/ssp mode each worker checks its own
step: with ``"skip"`` its gradients before the optimizer steps (a skipped step must
leave the optimizer's state alone, and pushes an empty delta); with ``"raise"`` the
update the optimizer made, inside the pass that takes it for the push (a NaN or Inf
gradient turns into a NaN or Inf update under every torch optimizer), before
anything reaches the shards. That saves the fast worker a pass over its gradients.
"""

import logging
import threading
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from ray_ps_plugin._errors import PSError
from ray_ps_plugin._types import NanPolicy

__all__ = ["NonFiniteGuard", "all_finite"]

logger = logging.getLogger(__name__)


def all_finite(values: "torch.Tensor | np.ndarray") -> bool:
    """Whether no element is NaN or Inf, in one pass without a mask allocation.

    NaN and Inf propagate through a sum, so checking the sum suffices. 16-bit values
    are summed in fp32, where a sum of finite values cannot overflow (fp16's largest
    value times a billion elements is far below fp32's range). A fp32 or fp64 sum
    overflows only for elements near the top of their range, which only happens once
    training has already diverged.
    """
    if isinstance(values, np.ndarray):
        wide = np.float32 if values.dtype.itemsize < 4 else values.dtype
        return bool(np.isfinite(values.sum(dtype=wide)))
    if values.is_sparse:  # a sparse embedding's gradient: its rows
        values = values._values()
    wide_t = torch.float32 if values.element_size() < 4 else values.dtype
    return bool(torch.isfinite(values.sum(dtype=wide_t)))


class NonFiniteGuard:
    """Applies the policy to one prepared model's optimizer steps.

    Args:
        policy: One of :data:`NAN_POLICIES`.
        rank: This worker's rank, for messages.
        params: The model's trainable parameters.
        check_local: Whether to inspect the local gradients before each step
            (async/ssp); sync mode flags bad sums through :meth:`flag` instead.
    """

    def __init__(
        self, policy: NanPolicy, rank: int, params: Sequence[torch.Tensor], check_local: bool
    ) -> None:
        self.policy = policy
        self._rank = rank
        self._params = list(params)
        self._ids = {id(p) for p in self._params}
        self._check_local = check_local
        # Keyed by the optimizer itself, weakly: an id() could be reused by a new
        # optimizer once the old one is collected.
        self._owned: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()
        self._flagged: int | None = None
        self.skipped = 0

    def owns(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` steps any of this model's trainable parameters."""
        owned = self._owned.get(optimizer)
        if owned is None:
            owned = any(id(p) in self._ids for g in optimizer.param_groups for p in g["params"])
            self._owned[optimizer] = owned
        return owned

    def flag(self, step: int) -> None:
        """Marks ``step``'s summed gradient as non-finite (sync mode, comm thread).

        The flag belongs to that step only: when the optimizer never steps on it
        (e.g. ``torch.amp.GradScaler`` skips a step whose scaled gradients overflowed,
        as it is designed to), the next, finite step is not affected.
        """
        with self._lock:
            self._flagged = step

    def before_step(self, step: int) -> None:
        """Raises or skips if this step's gradients are not finite.

        Args:
            step: The step (sync round or clock) about to be applied.

        Raises:
            PSError: With ``policy="raise"``, if a gradient holds NaN or Inf.
        """
        if self.policy == "ignore":
            return
        with self._lock:
            bad, self._flagged = self._flagged == step, None
        if not bad and self._check_local:
            bad = any(p.grad is not None and not all_finite(p.grad) for p in self._params)
        if not bad:
            return
        where = "summed over all workers" if not self._check_local else "of this worker"
        self._act(step, f"the gradient {where}")

    def check_update(self, step: int, finite: bool) -> None:
        """Raises if this worker's update (its optimizer step) was not finite.

        Async/ssp with ``policy="raise"`` check the update instead of the gradients
        (see the module docstring); the update has not reached any shard yet.

        Raises:
            PSError: If ``finite`` is False.
        """
        if not finite and self.policy == "raise":
            self._act(step, "the update of this worker (its optimizer step)")

    def _act(self, step: int, what: str) -> None:
        if self.policy == "raise":
            raise PSError(
                f"rank {self._rank}: step {step}: {what} holds NaN or Inf "
                "(PSConfig.nan_policy='raise'). Lower the learning rate, clip gradients, "
                "or set nan_policy='skip' to drop such steps."
            )
        for p in self._params:
            p.grad = None  # torch optimizers leave parameters without a gradient alone
        self.skipped += 1
        logger.warning(
            "rank %d: step %d: %s holds NaN or Inf; step skipped "
            "(PSConfig.nan_policy='skip', %d skipped so far).",
            self._rank,
            step,
            what,
            self.skipped,
        )
