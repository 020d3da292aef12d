"""Async and SSP on a real local Ray cluster: accuracy, staleness bound, duplicates,
checkpoints holding the servers' parameters, unchanged optimizer loops."""

import json

import pytest
from ray.train import FailureConfig, RunConfig, ScalingConfig

from ray_ps_plugin import PSTrainer
from tests.integration import digits, loops

pytestmark = pytest.mark.usefixtures("ray_cluster")

SCALING = ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5})
EPOCHS = 5  # 95 steps per worker; StepLR halves the rate every 40 steps
BASE = {"epochs": EPOCHS, "lr_step": 40, "final_barrier": True}
SGD = {**BASE, "optimizer": "sgd", "lr": 0.05}
ADAM = {**BASE, "optimizer": "adam", "lr": 3e-3}
# A straggler: rank 1 sleeps after every step.
STRAGGLER = {"slow_rank": 1, "step_sleep_s": 0.01}


def _fit(storage, name, config, **ps):
    trainer = PSTrainer(
        digits.digits_loop,
        train_loop_config=config,
        ps_config=loops.LoggedReadsConfig(**ps),
        scaling_config=SCALING,
        run_config=RunConfig(storage_path=storage, name=name, failure_config=FailureConfig(0)),
    )
    return trainer.fit()


# Each fit runs when a test first needs it, so a test's time limit covers only the
# fits it reads (all eight in one fixture set-up once ran past the limit on a
# loaded CI machine).
FITS = {
    "sync_sgd": (SGD, {}),
    "async_sgd": (SGD, {"mode": "async"}),
    # A short async run with a straggler: the fast worker must run ahead.
    "async_straggler": ({**SGD, **STRAGGLER, "epochs": 2, "out_dir": "async"}, {"mode": "async"}),
    "ssp0_sgd": (SGD, {"mode": "ssp", "staleness": 0}),
    "sync_adam": (ADAM, {}),
    "ssp2_adam": ({**ADAM, **STRAGGLER, "out_dir": "ssp"}, {"mode": "ssp", "staleness": 2}),
    # Compression applies to object-store traffic; shared memory (the default
    # between a worker and the shards of its node) stays fp32. Force the object
    # store so that every byte is encoded (and that path is covered too).
    "sync_sgd_bf16": (SGD, {"compression": "bf16", "shared_memory": False}),
    "async_sgd_fp16": (SGD, {"mode": "async", "compression": "fp16", "shared_memory": False}),
    # Scaled sign with error feedback on every push and every sum.
    "sync_sgd_onebit": (SGD, {"compression": "onebit", "shared_memory": False}),
    # DiLoCo: one local step with plain averaging is sync's maths; 32 local steps
    # (3 rounds of 32, 31 and 32 steps... here 95 = 2 x 32 + 31) with Nesterov.
    "diloco_h1_average": (SGD, {"mode": "diloco", "local_steps": 1, "outer_optimizer": "average"}),
    "diloco_h32": (SGD, {"mode": "diloco", "local_steps": 32}),
    # Round changes as 4-bit levels with error feedback, every round by message.
    "diloco_h32_int4": (
        SGD,
        {"mode": "diloco", "local_steps": 32, "compression": "int4", "shared_memory": False},
    ),
    "diloco_async_straggler": (
        {**SGD, **STRAGGLER, "out_dir": "diloco"},
        {"mode": "diloco", "local_steps": 8, "diloco_rounds": "async", "staleness": 2},
    ),
}


class _Runs:
    """The module's fits, each run once, on first use."""

    def __init__(self, storage, out_dir):
        self._storage = storage
        self.out_dir = out_dir
        self._done = {}

    def __getitem__(self, name):
        if name not in self._done:
            config, ps = FITS[name]
            if "out_dir" in config:
                (self.out_dir / config["out_dir"]).mkdir(exist_ok=True)
                config = {**config, "out_dir": str(self.out_dir / config["out_dir"])}
            self._done[name] = _fit(self._storage, name, config, **ps)
        return self._done[name]


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory):
    return _Runs(str(tmp_path_factory.mktemp("modes")), tmp_path_factory.mktemp("ranks"))


