"""How a worker reaches the shards, for every mode: calls, waits, errors, lanes.

A worker makes non-blocking calls to shard actors (:meth:`Transport.call`) and later
waits for their results with a bound (:meth:`Transport.wait`). A sync run across
nodes also has a direct TCP path to the shards (:attr:`Transport.direct`, one per
worker process, shared by its models). Every path hands back the same kind of
handle, a :data:`Handle` (``concurrent.futures.Future``), so one wait and one error
mapping (:func:`wait_all`) serve them all. Shards on the worker's own node can
also be reached through shared memory: a :class:`Lane` holds the worker's input
segment and the shard's output segments, and only a small notice of what was
written travels separately (a Ray call, or a frame on the direct path where the run
has one). Unit tests substitute a fake transport that runs real shard objects on an
in-process event loop.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ray_ps_plugin import _shm as shm
from ray_ps_plugin._errors import PSError, PSTimeoutError, WaitTimeout
from ray_ps_plugin._failover import Failover
from ray_ps_plugin._ray_compat import ping_actor
from ray_ps_plugin._shm import Segment, SegmentHandle

__all__ = [
    "DirectPath",
    "Handle",
    "Lane",
    "RayTransport",
    "Transport",
    "local_or_message",
    "mapped",
    "open_lanes",
    "wait_all",
    "wait_handles",
]

logger = logging.getLogger(__name__)

# How long a shard may take to answer a liveness ping after a wait timed out; a
# shard that answers within this is alive (it was waiting for someone else).
PING_TIMEOUT_S = 5.0

# Calls that name the caller's shared memory with a shard: a replica elsewhere
# cannot answer them, so their callers guard them with a call by message.
_LOCAL_CALLS = frozenset({"push_local", "pull_local"})

#: A call or push in flight, on any path: a Ray call (through ``ObjectRef.future``),
#: a push on the direct path, or a fake's call in unit tests.
Handle = concurrent.futures.Future


class DirectPath(Protocol):
    """The direct path from a worker to the shards (``_wire.streams.WireStreams``).

    Pushes return :data:`Handle` objects, waited for like Ray calls.
    """

    def push(
        self,
        shard: int,
        model: int,
        step: int,
        key: int,
        source: int,
        dtype: str,
        payload: Any,
        into: Any = None,
    ) -> Handle[Any]:
        """Sends one chunk; the future holds the answer's bytes."""
        ...

    def push_local(
        self,
        shard: int,
        model: int,
        step: int,
        source: int,
        dtype: str,
        chunks: Sequence[tuple[int, int, int | None]],
    ) -> Handle[Any]:
        """Names chunks left in shared memory for a shard of this node."""
        ...

    def push_rows(
        self, shard: int, model: int, step: int, source: int, payload: Any, owner: int | None = None
    ) -> Handle[Any]:
        """Sends a step's packed sparse rows (owned by ``owner`` when ``shard`` relays
        them); the future holds the packed answer."""
        ...

    def table_pull(self, shard: int, model: int, source: int, payload: Any) -> Handle[Any]:
        """Asks for a sharded table's rows (a packed pull); the future holds them."""
        ...

    def table_wait(
        self, shard: int, model: int, source: int, clocks: dict[int, int]
    ) -> Handle[Any]:
        """Waits on a shard until ``model``'s tables are fresh enough for ``clocks``."""
        ...

    def param_local(
        self, shard: int, model: int, source: int, clock: int, slot: int
    ) -> Handle[Any]:
        """Names an async/ssp update left in shared memory; the future holds the
        packed reply."""
        ...

    def table_push(self, shard: int, model: int, source: int, payload: Any) -> Handle[Any]:
        """Sends a packed step on a model's sharded tables; the future holds the answer."""
        ...

    def reaches(self, shard: int) -> bool:
        """Whether ``shard`` listens on the direct path."""
        ...

    def close(self, timeout_s: float = 5.0) -> None:
        """Closes every connection."""
        ...


