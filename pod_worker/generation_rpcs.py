"""The generation RPCs of the PodWorker service, a mixin of PodWorkerService (server.py): Generate
and GenerateStream (one GenerateChunk per generated position), their prompts and sampling checked,
decoded on the pod (pod_worker/generation.py) while the caller waits for it."""
from __future__ import annotations

import numpy as np

from multipod.model import Sampling
from multipod.pod_worker.generation import MAX_NEW_TOKENS, MAX_PROMPTS, collect
from multipod.pod_worker.request_tokens import TOKEN_DTYPES
from multipod.pod_worker.rpc_handler import deadline, handler, invalid, stream_handler
from multipod.protos import codec, multipod_pb2 as pb


def _while_caller_waits(chunks, context):
    """The generation's chunks until the caller cancels or its deadline passes: then the decoding
    stops (it would only take the devices from the training steps)."""
    try:
        for chunk in chunks:
            if not context.is_active():
                return
            yield chunk
    finally:
        chunks.close()


class GenerationRpcs:
    """Generate and GenerateStream, RPCs of PodWorkerService (server.py): they work on its pod."""

    def _generation(self, request: pb.GenerateRequest, context):
        """A Generate request, checked and started: (the stream of Chunks, the prompts' count,
        whether it used the one-prompt form)."""
        self.pod.setup()     # FAILED_PRECONDITION first if the pod is not configured
        if bool(request.prompt) == bool(request.prompts):
            raise invalid("give exactly one of prompt (one prompt) or prompts (a batch)")
        payloads = [request.prompt] if request.prompt else list(request.prompts)
        if len(payloads) > MAX_PROMPTS:
            raise invalid(f"{len(payloads)} prompts: a request carries at most {MAX_PROMPTS} "
                           f"(MAX_PROMPTS in pod_worker/generation.py)")
        prompts = []
        for i, payload in enumerate(payloads):
            prompt = codec.decode(payload, max_bytes=1 << 20)
            if prompt.dtype not in TOKEN_DTYPES or prompt.ndim != 1:
                name = "prompt" if request.prompt else f"prompt {i}"
                raise invalid(f"{name} must be a 1-d uint8, uint16 or int32 array, got {prompt.ndim}-d {prompt.dtype}")
            prompts.append(prompt.astype(np.int32))
        if not 0 < request.num_tokens <= MAX_NEW_TOKENS:
            raise invalid(f"num_tokens must be in [1, {MAX_NEW_TOKENS}], got {request.num_tokens}")
        sampling = Sampling(temperature=float(request.temperature), top_k=int(request.top_k),
                            top_p=float(request.top_p) if request.HasField("top_p") else 1.0, seed=int(request.seed))
        eos_id = int(request.eos_id) if request.HasField("eos_id") else None
        # The model's own checks (prompt lengths against max_seq_len, ids, sampling values) answer
        # INVALID_ARGUMENT through the pod's InvalidRequest.
        chunks = self.pod.generate_stream(prompts, int(request.num_tokens), sampling, deadline(context),
                                          eos_id=eos_id, shift_context=request.shift_context)
        return chunks, len(prompts), bool(request.prompt)

    @handler
    def Generate(self, request: pb.GenerateRequest, context) -> pb.GenerateReply:
        chunks, count, single = self._generation(request, context)
        out, lengths = collect(_while_caller_waits(chunks, context), count, request.num_tokens)
        tokens = out[0, :lengths[0]] if single else out
        return pb.GenerateReply(tokens=codec.encode(tokens), lengths=lengths.tolist())

    @stream_handler
    def GenerateStream(self, request: pb.GenerateRequest, context):
        chunks, _, _ = self._generation(request, context)
        for chunk in _while_caller_waits(chunks, context):
            yield pb.GenerateChunk(index=chunk.index, rows=chunk.rows.tolist(), tokens=codec.encode(chunk.tokens))