@pytest.mark.parametrize(("name", "sync"), [("async_sgd", "sync_sgd"), ("ssp2_adam", "sync_adam")])
def test_async_and_ssp_reach_sync_accuracy_within_two_points(runs, name, sync):
    acc, ref = runs[name].metrics["accuracy"], runs[sync].metrics["accuracy"]
    assert ref > 0.9, "the sync baseline itself must have learned the task"
    assert acc >= ref - 0.02, (name, acc, ref)


@pytest.mark.parametrize("name", ["async_sgd", "ssp0_sgd", "ssp2_adam"])
def test_user_optimizer_and_scheduler_run_unchanged(runs, name):
    m = runs[name].metrics
    lr0 = SGD["lr"] if "sgd" in name else ADAM["lr"]
    assert m["steps"] == 95 and m["ps"]["clock"] == 95
    assert m["lr"] == pytest.approx(lr0 * 0.25)  # StepLR applied twice, locally


def test_ssp_zero_is_sync_maths_for_momentum_sgd(runs):
    # Deltas of momentum SGD are linear in the gradients: the mean of the workers'
    # deltas is DDP's step, so bulk-synchronous SSP ends where sync does.
    sync, ssp0 = loops.load_state(runs["sync_sgd"]), loops.load_state(runs["ssp0_sgd"])
    diff = max((sync[k] - ssp0[k]).abs().max().item() for k in sync)
    assert diff <= 1e-4
    assert runs["ssp0_sgd"].metrics["ps"]["staleness_max"] == 0


def test_ssp_never_exceeds_its_staleness_bound(runs):
    probe = runs["ssp2_adam"].metrics["probe"]
    # Every read the shards answered (rank, reader clock, slowest clock included).
    assert probe["reads"] >= 2 * 95 and probe["max_read_gap"] <= 2
    # The shards' own counter agrees with the log the instrumented shard kept.
    assert probe["max_read_gap_counter"] == probe["max_read_gap"]
    for rank in (0, 1):
        stats = json.loads((runs.out_dir / "ssp" / f"rank{rank}.json").read_text())["ps"]
        assert stats["staleness_max"] <= 2 and stats["clock"] == 95
        assert stats["clocks"] == [95, 95]  # after the final flush + barrier


def test_the_fast_worker_ran_ahead_under_async_and_lost_no_update(runs):
    # Rank 1 sleeps after every step: rank 0 trains on parameters that lack some of
    # rank 1's updates (staleness > 0), yet every update of both reaches the shards.
    m = runs["async_straggler"].metrics
    steps = m["steps"]
    fast = json.loads((runs.out_dir / "async" / "rank0.json").read_text())["ps"]
    assert fast["staleness_max"] >= 1
    assert m["probe"]["max_read_gap"] >= 1
    assert m["ps"]["clocks"] == [steps, steps]
    assert m["probe"]["pushes"] == 2 * steps * 2  # 2 workers x 2 shards


@pytest.mark.parametrize("name", ["async_sgd", "ssp2_adam"])
def test_checkpoint_holds_the_servers_parameters(runs, name):
    probe = runs[name].metrics["probe"]
    assert probe["checkpoint_vs_server"] == 0.0


@pytest.mark.parametrize("name", ["async_sgd", "ssp0_sgd"])
def test_a_redelivered_push_is_applied_once(runs, name):
    probe = runs[name].metrics["probe"]
    assert probe["duplicates"] == 2  # one redelivery per shard, each ignored
    assert probe["duplicate_changed"] == 0.0


