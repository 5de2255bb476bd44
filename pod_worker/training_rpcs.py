"""The training RPCs of the PodWorker service, a mixin of PodWorkerService (server.py): Step (a
shard, with a degraded pod's extra shards, trained on the pod; its reply with the step's timings,
DCN bytes and DiLoCo outer step) and Evaluate."""
from __future__ import annotations

from typing import TYPE_CHECKING

from multipod.pod_worker.errors import StepAborted
from multipod.pod_worker.request_tokens import decode_mask, decode_tokens
from multipod.pod_worker.rpc_handler import deadline, handler, invalid
from multipod.protos import multipod_pb2 as pb

if TYPE_CHECKING:
    from multipod.pod_worker.pod import Pod


def _outer_step(report) -> pb.OuterStep | None:
    """A DiLoCo outer step's report (pod_worker/diloco.py OuterReport) on the wire; None if none."""
    if report is None:
        return None
    return pb.OuterStep(sync=report.sync, fragment=report.fragment, started_step=report.started_at,
                        seconds=report.seconds, exposed_s=report.exposed_s, pods=list(report.pods))


class TrainingRpcs:
    """Step and Evaluate, RPCs of PodWorkerService (server.py): they work on its pod."""

    pod: Pod        # PodWorkerService's

    @handler
    def Step(self, request: pb.StepRequest, context) -> pb.StepReply:
        setup = self.pod.setup()
        # This host's rows of the pod's shard.
        rows = setup.config.train.global_batch // setup.num_pods // self.pod.layout.hosts_per_pod
        tokens = decode_tokens(setup, request.tokens, rows)
        mask = decode_mask(setup, request.loss_mask, tokens)
        if request.global_tokens <= 0:
            raise invalid("global_tokens must be positive")
        extra, extra_masks, splits = {}, {}, {}
        for shard in request.extra_shards:
            if shard.slot in extra or shard.slot == self.pod.pod_index or shard.slot >= setup.num_pods:
                raise invalid(f"extra shard for slot {shard.slot}: a duplicate, this pod's own, or out of range")
            extra[shard.slot] = decode_tokens(setup, shard.tokens, rows)
            extra_masks[shard.slot] = decode_mask(setup, shard.loss_mask, extra[shard.slot])
            splits[shard.slot] = [int(h) for h in shard.microbatch_hosts]    # checked by Pod.step
        if request.run_id != setup.run_id:
            # Sent for another timeline (before a membership change, a restore or a takeover, and
            # delivered late): run on this one, its shards could be the wrong pods'.
            raise StepAborted(f"step {request.step} was sent for run {request.run_id or '(none)'}; "
                              f"the pod has moved on to run {setup.run_id}")
        outcome, wait_s = self.pod.step(setup, request.step, tokens, request.global_tokens, deadline(context),
                                        context.is_active, take_fingerprint=request.take_fingerprint, extra=extra,
                                        loss_mask=mask, extra_masks=extra_masks, splits=splits)
        link = outcome.link
        shards = [pb.ShardResult(slot=self.pod.pod_index if slot is None else slot, loss_sum=loss, z_loss_sum=z,
                                 tokens=count) for slot, loss, z, count in outcome.shards]
        return pb.StepReply(
            step=request.step, pod_index=self.pod.pod_index, loss_sum=outcome.loss_sum,
            z_loss_sum=outcome.z_loss_sum, tokens=outcome.tokens, grad_norm=outcome.grad_norm,
            learning_rate=outcome.learning_rate, skipped=outcome.skipped, checksum=outcome.checksum,
            fingerprint=outcome.fingerprint,
            timings=pb.StepTimings(wait_s=wait_s, compute_s=outcome.compute_s, exchange_s=outcome.exchange_s,
                                   update_s=outcome.update_s, checksum_s=outcome.checksum_s,
                                   fingerprint_s=outcome.fingerprint_s,
                                   idle_s=link.idle_s if link else 0.0,
                                   peer_wait_s=link.peer_wait_s if link else 0.0,
                                   wire_wait_s=link.wire_wait_s if link else 0.0,
                                   exposed_exchange_s=outcome.exposed_exchange_s),
            dcn_bytes_sent=link.bytes_sent if link else 0,
            dcn_bytes_received=link.bytes_received if link else 0, dcn_packed=bool(link and link.packed),
            shards=shards,
            outer=_outer_step(outcome.outer))

    @handler
    def Evaluate(self, request: pb.EvaluateRequest, context) -> pb.EvaluateReply:
        setup = self.pod.setup()
        tokens = decode_tokens(setup, request.tokens, None)
        data_axis = setup.trainer.mesh_shape[0]
        if tokens.shape[0] == 0 or tokens.shape[0] % data_axis:
            raise invalid(f"evaluation batch of {tokens.shape[0]} rows must be a positive multiple of "
                           f"the data axis ({data_axis})")
        mask = decode_mask(setup, request.loss_mask, tokens)
        loss_sum, count = self.pod.evaluate(tokens, deadline(context), mask)
        return pb.EvaluateReply(loss_sum=loss_sum, tokens=count)
