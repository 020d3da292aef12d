"""The DiLoCo worker client: H local steps, then one round with the shards.

The user's optimizer is the inner optimizer and steps the worker's own copy,
untouched, for ``local_steps`` (H) steps. After the H-th step the client:

1. takes the change since the global parameters it installed last
   (``delta = params - global``) into the push buffers: straight into the shared
   memory of the shards on its node, into a host buffer for the others;
2. pushes it to every shard (one call per shard, the round number as the clock),
   and waits for the replies: the shards answer with the new global parameters once
   the round is applied (synchronous rounds) or once the slowest worker is at most
   ``staleness`` rounds behind (asynchronous rounds);
3. installs them into the model: the next round starts from them.

By default the transfer does not overlap the inner steps: a worker waits for its
round's reply. ``diloco_overlap=True`` hides it with one round of delay: round
k + 1 trains while round k travels, and at its end the worker installs round k's
answer plus its own progress since, then pushes that progress. It changes the
maths (a round's change is computed from parameters the shards never held, so
``local_steps=1`` with plain averaging is no longer synchronous SGD), which is
why it is opt-in.

In synchronous rounds across nodes a worker hands its change for other nodes'
shards to its node's relay (:mod:`ray_ps_plugin._param.relay`), which sends each
owner one sum for the whole node.

A training function that ends between two rounds sends its last, shorter round
from :meth:`flush` (which the end of the loop calls too), so no local step is lost;
the shards apply a round without the workers that finished.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ray_ps_plugin._client import ClientBase, ClientSetup
from ray_ps_plugin._nonfinite import all_finite
from ray_ps_plugin._param.client import ParamClient
from ray_ps_plugin._param.relay import RoundRelays
from ray_ps_plugin._transport import Handle, Transport

__all__ = ["DilocoClient"]


class DilocoClient(ParamClient):
    """Runs the user's optimizer locally and meets the shards every H steps.

    Args:
        setup: The model, its worker and the run (see :class:`ClientSetup`).
        transport: How calls reach the shards.

    Raises:
        TypeError: If the trainable parameters are not all of one floating dtype.
    """

    def __init__(self, setup: ClientSetup, transport: Transport) -> None:
        super().__init__(setup, transport)
        self._local_steps = setup.settings.local_steps
        self._overlap = setup.settings.diloco_overlap
        # With overlap a round's reply is installed plus this worker's whole local
        # progress since the push (ParamClient's install adds ``delta * _scale``).
        self._scale = 1.0
        self._since_round = 0  # optimizer steps since the global parameters came in
        self._steps = 0
        relays = setup.topology if isinstance(setup.topology, RoundRelays) else None
        self._relay = None if relays is None else relays.relay_of_rank[self.rank]
        self._relayed = setup.remote_shards if self._relay is not None else frozenset()
        if self._relayed:
            # This worker exchanges nothing with other nodes itself: its relay does.
            self.remote_shards = frozenset()

    @property
    def next_step(self) -> int:
        """The optimizer step the next update will complete."""
        return self._steps + 1

    def before_forward(self) -> None:
        """Counts forward passes; the parameters change only at a round's end."""
        ClientBase.before_forward(self)
        self._forwards += 1

    def after_step(self) -> None:
        """Counts one local step; after the H-th, runs a round with the shards."""
        self._steps += 1
        self._since_round += 1
        with self._lock:
            self._stats.steps = self._steps
        if self._since_round >= self._local_steps:
            self._round()
        self._export_metrics()

    @property
    def start_step(self) -> int:
        """A clock counts rounds of ``local_steps`` steps: the step the round this
        worker went on from starts at (the local steps of the round a worker it
        replaces was in are not on the shards, so they are taken again)."""
        return self.step_of(self.start_clock)

    @property
    def loop_step(self) -> int:
        return self.start_step + self._steps

    def step_of(self, clock: int) -> int:
        return clock * self._local_steps

    def flush(self) -> None:
        """Sends the steps taken since the last round as a shorter round and installs
        the result: afterwards the model holds the global parameters.

        In synchronous rounds this is collective: the round is answered once every
        worker has sent its own (at its next H-th step, its own ``flush()`` or the
        end of its loop), so call it on every worker, as the final-checkpoint recipe
        does (``flush()``, barrier, save on rank 0).
        """
        self.raise_pending()
        if self._since_round:
            self._round()
        super().flush()  # with overlap: waits for the last round and installs it

    def sync(self) -> None:
        """Before ``state_dict()``: leaves the parameters as they are.

        A checkpoint holds this worker's parameters: right after a round (every
        ``local_steps`` steps, or after :meth:`flush`) those are the global ones;
        between rounds they hold this worker's local steps since, which pulling the
        shards' copy would throw away. No round is sent: ``state_dict()`` is often
        called on one worker only.
        """
        self.raise_pending()

    def reseed(self) -> None:
        """Hands loaded parameters to the shards; the next round starts from them
        (the local steps before the load are replaced by the loaded values)."""
        self._since_round = 0
        super().reseed()

    def finish(self, clean: bool = True) -> None:
        """Sends the steps taken since the last round (if the loop returned: a
        failed loop sends nothing new), then releases the other workers."""
        if not clean:
            self._since_round = 0
        super().finish(clean)

    def outer_state_dict(self) -> dict[str, Any]:
        """The outer momentum (the whole model's, gathered from every shard; ``None``
        for ``"average"``) and the rounds applied, for a checkpoint."""
        self.raise_pending()
        handles = [
            self._transport.call(s, "outer_state", self.model_id) for s in range(self.num_shards)
        ]
        slices = self._wait(handles, "reading the outer state")
        rounds = min(r for _, r in slices)
        if any(m is None for m, _ in slices):
            return {"momentum": None, "rounds": rounds}
        momentum = torch.from_numpy(np.concatenate([m for m, _ in slices]))
        return {"momentum": momentum, "rounds": rounds}

    def load_outer_state_dict(self, state: dict[str, Any]) -> None:
        """Rank 0 hands a checkpoint's outer state to the shards (the others only
        wait for it), before any round of this run: call it on every worker right
        after ``prepare_model``. A worker that joined live shards (see
        ``ClientSetup.joined``) leaves their newer state as it is.

        Raises:
            ValueError: ``state`` is not what :meth:`outer_state_dict` returns.
        """
        if not isinstance(state, dict) or set(state) != {"momentum", "rounds"}:
            raise ValueError(
                "load_outer_state_dict() takes what outer_state_dict() returned: a dict "
                f"with 'momentum' and 'rounds', got {type(state).__name__}."
            )
        if self.rank != 0 or self.setup.joined:  # live shards keep their newer state
            return
        momentum = state["momentum"]
        flat = None if momentum is None else momentum.detach().to(torch.float32).reshape(-1)
        if flat is not None and flat.numel() != self._bounds[-1]:
            raise ValueError(
                f"the outer state has {flat.numel()} elements for a model of "
                f"{self._bounds[-1]}; it belongs to another model."
            )
        handles = [
            self._transport.call(
                s,
                "load_outer_state",
                self.model_id,
                None if flat is None else flat[a:b].numpy(),
                int(state["rounds"]),
            )
            for s, (a, b) in enumerate(self._slices())
        ]
        self._wait(handles, "loading the outer state")

    def _round(self) -> None:
        """Pushes the change since the last global parameters; installs the new ones
        (with overlap: the previous round's, plus the local steps since)."""
        if self._overlap:
            self._overlapped_round()
            return
        self._since_round = 0
        self._take_delta()
        handles = self._push()
        self._install(self._wait_counted(handles, f"round {self._clock}"), self._clock % 2)
        self._sample_staleness()

    def _overlapped_round(self) -> None:
        """One round of delay: installs the answer to the previous round's push (it
        travelled during this round's local steps) plus the local progress since
        that push, then pushes that progress without waiting for its answer."""
        self._since_round = 0
        # The same pass as async's step: delta = params - base, params = answer +
        # delta, base = params; the answer is in the previous round's output slot.
        self._overlapped_push("round")

    def _push_by_message(self, shard: int, delta: Any, clock: int) -> Handle[Any]:
        """Another node's shard's slice goes to this node's relay, if it has one."""
        if shard not in self._relayed:
            return super()._push_by_message(shard, delta, clock)
        assert self._relay is not None
        return self._transport.call(
            self._relay, "relay_push", self.model_id, self.rank, clock, shard, delta
        )

    def _take_delta(self) -> None:
        """``delta = params - global`` into the push buffers; with
        ``nan_policy="raise"`` a non-finite change raises before the push.

        Raises:
            PSError: The change holds NaN or Inf (``nan_policy="raise"``).
        """
        sums = self._flat.take_delta(self.guard.policy == "raise")
        if sums:
            self.guard.check_update(self.next_step - 1, all_finite(torch.stack(sums)))
