"""``daemon_pool.handed_over``, which reads a tar's members on a thread of their own: the items come
in order from that thread, what the reading raises reaches the caller after the items before it,
the thread never runs more than ``ahead`` items before the caller and stops when the caller does.
``kept_ahead``: the same bound, on the caller's thread (an encode task's decodes)."""

from __future__ import annotations

import threading
import time

import pytest

from mmcache.precompute.worker.daemon_pool import handed_over, kept_ahead


def test_items_come_in_order_from_another_thread_and_its_error_after_them():
    readers = []

    def members():
        for n in range(3):
            readers.append(threading.current_thread().name)
            yield n
        raise OSError("connection reset while reading the tar")

    got = []
    with pytest.raises(OSError, match="connection reset"):
        for item in handed_over(members(), "read-unit", 2):
            got.append(item)
    assert got == [0, 1, 2] and readers == ["read-unit"] * 3


def test_an_empty_source_ends_at_once():
    assert list(handed_over(iter(()), "read-unit", 2)) == []


def test_the_reader_stays_within_ahead_of_the_caller_and_stops_with_it():
    produced = []

    def members():
        for n in range(1000):
            produced.append(n)
            yield n

    items = handed_over(members(), "read-unit", 3)
    assert next(items) == 0
    time.sleep(0.3)  # time enough for an unbounded reader to run far ahead
    assert len(produced) <= 1 + 3 + 1  # the one taken, the queue, the one waiting to be put
    items.close()  # the caller stops early: the thread ends at its next item
    deadline = time.monotonic() + 5
    while any(t.name == "read-unit" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.name == "read-unit" for t in threading.enumerate()) and len(produced) < 10


def test_kept_ahead_advances_its_source_at_most_ahead_items_before_the_caller():
    advanced = []

    def source():
        for n in range(10):
            advanced.append(n)
            yield n

    taken = []
    for item in kept_ahead(source(), 3):
        assert len(advanced) - len(taken) <= 4, (advanced, taken)  # this one and three ahead
        taken.append(item)
    assert taken == list(range(10))
