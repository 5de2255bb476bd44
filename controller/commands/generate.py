"""`multipod generate`: text from a checkpoint, generated with a KV cache on one pod.

Everything that can be wrong is found before a worker starts: the checkpoint (a checkpoint
directory, or one of its step folders), the run's resolved config and tokenizer kept beside it
(corpus.py: RUN_CONFIG, TOKENIZER_FILES), the prompts (a jsonl line without the field, a prompt
longer than the model's context) and the flags (generate_options.py). Then the pod: a local one
started with --devices simulated devices on --hosts-per-pod hosts (LocalPods), or the running
pod --workers names (its mesh is checked against its Status). It is configured with the run's
worker config on the mesh data = devices / model-parallel x model = model-parallel, restores the
checkpoint (resharded onto that mesh) and streams the tokens (GenerateStream): to the terminal
as they come for --prompt, as a jsonl for --prompts. Throughput goes to stderr.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import secrets
import sys
import tempfile
import time

from multipod.controller.commands.checkpoints import Checkpoint, GenerateError, find_checkpoint, newest_step
from multipod.controller.commands.generate_options import (
    DEFAULT_MAX_TOKENS,
    apply_layout,
    check_flags,
    check_mesh,
    check_pod_flags,
)
from multipod.protos.cli_flags import security_from_args


@dataclasses.dataclass
class Prompt:
    text: str
    ids: list[int]
    where: str          # how errors name it: "--prompt" or "FILE:LINE"


def load_run(root: pathlib.Path):
    """The run's resolved Config (its data section is not checked: the corpus need not exist
    here) and its tokenizer, from beside the checkpoints. A config an older version wrote (the
    components' keys still under [run]) is read as its sections hold them now."""
    from multipod.controller.core.run_config import Config, ConfigError, upgrade
    from multipod.controller.data.corpus import RUN_CONFIG, TOKENIZER_FILES
    from multipod.controller.data.tokenizer import ByteTokenizer, load_tokenizer
    file = root / RUN_CONFIG
    try:
        raw = json.loads(file.read_text())
        raw = upgrade(raw) if isinstance(raw, dict) else raw
        data = raw.get("data", {}) if isinstance(raw, dict) else None
        if not isinstance(data, dict):
            raise ValueError("not a JSON object with a data section")
        spec = data.get("tokenizer", "bytes")
        raw["data"] = {**data, "path": "", "tokenizer": "bytes", "cache_dir": ""}
        config = Config.from_dict(raw)
    except (OSError, ValueError) as exc:    # ConfigError and JSONDecodeError are ValueErrors
        detail = f"config: {exc}" if isinstance(exc, ConfigError) else str(exc)
        raise GenerateError(f"{file}: {detail}") from None
    if spec == "bytes":
        tokenizer = ByteTokenizer()
    else:
        found = [root / name for name in TOKENIZER_FILES.values() if (root / name).is_file()]
        if not found:
            raise GenerateError(f"{root} has no tokenizer file ({' or '.join(TOKENIZER_FILES.values())}) beside its "
                                f"checkpoints; the run used data.tokenizer = {spec!r}")
        tokenizer = load_tokenizer(str(found[0]))
    if tokenizer.vocab_size > config.model.vocab_size:
        raise GenerateError(f"tokenizer {tokenizer.name} has {tokenizer.vocab_size:,} tokens, more than the model's "
                            f"{config.model.vocab_size:,} (model.vocab_size in {file})")
    return config, tokenizer


def read_prompts(args, tokenizer) -> list[Prompt]:
    """The prompts of --prompt or --prompts, encoded. An empty one starts a new document: the
    tokenizer's end-of-text token. GenerateError (no such file) or DataError (sources.jsonl_texts) naming
    the file and line of a bad one."""
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text).tolist() or [tokenizer.eos_id]
    if args.prompt is not None:
        return [Prompt(args.prompt, encode(args.prompt), "--prompt")]
    from multipod.controller.data.sources import jsonl_texts
    path = pathlib.Path(args.prompts)
    if not path.is_file():
        raise GenerateError(f"--prompts {path}: no such file")
    try:
        return [Prompt(text, encode(text), where)
                for where, text in jsonl_texts(path, args.prompt_field, "--prompt-field names the field")]
    except OSError as exc:
        raise GenerateError(f"--prompts {path}: cannot be read: {exc}") from None


