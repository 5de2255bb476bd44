"""The state vote on the data plane (Exchange.send_vote / check_votes): before a step is applied,
every live pod checks that every other one started it from its own state, so that a pod whose
state was silently corrupted after an update cannot change anyone's parameters with a gradient
computed from it. Equal votes pass on every pod; a differing one fails the step on every pod,
naming every pod's state; a vote that does not fit is refused and the link goes on; a vote that
never comes fails at the deadline; degraded mode votes among the live pods only."""
from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

from multipod.pod_worker.dcn import ExchangeError, StateVoteError
from multipod.pod_worker.dcn.plan import PHASE_VOTE
from tests.unit.pod_worker.test_dcn import authenticated, send_chunk, wait_for
from tests.unit.pod_worker.test_dcn_degraded import cluster_factory  # noqa: F401


def _vote_all(exchanges, states: dict[int, int], step: int = 0) -> dict[int, object]:
    """Every exchange votes its state, then checks; {pod: None or the error}."""
    for ex in exchanges.values():
        ex.inbox.set_next_step(step)
    for pod, ex in exchanges.items():
        ex.send_vote(step, states[pod])

    def check(pod):
        try:
            exchanges[pod].check_votes(step, states[pod])
            return None
        except ExchangeError as exc:
            return exc
    with concurrent.futures.ThreadPoolExecutor(len(exchanges)) as pool:
        return dict(zip(exchanges, pool.map(check, exchanges)))


def _close(exchanges) -> None:
    for ex in exchanges.values():
        ex.close()


def test_equal_states_pass_and_a_corrupted_one_fails_the_step_on_every_pod(cluster_factory):  # noqa: F811
    cluster = cluster_factory(3)
    exchanges = cluster.exchanges("vote")
    try:
        assert _vote_all(exchanges, {0: 7, 1: 7, 2: 7}, step=0) == {0: None, 1: None, 2: None}
        states = {0: 7, 1: 7 ^ (1 << 63), 2: 7}
        errors = _vote_all(exchanges, states, step=1)
        for pod, error in errors.items():
            assert isinstance(error, StateVoteError), (pod, error)
            assert error.step == 1 and error.states == states
            assert "pod 1: 8000000000000007" in str(error) and "not applied" in str(error)
    finally:
        _close(exchanges)


def test_degraded_mode_votes_among_the_live_pods_only(cluster_factory):  # noqa: F811
    cluster = cluster_factory(3)
    exchanges = cluster.exchanges("vote-degraded", hosts=(0, 0, 2))      # pod 1 failed
    try:
        assert sorted(exchanges) == [0, 2]
        assert _vote_all(exchanges, {0: 5, 2: 5}) == {0: None, 2: None}
    finally:
        _close(exchanges)


@pytest.mark.parametrize("fields,payload,message", [
    (dict(leaf=1), np.uint64(5).tobytes(), "a state vote is one uint64 at leaf 0, offset 0"),
    (dict(offset=1), np.uint64(5).tobytes(), "a state vote is one uint64 at leaf 0, offset 0"),
    (dict(), b"1234", "4 bytes"),
])
def test_a_vote_that_does_not_fit_is_refused_and_the_link_goes_on(cluster_factory, fields, payload, message):  # noqa: F811
    cluster = cluster_factory(2)
    exchanges = cluster.exchanges("vote-bad")
    try:
        exchanges[0].inbox.set_next_step(0)
        conn = authenticated(cluster.addresses[0], 1, 0, run="vote-bad")
        try:
            send_chunk(conn, payload, **dict(dict(pod=1, phase=PHASE_VOTE, leaf=0, offset=0), **fields))
            wait_for(lambda: cluster.listeners[0].refused >= 1)
            assert message in cluster.listeners[0].refusals[-1]
            # The same link then delivers a good vote.
            send_chunk(conn, np.uint64(9).tobytes(), pod=1, phase=PHASE_VOTE, leaf=0, offset=0)
            exchanges[0].check_votes(0, 9)
            send_chunk(conn, np.uint64(9).tobytes(), pod=1, phase=PHASE_VOTE, leaf=0, offset=0)
            wait_for(lambda: cluster.listeners[0].refused >= 2)
            assert "a second state vote of pod 1 for step 0" in cluster.listeners[0].refusals[-1]
        finally:
            conn.close()
    finally:
        _close(exchanges)


def test_a_vote_that_never_comes_fails_at_the_deadline(cluster_factory):  # noqa: F811
    cluster = cluster_factory(2)
    exchanges = cluster.exchanges("vote-late", timeout_s=0.5)
    try:
        exchanges[0].inbox.set_next_step(0)
        with pytest.raises(ExchangeError, match="state vote of pod 1"):
            exchanges[0].check_votes(0, 3)
    finally:
        _close(exchanges)
