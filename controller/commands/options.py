"""The options that several commands share (every training run; simulated pods) and what they
resolve to: the run's config (defaults <- --config <- --set <- dedicated flags) and a pod's
simulated device count.

Kept free of jax imports: `multipod --help` builds every parser.
"""
from __future__ import annotations

import argparse
import json
import pathlib

from multipod.controller.core.policies import OnSpike
from multipod.protos.cli_flags import add_security_arguments


def add_train_options(parser: argparse.ArgumentParser) -> None:
    """The options of every training run: train, local, ray and ptune."""
    parser.add_argument("--config", help="TOML config file (see configs/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value, e.g. --set model.d_model=128 (repeatable)")
    parser.add_argument("--steps", type=int, help="training steps (run.steps)")
    parser.add_argument("--seed", type=int, help="seed for parameters and data (run.seed)")
    parser.add_argument("--data", help="a text file, a directory, a .jsonl or a .parquet (data.path; default: "
                        "Python's stdlib)")
    parser.add_argument("--tokenizer", help="bytes | bpe:N (trained on the corpus, cached) | a tokenizer.json | a "
                        "SentencePiece model (data.tokenizer)")
    parser.add_argument("--eval-every", type=int, help="evaluate the held-out split on every pod every N steps "
                        "(eval.every; 0: only at the end)")
    parser.add_argument("--peak-flops", type=float,
                        help="peak FLOP/s of one device, for MFU (default: measured once on this machine and cached)")
    parser.add_argument("--no-peak", action="store_true",
                        help="do not measure this machine's peak FLOP/s (MFU is then reported only if cached)")
    parser.add_argument("--run-dir", help="where config, metrics and logs go (default: a new folder under runs/)")
    # Runs that survive (docs/reliability.md).
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint in the checkpoint directory")
    parser.add_argument("--checkpoint-every", type=int, help="checkpoint every N steps (checkpoint.every)")
    parser.add_argument("--checkpoint-dir", help="checkpoint directory, readable by every pod (checkpoint.dir; "
                        "required by train; local defaults to RUN_DIR/checkpoints)")
    parser.add_argument("--max-restarts", type=int,
                        help="recoveries from failed pods before giving up (recovery.max_restarts)")
    parser.add_argument("--on-spike", choices=[policy.value for policy in OnSpike],
                        help="on a loss spike, rewind to the checkpoint before it (spike.policy)")
    parser.add_argument("--skip-batches", type=int, help="batches to skip after a rewind (spike.skip_batches)")
    add_security_arguments(parser)


def add_report_option(parser: argparse.ArgumentParser) -> None:
    """--no-report, for the commands that start their own workers and draw report.png at the end."""
    parser.add_argument("--no-report", action="store_true",
                        help="do not draw RUN_DIR/report.png at the end (about a second of CPU; metrics.jsonl is "
                             "written either way, and `multipod report RUN_DIR` draws it later)")


def add_local_options(parser: argparse.ArgumentParser) -> None:
    """The options of simulated pods on this machine: local and ptune."""
    parser.add_argument("--pods", type=int, default=2, help="number of simulated pods (default 2)")
    parser.add_argument("--hosts-per-pod", type=int, default=1,
                        help="worker processes per pod, one jax.distributed cluster per pod (default 1)")
    parser.add_argument("--devices-per-host", type=int,
                        help="simulated devices per worker process (default: 1 with several hosts per pod)")
    parser.add_argument("--devices-per-pod", type=int,
                        help="simulated devices per pod, all its hosts together, split evenly over them "
                             "(default 2 with one host per pod; = --hosts-per-pod x --devices-per-host if both given)")
    parser.add_argument("--spares", type=int, default=0, metavar="N",
                        help="also start N standby pods (worker --spare): each takes the slot of a pod that fails, "
                             "at its own address (hot-swap); with spares, a dead worker is not restarted in place "
                             "(default 0)")
    parser.add_argument("--netns", action="store_true",
                        help="run each host of each pod in a Linux network namespace of its own, with its own "
                             "address, joined through a bridge (needs root or CAP_NET_ADMIN + CAP_SYS_ADMIN, and "
                             "iproute2); the workers then serve TLS and CURVE with certificates made for the run")
    parser.add_argument("--netns-rate-gbps", type=float, metavar="R",
                        help="with --netns: shape each pod's link to R Gb/s each way (a tbf qdisc; default unshaped)")
    parser.add_argument("--netns-subnet", metavar="CIDR",
                        help="with --netns: the private IPv4 range of the run's addresses, one this machine does not "
                             "use (default: the first free /24 of 10.213.0.0/16)")
    parser.add_argument("--insecure", action="store_true",
                        help="with --netns: the workers listen on their namespace's address unencrypted (gRPC "
                             "without TLS, data plane without CURVE)")


