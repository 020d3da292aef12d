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
