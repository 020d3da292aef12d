"""The DiLoCo shard: a parameter shard whose updates are rounds of local steps.

It is the async/ssp shard (:class:`~ray_ps_plugin._param.shard.ParamShard`) with
another rule for applying what arrives. A worker's clock counts its *rounds*; each
push carries the change its H local steps made since the global parameters it
installed last, and the outer optimizer (:mod:`ray_ps_plugin._param.outer`) turns
those changes into the next global parameters:

- synchronous rounds (staleness 0): the changes of round k are summed; when every
  unfinished worker has sent its round k, the mean goes through the outer step, and
  only then is any push of round k answered;
- asynchronous rounds (staleness s >= 1): each change is applied as it arrives, a
  push of round k is answered once every worker has reached round k - s.
"""

from __future__ import annotations

import numpy as np
import torch

from ray_ps_plugin._errors import ShardProtocolError
from ray_ps_plugin._param.outer import OuterState
from ray_ps_plugin._param.shard import ParamShard, _ParamState
from ray_ps_plugin._types import Compression, OuterOptimizer

__all__ = ["DilocoShard"]


class DilocoShard(ParamShard):
    """Owns one slice of each model's global parameters and its outer optimizer.

    Args:
        shard_index: This shard's index, used in error messages.
        num_workers: Number of workers pushing rounds.
        staleness: 0 for synchronous rounds, else the largest round gap a reply may
            have (asynchronous rounds).
        timeout_s: How long a reply waits for slow workers before it fails.
        compression: Wire format of changes and parameters through the object store.
        outer_optimizer: ``"nesterov"`` or ``"average"``.
        outer_lr: The outer learning rate.
        outer_momentum: The outer momentum (``"nesterov"``).
    """

    def __init__(
        self,
        shard_index: int,
        num_workers: int,
        staleness: int,
        timeout_s: float,
        compression: Compression | None,
        outer_optimizer: OuterOptimizer,
        outer_lr: float,
        outer_momentum: float,
    ) -> None:
        super().__init__(shard_index, num_workers, staleness, timeout_s, compression)
        self._outer_args = (outer_optimizer, outer_lr, outer_momentum)
        self._outer: dict[int, OuterState] = {}

    def _outer_state(self, model: int, state: _ParamState) -> OuterState:
        outer = self._outer.get(model)
        if outer is None:
            assert state.params is not None
            kind, lr, momentum = self._outer_args
            outer = self._outer[model] = OuterState(
                state.params.numel(), kind, lr, momentum, self.num_workers
            )
        return outer

    def _apply(self, model: int, state: _ParamState, rank: int, update: torch.Tensor) -> None:
        assert state.params is not None
        outer = self._outer_state(model, state)
        if self.staleness:
            outer.apply_arrival(state.params, update)
        else:
            outer.add(update.to(torch.float32), state.clocks[rank])
            self._close_round(model, state)

    def _close_round(self, model: int, state: _ParamState) -> None:
        """Synchronous rounds: applies the round once every unfinished worker sent it.

        Called in the same event-loop turn that counts a push (before the waiting
        replies are woken), so a reply of round k never sees the parameters of
        round k - 1.
        """
        outer = self._outer.get(model)
        if self.staleness or outer is None or not outer.pending:
            return
        if state.slowest() >= outer.collecting:
            assert state.params is not None
            outer.close_round(state.params)

    async def outer_state(self, model: int) -> tuple[np.ndarray | None, int]:
        """This slice's outer momentum (fp32; ``None`` for ``"average"``) and the
        rounds applied, for a checkpoint."""
        self._check(model, 0)
        state = self._model(model)
        await self._wait_initialised(state, model, 0)
        outer = self._outer_state(model, state)
        m = outer.momentum
        return (None if m is None else m.numpy().copy()), outer.rounds

    async def load_outer_state(self, model: int, momentum: np.ndarray | None, rounds: int) -> None:
        """Restores this slice's outer momentum and round count from a checkpoint.

        Raises:
            ShardProtocolError: The state does not fit this slice (see
                :meth:`OuterState.load`).
        """
        self._check(model, 0)
        state = self._model(model)
        await self._wait_initialised(state, model, 0)
        try:
            self._outer_state(model, state).load(
                None if momentum is None else torch.from_numpy(momentum), rounds
            )
        except ValueError as e:
            raise ShardProtocolError(f"shard {self.shard_index}: model {model}: {e}") from None

    async def finish(self, model: int, rank: int) -> None:
        """Marks a finished worker; a round it will not send is applied without it."""
        self._check(model, rank)
        state = self._model(model)
        state.finished.add(rank)
        self._close_round(model, state)
        await super().finish(model, rank)

    def stats(self) -> dict[str, object]:
        """The parameter shard's counters plus the rounds each model applied."""
        return {**super().stats(), "rounds": {m: o.rounds for m, o in self._outer.items()}}
