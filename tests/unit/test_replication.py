"""A shard's state held twice: the primary forwards, the replica replays in the
primary's order, a worker's update is confirmed one push late (the next answer
waits until the replica holds it; a finish until it holds all), a promoted replica
drops the dead primary's unconfirmed replays, and a worker's calls fail over to the
replica only when the primary is confirmed dead. Real shard objects on one event
loop; the replica's actor handle is faked."""

import asyncio
import concurrent.futures
import random

import numpy as np
import pytest
import ray
import torch

from ray_ps_plugin import PSConfig
from ray_ps_plugin import _failover as failover_module
from ray_ps_plugin._failover import Failover
from ray_ps_plugin._param.shard import ParamShard


class _Method:
    def __init__(self, target, name, delay, gate):
        self._target, self._name, self._delay, self._gate = target, name, delay, gate

    def remote(self, *args):
        args = [a.copy() if isinstance(a, np.ndarray) else a for a in args]

        async def run():
            await asyncio.sleep(self._delay())
            await self._gate.wait()
            return await getattr(self._target, self._name)(*args)

        return _FakeRef(asyncio.ensure_future(run()))


class _FakeRef:
    """An ObjectRef of a call on the loop: awaitable, with Ray's ``future()``."""

    def __init__(self, task):
        self._task = task

    def __await__(self):
        return self._task.__await__()

    def future(self):
        out = concurrent.futures.Future()

        def done(t):
            if t.exception() is None:
                out.set_result(t.result())
            else:
                out.set_exception(t.exception())

        self._task.add_done_callback(done)
        return out


class FakeReplicaHandle:
    """An actor handle whose calls run on the same loop, each after a random delay
    (Ray does not order calls to an asyncio actor) and only while ``gate`` is set."""

    def __init__(self, target, jitter_s=0.0):
        self.target = target
        self.gate = asyncio.Event()
        self.gate.set()
        self._rng = random.Random(0)
        self._jitter_s = jitter_s

    def __getattr__(self, name):
        return _Method(self.target, name, lambda: self._rng.random() * self._jitter_s, self.gate)


def _pair(staleness=None, timeout_s=5.0, jitter_s=0.002, same_node=False):
    primary = ParamShard(0, 2, staleness, timeout_s)
    replica = ParamShard(0, 2, staleness, timeout_s)
    handle = FakeReplicaHandle(replica, jitter_s)
    primary.set_replica(handle, same_node)
    return primary, replica, handle


@pytest.mark.parametrize("same_node", [False, True], ids=["by-value", "shared-memory"])
def test_the_replica_replays_every_update_in_the_primarys_order_bit_for_bit(same_node, monkeypatch):
    """Through the object store or, on one node, shared-memory slots (each reused
    only once its change is held: a confirmation comes late here, so some
    updates fall back to the object store)."""
    forwarded = []
    if same_node:
        from ray_ps_plugin._param import replica as replica_module

        original = replica_module.ReplicaLink.forward

        def spy(self, method, *args, key=None):
            forwarded.append(method)
            return original(self, method, *args, key=key)

        monkeypatch.setattr(replica_module.ReplicaLink, "forward", spy)

    async def run():
        primary, replica, _ = _pair(same_node=same_node)
        assert await primary.init(0, np.zeros(1000, np.float32))
        rng = np.random.default_rng(0)

        async def worker(rank):
            for clock in range(1, 41):
                delta = rng.standard_normal(1000).astype(np.float32)
                await primary.push_pull(0, rank, clock, delta)

        await asyncio.gather(worker(0), worker(1))
        await asyncio.gather(primary.finish(0, 0), primary.finish(0, 1))
        return primary, replica

    primary, replica = asyncio.run(run())
    p, r = primary.export_state()["models"][0], replica.export_state()["models"][0]
    assert p["clocks"] == r["clocks"] == [40, 40]
    # Same additions in the same order: identical bits, not merely close.
    assert np.array_equal(p["params"], r["params"])
    if same_node:
        assert forwarded.count("mirror_shared") > 40, forwarded


