"""The prefetcher: shards of upcoming steps, built ahead on a thread."""
from __future__ import annotations

import threading
import time

import pytest

from multipod.controller.core.errors import RunError
from multipod.controller.data.batches import DataError, Prefetcher
from multipod.protos import codec
from tests.unit.controller.fakes import FakeBatches


def test_yields_steps_in_order_with_the_data_offset_applied():
    prefetch = Prefetcher(FakeBatches(rows=4), num_pods=2, start=3, stop=7, depth=2, offset=10)
    try:
        for step in range(3, 7):
            got, shards = prefetch.next(5.0)
            assert got == step and len(shards.tokens) == 2
            parts = [codec.decode(s) for s in shards.tokens]
            assert all(p.shape == (2, 9) and (p == step + 10).all() for p in parts)
        with pytest.raises(RunError):
            prefetch.next(0.1)        # nothing after the last step
    finally:
        prefetch.close()


class _Stalled:
    def __init__(self):
        self.release = threading.Event()

    def batch(self, index):
        self.release.wait(10)
        return FakeBatches().batch(index)

    def loss_mask(self, index):
        return None


def test_a_stalled_producer_is_a_deadline_error():
    batches = _Stalled()
    prefetch = Prefetcher(batches, num_pods=1, start=0, stop=3)
    started = time.monotonic()
    try:
        with pytest.raises(RunError, match=r"no batch within 0.2s"):
            prefetch.next(0.2)
        assert time.monotonic() - started < 2
    finally:
        batches.release.set()
        prefetch.close()


class _Broken:
    def batch(self, index):
        raise DataError("corpus vanished")


def test_a_producer_error_is_raised_by_next_not_swallowed():
    prefetch = Prefetcher(_Broken(), num_pods=1, start=0, stop=3)
    try:
        with pytest.raises(DataError, match="corpus vanished"):
            prefetch.next(5.0)
    finally:
        prefetch.close()


def test_close_stops_the_thread_even_when_the_queue_is_full():
    prefetch = Prefetcher(FakeBatches(), num_pods=1, start=0, stop=1000, depth=1)
    deadline = time.monotonic() + 5
    while prefetch._queue.qsize() < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert prefetch.running
    prefetch.close()
    assert not prefetch.running
