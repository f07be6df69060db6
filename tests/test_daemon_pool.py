"""``daemon_pool.handed_over``, which reads a tar's members on a thread of their own: the items come
in order from that thread, and what the reading raises reaches the caller after the items before it."""

from __future__ import annotations

import threading

import pytest

from mmcache.precompute.daemon_pool import handed_over


def test_items_come_in_order_from_another_thread_and_its_error_after_them():
    readers = []

    def members():
        for n in range(3):
            readers.append(threading.current_thread().name)
            yield n
        raise OSError("connection reset while reading the tar")

    got = []
    with pytest.raises(OSError, match="connection reset"):
        for item in handed_over(members(), "read-unit"):
            got.append(item)
    assert got == [0, 1, 2] and readers == ["read-unit"] * 3


def test_an_empty_source_ends_at_once():
    assert list(handed_over(iter(()), "read-unit")) == []
