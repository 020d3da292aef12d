"""Loading a checkpoint mid-run: the loaded parameters replace the shards' slices.

Rank 0 sends its loaded slice (``reseed``); every other worker that loaded waits
until that generation is in (``wait_generation``), so no worker pushes an update
relative to values the shards do not hold.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import numpy as np
import torch

from ray_ps_plugin._codec import as_torch
from ray_ps_plugin._dtypes import model_dtype
from ray_ps_plugin._errors import ShardProtocolError, ShardTimeoutError
from ray_ps_plugin._param.replica import ReplicaLink
from ray_ps_plugin._param.state import ParamState

__all__ = ["Reseeding"]


class _Shard(Protocol):
    """What reseeding needs of the async/ssp shard it is mixed into."""

    shard_index: int
    timeout_s: float
    _bytes_in: int
    _changed: asyncio.Condition
    _link: ReplicaLink

    def _check(self, model: object, rank: object | None, dtype: object = "float32") -> None: ...

    def _model(self, model: int) -> ParamState: ...

    async def _wait_initialised(self, state: ParamState, model: int, rank: int) -> torch.Tensor: ...


class Reseeding:
    """The async/ssp shard's methods for a checkpoint loaded mid-run."""

    async def reseed(self: _Shard, model: int, generation: int, params: np.ndarray) -> None:
        """Replaces the parameters with ones a worker loaded (``load_state_dict``).

        Clocks stay: a load is not an update. Each generation is applied once.

        Raises:
            ShardProtocolError: The slice's dtype or size differs from the shard's
                (a state dict of another model was loaded).
        """
        dtype = model_dtype(params)
        self._check(model, 0, dtype)
        state = self._model(model)
        await self._wait_initialised(state, model, 0)
        assert state.params is not None
        if dtype != state.dtype or params.shape != tuple(state.params.shape):
            raise ShardProtocolError(
                f"shard {self.shard_index}: model {model}: a loaded state dict gives "
                f"{dtype}{list(params.shape)} for a slice of {state.dtype}"
                f"{list(state.params.shape)}; it belongs to another model."
            )
        if generation > state.generation:
            state.params.copy_(as_torch(params))
            state.generation = generation
            self._bytes_in += params.nbytes
            self._link.forward("reseed", model, generation, params)
            async with self._changed:
                self._changed.notify_all()
        await self._link.confirm()

    async def wait_generation(self: _Shard, model: int, rank: int, generation: int) -> None:
        """Waits (bounded) until the parameters of reseed ``generation`` are in."""
        self._check(model, rank)
        state = self._model(model)
        if state.generation >= generation:
            return
        try:
            async with self._changed:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: state.generation >= generation),
                    self.timeout_s,
                )
        except asyncio.TimeoutError:
            raise ShardTimeoutError(
                f"shard {self.shard_index}: model {model}: rank {rank} loaded a state dict "
                f"and waited {self.timeout_s:g}s for rank 0 to load it too. Call "
                "load_state_dict on every worker (or on rank 0 only)."
            ) from None
