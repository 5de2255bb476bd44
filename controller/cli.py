"""The controller's commands of `multipod`: train, local, ray, ptune, peak-flops, tune, generate, report (the
entry module, multipod.cli, adds `worker` from the worker side).

Kept free of jax imports at module level: `multipod --help` needs only the standard library.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import secrets
import sys

from multipod.protos.cli_flags import add_security_arguments, security_from_args


def _add_train_options(parser: argparse.ArgumentParser) -> None:
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
                        "(run.eval_every; 0: only at the end)")
    parser.add_argument("--peak-flops", type=float,
                        help="peak FLOP/s of one device, for MFU (default: measured once on this machine and cached)")
    parser.add_argument("--no-peak", action="store_true",
                        help="do not measure this machine's peak FLOP/s (MFU is then reported only if cached)")
    parser.add_argument("--run-dir", help="where config, metrics and logs go (default: a new folder under runs/)")
    # Runs that survive (docs/reliability.md).
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint in the checkpoint directory")
    parser.add_argument("--checkpoint-every", type=int, help="checkpoint every N steps (run.checkpoint_every)")
    parser.add_argument("--checkpoint-dir", help="checkpoint directory, readable by every pod (run.checkpoint_dir; "
                        "required by train; local defaults to RUN_DIR/checkpoints)")
    parser.add_argument("--max-restarts", type=int,
                        help="recoveries from failed pods before giving up (run.max_restarts)")
    parser.add_argument("--on-spike", choices=("none", "rewind"),
                        help="on a loss spike, rewind to the checkpoint before it (run.on_spike)")
    parser.add_argument("--skip-batches", type=int, help="batches to skip after a rewind (run.skip_batches)")
    add_security_arguments(parser)


def _add_local_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pods", type=int, default=2, help="number of simulated pods (default 2)")
    parser.add_argument("--hosts-per-pod", type=int, default=1,
                        help="worker processes per pod, one jax.distributed cluster per pod (default 1)")
    parser.add_argument("--devices-per-host", type=int,
                        help="simulated devices per worker process (default: 1 with several hosts per pod)")
    parser.add_argument("--devices-per-pod", type=int,
                        help="simulated devices per pod, all its hosts together, split evenly over them "
                             "(default 2 with one host per pod; = --hosts-per-pod x --devices-per-host if both given)")


def add_commands(sub) -> None:
    """Add the controller's commands to the `multipod` subparsers."""
    train = sub.add_parser("train", help="run the controller against running pod workers")
    train.add_argument("--workers", required=True, metavar="ADDRESSES",
                       help="the pod workers' HOST:PORT in pod order: comma-separated for pods of one host; "
                            "for pods of several hosts, pods separated by ';' and a pod's hosts by ',' in host "
                            "order (e.g. 'a:1,b:1;c:1,d:1': 2 pods x 2 hosts); or @FILE with one pod per line "
                            "(hosts separated by commas or spaces, '#' comments)")
    _add_train_options(train)

    local = sub.add_parser("local", help="simulate pods on this machine and train")
    _add_local_options(local)
    _add_train_options(local)

    ray = sub.add_parser("ray", help="launch the pods on a Ray cluster (one placement group per pod, one actor per "
                         "host) and train; needs pip install 'multipod[ray]'")
    ray.add_argument("--address", default="auto",
                     help="the Ray cluster: HOST:PORT of its head (GCS), or auto for the one running on this machine "
                          "(default auto)")
    ray.add_argument("--pods", type=int, default=2, help="number of pods (default 2)")
    ray.add_argument("--hosts-per-pod", type=int, default=1,
                     help="hosts per pod: one Ray actor each, gang-scheduled in the pod's placement group; a pod's "
                          "hosts form one jax.distributed cluster (default 1)")
    ray.add_argument("--resources-per-host", default='{"CPU": 1}', metavar="JSON",
                     help='what each host asks Ray for, e.g. \'{"TPU": 4}\' or \'{"GPU": 8, "CPU": 8}\' '
                          '(default \'{"CPU": 1}\')')
    ray.add_argument("--devices-per-host", type=int, default=0,
                     help="simulated CPU devices per host (default 0: the devices jax finds on the node)")
    ray.add_argument("--placement-strategy", default="STRICT_SPREAD",
                     choices=("STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK"),
                     help="how a pod's hosts are spread over nodes (default STRICT_SPREAD: a node each; "
                          "PACK lets them share one, e.g. to try it on one machine)")
    ray.add_argument("--place-timeout", type=float, default=60.0, metavar="SECONDS",
                     help="deadline to place the pods, at the start and again after a failure (default 60)")
    ray.add_argument("--insecure", action="store_true",
                     help="let workers on other nodes than the controller listen unencrypted (gRPC without TLS, "
                          "data plane without dcn.encrypt): only on a network you trust")
    _add_train_options(ray)

    peak = sub.add_parser("peak-flops", help="measure per-device matmul FLOP/s and remember it for MFU")
    peak.add_argument("--devices", type=int, default=1, help="simulated devices sharing this machine (default 1)")
    peak.add_argument("--size", type=int, default=1024, help="matmul size")

    from multipod.controller.tune import add_arguments as add_tune_arguments
    tune = sub.add_parser("tune", help="search one pod's layout for training (mesh, sequence parallelism, "
                          "microbatches, remat), or with --inference for generation (mesh, batch)")
    add_tune_arguments(tune)

    tokenizer = sub.add_parser("tokenizer", help="tokenizer tools")
    tokenizer_sub = tokenizer.add_subparsers(dest="tokenizer_command", required=True)
    bpe = tokenizer_sub.add_parser("train", help="train a byte-level BPE tokenizer (Hugging Face tokenizer.json)")
    bpe.add_argument("--data", default="", help="text file, directory, .jsonl or .parquet (default: Python's stdlib)")
    bpe.add_argument("--text-field", default="text", help="the text field of .jsonl and .parquet records")
    bpe.add_argument("--vocab-size", type=int, required=True, help="tokens in the vocabulary, special tokens included")
    bpe.add_argument("--out", required=True, metavar="PATH", help="where tokenizer.json goes")

    from multipod.controller.ptune import add_arguments as add_ptune_arguments
    ptune = sub.add_parser("ptune", help="prompt tuning or p-tuning of a checkpoint on a task of input/output pairs: "
                           "the base stays frozen; across simulated pods, or --workers")
    add_ptune_arguments(ptune)
    _add_local_options(ptune)
    _add_train_options(ptune)

    from multipod.controller.generate import add_arguments as add_generate_arguments
    generate = sub.add_parser("generate", help="generate text from a checkpoint (KV cache, one local pod)")
    add_generate_arguments(generate)

    report = sub.add_parser("report", help="draw a run's metrics and events as one picture (report.png)")
    report.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (holds metrics.jsonl)")
    report.add_argument("--out", metavar="PATH", help="where the PNG goes (default: RUN_DIR/report.png)")