def test_an_update_is_confirmed_one_push_late_and_by_a_finish():
    """Push 1 is answered while the replica holds nothing of it (the worker keeps
    it); push 2's answer waits until the replica holds push 1; a finish waits
    until it holds everything."""

    async def run():
        primary, replica, handle = _pair(jitter_s=0.0)
        await primary.init(0, np.zeros(4, np.float32))
        handle.gate.clear()  # the replica takes nothing for now
        await asyncio.wait_for(primary.push_pull(0, 0, 1, np.ones(4, np.float32)), 5)
        assert replica.export_state()["models"][0]["clocks"] == [0, 0]
        push = asyncio.ensure_future(primary.push_pull(0, 0, 2, np.ones(4, np.float32)))
        other = asyncio.ensure_future(primary.push_pull(0, 1, 1, np.ones(4, np.float32)))
        await asyncio.sleep(0.05)
        assert not push.done()  # its previous update is not held twice yet
        assert other.done()  # rank 1's first: nothing of it to confirm
        handle.gate.set()
        await asyncio.wait_for(push, 5)
        assert replica.export_state()["models"][0]["clocks"][0] >= 1
        handle.gate.clear()
        finish = asyncio.ensure_future(primary.finish(0, 0))
        await asyncio.sleep(0.05)
        assert not finish.done()
        handle.gate.set()
        await asyncio.wait_for(finish, 5)
        return replica.export_state()["models"][0]

    held = asyncio.run(run())
    assert held["clocks"] == [2, 1]
    assert np.array_equal(held["params"], np.full(4, 1.5, np.float32))


def test_a_promoted_replica_drops_unconfirmed_replays_and_takes_the_resent_update():
    """The primary died after forwarding change 2 while change 1 never arrived:
    change 2 waits for its turn, the promotion drops it (never confirmed), and the
    worker's resent push applies it once."""

    async def run():
        replica = ParamShard(0, 2, None, 5.0)
        await replica.replay(1, "init", (0, np.zeros(4, np.float32), 0))
        stuck = asyncio.ensure_future(
            replica.replay(3, "mirror", (0, 0, 1, np.ones(4, np.float32)))
        )
        await asyncio.sleep(0.05)
        assert not stuck.done()  # change 2 is missing: change 3 waits
        assert not await replica.promote()
        await asyncio.wait_for(stuck, 5)  # dropped, not applied
        assert replica.export_state()["models"][0]["clocks"] == [0, 0]
        await replica.push_pull(0, 0, 1, np.ones(4, np.float32))  # the worker resends
        await replica.push_pull(0, 0, 1, np.ones(4, np.float32))  # a repeat: ignored
        return replica.export_state()["models"][0]

    held = asyncio.run(run())
    assert held["clocks"] == [1, 0]
    assert np.array_equal(held["params"], np.full(4, 0.5, np.float32))


def test_a_replica_that_fails_is_dropped_and_the_primary_goes_on(caplog):
    class Failing:
        def __getattr__(self, name):
            class M:
                @staticmethod
                def remote(*args):
                    future = asyncio.get_running_loop().create_future()
                    future.set_exception(RuntimeError("replica lost"))
                    return future

            return M()

    async def run():
        primary = ParamShard(0, 2, None, 5.0)
        primary.set_replica(Failing())
        await primary.init(0, np.zeros(4, np.float32))
        reply = await primary.push_pull(0, 0, 1, np.ones(4, np.float32))
        assert primary._link.replica is None
        return reply

    reply = asyncio.run(run())
    assert reply.clocks == (1, 0)
    assert "goes on without one" in caplog.text


def test_a_replica_replays_only_what_a_primary_forwards():
    with pytest.raises(Exception, match="replays"):
        asyncio.run(ParamShard(0, 1, None, 1.0).replay(1, "export_state", ()))


# --- the worker's failover ---------------------------------------------------------
class _Ref:
    def __init__(self, future):
        self._future = future

    def future(self):
        return self._future


class FakeActor:
    """A handle whose calls answer ``result`` or raise ``error`` at once."""

    def __init__(self, result=None, error=None):
        self.result, self.error, self.calls = result, error, []

    def __getattr__(self, name):
        actor = self

        class M:
            @staticmethod
            def remote(*args):
                actor.calls.append(name)
                future = concurrent.futures.Future()
                if actor.error is not None and name != "promote":
                    future.set_exception(actor.error)
                else:
                    future.set_result(actor.result)
                return future if name == "promote" else _Ref(future)

        return M()


