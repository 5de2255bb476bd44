"""The flags of `multipod generate` and their checks, all made before a worker starts (but the
mesh of a running pod, --workers, which its Status tells): where it generates (a local pod of
--devices on --hosts-per-pod hosts, or a running pod), the mesh, the sampling, the output."""
from __future__ import annotations

import argparse
import os
import pathlib

from multipod.protos.cli_flags import add_security_arguments

# Prompts sent in one GenerateStream request at most (a worker takes at most 256; the default is
# the config's generate.batch_size).
MAX_BATCH = 256
DEFAULT_MAX_TOKENS = 100


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="a run's checkpoint directory (RUN_DIR/checkpoints, or RUN_DIR itself: its newest "
                             "checkpoint) or one step folder in it (RUN_DIR/checkpoints/300)")
    parser.add_argument("--prompt-checkpoint", metavar="DIR",
                        help="generate after the virtual tokens a `multipod ptune` run learned on this --checkpoint "
                             "(its checkpoint directory or a step folder); refused for another base model")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="one prompt: the text is printed as it is generated")
    what.add_argument("--prompts", metavar="FILE.jsonl",
                      help="one prompt per line (a JSON object, the text in --prompt-field); a jsonl comes out")
    parser.add_argument("--prompt-field", default="prompt", help="the field of a --prompts line holding the text")
    parser.add_argument("--out", metavar="FILE.jsonl", help="where the jsonl of --prompts goes (default: stdout)")
    parser.add_argument("--max-tokens", type=int,
                        help=f"new tokens per prompt (default {DEFAULT_MAX_TOKENS}, or what fits the model's context)")
    parser.add_argument("--temperature", type=float, help="0: greedy (default: the run's sample.temperature)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="then among the most likely tokens holding this much probability, (0, 1] (1: all)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="go on after the end-of-text token (by default a completion ends with it)")
    parser.add_argument("--shift-context", action="store_true",
                        help="allow prompt + --max-tokens beyond the model's context: when it is full, go on from "
                             "its last half")
    parser.add_argument("--layout", metavar="FILE.toml",
                        help="take --devices, --model-parallel and --batch-size from this config's [generate] "
                             "section (what `multipod tune --inference` writes); the flags win over it")
    parser.add_argument("--devices", type=int, help="simulated devices of the pod (default 1)")
    parser.add_argument("--model-parallel", type=int,
                        help="the mesh's model axis: heads, MLP units and vocabulary split over this many devices "
                             "(default 1); the data axis takes the rest and splits the prompts")
    parser.add_argument("--batch-size", type=int,
                        help=f"prompts generated together, at most {MAX_BATCH} (default: --layout's, else 64)")
    parser.add_argument("--hosts-per-pod", type=int,
                        help="start the local pod as this many hosts (worker processes forming one jax.distributed "
                             "cluster), --devices split over them; the model axis stays inside a host (default 1)")
    parser.add_argument("--workers", metavar="ADDRESSES",
                        help="generate on a running pod instead of a local one: its hosts' HOST:PORT separated by "
                             "',' (workers started with --pod-index 0 or --spare, the same secret and TLS as below); "
                             "they read --checkpoint at the same path, and their devices make the mesh")
    add_security_arguments(parser)


def apply_layout(args) -> None:
    """Fill --devices, --model-parallel and --batch-size the user did not give from --layout's
    [generate] section, or from the defaults. ConfigError naming the file or the field."""
    from multipod.controller.core.run_config import GenerateConfig, read_section
    # Only [generate]: the rest of the file (a corpus path, say) need not exist here.
    layout = read_section(args.layout, "generate", GenerateConfig) if args.layout else GenerateConfig()
    for flag, value in (("devices", layout.devices), ("model_parallel", layout.model_parallel),
                        ("batch_size", layout.batch_size), ("hosts_per_pod", 1)):
        # A running pod (--workers) has its own devices and hosts.
        if getattr(args, flag, None) is None and not (getattr(args, "workers", None) and
                                                      flag in ("devices", "hosts_per_pod")):
            setattr(args, flag, value)