def resolve_config(args: argparse.Namespace, given: set | None = None):
    """Defaults <- --config <- --set <- the dedicated flags (--steps, --seed, --data, --peak-flops,
    ...). `given` receives the "section.key" names the user set (config.load_config)."""
    from multipod.controller.config import load_config
    overrides = list(args.overrides)
    if getattr(args, "no_peak", False):
        overrides.append("run.measure_peak=false")
    for flag, key in (("steps", "run.steps"), ("seed", "run.seed"), ("peak_flops", "run.peak_flops"),
                      ("checkpoint_every", "run.checkpoint_every"), ("max_restarts", "run.max_restarts"),
                      ("on_spike", "run.on_spike"), ("skip_batches", "run.skip_batches"),
                      ("eval_every", "run.eval_every"), ("tokenizer", "data.tokenizer")):
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f"{key}={json.dumps(value) if isinstance(value, str) else value}")
    if getattr(args, "checkpoint_dir", None) is not None:
        overrides.append(f"run.checkpoint_dir={json.dumps(str(pathlib.Path(args.checkpoint_dir).absolute()))}")
    if args.data is not None:
        overrides.append(f"data.path={json.dumps(args.data)}")
    return load_config(args.config, overrides, given)


def _run_dir(args: argparse.Namespace) -> pathlib.Path:
    if args.run_dir:
        return pathlib.Path(args.run_dir)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return pathlib.Path("runs") / f"{stamp}-{secrets.token_hex(2)}"