def _failover(primary, replica, monkeypatch, dead: bool):
    monkeypatch.setattr(failover_module, "_dead", lambda actor, error, timeout_s: dead)
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref.result(timeout))
    servers = [primary]
    return servers, Failover(servers, [replica], 5.0)


def test_a_call_to_a_dead_primary_is_made_again_on_its_promoted_replica(monkeypatch):
    primary = FakeActor(error=ray.exceptions.ActorDiedError())
    replica = FakeActor(result="from the replica")
    servers, failover = _failover(primary, replica, monkeypatch, dead=True)

    def call():
        return servers[0].push_pull.remote(1).future()

    assert failover.guard(0, primary, call(), call).result(5) == "from the replica"
    assert servers[0] is replica and failover.moved(0)
    assert replica.calls == ["promote", "push_pull"]
    # Later calls go to the replica: with no replica of its own, its failure is final.
    assert failover.guard(0, replica, call(), call).result(5) == "from the replica"
    replica.error = ray.exceptions.ActorDiedError()
    with pytest.raises(ray.exceptions.ActorDiedError):
        failover.guard(0, replica, call(), call).result(5)


def test_a_promoted_replica_is_sent_the_held_updates_before_any_call(monkeypatch):
    """What a worker holds (answered by the primary, maybe not yet by the
    replica) reaches the replica first, whether this worker's failed call or the
    controller's news of a new server moves it; a cleared hold sends nothing."""
    primary = FakeActor(error=ray.exceptions.ActorDiedError())
    replica = FakeActor(result="from the replica")
    servers, failover = _failover(primary, replica, monkeypatch, dead=True)
    failover.hold(0, ("param", 0), ("mirror", (0, 1, 7, np.ones(2))))
    failover.hold(0, ("param", 1), ("mirror", (1, 1, 3, np.ones(2))))
    failover.hold(0, ("param", 1), None)

    def call():
        return servers[0].push_pull.remote(1).future()

    assert failover.guard(0, primary, call(), call).result(5) == "from the replica"
    assert replica.calls == ["promote", "mirror", "push_pull"]

    moved, new = FakeActor(), FakeActor()
    servers, failover = _failover(moved, None, monkeypatch, dead=True)
    failover.hold(0, ("param", 0), ("mirror", (0, 1, 7, np.ones(2))))
    failover.set_shard(0, new, None)
    assert new.calls == ["mirror"] and servers[0] is new


def test_a_failed_call_to_a_live_primary_fails_and_promotes_nothing(monkeypatch):
    """A broken connection is not a death: a replica serving beside a live
    primary would diverge from it."""
    primary = FakeActor(error=ConnectionError("reset"))
    replica = FakeActor(result="from the replica")
    servers, failover = _failover(primary, replica, monkeypatch, dead=False)

    def call():
        return servers[0].push_pull.remote(1).future()

    with pytest.raises(ConnectionError):
        failover.guard(0, primary, call(), call).result(5)
    assert servers[0] is primary and not failover.moved(0) and replica.calls == []


def test_a_call_made_as_another_thread_promotes_the_replica_is_made_again_there(monkeypatch):
    """The race CI lost a run to: a push reaches the dead primary, the replica is
    promoted (by another call's failover) before the push is guarded; the push is
    still guarded against the actor it went to, so it is made again on the replica
    instead of failing the run."""
    primary = FakeActor(error=ray.exceptions.ActorDiedError())
    replica = FakeActor(result="from the replica")
    servers, failover = _failover(primary, replica, monkeypatch, dead=True)
    target = failover.server(0)
    handle = target.push_pull.remote(1).future()  # the call, read before the promotion
    assert failover.take_over_if_dead(0) and servers[0] is replica  # meanwhile

    def resend():
        return failover.server(0).push_pull.remote(1).future()

    assert failover.guard(0, target, handle, resend).result(5) == "from the replica"
    assert replica.calls == ["promote", "push_pull"]


class SameActor(FakeActor):
    """Handles that compare equal when they name one actor, as Ray's do."""

    def __init__(self, actor_id, **kwargs):
        super().__init__(**kwargs)
        self.actor_id = actor_id

    def __eq__(self, other):
        return isinstance(other, SameActor) and other.actor_id == self.actor_id

    def __hash__(self):
        return hash(self.actor_id)


