"""Sharded embedding tables on a real Ray cluster (tests/integration/tables.py).

A table built on the meta device lives on the shards only. In sync it must end
exactly where DDP ends with the same table replicated on every worker (the shards
initialise the rows as ``tables.Recsys(meta=False)`` does); in async it must learn;
and a worker killed mid-run must resume from the tables ``save_tables()`` wrote and
end where the uninterrupted run ends.
"""

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ray.train import FailureConfig, RunConfig, ScalingConfig

from ray_ps_plugin import PSConfig, PSTrainer
from tests.integration import dlrm, loops
from tests.integration import tables as tl

pytestmark = pytest.mark.usefixtures("ray_cluster")

STEPS = 20
SCALING = ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5})
MODES = {
    "ddp": {"strategy": "ddp"},
    "sync": {"mode": "sync"},
    "async": {"mode": "async"},
    # Real tables, every worker holding them, stepped on the shards.
    "replica": {"mode": "sync", "sparse_optimizer": "shards"},
    # Real tables in async: their rows looked up on the shards and stepped there.
    "async_real": {"mode": "async"},
    # Sync with the dense gradients as sign bits (error feedback), every chunk by
    # message; the tables' rows travel as fp32.
    "onebit": {"mode": "sync", "compression": "onebit", "shared_memory": False},
}
# One worker per node: each reads its own node's shard from shared memory and asks
# the other node's shard by message.
TWO_NODES = ScalingConfig(
    num_workers=2, resources_per_worker={"CPU": 0.5}, placement_strategy="STRICT_SPREAD"
)


def _fit(
    storage: Path, name: str, mode: str, scaling: ScalingConfig = SCALING, **config: Any
) -> dict[str, Any]:
    crash = "crash_after" in config
    if crash:
        marker_dir = storage / f"{name}-markers"
        marker_dir.mkdir()
        config["marker_dir"] = str(marker_dir)
    result = PSTrainer(
        tl.table_loop,
        train_loop_config={
            "steps": STEPS,
            "optimizer": "sparse_adam",
            "meta": mode not in ("ddp", "replica", "async_real", "onebit"),
        }
        | config,
        ps_config=PSConfig(ps_timeout_s=20, **MODES[mode]),
        scaling_config=scaling,
        run_config=RunConfig(
            storage_path=str(storage),
            name=name,
            failure_config=FailureConfig(max_failures=1 if crash else 0),
        ),
    ).fit()
    with result.checkpoint.as_directory() as d:
        mlp = torch.load(Path(d) / "mlp.pt")
        return {"metrics": result.metrics, "tables": tl.tables_from_checkpoint(Path(d)), "mlp": mlp}


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory):
    storage = tmp_path_factory.mktemp("tables")
    done: dict[str, dict[str, Any]] = {}

    def get(name: str) -> dict[str, Any]:
        if name not in done:
            if name == "crash":
                done[name] = _fit(storage, name, "sync", every=5, crash_after=12)
            elif name == "two_nodes":
                done[name] = _fit(storage, name, "sync", TWO_NODES)
            elif name == "replica_crash":
                done[name] = _fit(storage, name, "replica", every=5, crash_after=12, plain=True)
            elif name == "replica":
                done[name] = _fit(storage, name, "replica", plain=True)
            elif name == "onebit":
                done[name] = _fit(storage, name, "onebit", plain=True)
            elif name == "onebit_crash":
                done[name] = _fit(
                    storage, name, "onebit", every=5, crash_after=12, plain=True, feedback=True
                )
            elif name == "async_real":
                done[name] = _fit(storage, name, "async_real", plain=True)
            elif name == "async_real_crash":
                done[name] = _fit(storage, name, "async_real", every=5, crash_after=12, plain=True)
            else:
                done[name] = _fit(storage, name, name)
        return done[name]

    return get


def _max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    diffs = [float(np.abs(a["tables"][k] - b["tables"][k]).max()) for k in a["tables"]]
    diffs += [float((a["mlp"][k] - b["mlp"][k]).abs().max()) for k in a["mlp"]]
    return max(diffs)


def test_sync_ends_with_the_parameters_of_ddp_with_the_tables_replicated(runs):
    """SparseAdam on the tables (under a StepLR schedule: the shards read the learning
    rate at every step), Adam on the MLP; ids skewed, one rank's first batch only
    padding."""
    ddp, sync = runs("ddp"), runs("sync")
    assert sync["metrics"]["initial"] == pytest.approx(ddp["metrics"]["initial"], abs=1e-6)
    assert _max_diff(ddp, sync) <= 1e-5
    assert sync["metrics"]["final"] < 0.6 * sync["metrics"]["initial"]
    stats = sync["metrics"]["stats"]
    # Only touched rows travel: far less than the tables' 4 x 560 x 8 bytes per step.
    per_step = (stats["bytes_pulled"] + stats["bytes_pushed"]) / STEPS
    assert 0 < per_step < 0.5 * 4 * sum(tl.ROWS) * tl.DIM