def _train(args, addresses_fn) -> int:
    from multipod.controller.config import ConfigError
    from multipod.controller.corpus import prepare
    from multipod.controller.metrics import out
    from multipod.controller.summary import print_summary
    from multipod.controller.training import run_training
    from multipod.protos.transport import set_default_security
    given: set = set()
    config = resolve_config(args, given)
    mode = _mode(args)
    if mode == "train" and not config.run.checkpoint_dir:
        # Pod 0 writes the checkpoints: the default, under the controller's run directory, would
        # land on pod 0's own disk, where the other pods cannot read it when they restore.
        raise ConfigError("run.checkpoint_dir", "multipod train with --workers needs a checkpoint directory "
                          "that every pod can read (shared storage): pass --checkpoint-dir DIR or "
                          "--set run.checkpoint_dir=DIR")
    if args.resume and not (args.run_dir or config.run.checkpoint_dir):
        raise ConfigError("--resume", "say which run to continue: --run-dir of that run, or --checkpoint-dir")
    security = security_from_args(args)
    launched = mode in LAUNCHERS     # we start the workers (local, ray), not the user
    if launched and not security.token:
        # Workers we start still authenticate: a fresh secret per run, handed over in their
        # environment (local) or as an actor's constructor argument (ray), never on a command line.
        security = dataclasses.replace(security, token=secrets.token_urlsafe(32))
    set_default_security(security)
    run_dir = _run_dir(args)
    run_dir.mkdir(parents=True, exist_ok=True)
    out(f"run directory: {run_dir}")
    # The data first: a bad corpus or tokenizer is reported before any worker starts, and the
    # model's vocabulary (which follows the tokenizer) is known when the pods configure.
    data = prepare(config, vocab_given="model.vocab_size" in given)
    try:
        context = addresses_fn(run_dir, config)
        with context as addresses:
            summary = run_training(data.config, addresses, run_dir, resume=args.resume,
                                   supervisor=getattr(context, "pods", None), data=data,
                                   local=mode == "local")
        print_summary(summary)
    finally:
        if launched:     # after the workers stopped, whether the run succeeded or not
            write_report_quietly(run_dir)
    return 0


# The commands that start their own workers: a fresh auth token, and report.png at the end.
LAUNCHERS = ("local", "ray")


def _mode(args: argparse.Namespace) -> str:
    """Where the workers come from: "train" (the user's, --workers) or one of LAUNCHERS."""
    if args.command == "ptune":
        return "train" if args.workers else "local"
    return args.command


def write_report_quietly(run_dir: pathlib.Path) -> None:
    """The end of `multipod local` and `multipod ray`: draw RUN_DIR/report.png if the run wrote metrics, and print its
    path; a report that cannot be drawn is a warning, never the run's failure."""
    from multipod.controller.metrics import out
    metrics = run_dir / "metrics.jsonl"
    try:
        if not metrics.is_file() or metrics.stat().st_size == 0:
            return
        from multipod.controller.report import write_report
        out(f"report: {write_report(run_dir)}")
    except Exception as exc:    # drawing is a convenience; metrics.jsonl is the record
        print(f"warning: no report drawn: {exc}", file=sys.stderr, flush=True)


class _Fixed:
    def __init__(self, addresses):
        self.addresses = addresses

    def __enter__(self):
        return self.addresses

    def __exit__(self, *exc):
        return False


def local_devices(args: argparse.Namespace) -> int:
    """The simulated devices per pod for `multipod local` (all its hosts together), from
    --hosts-per-pod, --devices-per-host and --devices-per-pod; ConfigError if they contradict."""
    from multipod.controller.config import ConfigError
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


