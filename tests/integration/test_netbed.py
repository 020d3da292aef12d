"""Two Ray nodes in network namespaces behind 1 Gbit/s links (benchmarks/netbed.py).

DDP and PS sync train the same tiny model with one worker per node; their final
parameters must agree, and the PS shards must sit on the workers' nodes. The training
runs in a separate driver process inside the bed's head namespace: this pytest
process may already be connected to another Ray cluster. Needs root, ``ip`` and ``tc``.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
netbed = importlib.import_module("netbed")

_REASON = netbed.unavailable_reason(probe=False)
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

DRIVER = Path(__file__).with_name("netbed_driver.py")


@pytest.fixture(scope="module")
def bed_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Builds a 2-node bed, runs the driver in it, always tears the bed down.

    About 45 s on an idle 2-core machine; the bounds are generous because a loaded
    machine starts Ray's worker processes several times slower.
    """
    reason = netbed.unavailable_reason(probe=True)
    if reason:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("netbed") / "runs.json"
    bed = netbed.NetBed(
        nodes=2, cpus_per_node=2, shape=netbed.LinkShape(rate="1gbit"), start_timeout_s=60
    )
    try:
        bed.start()
        before = bed.link_bytes(1)
        proc = bed.run(
            [sys.executable, str(DRIVER), "--out", str(out), "--steps", "5"],
            timeout=200,
            capture=True,
        )
        after = bed.link_bytes(1)
    finally:
        bed.stop()
    assert proc.returncode == 0, f"driver failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return {
        "runs": json.loads(out.read_text()),
        "bed": bed.name,
        "node1_bytes": {k: after[k] - before[k] for k in after},
    }


def test_sync_ps_equals_ddp_across_shaped_links(bed_run: dict[str, Any]) -> None:
    ddp, ps = bed_run["runs"]["ddp"]["params"], bed_run["runs"]["ps"]["params"]
    assert ddp.keys() == ps.keys()
    import torch

    diff = max((torch.tensor(ddp[k]) - torch.tensor(ps[k])).abs().max().item() for k in ddp)
    assert diff <= 1e-5


def test_workers_and_shards_sit_on_both_nodes(bed_run: dict[str, Any]) -> None:
    for name in ("ddp", "ps"):
        assert len(set(bed_run["runs"][name]["worker_nodes"])) == 2, name
    ps = bed_run["runs"]["ps"]
    shards = ps["server_node_ids"]
    assert len(set(shards)) == 2
    # Shard i is colocated with worker i.
    assert shards == ps["worker_nodes"]


def test_traffic_crossed_the_worker_nodes_link(bed_run: dict[str, Any]) -> None:
    # Node 1 only runs a worker (and its shard): everything it exchanged with the
    # head went through its shaped link.
    assert bed_run["node1_bytes"]["tx"] > 0 and bed_run["node1_bytes"]["rx"] > 0


def test_bed_left_nothing_behind(bed_run: dict[str, Any]) -> None:
    left = [ns for ns in netbed.list_namespaces() if ns.startswith(f"{bed_run['bed']}_")]
    assert left == []
    assert not list(Path("/tmp").glob(f"{bed_run['bed']}_*"))