def resolve_config(args: argparse.Namespace, given: set | None = None):
    """Defaults <- --config <- --set <- the dedicated flags (--steps, --seed, --data, --peak-flops,
    ...). `given` receives the "section.key" names the user set (config.load_config)."""
    from multipod.controller.core.run_config import load_config
    overrides = list(args.overrides)
    if getattr(args, "no_peak", False):
        overrides.append("run.measure_peak=false")
    for flag, key in (("steps", "run.steps"), ("seed", "run.seed"), ("peak_flops", "run.peak_flops"),
                      ("checkpoint_every", "checkpoint.every"), ("max_restarts", "recovery.max_restarts"),
                      ("on_spike", "spike.policy"), ("skip_batches", "spike.skip_batches"),
                      ("eval_every", "eval.every"), ("tokenizer", "data.tokenizer")):
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f"{key}={json.dumps(value) if isinstance(value, str) else value}")
    if getattr(args, "checkpoint_dir", None) is not None:
        overrides.append(f"checkpoint.dir={json.dumps(str(pathlib.Path(args.checkpoint_dir).absolute()))}")
    if args.data is not None:
        overrides.append(f"data.path={json.dumps(args.data)}")
    return load_config(args.config, overrides, given)


def check_local_flags(args: argparse.Namespace) -> None:
    """The simulated pods' flags (--pods, --spares, the device counts), checked before the data is
    prepared, which on a corpus's first use takes minutes: ConfigError naming the flag."""
    from multipod.controller.core.run_config import ConfigError
    if args.pods < 1:
        raise ConfigError("--pods", f"must be >= 1, got {args.pods}")
    if args.spares < 0:
        raise ConfigError("--spares", f"must be >= 0, got {args.spares}")
    local_devices(args)


def local_devices(args: argparse.Namespace) -> int:
    """The simulated devices per pod for `multipod local` (all its hosts together), from
    --hosts-per-pod, --devices-per-host and --devices-per-pod; ConfigError if they contradict."""
    from multipod.controller.core.run_config import ConfigError
    hosts, per_host, per_pod = args.hosts_per_pod, args.devices_per_host, args.devices_per_pod
    if hosts < 1:
        raise ConfigError("--hosts-per-pod", f"must be >= 1, got {hosts}")
    for flag, value in (("--devices-per-host", per_host), ("--devices-per-pod", per_pod)):
        if value is not None and value < 1:
            raise ConfigError(flag, f"must be >= 1, got {value}")
    if per_host is not None and per_pod is not None and per_pod != hosts * per_host:
        raise ConfigError("--devices-per-pod", f"{per_pod} is not --hosts-per-pod x --devices-per-host "
                          f"({hosts} x {per_host} = {hosts * per_host}): give one of them")
    if per_pod is not None:
        if per_pod % hosts:
            raise ConfigError("--devices-per-pod", f"{per_pod} devices do not split evenly over {hosts} hosts per pod; "
                              f"give --devices-per-host instead")
        return per_pod
    if per_host is not None:
        return hosts * per_host
    return 2 if hosts == 1 else hosts
