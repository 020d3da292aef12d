"""Fixtures shared by the unit tests."""

import pytest

from tests.unit.fakes import LoopThread


@pytest.fixture
def loop():
    """The fake shards' event loop, on a thread of its own; stopped after the test."""
    lt = LoopThread()
    yield lt
    lt.stop()