def test_async_trains_the_sharded_tables(runs):
    m = runs("async")["metrics"]
    assert np.isfinite(m["final"]) and m["final"] < 0.7 * m["initial"]


def test_a_killed_worker_resumes_from_the_saved_tables_and_ends_as_the_uninterrupted_run(runs):
    """Rank 1 exits after step 12; the restart loads the newest registered checkpoint
    (MLP, optimizers, schedule, and the tables through load_tables onto new shards)
    and ends with the parameters of the run that was never interrupted."""
    crash, sync = runs("crash"), runs("sync")
    # Step 10's checkpoint, or step 5's when the worker died before Ray Train's
    # controller took in the step-10 report (its poll races the two steps between).
    assert crash["metrics"]["start"] in (5, 10)
    assert _max_diff(crash, sync) <= 1e-5
    assert loops.wait_until(lambda: loops.live_shards() == 0)


def test_a_run_with_onebit_compression_resumes_with_its_errors(runs):
    """Every worker saves the errors it holds beside the checkpoint
    (``save_compression_state``), rank 0 the shards' too; the resumed run loads them
    back. It ends far closer to the uninterrupted compressed run than compressing
    moves that run from DDP: measured 0.042 against 0.48 (0.09x); resumed without
    the state, 0.104 (0.22x). Not equal: the resumed run's first step starts with
    empty errors, as every start does (DDP lays its buckets out anew after it)."""
    crash, onebit, ddp = runs("onebit_crash"), runs("onebit"), runs("ddp")
    # Step 10's checkpoint: the dying worker waits until it is registered (from
    # step 5 the bound does not hold: 0.107 measured, with 15 steps to diverge).
    assert crash["metrics"]["start"] == 10
    own = _max_diff(onebit, ddp)  # what compressing costs, over the whole run
    resumed = _max_diff(crash, onebit)  # what resuming costs
    print(f"onebit resume: own {own:.3g}, resumed {resumed:.3g}")
    assert own > 1e-2, own  # it compressed
    assert resumed < 0.15 * own, (resumed, own)
    assert onebit["metrics"]["final"] < 0.6 * onebit["metrics"]["initial"]


def test_a_lightning_loop_trains_sharded_tables_as_ddp_trains_replicated_ones(tmp_path):
    """Lightning's recipe, manual optimization with SparseAdam on the tables: the
    framework moves the module (.to) and builds DDP itself; sync ends with the rows
    DDP reaches with the tables replicated, sharded or stepped on the shards."""
    pytest.importorskip("pytorch_lightning")
    rows = {}
    for mode in ("ddp", "sync", "replica"):
        result = PSTrainer(
            tl.lightning_loop,
            train_loop_config={"meta": mode == "sync"},
            ps_config=PSConfig(ps_timeout_s=30, **MODES[mode]),
            scaling_config=SCALING,
            run_config=RunConfig(storage_path=str(tmp_path), name=f"lightning-{mode}"),
        ).fit()
        with result.checkpoint.as_directory() as d:
            rows[mode] = tl.tables_from_checkpoint(Path(d))
    for mode in ("sync", "replica"):
        for name in rows["ddp"]:
            assert np.abs(rows["ddp"][name] - rows[mode][name]).max() <= 1e-5, (mode, name)


def test_across_two_nodes_sync_still_ends_with_the_parameters_of_ddp(runs):
    """Workers on two nodes: rows of the node's own shard from shared memory, the
    other node's by message, and the same parameters as DDP."""
    assert _max_diff(runs("ddp"), runs("two_nodes")) <= 1e-5


def test_replicated_tables_stepped_on_the_shards_end_with_the_parameters_of_ddp(runs):
    """sparse_optimizer='shards': the same real tables as DDP's, SparseAdam under
    StepLR applied once on the shards, each worker's copy written from their
    answers; DDP's parameters, and only touched rows travel."""
    ddp, replica = runs("ddp"), runs("replica")
    assert replica["metrics"]["initial"] == pytest.approx(ddp["metrics"]["initial"], abs=1e-6)
    assert _max_diff(ddp, replica) <= 1e-5
    stats = replica["metrics"]["stats"]
    per_step = (stats["bytes_pulled"] + stats["bytes_pushed"]) / STEPS
    assert 0 < per_step < 0.5 * 4 * sum(tl.ROWS) * tl.DIM


