"""Shared-memory segments: what one process writes, another mapping sees."""

import numpy as np
import pytest

from ray_ps_plugin import _shm
from ray_ps_plugin._shm import Segment

pytestmark = pytest.mark.skipif(not _shm.available(), reason="needs Linux memfd")


def test_a_second_mapping_sees_the_same_memory():
    a = Segment.create(64)
    b = Segment.open(a.handle)  # as another process would, through /proc
    a.view(8, np.float32, 4)[:] = [1, 2, 3, 4]
    np.testing.assert_array_equal(b.view(8, np.float32, 4), [1, 2, 3, 4])
    b.view(0, np.int16, 2)[:] = 7
    assert a.bytes[0] == 7
    b.close()
    a.close()


def test_views_outside_the_segment_are_refused():
    seg = Segment.create(16)
    with pytest.raises(ValueError, match="outside the 16-byte segment"):
        seg.view(8, np.float32, 3)
    seg.close()


def test_a_handle_whose_creator_closed_it_cannot_be_opened():
    seg = Segment.create(16)
    handle = seg.handle
    seg.close()
    with pytest.raises(OSError):
        Segment.open(handle)


def test_a_shard_that_cannot_be_attached_falls_back_with_a_warning(caplog):
    created_here = []

    def attach(shard, created):
        created.append(Segment.create(8))
        created_here.extend(created)
        if shard == 1:
            raise OSError("permission denied")
        return f"lane {shard}"

    lanes = _shm.attach_each([0, 1], rank=3, attach=attach)
    assert lanes == {0: "lane 0"}
    assert "rank 3: no shared memory with shard 1 (permission denied)" in caplog.text
    assert created_here[1].bytes.size == 0  # the failed shard's segment was released


def test_a_handle_naming_another_file_is_refused():
    """A reused pid/fd must not pass for the segment: identity is checked."""
    import dataclasses

    seg = Segment.create(64)
    forged = dataclasses.replace(seg.handle, ino=seg.handle.ino + 1)
    with pytest.raises(OSError, match="not the file found there"):
        Segment.open(forged)
    seg.close()


def test_an_empty_segment_is_a_segment_of_zero_bytes():
    """A shard's slice of a model smaller than the shard count is empty: its segment
    must still open, report 0 bytes (so size checks stay exact) and hold nothing."""
    seg = Segment.create(0)
    other = Segment.open(seg.handle)
    try:
        assert seg.handle.nbytes == other.handle.nbytes == 0
        assert other.view(0, np.float32, 0).size == 0
        with pytest.raises(ValueError, match="outside"):
            other.view(0, np.uint8, 1)
    finally:
        other.close()
        seg.close()
