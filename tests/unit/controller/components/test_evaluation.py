"""Periodic held-out evaluation (controller/components/evaluation.py) against fake pods: when it runs, how a
batch is cut over the pods, and that the number does not depend on which pods are live."""
from __future__ import annotations

import math

import grpc
import numpy as np
import pytest

from multipod.controller.cluster.client import WorkerError
from multipod.controller.components.evaluation import Evaluator, eval_metrics
from multipod.controller.core.errors import PodFailure
from multipod.protos import codec, multipod_pb2 as pb
from tests.unit.controller.fakes import FakeCall, make_config

SEQ = 8


class EvalPod:
    """Answers Evaluate with a loss that is a function of the rows it got (their token sum)."""

    def __init__(self, pod_index: int, fail: bool = False):
        self.pod_index, self.name, self.fail = pod_index, f"pod {pod_index}", fail
        self.rows: list[np.ndarray] = []

    def evaluate_async(self, request, timeout_s):
        rows = codec.decode(request.tokens)
        self.rows.append(rows)
        if self.fail:
            return FakeCall(error=WorkerError(f"{self.name}: Evaluate failed", grpc.StatusCode.INTERNAL))
        return FakeCall(pb.EvaluateReply(loss_sum=float(rows.astype(np.float64).sum()) / 100,
                                         tokens=rows.shape[0] * (rows.shape[1] - 1)))


class EvalCluster:
    def __init__(self, pods, hosts=None, steps: int = 5, every: int = 0, batches: int = 2):
        self.config = make_config(run={"steps": steps}, eval={"every": every, "batches": batches})
        self.clients = pods
        self.hosts = hosts or [p.pod_index for p in pods]
        self.diagnosed = []

    @property
    def size(self):
        return len(self.hosts)

    @property
    def live_clients(self):
        return [self.clients[p] for p in sorted(set(self.hosts))]

    def diagnose(self, message, suspects=()):
        self.diagnosed.append((message, list(suspects)))
        return PodFailure(message)


class Held:
    """A dataset of 3 held-out batches of 4 rows; eval batch i's row r holds i * 10 + r."""
    num_eval_batches = 3
    eval_bytes_per_token = 2.0

    def eval_batch(self, index):
        return np.repeat(np.arange(index * 10, index * 10 + 4)[:, None], SEQ + 1, axis=1).astype(np.int32)

    def eval_loss_mask(self, index):
        return None

    def epoch(self, step):
        return (step + 1) / 10


def _evaluate(cluster, step=4):
    records = []
    evaluator = Evaluator(cluster.config.eval, cluster, Held(), records.append)
    evaluator.evaluate(step)
    return records[0]


def test_two_pods_and_one_pod_and_a_degraded_pair_give_the_same_eval_loss():
    one = _evaluate(EvalCluster([EvalPod(0)], hosts=[0]))
    two_pods = [EvalPod(0), EvalPod(1)]
    two = _evaluate(EvalCluster(two_pods))
    # Pod 1 is out: pod 0 evaluates both slots' rows.
    survivor = EvalPod(0)
    degraded = _evaluate(EvalCluster([survivor, EvalPod(1)], hosts=[0, 0]))
    for record in (two, degraded):
        assert record["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-12)
        assert record["eval_tokens"] == one["eval_tokens"] == 2 * 4 * SEQ
    # Each pod got its slot's half of every batch, in order; the survivor got both halves.
    assert [r[:, 0].tolist() for r in two_pods[0].rows] == [[0, 1], [10, 11]]
    assert [r[:, 0].tolist() for r in two_pods[1].rows] == [[2, 3], [12, 13]]
    assert [r[:, 0].tolist() for r in survivor.rows] == [[0, 1], [2, 3], [10, 11], [12, 13]]


def test_the_record_has_loss_perplexity_bits_per_byte_and_epoch():
    record = _evaluate(EvalCluster([EvalPod(0), EvalPod(1)]), step=4)
    assert record["step"] == 3 and record["trained_steps"] == 4
    assert record["eval_perplexity"] == pytest.approx(math.exp(record["eval_loss"]))
    assert record["eval_bits_per_byte"] == pytest.approx(record["eval_loss"] / math.log(2) / 2.0)
    assert record["epoch"] == pytest.approx(0.4)
    assert "loss" not in record     # not a step record: the step lists stay step records only


def test_eval_metrics_without_a_byte_count():
    assert eval_metrics(6.0, 3, None) == {"eval_loss": 2.0, "eval_perplexity": pytest.approx(math.exp(2.0)),
                                          "eval_bits_per_byte": None}


def test_it_runs_every_n_steps_and_at_the_end_after_draining_once_per_boundary():
    cluster = EvalCluster([EvalPod(0)], hosts=[0], every=3, steps=7)
    records, drains = [], []
    evaluator = Evaluator(cluster.config.eval, cluster, Held(), records.append)
    evaluated = [step for step in [0, 1, 2, 3, 4, 5, 6, 6, 7]     # boundary 6 again: a replayed segment
                 if evaluator.on_step(step, lambda s=step: drains.append(s))]
    assert evaluated == [3, 6, 7]
    assert [r["trained_steps"] for r in records] == [3, 6, 7]
    assert drains == [3, 6, 7]
    assert evaluator.last is records[-1]


def test_eval_batches_zero_never_evaluates_and_the_dataset_caps_the_count():
    cluster = EvalCluster([EvalPod(0)], hosts=[0], every=1, steps=3, batches=0)
    evaluator = Evaluator(cluster.config.eval, cluster, Held(), lambda r: pytest.fail("evaluated"))
    for step in range(4):
        evaluator.on_step(step, lambda: None)
    pod = EvalPod(0)
    _evaluate(EvalCluster([pod], hosts=[0], batches=10))
    assert len(pod.rows) == Held.num_eval_batches


def test_a_pod_failing_its_evaluation_is_a_pod_failure_naming_it():
    cluster = EvalCluster([EvalPod(0), EvalPod(1, fail=True)])
    with pytest.raises(PodFailure, match="evaluation at step 4 failed on slot 1"):
        Evaluator(cluster.config.eval, cluster, Held(), lambda r: None).evaluate(4)
    assert cluster.diagnosed[0][1] == [1]
