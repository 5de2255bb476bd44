"""A pod's exchange with dcn.streams = "auto": the worker counts its streams for its host's CPUs and
the step the pod runs (schema.streams_for_cpus), and an explicit count decides alone."""
from __future__ import annotations

import types

import numpy as np
import pytest

from multipod.pod_worker.dcn import LeafSpec, Listener
from multipod.pod_worker.hosts import HostLayout
from multipod.pod_worker.membership import PodMembership
from multipod.pod_worker.schema import DcnConfig, SyncConfig, WorkerConfig, dcn as dcn_schema


def _links_per_peer(config: WorkerConfig, overlapped: bool) -> int:
    """Links per peer of pod 0's exchange with pod 1, built as a configured worker builds it."""
    pair = [Listener(p, "127.0.0.1:0", "streams-test-secret") for p in range(2)]
    pod = types.SimpleNamespace(pod_index=0, listener=pair[0], layout=HostLayout())
    pod._host_address = lambda address: PodMembership._host_address(pod, address)
    trainer = types.SimpleNamespace(overlapped=overlapped, exchange_specs=[LeafSpec((8,), np.dtype(np.float32))])
    exchange = PodMembership._new_exchange(pod, "run", trainer, config, [lst.address for lst in pair])
    try:
        return len(exchange.outbox._links[1])
    finally:
        exchange.close()
        for listener in pair:
            listener.close()


@pytest.mark.parametrize("cpus,fused,overlapped", [(2, 1, 4), (4, 2, 4), (16, 4, 4)])
def test_auto_streams_follow_the_host_s_cpus_and_the_pod_s_step(monkeypatch, cpus, fused, overlapped):
    monkeypatch.setattr(dcn_schema, "this_host_cpus", lambda: cpus)
    config = WorkerConfig()
    assert config.dcn.streams == "auto"
    assert _links_per_peer(config, overlapped=False) == fused
    assert _links_per_peer(config, overlapped=True) == overlapped
    # DiLoCo's outer gradients travel in one burst, whatever the inner step.
    diloco = WorkerConfig(sync=SyncConfig(mode="diloco", inner_steps=4, fragments=1))
    assert _links_per_peer(diloco, overlapped=True) == fused
    # A count decides alone.
    assert _links_per_peer(WorkerConfig(dcn=DcnConfig(streams=3)), overlapped=False) == 3