def plan(args, config, prompts: list[Prompt]) -> int:
    """The number of new tokens per prompt; GenerateError if a prompt or prompt + --max-tokens does
    not fit the model's context, ConfigError naming a bad flag."""
    from multipod.controller.core.run_config import ConfigError
    context = config.model.max_seq_len - (config.prompt.virtual_tokens if config.prompt.enabled else 0)
    for prompt in prompts:
        if len(prompt.ids) > context:
            raise GenerateError(f"{prompt.where}: the prompt has {len(prompt.ids)} tokens, more than the model's "
                                f"context of {context} tokens (model.max_seq_len)")
    longest = max(prompts, key=lambda p: len(p.ids))
    room = context - len(longest.ids)
    if args.max_tokens is None:
        wanted = DEFAULT_MAX_TOKENS if args.shift_context else min(DEFAULT_MAX_TOKENS, room)
        if wanted < 1:
            raise GenerateError(f"{longest.where}: the prompt fills the model's context of {context} tokens "
                                f"(model.max_seq_len): no room for a new token (--shift-context makes room)")
        return wanted
    if args.max_tokens < 1:
        raise ConfigError("--max-tokens", f"must be >= 1, got {args.max_tokens}")
    if args.max_tokens > 4096:
        raise ConfigError("--max-tokens", f"at most 4096, got {args.max_tokens}")
    if args.max_tokens > room and not args.shift_context:
        raise GenerateError(f"{longest.where}: the prompt ({len(longest.ids)} tokens) + --max-tokens "
                            f"{args.max_tokens} exceed the model's context of {context} tokens (model.max_seq_len): "
                            f"ask for at most {room}, or pass --shift-context")
    return args.max_tokens


def with_prompt(text: str, base: Checkpoint, base_config):
    """(the config of a pod generating after a prompt checkpoint's virtual tokens, the prompt
    checkpoint): the tuned run's config with --checkpoint as its base. GenerateError if `text`
    is not a prompt checkpoint or was tuned on a model of another shape; one tuned on another base
    of the same shape is refused by the pod when it restores it (the checkpoint holds the base's
    fingerprint)."""
    from multipod.model.config import LAYOUT_FIELDS
    prompt = find_checkpoint(text)
    tuned, _ = load_run(prompt.root)
    if not tuned.prompt.enabled:
        raise GenerateError(f"--prompt-checkpoint {text} is not a prompt checkpoint: its run trained the whole model "
                            f"(give the checkpoint directory of a multipod ptune run)")
    for field in dataclasses.fields(base_config.model):
        have, want = getattr(tuned.model, field.name), getattr(base_config.model, field.name)
        if field.name not in LAYOUT_FIELDS and have != want:
            raise GenerateError(f"--prompt-checkpoint {text} was tuned on another base model: its "
                                f"model.{field.name} is {have!r}, --checkpoint {base.path or base.root} has {want!r}")
    folder = base.path or newest_step(base)
    return dataclasses.replace(tuned, prompt=dataclasses.replace(tuned.prompt, base_checkpoint=str(folder))), prompt


