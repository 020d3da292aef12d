"""A shard's state held twice: the primary forwards each change, the replica replays it.

With ``PSConfig(shard_replicas=1)`` every async/ssp shard (the *primary*) has a
*replica*: a shard actor of the same slice, on another node where there is one. The
primary forwards every change it makes to its state (the initial parameters, each
applied update, a reseed, a worker that finishes, leaves or is admitted), so both
hold it (ps-lite's chain replication, with a chain of two).

When a change is confirmed: every change but a worker's update is answered only
once the replica holds it. A worker's update is confirmed *one push late*: the
primary answers push ``k`` once the replica holds that worker's push ``k - 1``,
and the worker keeps its update ``k`` until the answer to ``k + 1`` (or a finish)
says the replica holds it too. So the replica's copy and apply overlap the
worker's next step instead of lengthening this one, and still no update a worker
pushed is held by one actor only: when the primary dies, the worker sends the
update it keeps to the replica before anything else (:meth:`Replicated.push_held`;
a repeat is ignored by its clock). What a loss can drop is the update ``k`` of a
worker that dies *together with* the primary (a worker beside its shard on one
node): other workers may have read parameters holding it, and the worker that
replaces it goes on from clock ``k - 1`` and does step ``k`` again, as after any
push lost in flight.

Order: the primary numbers what it forwards, in the order it applied it, and the
replica replays in that order (Ray does not order calls to an asyncio actor, and
changes go as Ray calls until the frames' connection is open), so the two hold
bit-identical parameters, not merely the same sum in another order.

How a change travels: as a frame on the direct path (:mod:`.replay_channel`) or a
Ray call; an update to a replica on the primary's node as its place in shared
memory (:mod:`.replica_slots`).

Failover: when the primary dies, each worker's transport confirms the death, tells
the replica it now serves the slice (:meth:`ReplayOrder.promote`) and sends it the
calls the dead primary never answered. A replay still waiting for its turn then is
dropped: it was never confirmed, so its worker sends that update again, and each
update is applied once by its clock.

A replica that fails or does not answer within ``timeout_s`` is killed and the
primary goes on alone (logged): a worker must never fail over to a replica that
missed updates.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import sys
from collections.abc import Hashable
from typing import Any

import numpy as np
import torch

from ray_ps_plugin._errors import ShardProtocolError
from ray_ps_plugin._param.replay_channel import ReplayChannel, decode_call
from ray_ps_plugin._param.replica_slots import (
    SlotReader,
    SlotRef,
    Slots,
    dtype_name,
    make_slots,
)
from ray_ps_plugin._param.state import ParamState
from ray_ps_plugin._shm import SegmentHandle
from ray_ps_plugin._wire.frames import Frame

__all__ = ["REPLAYED", "ReplayOrder", "ReplicaLink", "Replicated"]

logger = logging.getLogger(__name__)

#: The shard methods a primary forwards and a replica replays.
REPLAYED = frozenset(
    {
        "init",
        "mirror",
        "mirror_shared",
        "map_input",
        "reseed",
        "finish",
        "leave",
        "admit",
        "restore",
    }
)


async def _result(ref: Any) -> Any:
    """Awaits a Ray call's result or a frame's answer."""
    if isinstance(ref, concurrent.futures.Future):
        return await asyncio.wrap_future(ref)
    return await ref


def _future(ref: Any) -> concurrent.futures.Future[Any]:
    return ref if isinstance(ref, concurrent.futures.Future) else ref.future()


def _held(slots: Slots, seq: int, replayed: concurrent.futures.Future[Any]) -> None:
    if replayed.exception() is None:
        slots.confirmed(seq)


class ReplicaLink:
    """The primary's side: forwards changes in order, confirms them before answering.

    Args:
        shard_index: The shard's index, for messages.
        timeout_s: How long a forwarded change may take to be confirmed.
        num_workers: The run's workers (how many updates can be unconfirmed).
    """

    def __init__(self, shard_index: int, timeout_s: float, num_workers: int = 1) -> None:
        self.shard_index = shard_index
        self.timeout_s = timeout_s
        self.num_workers = num_workers
        self.replica: Any = None
        self.same_node = False  # the replica reads this node's shared memory
        self._slots: Slots | None = None  # a replica on this node: shared memory
        self._channel: ReplayChannel | None = None  # frames instead of Ray calls
        # Numbers grow over replicas (a push may wait for a number taken before a
        # new replica was attached); each replica is sent them counted from 1.
        self._seq = 0
        self._base = 0  # the last number before the current replica's first
        self._pending: dict[int, Any] = {}  # unconfirmed forwards, in number order
        self._latest: dict[Hashable, int] = {}  # each update key's last number

    def attach(self, replica: Any, same_node: bool = False, direct: bool = False) -> None:
        """From now on every change is forwarded to ``replica`` (an actor handle,
        on this node if ``same_node``), which counts them from 1: as frames on the
        direct path once it is open if ``direct`` (see :mod:`.replay_channel`)."""
        self._close_slots()
        self.replica = replica
        self._channel = ReplayChannel(replica, self.shard_index, self.timeout_s) if direct else None
        self.same_node = same_node
        self._base = self._seq
        self._pending.clear()
        self._slots = make_slots(same_node, self.num_workers)

    def forward_update(
        self,
        model: int,
        rank: int,
        clock: int,
        values: torch.Tensor,
        shared: SlotRef | None = None,
    ) -> None:
        """Forwards ``rank``'s update of ``clock`` as applied (``values``, in the
        dtype the shard computes in). A replica on this node reads it where it
        lies (``shared``: the worker's input, when it holds ``values`` exactly),
        else from a shared-memory slot if one is free; otherwise it goes by value."""
        if self.replica is None:
            return
        if shared is not None and self.same_node and shared.dtype == dtype_name(values.dtype):
            self.forward("mirror_shared", model, rank, clock, shared, key=(model, rank))
            return
        ref = self._slots.put(model, values, self._seq + 1) if self._slots else None
        if ref is None:
            self.forward("mirror", model, rank, clock, values.numpy(), key=(model, rank))
        else:
            self.forward("mirror_shared", model, rank, clock, ref, key=(model, rank))

    def forward(self, method: str, *args: Any, key: Hashable = None) -> None:
        """Submits ``method(*args)`` to the replica, numbered after the last one;
        ``key`` (a model and rank) names an update :meth:`latest` finds again.

        Called right where the change is made, with no ``await`` in between, so the
        numbers follow the order the primary applied the changes in. Ray serialises
        the arguments here: a shared-memory view may be passed.
        """
        if self.replica is None:
            return
        assert method in REPLAYED, method
        self._seq += 1
        number = self._seq - self._base
        ref = self._channel.submit(number, method, args) if self._channel else None
        if ref is None:
            ref = self.replica.replay.remote(number, method, args)
        self._pending[self._seq] = ref
        if key is not None:
            self._latest[key] = self._seq
        if self._slots is not None:  # a slot is free again once its change is held
            _future(ref).add_done_callback(functools.partial(_held, self._slots, self._seq))

    def map_inputs(self, *handles: SegmentHandle) -> None:
        """Has a replica on this node map workers' input segments now, while the
        workers are surely alive (see :meth:`SlotReader.open`)."""
        if self.replica is not None and self.same_node:
            for handle in handles:
                self.forward("map_input", handle)

    def latest(self, key: Hashable) -> int:
        """The number of the last change forwarded under ``key`` (0: none)."""
        return self._latest.get(key, 0)

    async def confirm(self, through: int | None = None) -> None:
        """Waits until the replica holds every change forwarded so far, or (with
        ``through``) every change numbered up to ``through``."""
        if self.replica is None or not self._pending:
            return
        last = self._seq if through is None else through
        ref = self._pending.get(last)
        if ref is None:
            return  # confirmed already, or made before this replica (its snapshot)
        try:
            await asyncio.wait_for(_result(ref), self.timeout_s)
        except Exception as e:
            self._drop(e)
            return
        # The replica replays in number order: every earlier change is held too.
        for seq in [s for s in self._pending if s <= last]:
            del self._pending[seq]

    def _close_slots(self) -> None:
        """Releases the slots and the channel of the replica forwarded to so far."""
        slots, self._slots = self._slots, None
        if slots is not None:
            slots.close()
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()

    def _drop(self, error: BaseException) -> None:
        replica, self.replica = self.replica, None
        self._pending.clear()
        self._close_slots()
        if replica is None:
            return
        logger.warning(
            "shard %d: its replica failed or did not confirm an update within %gs "
            "(%r); it goes on without one, so its node's loss would lose its slice.",
            self.shard_index,
            self.timeout_s,
            error,
        )
        # A live replica that missed an update must not take over later. Only an
        # actor is killed: ray.kill on anything else would first start Ray here.
        try:
            import ray
            from ray.actor import ActorHandle

            if isinstance(replica, ActorHandle):
                ray.kill(replica, no_restart=True)
        except Exception:
            logger.debug("shard %d: killing its replica", self.shard_index, exc_info=True)


#: How many nice levels below the workers beside it a replica replays (Linux; 19
#: is the lowest priority): its work has a step of slack (confirmed one push late),
#: so it yields the cores to training and fills the time they would idle.
REPLICA_NICE = 10


def _in_actor() -> bool:
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


class _Background:
    """The replica's event-loop thread at background CPU priority until promoted.

    Linux gives each thread its own nice level (``setpriority`` on ``PRIO_PROCESS``
    0 is the calling thread), and threads it starts later inherit it: the replays
    and the connection that carries them, not Ray's own threads.
    """

    def __init__(self, shard_index: int, enabled: bool | None = None) -> None:
        self._shard_index = shard_index
        self._enabled = enabled  # None: in a Ray actor only (not a test's thread)
        self._before: int | None = None

    def lower(self) -> None:
        if self._enabled is None:
            self._enabled = _in_actor()
        if self._before is not None or not self._enabled or not sys.platform.startswith("linux"):
            return
        try:
            self._before = os.getpriority(os.PRIO_PROCESS, 0)
            os.setpriority(os.PRIO_PROCESS, 0, min(19, self._before + REPLICA_NICE))
        except OSError as e:
            logger.debug("shard %d: replica at normal priority (%s)", self._shard_index, e)

    def restore(self) -> None:
        before, self._before = self._before, None
        if before is None:
            return
        try:
            os.setpriority(os.PRIO_PROCESS, 0, before)
        except OSError as e:  # raising a priority needs CAP_SYS_NICE (or RLIMIT_NICE)
            logger.warning(
                "shard %d: the promoted replica keeps its background CPU priority (nice +%d): %s.",
                self._shard_index,
                REPLICA_NICE,
                e,
            )


class ReplayOrder:
    """The replica's side: lets forwarded changes through in the primary's order,
    at background CPU priority until promoted.

    Args:
        shard_index: The shard's index, for messages.
        timeout_s: How long a change waits for the ones numbered before it.
        background: Whether replays lower the thread's priority (``None``: only in
            a Ray actor).
    """

    def __init__(self, shard_index: int, timeout_s: float, background: bool | None = None) -> None:
        self.shard_index = shard_index
        self.timeout_s = timeout_s
        self.promoted = False
        self._applied = 0
        self._turn = asyncio.Condition()
        self._background = _Background(shard_index, background)

    async def turn(self, seq: int) -> bool:
        """Waits until every change numbered before ``seq`` is replayed; False when
        this replica was promoted meanwhile (the change is dropped: see the module
        docstring).

        Raises:
            TimeoutError: An earlier change did not arrive within ``timeout_s``.
        """
        if not self.promoted:
            self._background.lower()
        async with self._turn:
            await asyncio.wait_for(
                self._turn.wait_for(lambda: self.promoted or self._applied == seq - 1),
                self.timeout_s,
            )
        return not self.promoted

    async def done(self, seq: int) -> None:
        """Change ``seq`` is replayed: the next one may go."""
        async with self._turn:
            self._applied = seq
            self._turn.notify_all()

    async def promote(self) -> bool:
        """This replica serves its slice from now on (its primary is dead); returns
        whether it already did."""
        async with self._turn:
            already, self.promoted = self.promoted, True
            self._turn.notify_all()
        if not already:
            self._background.restore()
            logger.warning(
                "shard %d: its primary is lost; its replica serves the slice now.",
                self.shard_index,
            )
        return already


class Replicated:
    """The replication methods of a shard actor (mixed into the async/ssp shard).

    A shard is a primary (:meth:`set_replica` gave it a replica), a replica (its
    primary calls :meth:`replay`), or alone; a promoted replica serves as a shard
    alone.
    """

    _link: ReplicaLink
    _order: ReplayOrder
    _models: dict[int, ParamState]
    _slot_reader: SlotReader | None = None

    def set_replica(self, replica: Any, same_node: bool = False, direct: bool = False) -> None:
        """Makes this shard a primary: every change is held by ``replica`` too
        (on this node if ``same_node``: updates then go through shared memory;
        as frames on the direct path if ``direct``)."""
        self._link.attach(replica, same_node, direct)

    async def add_replica(
        self, replica: Any, same_node: bool = False, direct: bool = False
    ) -> None:
        """:meth:`set_replica` with a fresh shard of this slice: a snapshot now, then
        every later change, in order (no ``await`` between the snapshot and its
        forwarding, so no change falls in between)."""
        self._link.attach(replica, same_node, direct)
        self._link.forward("restore", self.export_state())
        self._link.map_inputs(*(h for m in self._models.values() for h in m.input_handles()))
        await self._link.confirm()

    def export_state(self) -> dict[str, Any]:
        """The shard's state, as a new replica's snapshot (the shard's own method)."""
        raise NotImplementedError

    async def mirror(self, model: int, rank: int, clock: int, update: np.ndarray) -> None:
        """Takes an update its primary applied (the shard's own method)."""
        raise NotImplementedError

    async def mirror_shared(self, model: int, rank: int, clock: int, ref: SlotRef) -> None:
        """:meth:`mirror` of an update its primary left in a shared-memory slot."""
        if self._slot_reader is None:
            self._slot_reader = SlotReader()
        await self.mirror(model, rank, clock, self._slot_reader.values(ref))

    async def map_input(self, handle: SegmentHandle) -> None:
        """Maps a worker's input segment (a replayed change: see
        :meth:`ReplicaLink.map_input`); a worker that is gone already is only
        logged, as it sends nothing more to read there."""
        if self._slot_reader is None:
            self._slot_reader = SlotReader()
        try:
            self._slot_reader.open(handle)
        except OSError as e:
            logger.debug("a worker's input is gone before its replica mapped it: %s", e)

    async def promote(self) -> bool:
        """Makes this replica serve its slice (see :meth:`ReplayOrder.promote`)."""
        return await self._order.promote()

    async def replay_frame(self, frame: Frame, payload: np.ndarray) -> np.ndarray:
        """:meth:`replay` of a change that came as a frame (see :mod:`.replay_channel`)."""
        method, args = decode_call(payload)
        await self.replay(frame.step, method, args)
        return np.empty(0, np.uint8)

    async def replay(self, seq: int, method: str, args: tuple[Any, ...]) -> None:
        """Replays change ``seq`` of the primary, after every change before it.

        Raises:
            ShardProtocolError: ``method`` is not one a primary forwards.
        """
        if method not in REPLAYED:
            raise ShardProtocolError(f"a replica replays {sorted(REPLAYED)}, not {method!r}.")
        if not await self._order.turn(seq):
            return
        try:
            await getattr(self, method)(*args)
        finally:
            await self._order.done(seq)
