"""The controller's replica keeper picks the node of a shard's new replica: never
beside the shard's primary while another node can take it, and not on a node where
an actor of the run was just found dead (Ray lists a node removed without grace as
alive for seconds). Fake actors and a fake view of who serves each shard."""

import concurrent.futures
from types import SimpleNamespace

import pytest
import ray

from ray_ps_plugin import _keeper as keeper_module
from ray_ps_plugin._keeper import ReplicaKeeper


class _Ref:
    def __init__(self, value=None, error=None):
        self.value, self.error = value, error


class FakeShard:
    """A shard actor on ``node``; ``dead`` makes its pings and calls fail."""

    def __init__(self, name, node, dead=False):
        self.name, self.node, self.dead, self.calls = name, node, dead, []
        self.killed = False

    def __getattr__(self, method):
        shard = self

        class M:
            @staticmethod
            def remote(*args):
                shard.calls.append(method)
                if shard.dead:
                    return _Ref(error=ray.exceptions.ActorDiedError())
                if method == "ready":
                    return _Ref({"node_id": shard.node, "pid": 1})
                return _Ref(None)

        return M()

    def __repr__(self):
        return self.name


class FakeFailover:
    """Who serves each shard and its replica, as the controller sees it; a dead
    primary with a replica is replaced by it on the keeper's look."""

    def __init__(self, servers, replicas):
        self.servers, self.replicas = list(servers), list(replicas)

    @property
    def num_shards(self):
        return len(self.servers)

    def take_over_if_dead(self, shard):
        if self.servers[shard].dead and self.replicas[shard] is not None:
            self.servers[shard], self.replicas[shard] = self.replicas[shard], None
        return True

    def server(self, shard):
        return self.servers[shard]

    def replica(self, shard):
        return self.replicas[shard]

    def set_shard(self, shard, primary, replica):
        self.servers[shard], self.replicas[shard] = primary, replica


@pytest.fixture(autouse=True)
def fake_ray(monkeypatch):
    def get(ref, timeout=None):
        if ref.error is not None:
            raise ref.error
        return ref.value

    def kill(actor, no_restart=True):
        actor.killed = True

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", kill)
    monkeypatch.setattr(keeper_module, "_dead", lambda actor, timeout_s: actor.dead)


def _keeper(primary, replica, nodes, lands_on=(), gone=()):
    """A keeper of one shard; its new replicas start where they were asked, or on
    the nodes ``lands_on`` names in turn; one asked on a node in ``gone`` dies."""
    failover = FakeFailover([primary], [replica])
    asked, told = [], []
    landings = iter(lands_on)

    def start_replica(shard, node):
        asked.append(node)
        return FakeShard(f"new{len(asked)}", next(landings, node), dead=node in gone)

    keeper = ReplicaKeeper(
        failover,
        [(primary.node, replica.node)],
        start_replica,
        lambda shard, p, r: told.append((shard, p, r)),
        5.0,
        lambda: list(nodes),
    )
    return keeper, failover, asked, told


def test_a_replica_that_starts_beside_its_primary_is_refused_and_made_again_elsewhere():
    """Asked on node a (c lost its replica just now), the first new replica comes up
    on the primary's node b (as a stale view of where the primary runs would have
    it): it is killed, nobody is told of it, and the next look makes one on a."""
    primary, replica = FakeShard("p", "b"), FakeShard("r", "c", dead=True)
    keeper, failover, asked, told = _keeper(primary, replica, ["a", "b", "c"], ["b"])
    with pytest.raises(RuntimeError, match="did not start away from its primary"):
        keeper.keep(0)
    refused = keeper.made[0]
    assert refused.killed and told == [] and failover.replica(0) is replica
    keeper.keep(0)
    new = keeper.made[1]
    assert new.node != primary.node and not new.killed
    assert failover.replica(0) is new and told == [(0, primary, new)]
    assert asked == ["a", "a"] and primary.calls == ["add_replica"]  # one seeded


def test_no_new_replica_goes_where_an_actor_was_just_found_dead():
    """Shard's primary on a dies; its replica on b serves now. Ray still lists a
    (a node removed without grace is listed alive for seconds): the new replica
    goes to c, neither beside the new primary nor onto the lost node."""
    primary, replica = FakeShard("p", "a", dead=True), FakeShard("r", "b")
    keeper, failover, asked, told = _keeper(primary, replica, ["a", "b", "c"])
    keeper.keep(0)
    assert failover.server(0) is replica and asked == ["c"]
    assert told == [(0, replica, keeper.made[0])] and keeper.made[0].node == "c"


def test_a_node_where_a_replica_did_not_start_is_passed_over_next_time():
    """A replica pinned to a node that is gone dies before it starts: the next look
    asks another node."""
    primary, replica = FakeShard("p", "a"), FakeShard("r", "b", dead=True)
    keeper, failover, asked, _ = _keeper(primary, replica, ["a", "c", "d"], gone=["c"])
    with pytest.raises(RuntimeError, match="did not start"):
        keeper.keep(0)
    keeper.keep(0)
    assert asked == ["c", "d"] and failover.replica(0).node == "d"


def test_beside_the_primary_only_when_no_other_node_can_take_it():
    """One node left (or all workers on one node): the replica goes beside its
    primary, where it still outlives the shard's process."""
    primary, replica = FakeShard("p", "a"), FakeShard("r", "a", dead=True)
    keeper, failover, asked, _ = _keeper(primary, replica, ["a"])
    keeper.keep(0)
    assert asked == ["a"] and failover.replica(0) is keeper.made[0]


def test_a_lost_node_is_used_again_once_it_has_been_avoided_long_enough(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(keeper_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    primary, replica = FakeShard("p", "a", dead=True), FakeShard("r", "b")
    keeper, _, asked, _ = _keeper(primary, replica, ["a", "b", "c"])
    keeper.keep(0)  # a lost: the new replica goes to c
    keeper.made[0].dead = True  # then c's replica dies too
    clock[0] += keeper_module.AVOID_S + 1  # a's loss is old news; c's is fresh
    keeper.keep(0)
    assert asked == ["c", "a"]


def test_the_keeper_logs_nothing_for_a_replica_killed_while_it_stops(caplog, monkeypatch):
    """The backend kills the replica being started when the run ends: that is no
    failure to keep a shard replicated."""
    primary, replica = FakeShard("p", "a"), FakeShard("r", "b", dead=True)
    keeper, _, _, _ = _keeper(primary, replica, ["a", "b"])
    stopped = concurrent.futures.Future()

    def keep(shard):
        keeper._stop.set()
        stopped.set_result(True)
        raise RuntimeError("the new replica did not start (killed)")

    keeper.keep = keep
    monkeypatch.setattr(keeper_module, "PERIOD_S", 0.01)
    keeper.start()
    assert stopped.result(5)
    keeper.stop()
    assert "Could not keep" not in caplog.text