def _worker_config(config, model_parallel: int, diloco_part: bool):
    """The run's config for one pod: its mesh is data x model_parallel on this pod's devices; the
    data plane is unused (one pod). Nothing the checkpoint's state key covers changes, but the
    sync mode of the folder restored: a DiLoCo run warm-started from an every-step run's
    checkpoints keeps those beside its own parts, and they restore as every-step state."""
    from multipod.pod_worker.schema import DcnConfig, MeshConfig, SyncConfig
    sync = config.sync if diloco_part or not config.sync.diloco else SyncConfig()
    return dataclasses.replace(config, mesh=MeshConfig(data=-1, model=model_parallel), sync=sync,
                               dcn=dataclasses.replace(DcnConfig(), timeout_s=config.dcn.timeout_s))


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class TextStream:
    """Print a completion as its tokens come: the new text of decode(prompt + tokens) beyond what
    is printed, holding back a trailing partial character (U+FFFD) until it is whole."""

    def __init__(self, tokenizer, prompt: Prompt, eos_id: int | None, out=sys.stdout):
        self.tokenizer, self.prompt_ids, self.eos_id, self.out = tokenizer, prompt.ids, eos_id, out
        self.base = tokenizer.decode(prompt.ids)
        self.tokens: list[int] = []
        self.printed = ""
        out.write(prompt.text)
        out.flush()

    def text(self) -> str:
        tokens = self.tokens[:-1] if self.tokens and self.tokens[-1] == self.eos_id else self.tokens
        whole = self.tokenizer.decode(self.prompt_ids + tokens)
        return whole[len(self.base):] if whole.startswith(self.base) else self.tokenizer.decode(tokens)

    def add(self, token: int) -> None:
        self.tokens.append(token)
        text = self.text().rstrip("\ufffd")
        if text.startswith(self.printed) and len(text) > len(self.printed):
            self.out.write(text[len(self.printed):])
            self.out.flush()
            self.printed = text

    def close(self) -> None:
        text = self.text()
        self.out.write((text[len(self.printed):] if text.startswith(self.printed) else "") + "\n")
        self.out.flush()


def main(args) -> int:
    """Run `multipod generate`; returns the exit code (errors are raised for cli.run to print)."""
    remote = check_pod_flags(args)
    apply_layout(args)
    checkpoint = find_checkpoint(args.checkpoint)
    config, tokenizer = load_run(checkpoint.root)
    restore = checkpoint
    if args.prompt_checkpoint:
        config, restore = with_prompt(args.prompt_checkpoint, checkpoint, config)
    check_flags(args, config)
    prompts = read_prompts(args, tokenizer)
    num_tokens = plan(args, config, prompts)
    config = _worker_config(config, args.model_parallel, diloco_part=restore.is_part)
    temperature = config.sample.temperature if args.temperature is None else args.temperature
    eos_id = None if args.ignore_eos else tokenizer.eos_id
    _say(f"checkpoint {checkpoint.path or checkpoint.root} ({'newest step' if checkpoint.path is None else 'this step'}"
         f"): {config.model.param_count():,} parameters, context {config.model.max_seq_len} tokens, tokenizer "
         f"{tokenizer.describe()}")
    if config.prompt.enabled:
        where = restore.path or restore.root
        _say(f"after the {config.prompt.virtual_tokens} virtual tokens of prompt checkpoint {where} "
             f"({config.prompt.kind}; {'newest step' if restore.path is None else 'this step'})")

    from multipod.controller.cluster.pods import connect
    from multipod.protos import multipod_pb2 as pb
    from multipod.protos.channels import Security, set_default_security
    # A running pod takes the user's secret and TLS; a local one gets a fresh secret.
    set_default_security(security_from_args(args) if remote else Security(token=secrets.token_urlsafe(32)))
    with _pod(args, remote) as addresses:
        cluster = connect(addresses, config, generation_only=True)
        try:
            if remote:
                cluster.collect_dcn_addresses()     # the pod's device count, from its Status
                devices, hosts = cluster.device_counts[0], cluster.hosts_per_pod
                check_mesh(devices, hosts, args.model_parallel, config)
                _say(f"generating on the pod at {', '.join(remote)}: {devices} device(s) on {hosts} host(s), mesh "
                     f"data={devices // args.model_parallel} model={args.model_parallel}")
            started = time.perf_counter()
            cluster.configure(awaits_state=True)      # the restore below gives the pod its state
            client = cluster.clients[0]
            # A prompt checkpoint is the state of a prompt-tuning pod, whose base --checkpoint is.
            target = ({"path": str(restore.path)} if restore.path else {"directory": str(restore.steps)})
            restored = client.restore(pb.RestoreRequest(run_id=cluster.next_generation(), **target),
                                      config.run.step_timeout_s + 60.0)
            _say(f"restored {restored.path} (step {restored.step}) in {time.perf_counter() - started:.1f} s")
            request = dict(num_tokens=num_tokens, temperature=temperature, top_k=args.top_k, top_p=args.top_p,
                           seed=args.seed, shift_context=args.shift_context)
            if eos_id is not None:
                request["eos_id"] = eos_id
            timeout = config.run.step_timeout_s + 1.0 * num_tokens
            if args.prompt is not None:
                return _one(client, prompts[0], request, timeout, tokenizer, eos_id)
            return _many(client, prompts, request, timeout, tokenizer, eos_id, args)
        finally:
            cluster.close()


