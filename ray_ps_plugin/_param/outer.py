"""The DiLoCo outer optimizer of one shard's slice: rounds of changes into parameters.

Every round a worker sends the change its H local steps made to the global
parameters (``delta = local - global``). DiLoCo (Douillard et al., 2023) calls
``-mean(delta)`` the *pseudo-gradient* and steps the global parameters with SGD and
Nesterov momentum on it. Written in terms of the change ``c = mean(delta)`` and the
momentum of changes ``m`` (minus PyTorch's buffer), PyTorch's
``SGD(nesterov=True)`` step is::

    m = mu * m + c
    params += lr * (c + mu * m)

``"average"`` is ``params += lr * c``: with ``lr = 1`` the new global parameters are
the mean of the workers' parameters (local SGD).

Asynchronous rounds apply each worker's change as it arrives. Its plain part,
``lr * delta / W``, goes in at once; the momentum part is delayed (as in Liu et
al.'s delayed Nesterov, arXiv 2401.09135): the arrivals are summed, and after every
W of them the momentum takes their sum as one round's ``c`` and adds
``lr * mu * m``. When the W arrivals are one round of every worker, the result is
exactly the synchronous step above; a stale change moves the parameters by its own
small plain part without being amplified by momentum at once.
"""

from __future__ import annotations

from typing import Any

import torch

from ray_ps_plugin._types import OuterOptimizer

__all__ = ["OuterState"]


class OuterState:
    """The outer optimizer's state of one model's slice on one shard.

    Args:
        numel: Elements of the slice.
        kind: ``"nesterov"`` or ``"average"``.
        lr: The outer learning rate.
        momentum: The outer momentum (``"nesterov"`` only).
        num_workers: W: the weight of one worker's change is ``1 / W``.
    """

    def __init__(
        self, numel: int, kind: OuterOptimizer, lr: float, momentum: float, num_workers: int
    ) -> None:
        self.kind = kind
        self.lr = lr
        self.mu = momentum
        self.num_workers = num_workers
        # Sums in fp32 at least (16-bit models keep fp32 masters on the shard too).
        self._sum = torch.zeros(numel, dtype=torch.float32)
        self._count = 0  # changes in ``_sum``
        self._m = torch.zeros(numel, dtype=torch.float32) if kind == "nesterov" else None
        self.rounds = 0  # rounds (or, async, groups of W arrivals) applied
        self.collecting = 0  # synchronous rounds: the clock of the round in ``_sum``

    @property
    def momentum(self) -> torch.Tensor | None:
        """The momentum of changes (``"nesterov"``), or ``None`` (``"average"``)."""
        return self._m

    def load(self, momentum: torch.Tensor | None, rounds: int) -> None:
        """Restores the momentum and round count of a checkpoint.

        Raises:
            ValueError: The momentum's size differs from the slice's, or only one of
                the two states has a momentum (another outer optimizer).
        """
        if (momentum is None) != (self._m is None):
            raise ValueError(
                f"the checkpoint's outer state {'has no' if momentum is None else 'has a'} "
                f"momentum, but outer_optimizer={self.kind!r} "
                f"{'keeps one' if self._m is not None else 'keeps none'}."
            )
        if momentum is not None and self._m is not None:
            if momentum.numel() != self._m.numel():
                raise ValueError(
                    f"the checkpoint's outer momentum has {momentum.numel()} elements for "
                    f"a slice of {self._m.numel()}: it belongs to another model or shard "
                    "count."
                )
            self._m.copy_(momentum)
        self.rounds = rounds

    def export(self) -> dict[str, Any]:
        """Everything a later group's shard needs to go on: the momentum, the rounds
        applied, and a round being collected (its sum so far)."""
        return {
            "momentum": None if self._m is None else self._m.clone(),
            "rounds": self.rounds,
            "collecting": self.collecting,
            "sum": self._sum.clone(),
            "count": self._count,
        }

    def import_(self, exported: dict[str, Any]) -> None:
        """Takes what :meth:`export` gave (the same slice)."""
        self.load(exported["momentum"], exported["rounds"])
        self.collecting, self._count = exported["collecting"], exported["count"]
        self._sum.copy_(exported["sum"])

    @property
    def pending(self) -> int:
        """Changes received and not yet turned into a round."""
        return self._count

    def add(self, delta: torch.Tensor, clock: int, count: int = 1) -> None:
        """Synchronous rounds: keeps the change of round ``clock`` of one worker (or the
        sum of ``count`` workers' changes, from a node's relay) for :meth:`close_round`."""
        self.collecting = clock
        self._sum.add_(delta)
        self._count += count

    def close_round(self, params: torch.Tensor) -> None:
        """Synchronous rounds: applies the mean of the changes received (a worker
        that finished without sending this round does not count)."""
        if not self._count:
            return
        change = self._sum.div_(self._count)
        if self._m is None:
            params.add_(change.to(params.dtype), alpha=self.lr)
        else:
            self._m.mul_(self.mu).add_(change)
            params.add_((change + self.mu * self._m).to(params.dtype), alpha=self.lr)
        self._sum.zero_()
        self._count = 0
        self.rounds += 1

    def apply_arrival(self, params: torch.Tensor, delta: torch.Tensor) -> None:
        """Asynchronous rounds: applies one worker's change as it arrives."""
        share = delta.to(torch.float32) / self.num_workers
        params.add_(share.to(params.dtype), alpha=self.lr)
        if self._m is None:
            self.rounds += 1
            return
        self._sum.add_(share)
        self._count += 1
        if self._count >= self.num_workers:
            self._m.mul_(self.mu).add_(self._sum)
            params.add_(self._m.to(params.dtype), alpha=self.lr * self.mu)
            self._sum.zero_()
            self._count = 0
            self.rounds += 1