def test_a_new_handle_of_the_same_primary_is_no_move(monkeypatch):
    """The controller hands the workers new handle objects: the same primary with a
    new replica is not a move (shared memory with it stays in use)."""
    primary = SameActor("p")
    servers, failover = _failover(primary, SameActor("r1"), monkeypatch, dead=True)
    failover.set_shard(0, SameActor("p"), SameActor("r2"))
    assert servers[0] is primary and not failover.moved(0)
    assert failover.replica(0) == SameActor("r2")


def test_a_call_in_flight_fails_over_to_a_replica_given_meanwhile(monkeypatch):
    """A call to a promoted replica, made while the shard had no replica, fails over
    to the new replica the controller gave it before the call failed."""
    first = SameActor("p", error=ray.exceptions.ActorDiedError())
    promoted = SameActor("r1", error=ray.exceptions.ActorDiedError())
    servers, failover = _failover(first, promoted, monkeypatch, dead=True)
    assert failover.take_over_if_dead(0) and failover.replica(0) is None
    in_flight = concurrent.futures.Future()

    def resend():
        return failover.server(0).push_pull.remote(1).future()

    out = failover.guard(0, promoted, in_flight, resend)
    new = SameActor("r2", result="from the new replica")
    failover.set_shard(0, SameActor("r1"), new)
    assert servers[0] is promoted
    in_flight.set_exception(ray.exceptions.ActorDiedError())
    assert out.result(5) == "from the new replica"
    assert servers[0] is new and new.calls == ["promote", "push_pull"]


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"mode": "async", "shard_replicas": 2}, ValueError, "one replica"),
        ({"mode": "async", "shard_replicas": -1}, ValueError, ">= 0"),
        ({"mode": "async", "shard_replicas": True}, TypeError, "int"),
        ({"mode": "sync", "shard_replicas": 1}, ValueError, "'async', 'ssp'"),
        ({"mode": "diloco", "shard_replicas": 1}, ValueError, "mode='diloco'"),
    ],
)
def test_shard_replicas_is_validated_naming_the_field(fields, error, match):
    with pytest.raises(error, match=match):
        PSConfig(**fields)
    assert PSConfig(mode="ssp", staleness=2, shard_replicas=1).shard_replicas == 1


def test_a_replicated_update_is_widened_like_the_master():
    """A bf16 model's update reaches the replica in the fp32 master's dtype, so
    both add the same values."""

    async def run():
        primary, replica, _ = _pair(jitter_s=0.0)
        bf16 = torch.zeros(8, dtype=torch.bfloat16).view(torch.int16).numpy()
        await primary.init(0, bf16)
        delta = torch.full((8,), 0.1, dtype=torch.bfloat16).view(torch.int16).numpy()
        await primary.push_pull(0, 1, 1, delta)
        await primary.finish(0, 1)  # confirms every update
        return primary, replica

    primary, replica = asyncio.run(run())
    p, r = primary.export_state()["models"][0], replica.export_state()["models"][0]
    assert p["params"].dtype == r["params"].dtype == np.float32
    assert np.array_equal(p["params"], r["params"])


def test_a_shared_memory_slot_is_reused_only_once_its_change_is_held():
    """Four slots for two workers; a fifth update while none is confirmed goes by
    value (``None``); a slot of a confirmed change carries the next one; the
    replica reads exactly what was put."""
    from ray_ps_plugin._param.replica_slots import SlotReader, make_slots

    assert make_slots(False, 2) is None  # a replica on another node: by value
    slots, reader = make_slots(True, 2), SlotReader()
    refs = [slots.put(0, torch.full((5,), float(seq)), seq) for seq in range(1, 5)]
    assert all(refs) and len({r.handle for r in refs}) == 4
    assert slots.put(0, torch.zeros(5), 5) is None
    slots.confirmed(1)
    again = slots.put(0, torch.full((5,), 6.0), 6)
    assert again.handle == refs[0].handle
    np.testing.assert_array_equal(reader.values(again), np.full(5, 6.0, np.float32))
    np.testing.assert_array_equal(reader.values(refs[1]), np.full(5, 2.0, np.float32))
    slots.close()


