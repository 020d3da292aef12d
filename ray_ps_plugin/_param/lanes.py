"""How an async/ssp worker reaches a shard of its own node: through shared memory.

The worker writes its delta into the shard's input segment and sends a notice (a
frame on the direct path where the run has one, else a Ray call); the shard answers
in an output segment. Where the shard has a replica (``PSConfig.shard_replicas``),
each such call is guarded by the same call by message: when the shard dies, its
replica, on another node, takes the delta and answers by message instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ray_ps_plugin._param.reply import Reply
from ray_ps_plugin._transport import Handle, Transport, local_or_message, mapped

__all__ = ["LaneCalls"]


class LaneCalls:
    """One prepared model's pushes and pulls through shared memory.

    Args:
        transport: Where the shards are.
        model: The prepared model's id on the shards.
        rank: This worker's rank.
        lane_delta: A shard's slice of the delta, taken from its input segment
            and encoded for a message.
        by_message: Sends ``(shard, encoded delta, clock)`` by message.
    """

    def __init__(
        self,
        transport: Transport,
        model: int,
        rank: int,
        lane_delta: Callable[[int], Any],
        by_message: Callable[[int, Any, int], Handle[Any]],
    ) -> None:
        self._transport = transport
        self._model = model
        self._rank = rank
        self._lane_delta = lane_delta
        self._by_message = by_message

    def push(self, shard: int, clock: int, slot: int) -> Handle[Any]:
        """Names the delta left in ``shard``'s input as ``clock``'s update; the
        shard answers in output ``slot``."""
        return local_or_message(
            self._transport,
            shard,
            functools.partial(self._notice, shard, clock, slot),
            # The delta stays in the segment until this push is confirmed.
            lambda: self._by_message(shard, self._lane_delta(shard), clock),
        )

    def pull(self, shard: int, clock: int, slot: int) -> Handle[Any]:
        """Asks ``shard`` for its parameters, as fresh as a worker at ``clock`` may
        train on, into output ``slot``."""
        call = self._transport.call
        return local_or_message(
            self._transport,
            shard,
            functools.partial(call, shard, "pull_local", self._model, self._rank, clock, slot),
            functools.partial(call, shard, "pull", self._model, self._rank, clock),
        )

    def _notice(self, shard: int, clock: int, slot: int) -> Handle[Any]:
        direct = self._transport.direct
        if direct is not None and direct.reaches(shard):
            # A frame on an open socket: a Ray call and its reply cost a worker
            # about a millisecond of CPU on a loaded machine.
            notice = direct.param_local(shard, self._model, self._rank, clock, slot)
            return mapped(notice, Reply.unpack)
        call = self._transport.call
        return call(shard, "push_local", self._model, self._rank, clock, slot)
