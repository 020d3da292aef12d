"""A worker's side of replication: when a shard dies, its replica takes its calls.

With ``PSConfig(shard_replicas=1)`` every call a worker makes to a shard is
guarded: if it fails and the shard is *confirmed* dead, the replica is promoted
(it stops replaying the dead primary's unconfirmed changes) and the call is made
again there. Every call a worker makes may be made twice: a push is applied once
by its clock, a pull or an init changes nothing the second time. The promotion is
per worker process and idempotent on the replica, so whichever worker notices
first, all end up on the replica.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
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
        self._replicas = dict(enumerate(replicas))
        self._timeout_s = timeout_s
        self._moved: set[int] = set()
        self._lock = threading.Lock()

    def moved(self, shard: int) -> bool:
        """Whether ``shard``'s replica serves it now."""
        return shard in self._moved

    def guard(
        self, shard: int, handle: concurrent.futures.Future[Any], resend: Callable[[], Any]
    ) -> concurrent.futures.Future[Any]:
        """``handle``, or, should ``shard`` die with a replica to take over, the
        result of ``resend()`` (a new handle) made once the replica serves it."""
        if shard not in self._replicas or shard in self._moved:
            return handle  # a failure on the replica itself is final
        out: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def done(h: concurrent.futures.Future[Any]) -> None:
            error = h.exception()
            if error is None:
                out.set_result(h.result())
            else:  # not on Ray's callback thread: a failover blocks on Ray calls
                _pool().submit(self._fail_over, shard, error, resend, out)

        handle.add_done_callback(done)
        return out

    def take_over_if_dead(self, shard: int) -> bool:
        """Promotes ``shard``'s replica if a ping finds its primary dead; whether
        the replica serves it now."""
        return self._take_over(shard, RuntimeError("checking"))

    def _fail_over(
        self,
        shard: int,
        error: BaseException,
        resend: Callable[[], Any],
        out: concurrent.futures.Future[Any],
    ) -> None:
        """Settles ``out`` with ``resend()``'s result once the replica serves
        ``shard``, or with ``error`` when the primary is not confirmed dead."""
        try:
            if not self._take_over(shard, error):
                out.set_exception(error)
                return
            again = resend()
        except Exception as e:
            out.set_exception(e)
            return
        again.add_done_callback(lambda h: _settle(out, h))

    def _take_over(self, shard: int, error: BaseException) -> bool:
        """Promotes ``shard``'s replica if its primary is dead; whether it serves."""
        import ray

        with self._lock:
            if shard in self._moved:
                return True
            replica = self._replicas.get(shard)
            if replica is None or not _dead(self._servers[shard], error, self._timeout_s):
                return False
            # Promoted before any call reaches it: replays of the dead primary's
            # unconfirmed changes still waiting there are dropped, not applied.
            ray.get(replica.promote.remote(), timeout=self._timeout_s)
            self._servers[shard] = replica
            self._moved.add(shard)
            logger.warning("parameter-server shard %d is lost; its replica serves it.", shard)
            return True


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
