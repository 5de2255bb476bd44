"""Held-out evaluation on every pod: a component of the step loop that decides when it runs.

Every eval.every steps (and once at the end), at a step boundary with no step in flight, each
held-out batch is cut into the run's slots exactly like a training batch, each slot's rows go to
the pod that computes that slot (its own, or a failed pod's in degraded mode), and the controller
adds the pods' loss sums in slot order. So the number is the same whichever pods are live, and
the same as one pod evaluating the whole batch, to float rounding.

The record (step, eval_loss, eval_perplexity, eval_bits_per_byte, epoch) goes to metrics.jsonl
and TensorBoard beside the step records; bits per byte divides by the held-out text's UTF-8 bytes,
so it compares runs with different tokenizers.
"""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from multipod.controller.cluster.client import WorkerError
from multipod.controller.data.batches import step_data, token_dtype
from multipod.protos import multipod_pb2 as pb

if TYPE_CHECKING:
    from multipod.controller.core.run_config import EvalConfig


def eval_metrics(loss_sum: float, tokens: int, bytes_per_token: float | None) -> dict:
    """Mean loss, perplexity and bits per byte (None without a byte count) of a loss sum in nats."""
    loss = loss_sum / tokens
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0)),
            "eval_bits_per_byte": loss / math.log(2) / bytes_per_token if bytes_per_token else None}


class Evaluator:
    """Evaluates eval.batches held-out batches every eval.every steps and at run.steps.

    config: the run's [eval]; cluster: the pods (live_clients, hosts, size, diagnose); dataset: a
    dataset.TokenDataset (or anything with eval_batch(i), eval_loss_mask(i), num_eval_batches,
    eval_bytes_per_token and epoch(index)); write: where the record goes (Recorder.write_eval)."""

    def __init__(self, config: EvalConfig, cluster, dataset, write, data_offset: int = 0):
        self.config, self.cluster, self.dataset, self.write = config, cluster, dataset, write
        self.run = cluster.config.run       # its length and deadlines
        self.data_offset = data_offset
        self.last: dict | None = None       # the latest evaluation's record
        self._done_at: int | None = None    # the boundary last evaluated (a replayed segment skips it)
        self._dtype = token_dtype(cluster.config.model.vocab_size)

    @property
    def batches(self) -> int:
        return min(self.config.batches, self.dataset.num_eval_batches)

    def on_step(self, step: int, drain) -> bool:
        """At the boundary before `step` (after `step` steps have trained): evaluate if it is a
        multiple of eval.every or the end of the run; drain() first finishes the steps in
        flight. Returns whether it evaluated."""
        every = self.config.every
        due = step == self.run.steps or (every and step > 0 and step % every == 0)
        if not due or not self.batches or step == self._done_at:
            return False
        drain()
        self.evaluate(step)
        return True

    def evaluate(self, step: int) -> dict:
        """Evaluate now (the state after `step` steps) on the live pods; write and return the record.
        A pod that fails its evaluation is a PodFailure (cluster.diagnose), as a failed step is."""
        started = time.perf_counter()
        hosts = list(self.cluster.hosts)
        clients = {c.pod_index: c for c in self.cluster.live_clients}
        loss_sum, tokens = 0.0, 0
        for index in range(self.batches):
            data = step_data(self.dataset.eval_batch(index), self.dataset.eval_loss_mask(index), self.cluster.size,
                             self._dtype)
            calls = [clients[hosts[slot]].evaluate_async(
                pb.EvaluateRequest(tokens=data.tokens[slot], loss_mask=data.masks[slot]),
                self.run.step_timeout_s) for slot in range(self.cluster.size)]
            for slot, call in enumerate(calls):     # summed in slot order: the same on any pods
                try:
                    reply = call.result()
                except WorkerError as exc:
                    for other in calls:
                        other.cancel()
                    raise self.cluster.diagnose(f"evaluation at step {step} failed on slot {slot}: {exc}",
                                                [hosts[slot]]) from None
                loss_sum, tokens = loss_sum + reply.loss_sum, tokens + reply.tokens
        record = {"step": step - 1, "trained_steps": step,
                  **eval_metrics(loss_sum, tokens, self.dataset.eval_bytes_per_token),
                  "eval_tokens": tokens, "eval_time_s": time.perf_counter() - started, "time": time.time()}
        if step > 0:
            record["epoch"] = self.dataset.epoch(step - 1 + self.data_offset)
        self.write(record)
        self.last, self._done_at = record, step
        return record
