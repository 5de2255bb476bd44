"""The overlapped step (dcn.overlap, pod_worker/overlap.py) against the fused step, with pods
exchanging over loopback data planes in this process: with microbatches, on 2 pods of 2 devices
(the whole gradient) and 3 pods of 1 device (reduce-scatter + all-gather). The overlapped pods are
bitwise identical at every step and train like fused pods on the same shards to float tolerance
(losses, gradient norms, parameters). Plain 2 pods are tests/e2e/test_overlap.py's, pods of two
hosts tests/e2e/test_hosts.py's.

Pods of 2 devices have devices of their own, as in a run: two threads dispatching programs with
collectives onto the same devices can deadlock XLA CPU's in-process rendezvous, which no worker
does (one pod per process, one step at a time). Pods of one device run no collectives and share
device 0, so that they share compiled programs."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools

import jax
import numpy as np
import pytest

from multipod.pod_worker.dcn import Exchange, Listener
from multipod.pod_worker.hosts import host_value
from multipod.pod_worker.schema import DcnConfig, MeshConfig
from multipod.pod_worker.trainer import PodTrainer
from tests.helpers import tiny_worker_config

SECRET = "overlap-parity-test-secret-0123456789"
ROWS, COLS = 4, tiny_worker_config().train.seq_len + 1     # one pod's shard
STEPS = 3
DEADLINE_S = 60.0
_runs = itertools.count()


def _config(pods: int, overlap: bool, microbatches: int):
    base = tiny_worker_config()
    devices = len(jax.devices()) // pods
    return dataclasses.replace(
        base, mesh=MeshConfig(data=devices, model=1), model=dataclasses.replace(base.model, microbatches=microbatches),
        train=dataclasses.replace(base.train, global_batch=pods * ROWS),
        dcn=DcnConfig(overlap=overlap, timeout_s=DEADLINE_S)).validate()


def _tokens(step: int, pod: int) -> np.ndarray:
    return np.random.default_rng([step, pod]).integers(0, 256, (ROWS, COLS), dtype=np.int32)


def _train(config, pods: int):
    """STEPS steps of `pods` trainers, each on its own devices and exchanging as Pod._train does:
    ([[outcome by pod]] by step, pod 0's final parameters on the host)."""
    per_pod = len(jax.devices()) // pods
    # Pods of several devices on disjoint devices (collectives). Pods of one device all on device 0
    # (no collectives: one cache key for every pod's programs), compiled one pod after another so
    # that the first compiles and the others load (threads compiling at once would each compile).
    if per_pod > 1:
        trainers = [PodTrainer(config, jax.devices()[p * per_pod:(p + 1) * per_pod]) for p in range(pods)]
    else:
        trainers = [PodTrainer(config, jax.devices()[:1]) for _ in range(pods)]
        for t in trainers:
            t.compile_for((ROWS, COLS))
            t.warm_up((ROWS, COLS), evaluate=False)
    assert all((t._overlapped is not None) == (config.dcn.overlap == "true") for t in trainers)
    listeners = [Listener(p, "127.0.0.1:0", SECRET) for p in range(pods)]
    run_id = f"parity-{next(_runs)}"
    exchanges = [Exchange(run_id, p, [lst.address for lst in listeners], trainers[p].exchange_specs, listeners[p],
                          dcn=config.dcn) for p in range(pods)]

    def step(p: int, s: int):
        exchanges[p].inbox.set_next_step(s)
        all_reduce = lambda grads, **kw: exchanges[p].all_reduce(s, grads, on_leaf=trainers[p].summed_leaf_hook(), **kw)
        return trainers[p].train_step(trainers[p].put_batch(_tokens(s, p)), pods * ROWS * (COLS - 1), all_reduce,
                                      take_fingerprint=True)
    try:
        with concurrent.futures.ThreadPoolExecutor(pods) as pool:
            steps = [[f.result(timeout=2 * DEADLINE_S) for f in [pool.submit(step, p, s) for p in range(pods)]]
                     for s in range(STEPS)]
        return steps, jax.tree.map(host_value, trainers[0].params)
    finally:
        for exchange in exchanges:
            exchange.close()
        for listener in listeners:
            listener.close()


@pytest.mark.parametrize("pods,microbatches", [(2, 2), (3, 2)], ids=["2-pods-microbatches", "3-pods-microbatches"])
def test_overlapped_pods_are_identical_and_train_like_fused_pods(pods, microbatches):
    fused, fused_params = _train(_config(pods, False, microbatches), pods)
    overlapped, overlapped_params = _train(_config(pods, True, microbatches), pods)
    for run in (fused, overlapped):
        for outcomes in run:
            assert len({(o.checksum, o.fingerprint) for o in outcomes}) == 1      # the pods are bitwise equal
            assert not any(o.skipped for o in outcomes)
        assert len({outcomes[0].fingerprint for outcomes in run}) == STEPS        # and the state changes
    for s, (want, got) in enumerate(zip(fused, overlapped)):
        for p in range(pods):
            assert got[p].loss_sum == pytest.approx(want[p].loss_sum, rel=1e-5), (s, p)
            assert got[p].grad_norm == pytest.approx(want[p].grad_norm, rel=1e-4), s
    for a, b in zip(jax.tree.leaves(overlapped_params), jax.tree.leaves(fused_params)):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)