@contextlib.contextmanager
def _pod(args, remote: list[str] | None):
    """The addresses of the pod to generate on: the running one's (`remote`), or those of a local
    pod of --devices simulated devices on --hosts-per-pod hosts, stopped at the end."""
    if remote:
        yield [remote]
        return
    from multipod.controller.launch.local import LocalPods
    with tempfile.TemporaryDirectory(prefix="multipod-generate-") as logs:
        hosts = f" on {args.hosts_per_pod} hosts" if args.hosts_per_pod > 1 else ""
        _say(f"starting a pod worker with {args.devices} simulated device(s){hosts}, mesh "
             f"data={args.devices // args.model_parallel} model={args.model_parallel}")
        with LocalPods(1, args.devices, pathlib.Path(logs), hosts_per_pod=args.hosts_per_pod) as pods:
            yield pods.host_addresses


def _report(tokens: int, elapsed: float, first: float | None) -> None:
    """Throughput on stderr: over the whole request, and after the first token (whose wait
    includes compiling the programs and the prefill)."""
    line = f"{tokens} token(s) in {elapsed:.2f} s: {tokens / elapsed if elapsed > 0 else 0.0:.1f} tokens/s"
    if first is not None:
        line += f" (first token after {first:.2f} s"
        if tokens > 1 and elapsed > first:
            line += f", then {(tokens - 1) / (elapsed - first):.1f} tokens/s"
        line += ")"
    _say(line)


def _one(client, prompt: Prompt, request: dict, timeout: float, tokenizer, eos_id) -> int:
    from multipod.protos import codec, multipod_pb2 as pb
    text = TextStream(tokenizer, prompt, eos_id)
    started, first, count = time.perf_counter(), None, 0
    message = pb.GenerateRequest(prompts=[codec.encode(_narrow(prompt.ids))], **request)
    for chunk in client.generate_stream(message, timeout):
        for token in codec.decode(chunk.tokens).tolist():
            first = time.perf_counter() - started if first is None else first
            count += 1
            text.add(token)
    text.close()
    _report(count, time.perf_counter() - started, first)
    return 0


def _many(client, prompts: list[Prompt], request: dict, timeout: float, tokenizer, eos_id, args) -> int:
    from multipod.protos import codec, multipod_pb2 as pb
    out = open(args.out, "w", encoding="utf-8") if args.out else sys.stdout   # noqa: SIM115 - closed below
    started, first, count = time.perf_counter(), None, 0
    try:
        for at in range(0, len(prompts), args.batch_size):
            batch = prompts[at:at + args.batch_size]
            completions: list[list[int]] = [[] for _ in batch]
            message = pb.GenerateRequest(prompts=[codec.encode(_narrow(p.ids)) for p in batch], **request)
            for chunk in client.generate_stream(message, timeout):
                first = time.perf_counter() - started if first is None else first
                for row, token in zip(chunk.rows, codec.decode(chunk.tokens).tolist()):
                    completions[row].append(token)
                    count += 1
            for prompt, tokens in zip(batch, completions):
                ended = bool(tokens) and eos_id is not None and tokens[-1] == eos_id
                kept = tokens[:-1] if ended else tokens     # the end-of-text token is not text
                text, base = tokenizer.decode(prompt.ids + kept), tokenizer.decode(prompt.ids)
                completion = text[len(base):] if text.startswith(base) else tokenizer.decode(kept)
                out.write(json.dumps({"prompt": prompt.text, "completion": completion, "tokens": len(tokens),
                                      "finish": "eos" if ended else "length"}) + "\n")
            out.flush()
    finally:
        if out is not sys.stdout:
            out.close()
    _report(count, time.perf_counter() - started, first)
    if args.out:
        _say(f"{len(prompts)} completion(s) in {args.out}")
    return 0


def _narrow(ids: list[int]):
    """Token ids in the narrowest dtype the wire carries."""
    import numpy as np

    from multipod.controller.data.batches import narrow
    return narrow(np.asarray(ids, dtype=np.int32))