class _Local:
    def __init__(self, args, run_dir, config):
        from multipod.controller.launcher import LocalPods
        # Supervised: a worker that dies is started again on its port (run.max_restarts in all);
        # a pod of several hosts is restarted as a whole.
        self.pods = LocalPods(args.pods, local_devices(args), run_dir, supervise=True,
                              max_restarts=config.run.max_restarts, dcn_encrypt=config.dcn.encrypt,
                              hosts_per_pod=args.hosts_per_pod)

    def __enter__(self):
        from multipod.controller.metrics import out
        self.pods.__enter__()
        pods = self.pods
        if pods.multi_host:
            what = (f"{pods.num_pods} pod(s) of {pods.hosts_per_pod} worker(s) with "
                    f"{pods.host_devices[0][0]} simulated device(s) each: {pods.workers}")
        else:
            what = (f"{pods.num_pods} pod worker(s) with {pods.device_counts[0]} simulated device(s) each: "
                    + ", ".join(pods.addresses))
        out(f"started {what} (logs in {pods.log_dir})")
        return pods.host_addresses     # [pod][host]: controller/cluster.py connect() takes them

    def __exit__(self, *exc):
        self.pods.__exit__(*exc)
        return False


def run(args: argparse.Namespace) -> int:
    """Run one controller command; returns the exit code (errors are printed, not raised)."""
    from multipod.controller.client import WorkerError
    from multipod.controller.config import ConfigError
    from multipod.controller.data import DataError
    from multipod.controller.errors import RunError
    from multipod.controller.launcher import LaunchError
    try:
        if args.command == "train":
            from multipod.controller.hosts import parse_workers
            addresses = parse_workers(args.workers)     # [pod][host]; before anything else is done
            return _train(args, lambda run_dir, config: _Fixed(addresses))
        if args.command == "local":
            return _train(args, lambda run_dir, config: _Local(args, run_dir, config))
        if args.command == "ptune":
            from multipod.controller.ptune import derived_overrides
            args.overrides = derived_overrides(args) + args.overrides     # the user's --set come last
            if args.workers:
                from multipod.controller.hosts import parse_workers
                addresses = parse_workers(args.workers)
                return _train(args, lambda run_dir, config: _Fixed(addresses))
            return _train(args, lambda run_dir, config: _Local(args, run_dir, config))
        if args.command == "ray":
            from multipod.controller.ray_cluster import check_request, import_ray, parse_resources
            from multipod.controller.ray_launcher import RayContext
            # Everything that can be checked without a cluster, before the data is prepared.
            import_ray()
            parse_resources(args.resources_per_host)
            check_request(args.pods, args.hosts_per_pod, args.placement_strategy, args.devices_per_host)
            return _train(args, lambda run_dir, config: RayContext(args, run_dir, config))
        if args.command == "report":
            from multipod.controller.report import write_report
            print(write_report(pathlib.Path(args.run_dir), args.out and pathlib.Path(args.out)))
            return 0
        if args.command == "generate":
            from multipod.controller.generate import main as generate_main
            return generate_main(args)
        if args.command == "tokenizer":
            from multipod.controller.tokenizer import train_main
            return train_main(args)
        if args.command == "tune":
            from multipod.controller.tune import main as tune_main
            return tune_main(args)
        if args.command == "peak-flops":
            from multipod.controller.metrics import store_measured_peak
            from multipod.controller.peak import measure
            result = measure(args.devices, args.size)
            path = store_measured_peak(result["device_kind"], result["devices"], result["per_device_flops"])
            print(json.dumps(result))
            print(f"stored in {path}: {result['per_device_flops'] / 1e9:.1f} GFLOP/s per device "
                  f"({result['device_kind']}, {result['devices']} device(s))", file=sys.stderr)
            return 0
    except ConfigError as exc:
        print(f"error: config: {exc}", file=sys.stderr)
        return 2
    except (WorkerError, RunError, LaunchError, DataError, ValueError) as exc:   # incl. SecurityError
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: workers stopped", file=sys.stderr)
        return 130
    print(f"error: unknown command {args.command}", file=sys.stderr)
    return 2


