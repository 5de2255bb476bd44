"""DiLoCo (issue 22), in-process: the schedule and the fragments, the config's refusals, pods over
loopback listeners bitwise identical in the agreed state after every outer step (2 and 3 pods,
with and without fragments and overlap, float32 and int4), and one pod at H=1 with plain outer
SGD at lr 1 training like every-step training."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import time

import jax
import numpy as np
import pytest

from multipod.model.config import ConfigError
from multipod.pod_worker.dcn import Listener
from multipod.pod_worker.diloco import fragment_leaves
from multipod.pod_worker.pod import Pod
from multipod.pod_worker.schema import PromptConfig, SyncConfig, WorkerConfig
from multipod.pod_worker.trainer import PodTrainer, fingerprint
from tests.helpers import tiny_worker_config

SECRET = "diloco-test-secret-0123456789abcdef"
ROWS = 4
COLS = tiny_worker_config().train.seq_len + 1
DEADLINE_S = 30.0
_runs = itertools.count()


# The Pods of this module run side by side in threads: on one device (conftest.py says why).
pytestmark = pytest.mark.usefixtures("pods_on_device_0")


def _config(pods: int, **sync) -> WorkerConfig:
    base = tiny_worker_config()
    return dataclasses.replace(base, train=dataclasses.replace(base.train, global_batch=pods * ROWS),
                               sync=SyncConfig(**{"mode": "diloco", **sync})).validate()


def tokens(step: int, slot: int) -> np.ndarray:
    return np.random.default_rng([step, slot]).integers(0, 256, (ROWS, COLS), dtype=np.int32)


# -- configuration -------------------------------------------------------------------------------
@pytest.mark.parametrize("sync, field, words", [
    ({"inner_steps": 10, "fragments": 4}, "sync.fragments", "do not divide sync.inner_steps"),
    ({"inner_steps": 8, "fragments": 2, "overlap_steps": 4}, "sync.overlap_steps", "must be below"),
    ({"outer_dtype": "int2"}, "sync.outer_dtype", "int4"),
    ({"outer_momentum": 0.0}, "sync.outer_momentum", "Nesterov needs"),
    ({"outer_momentum": 1.0}, "sync.outer_momentum", "[0, 1)"),
    ({"inner_steps": 0}, "sync.inner_steps", "> 0"),
    ({"mode": "sometimes"}, "sync.mode", "every_step"),
    ({"inner_steps": 4, "fragments": 4}, "sync.fragments", "the model has 2 layers"),
])
def test_a_bad_sync_config_is_refused_naming_the_field(sync, field, words):
    with pytest.raises(ConfigError) as caught:
        _config(2, **sync)
    assert caught.value.field == field
    assert words in str(caught.value)


def test_prompt_tuning_refuses_diloco():
    base = _config(2)
    prompt = PromptConfig(kind="prompt", virtual_tokens=4, base_checkpoint="/base")
    with pytest.raises(ConfigError) as caught:
        dataclasses.replace(base, prompt=prompt, train=dataclasses.replace(base.train, seq_len=16)).validate()
    assert caught.value.field == "sync.mode"


# -- fragments and schedule ----------------------------------------------------------------------
def test_fragments_are_contiguous_layers_covering_every_leaf_once():
    config = dataclasses.replace(tiny_worker_config().model, n_layers=4)
    from multipod.model import abstract_params
    params = abstract_params(config)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    groups = fragment_leaves(params, 4, 2)
    assert sorted(i for g in groups for i in g) == list(range(len(paths)))
    names = [{paths[i].split("'")[1] for i in g} for g in groups]
    assert names == [{"embedding", "block_0", "block_1"}, {"block_2", "block_3", "final_norm"}]
    assert [len(g) for g in fragment_leaves(params, 4, 1)] == [len(paths)]


def test_the_schedule_staggers_fragments_over_the_cycle():
    trainer = PodTrainer(_config(1, inner_steps=4, fragments=2), devices=jax.devices()[:1])
    trainer.start_outer(1)
    outer = trainer.outer
    starts = {count: outer.sync_at(count) for count in range(1, 13) if outer.sync_at(count) is not None}
    assert starts == {2: 1, 4: 2, 6: 3, 8: 4, 10: 5, 12: 6}
    assert [outer.fragment_of(n) for n in starts.values()] == [0, 1, 0, 1, 0, 1]


# -- pods over the data plane --------------------------------------------------------------------
class Pods:
    """N configured Pods on loopback listeners in this process."""

    def __init__(self, config: WorkerConfig, count: int):
        self.listeners = [Listener(i, "127.0.0.1:0", SECRET) for i in range(count)]
        addresses = [lst.address for lst in self.listeners]
        self.pods = [Pod(i, lst) for i, lst in enumerate(self.listeners)]
        run_id = f"diloco-{next(_runs)}"
        with concurrent.futures.ThreadPoolExecutor(count) as pool:
            list(pool.map(lambda pod: pod.configure(config, count, addresses, run_id), self.pods))

    def step(self, step: int) -> list:
        with concurrent.futures.ThreadPoolExecutor(len(self.pods)) as pool:
            futures = [pool.submit(pod.step, pod.setup(), step, tokens(step, pod.pod_index), 0,
                                   time.monotonic() + DEADLINE_S, lambda: True) for pod in self.pods]
            return [future.result(timeout=60)[0] for future in futures]

    def close(self) -> None:
        for pod in self.pods:
            pod.close()


def _local(pod: Pod) -> str:
    trainer = pod.trainer
    return fingerprint(trainer.params, trainer.opt_state)


@pytest.mark.parametrize("count, sync", [
    (2, {"inner_steps": 2}),
    (3, {"inner_steps": 2}),
    (2, {"inner_steps": 4, "fragments": 2, "overlap_steps": 1, "outer_dtype": "int4"}),
    (3, {"inner_steps": 4, "fragments": 2, "overlap_steps": 1, "outer_dtype": "int8"}),
])
def test_outer_steps_leave_every_pod_bitwise_alike_and_the_pods_differ_between_them(count, sync):
    config = _config(count, **sync)
    pods = Pods(config, count)
    try:
        period, tau = config.sync.period, config.sync.overlap_steps
        applied, agreed = [], []
        for step in range(3 * period):
            outcomes = pods.step(step)
            assert len({o.checksum for o in outcomes}) == 1, f"step {step}: the agreed state differs"
            agreed.append(outcomes[0].checksum)
            reports = [o.outer for o in outcomes]
            if (step + 1 - tau) % period == 0 and step + 1 > tau:
                assert all(r is not None for r in reports), f"step {step}: an outer step was due"
                assert len({(r.sync, r.fragment) for r in reports}) == 1
                applied.append((reports[0].sync, reports[0].fragment))
                # Right after the outer step, the fragment it synced is bitwise alike everywhere.
                indices = pods.pods[0].trainer.outer.fragments[reports[0].fragment]
                leaves = [jax.tree.leaves(p.trainer.params) for p in pods.pods]
                assert len({fingerprint([lv[i] for i in indices]) for lv in leaves}) == 1
                assert all(o.link.bytes_sent > 0 for o in outcomes)
            else:
                assert all(r is None for r in reports), f"step {step}: no outer step was due"
        fragments = config.sync.fragments
        assert applied == [(n, (n - 1) % fragments) for n in range(1, len(applied) + 1)]
        assert len(set(agreed)) > 1, "the agreed state never changed"
        # Between outer steps each pod trains on its own: their inner states differ.
        assert len({_local(p) for p in pods.pods}) == count
        # No pod has saved: none keeps the outer steps a replay merges (a copy of the model every H steps).
        assert all(p.trainer.outer.history == [] for p in pods.pods)
    finally:
        pods.close()


def test_one_pod_at_h1_with_plain_outer_sgd_trains_like_every_step_training():
    plain = tiny_worker_config()
    plain = dataclasses.replace(plain, train=dataclasses.replace(plain.train, global_batch=ROWS))
    diloco = dataclasses.replace(plain, sync=SyncConfig(mode="diloco", inner_steps=1, outer_optimizer="sgd",
                                                        outer_lr=1.0, outer_momentum=0.0)).validate()
    devices = jax.devices()[:1]
    reference, trainer = PodTrainer(plain, devices=devices), PodTrainer(diloco, devices=devices)
    trainer.start_outer(1)
    for step in range(4):
        batch = tokens(step, 0)
        want = reference.train_step(reference.put_batch(batch), ROWS * (COLS - 1), None)
        got = trainer.train_step(trainer.put_batch(batch), ROWS * (COLS - 1), None)
        assert trainer.outer_step(None) is not None
        assert got.loss_sum == pytest.approx(want.loss_sum, rel=1e-5)
        for a, b in zip(jax.tree.leaves(trainer.agreed_params), jax.tree.leaves(reference.params)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_a_failed_outer_exchange_undoes_the_step_and_is_exchanged_again_after_a_new_membership():
    """Pod 1 is late for outer sync 1, and pod 0's exchange of it is aborted (as a membership
    change does): pod 0's step that was to apply it fails with its state as it was; after a new
    membership both pods exchange the sync again and end bitwise where an uninterrupted pair ends."""
    config = _config(2, inner_steps=2, overlap_steps=1)
    reference = Pods(config, 2)
    try:
        want = [reference.step(step)[0].checksum for step in range(4)]
    finally:
        reference.close()
    pods = Pods(config, 2)
    first, second = pods.pods
    try:
        pods.step(0)
        deadline = lambda: time.monotonic() + DEADLINE_S  # noqa: E731
        first.step(first.setup(), 1, tokens(1, 0), 0, deadline(), lambda: True)    # sync 1 starts; pod 1 is late
        before = (_local(first), first.trainer.step)
        first.exchange.abort("test: the link to pod 1 is gone")
        with pytest.raises(Exception, match="link to pod 1 is gone"):
            first.step(first.setup(), 2, tokens(2, 0), 0, deadline(), lambda: True)
        assert (_local(first), first.trainer.step) == before, "a failed step left the state changed"
        second.step(second.setup(), 1, tokens(1, 1), 0, deadline(), lambda: True)
        run_id = f"diloco-{next(_runs)}"
        for pod in pods.pods:
            pod.set_membership(run_id, None, deadline())
        got = [pods.step(step) for step in (2, 3)]
        assert [o.outer is not None for o in got[0]] == [True, True]
        assert [{o.checksum for o in outcomes} for outcomes in got] == [{want[2]}, {want[3]}]
    finally:
        pods.close()


def test_replay_rebuilds_a_dead_pod_from_its_checkpoint_part_and_the_run_stays_bitwise(tmp_path):
    """sync.on_pod_failure = "replay": both pods save their own parts after 4 steps (a sync pending
    in them); pod 1 dies after 7 steps while pod 0's exchange of sync 4 waits for it. The step
    that was to apply it fails on pod 0 with its state as it was; pod 0 then hosts pod 1's slot,
    rebuilds its state from its checkpoint part by retaking steps 4-7 (merging the outer steps
    where they were applied, and taking its pseudo-gradient of the pending sync 4), and trains it
    beside its own: every agreed state is bitwise the uninterrupted pair's, and so is the
    replica's own state at the end."""
    config = _config(2, inner_steps=4, fragments=2, overlap_steps=1)
    steps = 11
    reference = Pods(config, 2)
    try:
        want = [reference.step(step)[0].checksum for step in range(steps)]
        want_pod1 = _local(reference.pods[1])
    finally:
        reference.close()
    pods = Pods(config, 2)
    first, second = pods.pods
    deadline = lambda: time.monotonic() + DEADLINE_S  # noqa: E731
    try:
        for step in range(4):
            pods.step(step)
        assert first.trainer.outer.history == []     # nothing to replay from before a save
        for pod in pods.pods:
            directory = str(tmp_path / f"pod-{pod.pod_index}")
            pod.start_save(4, directory, {}, 0, deadline())
            pod.wait_save(directory, 4, DEADLINE_S)
        for step in range(4, 7):
            assert [o.checksum for o in pods.step(step)] == [want[step]] * 2
        first.step(first.setup(), 7, tokens(7, 0), 0, deadline(), lambda: True)   # sync 4 starts on pod 0 only
        second.close()      # pod 1 dies
        before = (_local(first), first.trainer.step)
        with pytest.raises(Exception, match="pod 1"):
            first.step(first.setup(), 8, tokens(8, 0), 0, deadline(), lambda: True)
        assert (_local(first), first.trainer.step) == before
        first.set_membership(f"diloco-{next(_runs)}", [0, 0], deadline())
        step, _ = first.adopt_slot(1, str(tmp_path / "pod-1" / "4"), [tokens(s, 1) for s in range(4, 8)], deadline())
        assert step == 8
        for step in range(8, steps):
            outcome, _ = first.step(first.setup(), step, tokens(step, 0), 0, deadline(), lambda: True,
                                    extra={1: tokens(step, 1)})
            assert outcome.checksum == want[step], f"step {step}"
            assert [s[0] for s in outcome.shards] == [None, 1]
        replica = first.trainer.outer.replicas[1]
        assert fingerprint(replica.params, replica.opt_state) == want_pod1
    finally:
        first.close()