def test_replicated_tables_stepped_on_the_shards_resume_from_torchs_state_dicts(runs):
    """Checkpoints as DDP's loop writes them (rank 0: the tables' weights and
    optimizer.state_dict(), which reads SparseAdam's state from the shards). Rank 1
    exits after step 12; the restart loads the weights and the optimizer's state
    dict, which go to the new shards at the first step, and the run ends as the
    uninterrupted one."""
    crash, replica = runs("replica_crash"), runs("replica")
    assert crash["metrics"]["start"] in (5, 10)
    assert _max_diff(crash, replica) <= 1e-5
    assert loops.wait_until(lambda: loops.live_shards() == 0)


def test_async_looks_real_tables_up_on_the_shards_and_checkpoints_their_rows(runs):
    """Async with real tables (sparse_optimizer's default there): the rows live on
    the shards, forward looks up the batch's, so only touched rows travel; the loop
    learns; the checkpoint, written through state_dict() as a DDP loop writes it,
    holds the shards' trained rows, not rank 0's initial copy."""
    ddp, run = runs("ddp"), runs("async_real")
    m = run["metrics"]
    assert np.isfinite(m["final"]) and m["final"] < 0.7 * m["initial"]
    stats = m["stats"]
    per_step = (stats["bytes_pulled"] + stats["bytes_pushed"]) / STEPS
    assert 0 < per_step < 0.5 * 4 * sum(tl.ROWS) * tl.DIM
    initial = tl.Recsys(meta=False)
    for name in ("bags", "items"):
        start = getattr(initial, name).weight.detach().numpy()
        moved = np.abs(run["tables"][name] - start).max(axis=1) > 0
        trained = np.abs(ddp["tables"][name] - start).max(axis=1) > 0
        assert moved.sum() >= 0.5 * trained.sum(), name


def test_async_with_real_tables_resumes_from_torchs_state_dicts(runs):
    """Rank 1 exits after step 12; the restart loads the tables' weights (which go
    to the new shards at once, every rank waiting) and the optimizer's state dict,
    and the run learns on from there."""
    run, first = runs("async_real_crash"), runs("async_real")
    m = run["metrics"]
    assert m["start"] in (5, 10)
    # The restart's first loss is the checkpoint's, already below the untrained one.
    assert m["initial"] < 0.9 * first["metrics"]["initial"]
    assert np.isfinite(m["final"]) and m["final"] < 0.7 * first["metrics"]["initial"]
    assert loops.wait_until(lambda: loops.live_shards() == 0)


#: A DLRM-shaped model (tests/integration/dlrm.py): tables of different sizes, ids
#: from a Zipf law with a hot last row, the field's SGD recipe.
DLRM_ROWS = [100, 500, 1000, 5000, 20000, 50000]
DLRM_STEPS = 160


def _fit_dlrm(storage: Path, name: str, cfg: PSConfig) -> list[list[dict[str, torch.Tensor]]]:
    # The DDP reference may restart once: a CI run lost it to gloo aborting a worker
    # (SIGABRT) while DDP set up its process group. The loop reads no checkpoint, so a
    # restart trains from step 0 to the same bits. The PS runs under test may not.
    retries = 1 if cfg.strategy == "ddp" else 0
    result = PSTrainer(
        dlrm.dlrm_loop,
        train_loop_config={"rows": DLRM_ROWS, "steps": DLRM_STEPS, "seeds": [0, 1]},
        ps_config=cfg,
        scaling_config=SCALING,
        run_config=RunConfig(
            storage_path=str(storage), name=name, failure_config=FailureConfig(max_failures=retries)
        ),
    ).fit()
    return dlrm.final_parameters(result, 2)


def test_dlrm_with_sgd_on_the_shards_ends_with_ddps_bits(tmp_path):
    """DLRM's recipe (one SGD over every parameter under a warm-up and a decay) for
    160 steps and two seeds: with the optimizer on the shards, and by default,
    every rank ends with DDP's parameters bit for bit. Bits, not a tolerance: one
    rounding apart at step 0 grew to 2e-5 by step 57 in a run of DLRM's own model
    (a ReLU input that rounds to the other side of zero changes a sample's
    backward), while shorter runs stayed within 3e-8."""
    ddp = _fit_dlrm(tmp_path, "dlrm-ddp", PSConfig(strategy="ddp"))
    for name, cfg in {
        "shards": PSConfig(mode="sync", sparse_optimizer="shards", ps_timeout_s=30),
        "default": PSConfig(mode="sync", ps_timeout_s=30),
    }.items():
        ps = _fit_dlrm(tmp_path, f"dlrm-{name}", cfg)
        for rank in range(2):
            for seed, (want, got) in enumerate(zip(ddp[rank], ps[rank])):
                for k in want:
                    diff = float((want[k] - got[k]).abs().max())
                    assert diff == 0.0, f"{name}: rank {rank}, seed {seed}, {k} {diff:.2e} apart"
