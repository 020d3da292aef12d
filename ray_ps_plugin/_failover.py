"""A worker's side of replication: when a shard dies, its replica takes its calls.

With ``PSConfig(shard_replicas=1)`` every call a worker makes to a shard is
guarded: if it fails and the shard is *confirmed* dead, the replica is promoted
(it stops replaying the dead primary's unconfirmed changes) and the call is made
again there. Every call a worker makes may be made twice: a push is applied once
by its clock, a pull or an init changes nothing the second time. The promotion is
per worker process and idempotent on the replica, so whichever worker notices
first, all end up on the replica.

A call is guarded against the actor it was made to, read once by the caller: a
promotion by another thread between the call and its guard must neither leave the
call unguarded (its failure would end the run while a live replica serves the
shard) nor blame the replica for the old primary's death. Actors are told apart by
their id (handles compare so), not by the handle object: the controller hands a
worker new handle objects for the same actors.

A worker's update is confirmed by its primary one push late (see
:mod:`ray_ps_plugin._param.replica`): through :meth:`Failover.hold` the client
keeps the last update each shard answered until the next answer, and a new server
of the shard is sent the held updates before it serves any call of this process.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from ray_ps_plugin._ray_compat import ping_actor

__all__ = ["Failover"]

logger = logging.getLogger(__name__)

_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_RETRY_S = 0.5  # between pings of a shard Ray calls unavailable


class Failover:
    """Guards calls to replicated shards and promotes replicas of dead ones.

    Args:
        servers: The shard handles calls go to, in shard order; a promoted
            replica replaces its primary in this list (shared with the caller).
        replicas: Each shard's replica, or empty.
        timeout_s: Bound on confirming a death and on a promotion.
    """

    def __init__(self, servers: list[Any], replicas: Sequence[Any], timeout_s: float) -> None:
        self._servers = servers
        self._first = list(servers)  # the shards the worker attached shared memory to
        self._replicas = {s: r for s, r in enumerate(replicas) if r is not None}
        # A run with replicas guards every call, even to a shard without one now:
        # the controller may give it a new replica while the call is in flight.
        self._replicated = bool(self._replicas)
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        # shard -> sender -> sends the held update to a given actor.
        self._held: dict[int, dict[Hashable, tuple[str, tuple[Any, ...]]]] = {}

    def moved(self, shard: int) -> bool:
        """Whether another actor than the first serves ``shard`` now."""
        return not _same(self._servers[shard], self._first[shard])

    @property
    def num_shards(self) -> int:
        return len(self._servers)

    def server(self, shard: int) -> Any:
        """The actor that serves ``shard`` now."""
        return self._servers[shard]

    def first(self, shard: int) -> Any:
        """The actor ``shard`` started on (the one a worker shares memory with)."""
        return self._first[shard]

    def replica(self, shard: int) -> Any:
        """``shard``'s replica, or ``None`` (never had one, or it was promoted)."""
        return self._replicas.get(shard)

    def hold(self, shard: int, key: Hashable, call: tuple[str, tuple[Any, ...]] | None) -> None:
        """Keeps ``call`` (a method of a shard and its arguments: it sends an
        update ``shard`` answered but its replica may not hold yet) until the next
        ``hold`` of ``key``; ``None`` holds nothing."""
        with self._lock:
            held = self._held.setdefault(shard, {})
            if call is None:
                held.pop(key, None)
            else:
                held[key] = call

    def set_shard(self, shard: int, primary: Any, replica: Any) -> None:
        """Who serves ``shard`` now and its new replica (the controller made it)."""
        with self._lock:
            if not _same(self._servers[shard], primary):
                self._send_held(shard, primary)
                self._servers[shard] = primary
            self._replicas[shard] = replica
            self._replicated = True

    def guard(
        self,
        shard: int,
        target: Any,
        handle: concurrent.futures.Future[Any],
        resend: Callable[[], Any],
    ) -> concurrent.futures.Future[Any]:
        """``handle`` (a call just made to ``target``, an actor of ``shard``), or,
        should ``target`` die with a replica to take over (or be replaced already),
        the result of ``resend()`` (a new handle) made once another actor serves it.

        ``target`` is the actor the caller called, not whoever serves the shard
        now: a promotion may have happened in between.
        """
        if not self._replicated:
            return handle  # no replicas in this run: a failure is final
        out: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def done(h: concurrent.futures.Future[Any]) -> None:
            error = h.exception()
            if error is None:
                out.set_result(h.result())
            else:  # not on Ray's callback thread: a failover blocks on Ray calls
                _pool().submit(self._fail_over, shard, target, error, resend, out)

        handle.add_done_callback(done)
        return out

    def take_over_if_dead(self, shard: int) -> bool:
        """Promotes ``shard``'s replica if a ping finds its actor dead; whether
        another actor serves it now."""
        return self._take_over(shard, self._servers[shard], RuntimeError("checking"))

    def _fail_over(
        self,
        shard: int,
        target: Any,
        error: BaseException,
        resend: Callable[[], Any],
        out: concurrent.futures.Future[Any],
    ) -> None:
        """Settles ``out`` with ``resend()``'s result once another actor serves
        ``shard``, or with ``error`` when ``target`` is not confirmed dead."""
        try:
            if not self._take_over(shard, target, error):
                out.set_exception(error)
                return
            again = resend()
        except Exception as e:
            out.set_exception(e)
            return
        again.add_done_callback(lambda h: _settle(out, h))

    def _take_over(self, shard: int, target: Any, error: BaseException) -> bool:
        """Promotes ``shard``'s replica if ``target`` (the actor a call went to) is
        dead; whether another actor serves ``shard`` now."""
        import ray

        with self._lock:
            if not _same(self._servers[shard], target):
                return True  # already moved on: the call is made again there
            replica = self._replicas.get(shard)
            if replica is None or not _dead(target, error, self._timeout_s):
                return False
            # Promoted before any call reaches it: replays of the dead primary's
            # unconfirmed changes still waiting there are dropped, not applied.
            ray.get(replica.promote.remote(), timeout=self._timeout_s)
            self._send_held(shard, replica)
            self._servers[shard] = replica
            del self._replicas[shard]  # until the controller makes a new one
            logger.warning("parameter-server shard %d is lost; its replica serves it.", shard)
            return True

    def _send_held(self, shard: int, actor: Any) -> None:
        """Sends ``actor``, about to serve ``shard``, the updates this process holds
        for it, and waits until it took them (called with the lock held, before
        any other call of this process can reach ``actor``).

        Raises:
            Exception: A held update did not reach ``actor`` (the run cannot go on
                without it: its worker's next update would find it missing).
        """
        calls = list(self._held.get(shard, {}).values())
        handles = [getattr(actor, method).remote(*args).future() for method, args in calls]
        for handle in handles:
            handle.result(timeout=self._timeout_s)
        if calls:
            logger.info("shard %d: %d held update(s) sent to its new server.", shard, len(calls))


def _same(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are handles of one actor (Ray's handles compare by
    actor id; a handle that defines no equality is only the same as itself)."""
    return a is b or bool(a == b)


def _settle(out: concurrent.futures.Future[Any], h: concurrent.futures.Future[Any]) -> None:
    error = h.exception()
    if error is None:
        out.set_result(h.result())
    else:
        out.set_exception(error)


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="ps-failover")
    return _POOL


def _dead(actor: Any, error: BaseException, timeout_s: float) -> bool:
    """Whether ``actor`` is confirmed dead: ``error`` says so, or pings do.

    Anything less is not enough: a replica serving beside a live primary would
    diverge from it. An actor Ray calls *unavailable* (its node stopped answering,
    not yet declared dead: Ray's health checks take seconds) is pinged again until
    Ray decides, or ``timeout_s`` runs out.
    """
    import ray

    if isinstance(error, ray.exceptions.ActorDiedError):
        return True
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(ping_actor(actor), timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.ActorDiedError:
            return True
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                return False
            time.sleep(_RETRY_S)
            continue
        except Exception:
            return False
        return False