def test_slots_that_cannot_be_made_leave_every_update_to_go_by_value(monkeypatch):
    """A host out of shared memory warns once and forwards by value from then on."""
    from ray_ps_plugin._param import replica_slots

    def refuse(nbytes):
        raise OSError("no space left on device")

    monkeypatch.setattr(replica_slots.Segment, "create", refuse)
    slots = replica_slots.make_slots(True, 2)
    assert slots.put(0, torch.ones(5), 1) is None
    assert slots.put(0, torch.ones(5), 2) is None


def test_segments_made_before_the_host_runs_out_are_closed(monkeypatch):
    """The second of a ring's segments cannot be made: the first is unmapped and its
    descriptor closed, not left open for the shard's lifetime."""
    from ray_ps_plugin._param import replica_slots

    made = []
    create = replica_slots.Segment.create

    def second_fails(nbytes):
        if made:
            raise OSError("no space left on device")
        made.append(create(nbytes))
        return made[-1]

    monkeypatch.setattr(replica_slots.Segment, "create", second_fails)
    slots = replica_slots.make_slots(True, 2)
    assert slots.put(0, torch.ones(5), 1) is None
    assert len(made) == 1
    assert made[0]._fd is None and made[0].bytes.size == 0


async def _two_workers_through_two_delta_inputs(primary, inputs, n, pause_s=0.0):
    """Ranks 0 and 1 attach ``inputs`` (two deltas of ``n`` fp32 each), rank 0
    seeds zeros, each pushes clocks 1..40 through shared memory (writing a clock's
    half as soon as its answer to the clock before came), then both finish."""
    for rank, seg in enumerate(inputs):
        primary.attach(0, rank, seg.handle, 0, 4 * n)
    assert await primary.init(0, np.zeros(n, np.float32))
    rng = np.random.default_rng(0)

    async def worker(rank):
        for clock in range(1, 41):
            half = inputs[rank].view(4 * n * (clock % 2), np.float32, n)
            half[:] = rng.standard_normal(n).astype(np.float32)
            await primary.push_local(0, rank, clock, clock % 2)
            await asyncio.sleep(pause_s)

    await asyncio.gather(worker(0), worker(1))
    await asyncio.gather(primary.finish(0, 0), primary.finish(0, 1))


def test_a_replica_on_the_node_replays_updates_from_the_workers_two_delta_inputs(monkeypatch):
    """Workers attached through inputs of two deltas (odd clocks in the second
    half): the primary forwards only where each update lies (no slot copy), the
    replica maps each input as its worker attaches and ends bit-identical, although
    every worker writes clock ``k + 2`` into the half of ``k`` as soon as the
    answer to ``k + 1`` comes (the replica's reads come late here)."""
    from ray_ps_plugin._param import replica as replica_module
    from ray_ps_plugin._param.replica_slots import Slots
    from ray_ps_plugin._shm import Segment

    def no_copy(self, *args):
        raise AssertionError("an update in a worker's input was copied into a slot")

    monkeypatch.setattr(Slots, "put", no_copy)
    forwarded = []
    original = replica_module.ReplicaLink.forward

    def spy(self, method, *args, key=None):
        forwarded.append((method, args[-1]))
        return original(self, method, *args, key=key)

    monkeypatch.setattr(replica_module.ReplicaLink, "forward", spy)
    n = 1000
    inputs = [Segment.create(2 * 4 * n) for _ in range(2)]

    async def run():
        primary, replica, _ = _pair(same_node=True, jitter_s=0.004)
        await _two_workers_through_two_delta_inputs(primary, inputs, n)
        return primary, replica

    primary, replica = asyncio.run(run())
    p, r = primary.export_state()["models"][0], replica.export_state()["models"][0]
    assert p["clocks"] == r["clocks"] == [40, 40]
    assert np.array_equal(p["params"], r["params"])
    methods = [m for m, _ in forwarded]
    assert methods[:2] == ["map_input", "map_input"] and methods.count("mirror_shared") == 80
    refs = [ref for m, ref in forwarded if m == "mirror_shared"]
    assert {ref.handle for ref in refs} == {seg.handle for seg in inputs}
    assert {ref.offset for ref in refs} == {0, 4 * n}
    assert set(replica._slot_reader._segments) == {seg.handle for seg in inputs}


