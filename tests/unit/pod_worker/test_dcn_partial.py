"""A failed slot's partial sums on the data plane (Exchange.send_partial / receive_partial, degraded
mode with the slot's microbatches split over the live pods): they arrive bitwise, raw float32
whatever the compression; a partial-sum chunk that does not fit (a slot that has not failed, off
the grid, the wrong size, a repeat, a healthy exchange) is refused and writes nothing, and the
link goes on; misuse is refused with a clear error; a partial sum that never comes fails the
wait at the deadline."""
from __future__ import annotations

import numpy as np
import pytest

from multipod.pod_worker.dcn import ExchangeError
from multipod.pod_worker.dcn.plan import PHASE_PARTIAL_BASE
from tests.unit.pod_worker.test_dcn import authenticated, send_chunk, wait_for
from tests.unit.pod_worker.test_dcn_degraded import CHUNK, LEAVES, cluster_factory, slot_gradients  # noqa: F401

HOSTS = (0, 0, 2)      # pod 1 failed; pod 0 hosts its slot
PER_CHUNK = CHUNK // 4


def _close(exchanges) -> None:
    for ex in exchanges.values():
        ex.close()


@pytest.mark.parametrize("compression", ["none", "int8"])
def test_a_partial_sum_arrives_bitwise(cluster_factory, compression):  # noqa: F811
    cluster = cluster_factory(3)
    exchanges = cluster.exchanges("partial", hosts=HOSTS, compression=compression)
    try:
        for ex in exchanges.values():
            ex.inbox.set_next_step(0)
        partial = slot_gradients(1, seed=3)[0]
        partial[0].flat[0] = -0.0
        losses = np.array([3.5, -0.0], np.float32)
        sent = exchanges[2].send_partial(0, 1, 0, partial, losses)
        assert sent == sum(leaf.nbytes for leaf in partial) + 8        # raw: never compressed
        got, got_losses = exchanges[0].receive_partial(0, 1, 2)
        for a, b in zip(got, partial):
            assert a.shape == b.shape and a.tobytes() == b.tobytes()
        assert got_losses.tobytes() == losses.tobytes()
    finally:
        _close(exchanges)


@pytest.mark.parametrize("fields,size,message", [
    (dict(phase=PHASE_PARTIAL_BASE + 2), PER_CHUNK, "phase 50 is not used"),       # slot 2 has not failed
    (dict(offset=4), PER_CHUNK, "not on the grid of slot 1's partial sums"),
    (dict(), PER_CHUNK - 1, "expected 600"),
    (dict(leaf=1), 4, "expected 12"),                                               # leaf 1 has 3 values
])
def test_a_partial_chunk_that_does_not_fit_is_refused_and_writes_nothing(cluster_factory, fields, size, message):  # noqa: F811
    cluster = cluster_factory(3)
    exchanges = cluster.exchanges("partial", hosts=HOSTS)
    try:
        inbox = exchanges[0].inbox
        inbox.set_next_step(0)
        conn = authenticated(cluster.addresses[0], 2, 0, run="partial")
        try:
            header = dict(dict(pod=2, phase=PHASE_PARTIAL_BASE + 1, leaf=4, offset=0), **fields)
            send_chunk(conn, np.full(size, 7, np.float32).tobytes(), **header)
            wait_for(lambda: cluster.listeners[0].refused >= 1)
        finally:
            conn.close()
        assert message in cluster.listeners[0].refusals[-1]
        assert not [key for key in inbox.state(0).slots if key[0] >= PHASE_PARTIAL_BASE]    # nothing made
        partial = slot_gradients(1, seed=4)[0]       # the real partial sum still comes through
        exchanges[2].send_partial(0, 1, 0, partial, np.zeros(2, np.float32))
        got, _ = exchanges[0].receive_partial(0, 1, 2)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(got, partial))
    finally:
        _close(exchanges)


@pytest.mark.parametrize("degraded", [True, False], ids=["repeated", "healthy-exchange"])
def test_a_repeated_partial_chunk_or_one_in_a_healthy_exchange_is_refused(cluster_factory, degraded):  # noqa: F811
    cluster = cluster_factory(3)
    exchanges = cluster.exchanges("partial", hosts=HOSTS if degraded else None)
    try:
        exchanges[0].inbox.set_next_step(0)
        payload = np.full(PER_CHUNK, 7, np.float32).tobytes()
        conn = authenticated(cluster.addresses[0], 2, 0, run="partial")
        try:
            for _ in range(2 if degraded else 1):
                send_chunk(conn, payload, pod=2, phase=PHASE_PARTIAL_BASE + 1, leaf=4, offset=0)
            wait_for(lambda: cluster.listeners[0].refused >= 1)
        finally:
            conn.close()
        message = "duplicate chunk at offset 0 of slot 1's partial sum" if degraded else "phase 49 is not used"
        assert message in cluster.listeners[0].refusals[-1]
    finally:
        _close(exchanges)


def test_misuse_is_refused_and_a_missing_partial_sum_fails_at_the_deadline(cluster_factory):  # noqa: F811
    cluster = cluster_factory(3)
    exchanges = cluster.exchanges("partial", hosts=HOSTS, timeout_s=0.5)
    try:
        partial = slot_gradients(1)[0]
        losses = np.zeros(2, np.float32)
        with pytest.raises(ValueError, match="slot 2 is not a failed pod's slot"):
            exchanges[0].send_partial(0, 2, 2, partial, losses)
        with pytest.raises(ValueError, match="pod 1 is not another live pod"):
            exchanges[0].send_partial(0, 1, 1, partial, losses)
        with pytest.raises(ValueError, match="expected 35 float32"):
            exchanges[0].send_partial(0, 1, 2, [leaf.astype(np.float64) for leaf in partial], losses)
        with pytest.raises(ValueError, match="the losses of a partial sum: 3"):
            exchanges[0].send_partial(0, 1, 2, partial, np.zeros(3, np.float32))
        exchanges[0].inbox.set_next_step(0)
        with pytest.raises(ExchangeError, match="slot 1's partial sum from pod 2"):
            exchanges[0].receive_partial(0, 1, 2)
    finally:
        _close(exchanges)
