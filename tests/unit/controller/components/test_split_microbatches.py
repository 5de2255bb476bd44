"""failover.split_microbatches: each failed slot's microbatches over every live pod, one contiguous
run each, as even as the count allows, the slot's host last (it ends the slot's sum)."""
from __future__ import annotations

import pytest

from multipod.controller.components.failover import reassign, split_microbatches


def runs(microbatch_hosts: list[int]) -> list[tuple[int, int]]:
    """(pod, count) of each run of consecutive microbatches."""
    out: list[tuple[int, int]] = []
    for pod in microbatch_hosts:
        if out and out[-1][0] == pod:
            out[-1] = (pod, out[-1][1] + 1)
        else:
            out.append((pod, 1))
    return out


@pytest.mark.parametrize("pods,failed,microbatches", [(3, {1}, 2), (3, {1}, 4), (4, {1}, 3), (4, {1}, 8),
                                                      (4, {1, 2}, 4), (4, {0}, 6), (5, {3}, 4)])
def test_every_live_pod_takes_an_even_run_and_the_host_ends_it(pods, failed, microbatches):
    hosts = reassign(list(range(pods)), failed)
    live = sorted(set(hosts))
    splits = split_microbatches(hosts, microbatches)
    assert sorted(splits) == sorted(failed)
    for slot, microbatch_hosts in splits.items():
        assert len(microbatch_hosts) == microbatches
        got = runs(microbatch_hosts)
        assert len({pod for pod, _ in got}) == len(got)                  # one run per pod
        assert got[-1][0] == hosts[slot]                                  # the host ends the sum
        assert {pod for pod, _ in got} == set(live)                        # every live pod takes part
        counts = [count for _, count in got]
        assert max(counts) - min(counts) <= 1                             # as even as the count allows


def test_fewer_microbatches_than_live_pods_and_healthy():
    assert split_microbatches([0, 1, 2], 4) == {}
    assert split_microbatches([0, 0, 2, 3], 2) == {1: [3, 0]}             # the last two of [2, 3, 0]
    assert split_microbatches([0, 0, 2], 1) == {1: [0]}                   # one microbatch: whole, on the host
