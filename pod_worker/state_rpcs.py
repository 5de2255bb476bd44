"""The RPCs of the PodWorker service that move a pod's state, a mixin of PodWorkerService
(server.py): checkpoints (Save, WaitSave, Restore), the change of whom the pod exchanges with
(SetMembership), the state transfer to a rejoining pod (SendState, ReceiveState), and a DiLoCo
replica adopted from a failed pod's checkpoint part (AdoptSlot)."""
from __future__ import annotations

import json

from multipod.pod_worker import checkpoint_parts
from multipod.pod_worker.request_tokens import decode_tokens
from multipod.pod_worker.rpc_handler import deadline, handler, invalid, wait_budget
from multipod.protos import multipod_pb2 as pb


class StateRpcs:
    """The state-moving RPCs of PodWorkerService (server.py): they work on its pod."""

    @handler
    def Save(self, request: pb.SaveRequest, context) -> pb.SaveReply:
        """Start a checkpoint of the state after `step` steps (with `slot`, DiLoCo: a failed slot's
        part, written on its behalf); with background=false, also wait for it to be written
        (within the RPC's deadline)."""
        self.pod.setup()
        if not request.directory:
            raise invalid("directory is empty")
        try:
            metadata = json.loads(request.metadata_json or "{}")
        except ValueError:
            raise invalid("metadata_json is not valid JSON") from None
        if not isinstance(metadata, dict):
            raise invalid("metadata_json must be a JSON object")
        slot = int(request.slot) if request.HasField("slot") else None
        started = self.pod.start_save(request.step, request.directory, metadata, int(request.keep),
                                      deadline(context), slot=slot)
        if request.background:
            return pb.SaveReply(path=str(started.path), fingerprint=started.fingerprint, pending=True)
        self.pod.wait_save(request.directory, started.step, wait_budget(context, default_s=600.0))
        return pb.SaveReply(path=str(started.path), fingerprint=started.fingerprint)

    @handler
    def WaitSave(self, request: pb.WaitSaveRequest, context) -> pb.SaveReply:
        """How the background save of `step` went (waits for it within the RPC's deadline;
        FAILED_PRECONDITION if it is still being written then)."""
        self.pod.setup()
        if not request.directory:
            raise invalid("directory is empty")
        path = self.pod.wait_save(request.directory, int(request.step), wait_budget(context, default_s=60.0))
        return pb.SaveReply(path=str(path))

    @handler
    def Restore(self, request: pb.RestoreRequest, context) -> pb.RestoreReply:
        """Load a checkpoint: `path`, or the newest one under `directory` that each of `parts` also
        holds whole (older than before_step if set); the newer ones passed over are in `skipped`.
        DiLoCo: warm_start (with path) or warm_start_directory (with directory) take an
        every-step checkpoint, from which the outer state starts afresh; an every-step resume
        refuses to go back past a newer checkpoint in diloco_directories."""
        self.pod.setup()
        if bool(request.path) == bool(request.directory):
            raise invalid("give exactly one of path (a checkpoint) or directory (restore its newest checkpoint)")
        if request.path and (request.parts or request.before_step or request.warm_start_directory
                             or request.diloco_directories):
            raise invalid("parts, before_step, warm_start_directory and diloco_directories go with directory, "
                          "not with path")
        if request.directory and request.warm_start:
            raise invalid("warm_start goes with path; with directory, give warm_start_directory")
        if any(not part for part in request.parts):
            raise invalid("parts holds an empty folder name")
        if any(not folder for folder in request.diloco_directories):
            raise invalid("diloco_directories holds an empty folder name")
        restored = self.pod.restore(request.path or None, request.directory or None, request.run_id,
                                    deadline(context), parts=tuple(request.parts), before=int(request.before_step),
                                    warm_start_directory=request.warm_start_directory,
                                    warm_start=request.warm_start,
                                    diloco_directories=tuple(request.diloco_directories))
        return pb.RestoreReply(step=restored.step, fingerprint=restored.fingerprint,
                               metadata_json=json.dumps(restored.metadata), path=restored.path,
                               skipped=checkpoint_parts.to_proto(restored.skipped),
                               warm_start=restored.warm_start)

    @handler
    def SetMembership(self, request: pb.MembershipRequest, context) -> pb.MembershipReply:
        """Degraded mode and rejoin: a new exchange among the pods in `hosts` (pod.set_membership)."""
        setup = self.pod.setup()
        if not request.run_id:
            raise invalid("run_id is empty")
        if request.num_pods != setup.num_pods:
            raise invalid(f"num_pods={request.num_pods}, the pod was configured for {setup.num_pods}")
        if request.dcn_addresses and len(request.dcn_addresses) != setup.num_pods:
            raise invalid(f"{len(request.dcn_addresses)} data-plane addresses for {setup.num_pods} pods")
        membership = self.pod.set_membership(request.run_id, list(request.hosts) or None, deadline(context),
                                             peers=list(request.dcn_addresses) or None)
        return pb.MembershipReply(step=membership.step, checksum=membership.checksum,
                                  fingerprint=membership.fingerprint, config_hash=membership.config_hash,
                                  aborted_step=membership.aborted_step)

    @handler
    def SendState(self, request: pb.SendStateRequest, context) -> pb.TransferReply:
        """Stream this pod's state to a rejoining pod over the data plane."""
        if not request.transfer_id or not request.to_address:
            raise invalid("transfer_id and to_address are required")
        sent = self.pod.send_state(request.transfer_id, int(request.to_pod), request.to_address, deadline(context))
        return pb.TransferReply(step=sent.step, fingerprint=sent.fingerprint, bytes=sent.bytes,
                                seconds=sent.seconds)

    @handler
    def ReceiveState(self, request: pb.ReceiveStateRequest, context) -> pb.TransferReply:
        """Take a live pod's state, verified by its fingerprint before it replaces this pod's."""
        if not request.transfer_id:
            raise invalid("transfer_id is empty")
        got = self.pod.receive_state(request.transfer_id, int(request.from_pod), deadline(context))
        return pb.TransferReply(step=got.step, fingerprint=got.fingerprint, bytes=got.bytes,
                                seconds=got.seconds)

    @handler
    def AdoptSlot(self, request: pb.AdoptSlotRequest, context) -> pb.AdoptSlotReply:
        """DiLoCo "replay": host a failed pod's replica, retaking its inner steps from its checkpoint part."""
        setup = self.pod.setup()
        if not request.checkpoint_path:
            raise invalid("checkpoint_path is empty")
        rows = setup.config.train.global_batch // setup.num_pods
        batches = [decode_tokens(setup, payload, rows) for payload in request.tokens]
        step, fp = self.pod.adopt_slot(int(request.slot), request.checkpoint_path, batches, deadline(context))
        return pb.AdoptSlotReply(step=step, fingerprint=fp)