def check_flags(args, config) -> None:
    """ConfigError naming the first flag that cannot work with this checkpoint."""
    from multipod.controller.core.run_config import ConfigError
    if args.out and args.prompts is None:
        raise ConfigError("--out", "goes with --prompts (--prompt prints to the terminal)")
    if args.out:    # checked before a worker starts, not found out after the generation
        folder = pathlib.Path(args.out).absolute().parent
        if not folder.is_dir() or not os.access(folder, os.W_OK) or pathlib.Path(args.out).is_dir():
            raise ConfigError("--out", f"{args.out} cannot be written (is {folder} a writable directory?)")
    if args.temperature is not None and not args.temperature >= 0:
        raise ConfigError("--temperature", f"must be >= 0, got {args.temperature}")
    if args.top_k < 0:
        raise ConfigError("--top-k", f"must be >= 0, got {args.top_k}")
    if not 0 < args.top_p <= 1:
        raise ConfigError("--top-p", f"must be in (0, 1], got {args.top_p}")
    if not 0 <= args.seed < 1 << 64:
        raise ConfigError("--seed", f"must be in [0, 2**64), got {args.seed}")
    if not 1 <= args.batch_size <= MAX_BATCH:
        raise ConfigError("--batch-size", f"must be in [1, {MAX_BATCH}], got {args.batch_size}")
    if args.workers is None:
        check_mesh(args.devices, args.hosts_per_pod, args.model_parallel, config)


def check_pod_flags(args) -> list[str] | None:
    """The hosts of the running pod --workers names (None: a local pod), checked before --layout
    fills --devices: ConfigError for a flag that does not go with it, or more than one pod."""
    from multipod.controller.cluster.addresses import check_pod_hosts, parse_workers
    from multipod.controller.core.run_config import ConfigError
    if args.workers is None:
        return None
    for flag in ("devices", "hosts_per_pod"):
        if getattr(args, flag) is not None:
            raise ConfigError(f"--{flag.replace('_', '-')}", "sets up a local pod: with --workers the running "
                              "pod's own devices and hosts make the mesh")
    spec = args.workers.strip()
    pods = parse_workers(spec) if spec.startswith("@") or ";" in spec else \
        [[a.strip() for a in spec.split(",") if a.strip()]]
    if len(pods) != 1 or not pods[0]:
        raise ConfigError("--workers", f"generation runs on one pod: give its hosts' HOST:PORT separated by ',' "
                          f"(got {len(pods)} pods: {args.workers!r})")
    return check_pod_hosts("--workers", pods[0])


def check_mesh(devices: int, hosts: int, parallel: int, config) -> None:
    """ConfigError naming the flag if a pod of `devices` devices on `hosts` hosts cannot take the
    mesh data x `parallel` for this model and the run's batch."""
    from multipod.controller.core.run_config import ConfigError
    if devices < 1:
        raise ConfigError("--devices", f"must be >= 1, got {devices}")
    if hosts < 1 or devices % hosts:
        raise ConfigError("--hosts-per-pod", f"must be >= 1 and divide the pod's {devices} devices, got {hosts}")
    if parallel < 1 or devices % parallel:
        raise ConfigError("--model-parallel", f"must be >= 1 and divide the pod's {devices} devices, got {parallel}")
    if (devices // hosts) % parallel:
        raise ConfigError("--model-parallel", f"{parallel} does not divide the {devices // hosts} devices of each of "
                          f"the pod's {hosts} hosts: the model axis stays inside a host")
    model = config.model
    for name in ("n_heads", "mlp_dim", "vocab_size"):
        if getattr(model, name) % parallel:
            raise ConfigError("--model-parallel", f"{parallel} does not divide the model's {name} "
                              f"({getattr(model, name)})")
    data, batch = devices // parallel, config.data.global_batch
    if batch % data:
        # Configure compiles the run's training step (its batch is part of the checkpoint's identity).
        raise ConfigError("--devices", f"{devices} devices / --model-parallel {parallel} make a data axis of "
                          f"{data}, which does not divide the run's batch of {batch} sequences (data.global_batch)")
