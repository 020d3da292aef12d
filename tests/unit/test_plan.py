"""The per-bucket plan of sync mode: which message carries each piece, decided once."""

from ray_ps_plugin._sync.layout import StreamLayout
from ray_ps_plugin._sync.plan import plan_bucket
from ray_ps_plugin._sync.topology import Route

# Two shards owning 4 KiB each of an 8 KiB fp32 stream, cut into 1 KiB chunks.
LAYOUT = StreamLayout(8192, 2, 1024)
OWN_ROUTES = [Route(0, direct=False), Route(1, direct=True)]


def _plan(routes, local, reaches=None, on_gpu=False, offset=0, numel=2048):
    return plan_bucket(
        LAYOUT, routes, frozenset(local), reaches, offset, numel, 4, lambda n: 2 * n, on_gpu
    )


def test_every_piece_is_in_exactly_one_send_and_answers_are_taken_in_byte_order():
    plan = _plan(OWN_ROUTES, local={0}, reaches=lambda s: True)
    carried = sorted(i for s in plan.sends for i in s.indices)
    assert carried == list(range(len(plan.pieces)))
    # Pieces for the other node go first; their answers are taken after the local
    # notice, whose pieces lie first in the bucket.
    assert not plan.sends[0].notice and plan.sends[-1].notice
    firsts = [plan.sends[k].indices[0] for k in plan.wait_order]
    assert firsts == sorted(firsts)
    for send in plan.sends:
        assert send.pieces == tuple(plan.pieces[i] for i in send.indices)


def test_pieces_by_value_count_encoded_bytes_and_take_the_direct_path_only_where_routed():
    plan = _plan(OWN_ROUTES, local={0}, reaches=lambda s: True)
    for send in plan.sends:
        (i, *_) = send.indices
        itemsize = 4 if send.notice else 2
        assert plan.push_bytes[i] == plan.pieces[i].numel * itemsize
        assert send.direct  # shard 1's route is direct, and shard 0 listens for notices
    without_path = _plan(OWN_ROUTES, local={0}, reaches=None)
    assert not any(s.direct for s in without_path.sends)


def test_a_cpu_bucket_summed_by_one_local_shard_is_read_in_place():
    plan = _plan(OWN_ROUTES, local={0}, numel=1024)  # shard 0's range only
    assert plan.in_place == 0 and not plan.by_value
    assert _plan(OWN_ROUTES, local={0}, numel=1024, on_gpu=True).in_place is None
    assert _plan(OWN_ROUTES, local={0}).in_place is None  # half of it leaves the node


def test_a_relay_gets_the_other_nodes_pieces_in_groups_before_its_own():
    relay_routes = [Route(0, direct=False), Route(0, direct=False)]  # shard 0 relays
    plan = _plan(relay_routes, local={0})
    assert all(s.notice and s.target == 0 for s in plan.sends)
    owners = [{p.shard for p in s.pieces} for s in plan.sends]
    assert owners[-1] == {0} and all(o == {1} for o in owners[:-1])
    forwarded = [e for s in plan.sends[:-1] for e in s.entries]
    assert all(owner == 1 for _, _, owner in forwarded)
    assert all(owner is None for _, _, owner in plan.sends[-1].entries)
    assert plan.in_place == 0  # the relay's segment covers the whole stream