class Transport(Protocol):
    """How a worker's calls reach the shard actors; the real one is Ray.

    Attributes:
        direct: The direct TCP path to the shards (sync runs across nodes with
            ``data_path="tcp"``), or ``None``.
    """

    direct: DirectPath | None

    def call(self, shard: int, method: str, *args: Any) -> Handle[Any]:
        """Starts ``method(*args)`` on a shard; returns a handle to its result."""
        ...

    def attach(
        self, shard: int, model: int, rank: int, inputs: SegmentHandle, lo: int, nbytes: int
    ) -> tuple[SegmentHandle, ...]:
        """Connects through shared memory (blocking); returns the output segments."""
        ...

    def wait(self, handles: Sequence[Handle[Any]], timeout_s: float) -> list[Any]:
        """Waits for all results; raises ``WaitTimeout`` after ``timeout_s``."""
        ...

    def silent(self, shards: Sequence[int], timeout_s: float) -> list[int]:
        """The shards among ``shards`` that do not answer a ping within ``timeout_s``."""
        ...

    def guard(
        self, shard: int, handle: Handle[Any], resend: Callable[[], Handle[Any]]
    ) -> Handle[Any]:
        """``handle`` (a call through shared memory, so to ``shard``'s first actor),
        or, should that actor die with a replica to take over, the result of
        ``resend()`` made once the replica serves it (see :meth:`moved`)."""
        ...

    def moved(self, shard: int) -> bool:
        """Whether ``shard``'s replica serves it now (its calls go there; shared
        memory with the dead primary is no longer read)."""
        ...

    def set_shard(self, shard: int, primary: Any, replica: Any) -> None:
        """``shard`` is served by ``primary`` now, with ``replica`` to fail over to."""
        ...

    def replica(self, shard: int) -> Any:
        """``shard``'s replica to fail over to, or ``None``."""
        ...

    def hold(self, shard: int, key: Hashable, call: tuple[str, tuple[Any, ...]] | None) -> None:
        """Keeps an update ``shard`` answered until its replica is known to hold it:
        ``call`` (a shard method and its arguments) is made to whichever actor
        serves ``shard`` next (:meth:`ray_ps_plugin._failover.Failover.hold`)."""
        ...

    def close(self) -> None:
        """Releases what the transport holds open (the direct path's connections)."""
        ...


def mapped(handle: Handle[Any], fn: Any) -> Handle[Any]:
    """A handle whose result is ``fn(handle's result)`` (the same error if it fails)."""
    out: Handle[Any] = concurrent.futures.Future()

    def done(h: Handle[Any]) -> None:
        error = h.exception()
        if error is not None:
            out.set_exception(error)
            return
        try:
            out.set_result(fn(h.result()))
        except Exception as e:
            out.set_exception(e)

    handle.add_done_callback(done)
    return out


def local_or_message(
    transport: Transport,
    shard: int,
    local: Callable[[], Handle[Any]],
    by_message: Callable[[], Handle[Any]],
) -> Handle[Any]:
    """A call through shared memory with ``shard`` (``local``), guarded by the same
    call by message, which a promoted replica, on another node, takes instead."""
    if transport.moved(shard):
        return by_message()
    return transport.guard(shard, local(), by_message)


def wait_handles(handles: Sequence[Handle[Any]], timeout_s: float) -> list[Any]:
    """The results of ``handles``, in order, within ``timeout_s`` in all.

    A handle may appear several times (one call can stand for several chunks).

    Raises:
        WaitTimeout: A result is not there by the deadline.
        Exception: The first failed call's error, as the call raised it.
    """
    deadline = time.monotonic() + timeout_s
    out = []
    for h in handles:
        try:
            out.append(h.result(timeout=max(0.0, deadline - time.monotonic())))
        except concurrent.futures.TimeoutError as e:
            raise WaitTimeout(f"a call is not answered within {timeout_s:g}s") from e
    return out