@pytest.mark.parametrize(
    ("name", "ref", "acc_ref", "points"),
    [
        ("sync_sgd_bf16", "sync_sgd", "sync_sgd", 0.01),
        # Two async runs differ by about a point on their own (updates interleave
        # differently every run: 0.924 against 0.935 seen in CI), so async with fp16
        # is held to the bound async itself meets against sync.
        ("async_sgd_fp16", "async_sgd", "sync_sgd", 0.02),
    ],
)
def test_16_bit_compression_halves_bytes_and_keeps_accuracy(runs, name, ref, acc_ref, points):
    m, r = runs[name].metrics, runs[ref].metrics
    acc = runs[acc_ref].metrics["accuracy"]
    assert m["accuracy"] >= acc - points, (m["accuracy"], acc)
    assert m["ps"]["bytes_pushed"] * 2 == r["ps"]["bytes_pushed"]
    assert m["ps"]["bytes_pulled"] * 2 == r["ps"]["bytes_pulled"]


def test_onebit_compression_sends_25_times_fewer_bytes_and_keeps_accuracy(runs):
    """Every chunk and sum crosses as 1.25 bits a value (a sign, and a scale per 128
    values); error feedback keeps digits accuracy within 2 points of fp32 sync."""
    m, r = runs["sync_sgd_onebit"].metrics, runs["sync_sgd"].metrics
    assert m["accuracy"] >= r["accuracy"] - 0.02, (m["accuracy"], r["accuracy"])
    for direction in ("bytes_pushed", "bytes_pulled"):
        ratio = r["ps"][direction] / m["ps"][direction]
        assert 24.0 <= ratio <= 25.6, (direction, ratio)


def test_diloco_int4_rounds_push_7_5_times_fewer_bytes(runs):
    m, r = runs["diloco_h32_int4"].metrics["ps"], runs["diloco_h32"].metrics["ps"]
    assert 7.3 <= r["bytes_pushed"] / m["bytes_pushed"] <= 7.5
    assert m["clock"] == r["clock"]  # the same rounds


def test_diloco_with_one_local_step_and_plain_averaging_is_sync_maths(runs):
    sync, diloco = loops.load_state(runs["sync_sgd"]), loops.load_state(runs["diloco_h1_average"])
    diff = max((sync[k] - diloco[k]).abs().max().item() for k in sync)
    assert diff <= 1e-5, diff
    assert runs["diloco_h1_average"].metrics["ps"]["clock"] == 95  # a round per step


@pytest.mark.parametrize(
    ("name", "points"),
    [("diloco_h32", 0.01), ("diloco_h32_int4", 0.01), ("diloco_async_straggler", 0.02)],
)
def test_diloco_reaches_sync_accuracy(runs, name, points):
    m, ref = runs[name].metrics, runs["sync_sgd"].metrics
    assert m["accuracy"] >= ref["accuracy"] - points, (m["accuracy"], ref["accuracy"])
    assert m["steps"] == 95 and m["lr"] == pytest.approx(SGD["lr"] * 0.25)


def test_diloco_sends_a_round_every_local_steps_and_the_last_at_the_end(runs):
    m = runs["diloco_h32"].metrics
    assert m["ps"]["clock"] == 3  # steps 32, 64 and the last 31 at the loop's end
    assert m["probe"]["rounds"] == [3, 3]  # both shards applied three rounds
    # Bytes: one push and one reply of the whole model per round, not per step.
    h1 = runs["diloco_h1_average"].metrics["ps"]
    assert m["ps"]["bytes_pushed"] * 95 == h1["bytes_pushed"] * 3


def test_async_diloco_lets_the_fast_worker_run_ahead_within_the_bound(runs):
    m = runs["diloco_async_straggler"].metrics
    fast = json.loads((runs.out_dir / "diloco" / "rank0.json").read_text())["ps"]
    assert fast["clock"] == 12  # 11 rounds of 8 steps, the last 7 at the end
    assert 1 <= m["probe"]["max_read_gap"] <= 2


def test_no_server_outlives_the_runs(runs):
    for name in FITS:  # runs any fit no test has read yet, so all are checked
        runs[name]
    assert loops.wait_until(lambda: loops.live_shards() == 0)
    assert loops.wait_until(lambda: loops.live_placement_groups() == 0)