def test_an_input_of_another_size_is_refused_naming_the_rank():
    """A worker whose input holds neither one slice nor two: its models differ."""
    from ray_ps_plugin._errors import ShardProtocolError
    from ray_ps_plugin._shm import Segment

    seg = Segment.create(3 * 4 * 10)

    async def run():
        primary, _, _ = _pair(jitter_s=0.0)
        primary.attach(0, 1, seg.handle, 0, 4 * 10)
        await primary.init(0, np.zeros(10, np.float32))
        await primary.push_local(0, 1, 1, 1)

    with pytest.raises(ShardProtocolError, match="rank 1 attached a 120-byte slice"):
        asyncio.run(run())


class _LoopbackReplicaHandle(FakeReplicaHandle):
    """A fake handle whose ``open_wire`` listens on the loopback address (a real
    replica listens on its node's address in Ray)."""

    def __getattr__(self, name):
        method = super().__getattr__(name)
        if name != "open_wire":
            return method
        target = self.target

        class _Open:
            def remote(self, token):
                return _FakeRef(asyncio.ensure_future(target.open_wire(token, "127.0.0.1")))

        return _Open()


def test_changes_go_to_the_replica_as_frames_once_the_direct_path_is_open(monkeypatch):
    """With ``direct``, the primary opens a connection to its replica with a token
    of its own and sends each change as a frame (the first ones, sent while it
    opens, as calls): the replica ends bit-identical, it accepts the primary's
    token beside the run's, and dropping the replica closes the connection."""
    from ray_ps_plugin._param import replica as replica_module
    from ray_ps_plugin._shm import Segment

    framed = []
    original = replica_module.Replicated.replay_frame

    async def spy(self, frame, payload):
        framed.append(frame.step)
        return await original(self, frame, payload)

    monkeypatch.setattr(replica_module.Replicated, "replay_frame", spy)
    n = 1000
    inputs = [Segment.create(2 * 4 * n) for _ in range(2)]

    async def run():
        primary = ParamShard(0, 2, None, 5.0)
        replica = ParamShard(0, 2, None, 5.0)
        await replica.open_wire(bytes(32), "127.0.0.1")  # the run's token, say
        primary.set_replica(_LoopbackReplicaHandle(replica, 0.002), True, direct=True)
        await _two_workers_through_two_delta_inputs(primary, inputs, n, pause_s=0.001)
        channel = primary._link._channel
        assert channel is not None and channel._streams is not None
        primary._link._drop(RuntimeError("test"))
        assert channel._streams is None and primary._link._channel is None
        return primary, replica

    primary, replica = asyncio.run(run())
    p, r = primary.export_state()["models"][0], replica.export_state()["models"][0]
    assert p["clocks"] == r["clocks"] == [40, 40]
    assert np.array_equal(p["params"], r["params"])
    assert len(framed) > 60 and framed == sorted(framed), framed
    assert replica._wire_server._tokens[0] == bytes(32) and len(replica._wire_server._tokens) == 2


def test_a_replica_replays_at_background_priority_until_promoted(caplog):
    """The first replay lowers the replaying thread's nice level by REPLICA_NICE;
    promotion raises it back (or, without the right to, says so). In a thread of
    its own: the test's thread keeps its priority. Off outside a Ray actor."""
    import os
    import threading

    from ray_ps_plugin._param.replica import REPLICA_NICE, ReplayOrder

    seen = {}

    def run():
        order = ReplayOrder(0, 5.0, background=True)
        seen["before"] = os.getpriority(os.PRIO_PROCESS, 0)

        async def go():
            assert await order.turn(1)
            await order.done(1)
            seen["replaying"] = os.getpriority(os.PRIO_PROCESS, 0)
            await order.promote()
            seen["promoted"] = os.getpriority(os.PRIO_PROCESS, 0)

        asyncio.run(go())

    main_before = os.getpriority(os.PRIO_PROCESS, 0)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert seen["replaying"] == min(19, seen["before"] + REPLICA_NICE)
    assert seen["promoted"] == seen["before"] or "keeps its background" in caplog.text
    assert os.getpriority(os.PRIO_PROCESS, 0) == main_before

    async def outside_an_actor():
        order = ReplayOrder(0, 5.0)  # background=None: only in a Ray actor
        assert await order.turn(1)
        return os.getpriority(os.PRIO_PROCESS, 0)

    assert asyncio.run(outside_an_actor()) == main_before