class RayTransport:
    """Calls shard actors through Ray; bulk arguments travel in the object store.

    A call's handle is its ``ObjectRef.future()``: it resolves, or raises the error
    ``ray.get`` would raise, without a ``ray.get`` per handle type.

    A call to a shard with a replica is guarded (:mod:`ray_ps_plugin._failover`).

    Args:
        servers: The shard actor handles, in shard order.
        timeout_s: Bound on the blocking calls (``attach``, a promotion).
        direct: The run's direct path, or ``None``; closed by :meth:`close`.
        replicas: Each shard's replica (``PSConfig.shard_replicas``), or empty.
    """

    def __init__(
        self,
        servers: Sequence[Any],
        timeout_s: float,
        direct: DirectPath | None = None,
        replicas: Sequence[Any] = (),
    ) -> None:
        self._servers = list(servers)  # a promoted replica replaces its primary here
        self._timeout_s = timeout_s
        self.direct = direct
        self._failover = Failover(self._servers, replicas, timeout_s)

    def close(self) -> None:
        """Closes the direct path's connections (Ray calls need no closing)."""
        direct, self.direct = self.direct, None
        if direct is not None:
            direct.close()

    def call(self, shard: int, method: str, *args: Any) -> Handle[Any]:
        local = method in _LOCAL_CALLS
        # Shared memory is with the shard's first actor; a message goes to whoever
        # serves the shard now. The actor is read once and guarded as called: a
        # promotion by another thread before the guard must not leave this call
        # unguarded (CI lost a run so, to a push made as the replica took over).
        target = self._failover.first(shard) if local else self._failover.server(shard)
        # Ray serialises the arguments inside .remote(): buffers passed here may be
        # reused as soon as this returns.
        future: Handle[Any] = getattr(target, method).remote(*args).future()
        if local:
            return future  # the caller guards it with a call by message
        return self._failover.guard(shard, target, future, lambda: self.call(shard, method, *args))

    def guard(
        self, shard: int, handle: Handle[Any], resend: Callable[[], Handle[Any]]
    ) -> Handle[Any]:
        # Only calls through shared memory are guarded here: made to the first actor.
        return self._failover.guard(shard, self._failover.first(shard), handle, resend)

    def server(self, shard: int) -> Any:
        """The actor that serves ``shard`` now."""
        return self._failover.server(shard)

    def moved(self, shard: int) -> bool:
        return self._failover.moved(shard)

    def set_shard(self, shard: int, primary: Any, replica: Any) -> None:
        self._failover.set_shard(shard, primary, replica)

    def replica(self, shard: int) -> Any:
        return self._failover.replica(shard)

    def hold(self, shard: int, key: Hashable, call: tuple[str, tuple[Any, ...]] | None) -> None:
        self._failover.hold(shard, key, call)

    def attach(
        self, shard: int, model: int, rank: int, inputs: SegmentHandle, lo: int, nbytes: int
    ) -> tuple[SegmentHandle, ...]:
        import ray

        call = self._servers[shard].attach.remote(model, rank, inputs, lo, nbytes)
        return tuple(ray.get(call, timeout=self._timeout_s))

    def wait(self, handles: Sequence[Handle[Any]], timeout_s: float) -> list[Any]:
        return wait_handles(handles, timeout_s)

    def silent(self, shards: Sequence[int], timeout_s: float) -> list[int]:
        import ray

        refs = {s: ping_actor(self._servers[s]) for s in shards}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        answered = set()
        for s, ref in refs.items():
            if ref in ready:
                try:
                    ray.get(ref, timeout=0)
                    answered.add(s)
                except Exception:
                    pass
        return [s for s in shards if s not in answered]


def _failed(transport: Transport, handles: Sequence[Handle[Any]]) -> list[int]:
    """Indices of the calls that failed (rather than still running)."""
    failed = []
    for i, handle in enumerate(handles):
        try:
            transport.wait([handle], 0.01)
        except WaitTimeout:
            continue
        except Exception:
            failed.append(i)
    return failed


