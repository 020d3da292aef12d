"""Session-wide test policy: under CI a skipped test is a failure of the set-up,
except the GPU tests (CI has no GPU).

A skip hides a missing install step: the network-bed tests skip without root,
``ip``, ``tc`` or ``nft``, and a green run would then have run less than it says.
"""

import os

import pytest

_UNEXPECTED: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # An expected failure reports as skipped too; it hides no missing install.
    if report.skipped and "gpu" not in report.keywords and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _UNEXPECTED.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("CI") and _UNEXPECTED and exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus: int) -> None:
    if not _UNEXPECTED:
        return
    verdict = "fail the run (CI is set)" if os.environ.get("CI") else "would fail under CI"
    terminalreporter.section("skips other than the GPU tests")
    terminalreporter.write_line(f"{len(_UNEXPECTED)} such skip(s) {verdict}:")
    for line in _UNEXPECTED:
        terminalreporter.write_line(f"  {line}")


#: Integration files, the longest first (their time on the 2-core CI machine, from
#: ``--durations``). ``make test`` runs two pytest-xdist workers that take whole files
#: in collection order (``--dist loadfile --no-loadscope-reorder``); starting with the
#: longest keeps both busy until the end. It changes the order only, never a result.
_LONGEST_FIRST = (
    "test_worker_loss",
    "test_faults",
    "test_tables",
    "test_multinode",
    "test_compat",
    "test_modes",
    "test_netbed",
    "test_frameworks",
    "test_replication",
    "test_tune",
    "test_sync",
    "test_gpu",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    # A stable sort: each file's tests stay together and in their order, and every
    # file not named keeps its place after the named ones.
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))
