"""One real local Ray cluster for the whole integration session."""

import os

# Ray Train waits for the controller's poll on every report; 2 s by default.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import pytest  # noqa: E402
import ray  # noqa: E402
from ray import cloudpickle  # noqa: E402

from tests.integration import digits, faults, loops  # noqa: E402

# Workers cannot import the tests package; ship the loops by value.
cloudpickle.register_pickle_by_value(loops)
cloudpickle.register_pickle_by_value(digits)
cloudpickle.register_pickle_by_value(faults)


@pytest.fixture(scope="session")
def ray_cluster():
    # Logical CPUs: workers ask for fractions, so 4 keeps two runs schedulable on
    # a 2-core machine without oversubscribing real work.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def storage(tmp_path):
    return str(tmp_path / "ray_results")