def wait_all(
    transport: Transport,
    handles: Sequence[Handle[Any]],
    shards: Sequence[int],
    timeout_s: float,
    where: str,
    deadline: float | None = None,
) -> list[Any]:
    """Waits for a batch of calls; turns every failure into a ``PSError`` naming the
    shard(s) to look at.

    Args:
        transport: Where the calls were made.
        handles: The calls.
        shards: The shard of each call.
        timeout_s: The bound on the wait (``ps_timeout_s``).
        where: Rank and step or clock, for the message.
        deadline: A ``time.monotonic()`` by which the wait ends when several waits
            share one ``timeout_s`` bound (the message still names ``timeout_s``).

    Raises:
        PSTimeoutError: The wait ran out; names the shards that stop answering a
            ping, or, if all answer, every shard waited for (a worker is missing).
            Also raised for a shard's own timeout, with the shard's message.
        PSError: A call failed (e.g. a dead shard); names the shard(s) whose call
            failed.
    """
    wait_s = timeout_s if deadline is None else max(0.0, deadline - time.monotonic())
    try:
        return transport.wait(handles, wait_s)
    except WaitTimeout:
        waited = sorted(set(shards))
        silent = transport.silent(waited, min(PING_TIMEOUT_S, timeout_s))
        bound = f"did not answer within ps_timeout_s={timeout_s:g}s"
        if silent:
            message = (
                f"{where}: server shard(s) {silent} {bound} and stopped answering pings: "
                "the shard process is stuck or dead."
            )
        else:
            message = (
                f"{where}: server shard(s) {waited} {bound}; they answer pings, so they "
                "wait for a worker that is slow, stuck or dead. Raise "
                "PSConfig.ps_timeout_s if steps are legitimately slower."
            )
        raise PSTimeoutError(message) from None
    except Exception as e:
        failed = sorted({shards[i] for i in _failed(transport, handles)}) or sorted(set(shards))
        # A shard's own timeout (it waited for a worker) stays a timeout, with the
        # shard's message naming the workers it waited for.
        error = PSTimeoutError if isinstance(e, TimeoutError) else PSError
        raise error(f"{where}: server shard(s) {failed} failed: {e}") from e


@dataclass
class Lane:
    """Shared memory between this worker and one shard of its node, for one model.

    Attributes:
        lo: Byte at which the segments start in the model's stream (sync) or 0.
        inputs: What this worker writes for the shard (gradient chunks, deltas).
        outputs: What the shard answers in (sums by step parity; parameters by
            the slot the worker names).
    """

    lo: int
    inputs: Segment
    outputs: tuple[Segment, ...]

    def close(self) -> None:
        for seg in (self.inputs, *self.outputs):
            seg.close()


def open_lanes(
    transport: Transport,
    model: int,
    spans: Mapping[int, tuple[int, int]],
    rank: int,
    inputs: int = 1,
) -> dict[int, Lane]:
    """Attaches this worker to the shards of its node through shared memory.

    Args:
        transport: Where the shards are.
        model: The prepared model's id on the shards.
        spans: ``(lo, nbytes)`` per shard: where its segments start in the model's
            byte stream and how large they are.
        rank: This worker's rank.
        inputs: Deltas the input segment holds (two alternate by clock: replicas).

    Returns:
        One lane per shard that could be attached (see
        :func:`~ray_ps_plugin._shm.attach_each` for those that cannot).
    """

    def attach(s: int, created: list[Segment]) -> Lane:
        lo, nbytes = spans[s]
        created.append(Segment.create(nbytes * inputs))
        handles = transport.attach(s, model, rank, created[0].handle, lo, nbytes)
        created.extend(Segment.open(h) for h in handles)
        return Lane(lo, created[0], tuple(created[1:]))

    return shm.attach_each(sorted(spans), rank, attach)
