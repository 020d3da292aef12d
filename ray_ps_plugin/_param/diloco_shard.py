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

In synchronous rounds across nodes, a node's first shard may also *relay* its
node's rounds (:mod:`ray_ps_plugin._param.relay`): it sums the node's changes for
another node's shard and sends that shard one message (:meth:`push_pull_many`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import torch

from ray_ps_plugin._errors import ShardProtocolError, ShardTimeoutError
from ray_ps_plugin._param.outer import OuterState
from ray_ps_plugin._param.relay import RelayGroup
from ray_ps_plugin._param.reply import Reply
from ray_ps_plugin._param.shard import ParamShard
from ray_ps_plugin._param.state import ParamState
from ray_ps_plugin._shard import rejoin_clock
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
        compression: The encoding of changes and parameters through the object store.
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
        # As a relay (configure_relay): every shard, this node's workers, and the
        # rounds being summed, by (model, owning shard, round).
        self._peers: list[Any] = []
        self._relayed: frozenset[int] = frozenset()
        self._groups: dict[tuple[int, int, int], RelayGroup] = {}

    def _outer_state(self, model: int, state: ParamState) -> OuterState:
        outer = self._outer.get(model)
        if outer is None:
            assert state.params is not None
            kind, lr, momentum = self._outer_args
            outer = self._outer[model] = OuterState(
                state.params.numel(), kind, lr, momentum, self.num_workers
            )
        return outer

    def _apply(self, model: int, state: ParamState, rank: int, update: torch.Tensor) -> None:
        assert state.params is not None
        outer = self._outer_state(model, state)
        if self.staleness:
            outer.apply_arrival(state.params, update)
        else:
            outer.add(update.to(torch.float32), state.clocks[rank])
            self._close_round(model, state)

    def _close_round(self, model: int, state: ParamState) -> None:
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

    async def admit(self, rank: int) -> None:
        """A worker replaces one that left: it joins the round being collected (the
        rounds went on without it), from the start of that round's steps (see
        ``DilocoClient.start_step``): the lost worker's round in progress is lost,
        and round boundaries stay at the same steps on every worker."""
        self._check(0, rank)
        for state in self._models.values():
            state.finished.discard(rank)
            state.clocks[rank] = rejoin_clock(state.clocks, state.finished, rank, bounded=True)
        self._tables.admit(rank)

    def export_state(self) -> dict[str, Any]:
        """:meth:`ParamShard.export_state` and each model's outer optimizer.

        Synchronous rounds export the last round applied: a round some workers had
        sent and others not is dropped, with those workers' clocks set back. Every
        worker of the next group starts its loop at the same step, so their
        clocks must agree, or one would wait in a round the others reach only
        after a ``report`` it is not at.
        """
        out = super().export_state()
        out["outer"] = {model: outer.export() for model, outer in self._outer.items()}
        if not self.staleness:
            for model, outer in out["outer"].items():
                if outer["count"] and model in out["models"]:
                    closed = outer["collecting"] - 1
                    clocks = out["models"][model]["clocks"]
                    out["models"][model]["clocks"] = [min(c, closed) for c in clocks]
                    outer["sum"].zero_()
                    outer["count"] = 0
        return out

    def import_state(self, exported: dict[str, Any]) -> None:
        """:meth:`ParamShard.import_state` and each model's outer optimizer."""
        super().import_state(exported)
        for model, outer in exported.get("outer", {}).items():
            self._outer_state(model, self._model(model)).import_(outer)

    async def finish(self, model: int, rank: int) -> None:
        """Marks a finished worker; a round it will not send is applied without it
        (and, on a relay, sent on without it)."""
        self._check(model, rank)
        state = self._model(model)
        state.finished.add(rank)
        self._close_round(model, state)
        for key, group in list(self._groups.items()):
            if key[0] == model:
                self._forward_if_complete(key, group, state)
        await super().finish(model, rank)

    # --- node-level aggregation (synchronous rounds) ------------------------------
    def configure_relay(self, peers: list[Any], ranks: list[int]) -> None:
        """Makes this shard its node's relay: ``peers`` are every shard (in shard
        order), ``ranks`` this node's workers."""
        self._peers = list(peers)
        self._relayed = frozenset(ranks)

    async def relay_push(
        self, model: int, rank: int, clock: int, owner: int, delta: np.ndarray
    ) -> Reply:
        """Takes one worker's change of round ``clock`` for shard ``owner``'s slice;
        answers with ``owner``'s reply once the node's sum has been applied there.

        Raises:
            ShardProtocolError: This shard does not relay for ``rank``.
            ShardTimeoutError: The node's other workers do not send, or the owner does
                not answer, within the timeout.
        """
        self._check(model, rank)
        if rank not in self._relayed or not 0 <= owner < len(self._peers):
            raise ShardProtocolError(
                f"shard {self.shard_index}: rank {rank} sent its round to this shard for "
                f"shard {owner}, but this shard relays for ranks {sorted(self._relayed)} "
                f"of {len(self._peers)} shards; the workers' topology differs from the "
                "shards'."
            )
        state = self._model(model)
        with self._queued():
            params = await self._wait_initialised(state, model, rank)
            key = (model, owner, clock)
            group = self._groups.get(key)
            if group is None:
                group = self._groups[key] = RelayGroup()
                group.answer = asyncio.get_running_loop().create_future()
                # Waiters that timed out are gone; the failure is theirs, not a leak.
                group.answer.add_done_callback(lambda f: f.cancelled() or f.exception())
            group.add(rank, self._codec.decode(delta, params.dtype))
            self._bytes_in += delta.nbytes
            self._forward_if_complete(key, group, state)
            try:
                reply: Reply = await group.wait(self.timeout_s)
            except TimeoutError:
                if group.answer is not None and group.answer.done():
                    raise  # the owner's failure (its own timeout), as the relay got it
                if group.forward is not None:  # the node's sum left: the owner is late
                    raise self._owner_late(key) from None
                # Named when the wait ends: workers that arrived meanwhile are not missing.
                missing = sorted(self._relayed - state.finished - set(group.ranks))
                raise ShardTimeoutError(
                    f"shard {self.shard_index}: model {model}: relaying round {clock} to "
                    f"shard {owner} waited {self.timeout_s:g}s (workers of this node that "
                    f"had not sent their change: {missing}); a worker or the owning shard "
                    "is stuck or dead. Raise PSConfig.ps_timeout_s if rounds are "
                    "legitimately slower."
                ) from None
            return reply

    def _forward_if_complete(
        self, key: tuple[int, int, int], group: RelayGroup, state: ParamState
    ) -> None:
        """Sends the node's sum on once every worker of the node still training is in."""
        if group.forward is not None or not self._relayed - state.finished <= set(group.ranks):
            return
        group.forward = asyncio.get_running_loop().create_task(
            self._forward(key, group, state.dtype)
        )

    async def _forward(self, key: tuple[int, int, int], group: RelayGroup, dtype: str) -> None:
        model, owner, clock = key
        assert group.total is not None and group.answer is not None
        try:
            # Quantized rounds: the relay keeps the error of its node's sum per owner.
            total = self._codec.encode_np(group.total.numpy(), dtype, key=(model, owner))
            self._bytes_out += total.nbytes
            call = self._peers[owner].push_pull_many.remote(
                model, sorted(group.ranks), clock, total
            )
            group.answer.set_result(await asyncio.wait_for(call, self.timeout_s))
        except asyncio.TimeoutError:
            group.answer.set_exception(self._owner_late(key))
        except Exception as e:  # every waiter of the node gets the owner's failure
            group.answer.set_exception(e)
        finally:
            self._groups.pop(key, None)

    def _owner_late(self, key: tuple[int, int, int]) -> ShardTimeoutError:
        """The error of a relayed round whose owner did not answer in time: the
        forward's own, and the waiters' when their timer (started first) ends first."""
        model, owner, clock = key
        return ShardTimeoutError(
            f"shard {self.shard_index}: model {model}: relaying round {clock}: shard "
            f"{owner} did not answer within {self.timeout_s:g}s"
        )

    async def push_pull_many(
        self, model: int, ranks: list[int], clock: int, total: np.ndarray
    ) -> Reply:
        """:meth:`push_pull` for the sum of several workers' changes of round
        ``clock``, sent by their node's relay.

        Raises:
            ShardProtocolError: The ranks' clocks disagree with ``clock`` (a round
                missing or partly applied) or the slice's size differs.
        """
        for rank in ranks:
            self._check(model, rank)
        state = self._model(model)
        with self._queued():
            params = await self._wait_initialised(state, model, ranks[0])
            last = [state.clocks[r] for r in ranks]
            if all(c >= clock for c in last):
                self._duplicates += 1
            elif all(c == clock - 1 for c in last):
                values = self._codec.decode(total, params.dtype)
                self._check_slice(model, "a relay", values, params)
                for rank in ranks:
                    state.clocks[rank] = clock
                outer = self._outer_state(model, state)
                outer.add(values.to(torch.float32), clock, count=len(ranks))
                self._close_round(model, state)
                self._serve_waiting(model, state)
                self._pushes += len(ranks)
                self._bytes_in += total.nbytes
            else:
                raise ShardProtocolError(
                    f"shard {self.shard_index}: model {model}: a relay pushed round {clock} "
                    f"of ranks {ranks}, whose last rounds here are {last}."
                )
            return await self._read(state, model, ranks[0], clock)

    def stats(self) -> dict[str, object]:
        """The parameter shard's counters plus the rounds each model applied."""
        return {**super().stats(), "rounds": {m: o.rounds for m, o in self._outer.items()}}
