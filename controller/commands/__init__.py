"""The controller's commands of `multipod`, one module each where a command has code of its own:

  options     the options every training run shares, and the config they resolve to
  train       a training run: train (--workers), local, ray and ptune all run one
  ptune       ptune's config, derived from the base checkpoint
  generate    generate: text from a checkpoint on one pod (local, or running: --workers)
  generate_options  generate's flags and their checks
  checkpoints what --checkpoint names for generate and ptune (DiLoCo runs' per-pod parts too)
  tune        tune: search one pod's layout (the search itself is controller/tune/)
  plan        plan: project the cross-pod sync settings onto a cluster on paper (tune/cost.py)

report, tokenizer, cache and peak-flops call straight into their concern's module
(observe/report.py, data/tokenizer.py, data/cache_store.py, observe/peak.py). The entry module,
multipod.cli, adds `worker` from the worker side.

Kept free of jax imports at module level: `multipod --help` needs only the standard library.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

from multipod.controller.commands.options import add_local_options, add_report_option, add_train_options


def add_commands(sub) -> None:
    """Add the controller's commands to the `multipod` subparsers."""
    train = sub.add_parser("train", help="run the controller against running pod workers")
    train.add_argument("--workers", required=True, metavar="ADDRESSES",
                       help="the pod workers' HOST:PORT in pod order: comma-separated for pods of one host; "
                            "for pods of several hosts, pods separated by ';' and a pod's hosts by ',' in host "
                            "order (e.g. 'a:1,b:1;c:1,d:1': 2 pods x 2 hosts); or @FILE with one pod per line "
                            "(hosts separated by commas or spaces, '#' comments)")
    train.add_argument("--spares", metavar="ADDRESSES",
                       help="standby pods (workers started with --spare), in the --workers format: each takes the "
                            "slot of a pod that fails, at its own address (hot-swap); more can be offered while the "
                            "run goes on with `multipod attach`")
    add_train_options(train)

    attach = sub.add_parser("attach", help="offer a standby pod (workers started with --spare) to a running run: "
                            "it takes the slot of the next pod that fails, or of one that failed already")
    attach.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory (where the controller writes)")
    attach.add_argument("--worker", required=True, metavar="ADDRESSES",
                        help="the standby pod's HOST:PORT; for a pod of several hosts, its hosts separated by ',' "
                             "in host order")

    local = sub.add_parser("local", help="simulate pods on this machine and train")
    add_local_options(local)
    add_train_options(local)
    add_report_option(local)

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
    add_train_options(ray)
    add_report_option(ray)

    peak = sub.add_parser("peak-flops", help="measure per-device matmul FLOP/s and remember it for MFU")
    peak.add_argument("--devices", type=int, default=1, help="simulated devices sharing this machine (default 1)")
    peak.add_argument("--size", type=int, default=1024, help="matmul size")

    from multipod.controller.commands.tune import add_arguments as add_tune_arguments
    tune = sub.add_parser("tune", help="search one pod's layout for training (mesh, sequence parallelism, "
                          "microbatches, remat), or with --inference for generation (mesh, batch)")
    add_tune_arguments(tune)

    from multipod.controller.commands.plan import add_arguments as add_plan_arguments
    plan = sub.add_parser("plan", help="project step time, exposed communication, weak scaling and DCN bytes per "
                          "step of every cross-pod sync setting onto a cluster, on paper, and recommend [dcn]/[sync]")
    add_plan_arguments(plan)

    tokenizer = sub.add_parser("tokenizer", help="tokenizer tools")
    tokenizer_sub = tokenizer.add_subparsers(dest="tokenizer_command", required=True)
    bpe = tokenizer_sub.add_parser("train", help="train a byte-level BPE tokenizer (Hugging Face tokenizer.json)")
    bpe.add_argument("--data", default="", help="text file, directory, .jsonl or .parquet (default: Python's stdlib)")
    bpe.add_argument("--text-field", default="text", help="the text field of .jsonl and .parquet records")
    bpe.add_argument("--vocab-size", type=int, required=True, help="tokens in the vocabulary, special tokens included")
    bpe.add_argument("--out", required=True, metavar="PATH", help="where tokenizer.json goes")

    cache = sub.add_parser("cache", help="list the cache (token caches, trained tokenizers, the workers' compiled "
                           "programs), or remove what no run has used for a while")
    cache_sub = cache.add_subparsers(dest="cache_command", required=True)
    for name, text in (("list", "every entry: size, days since a run used it, what it was made from"),
                       ("prune", "remove the entries no run has used for --older-than-days (a run that needs one "
                                 "again rebuilds it)")):
        command = cache_sub.add_parser(name, help=text)
        command.add_argument("--cache-dir", metavar="DIR",
                             help="the cache root (default: $MULTIPOD_CACHE_DIR, else ~/.cache/multipod; a run's "
                                  "data.cache_dir)")
        if name == "prune":
            command.add_argument("--older-than-days", type=float, required=True, metavar="DAYS",
                                 help="remove what no run has used for this many days (0: everything)")
            command.add_argument("--dry-run", action="store_true", help="say what would go, and remove nothing")

    from multipod.controller.commands.ptune import add_arguments as add_ptune_arguments
    ptune = sub.add_parser("ptune", help="prompt tuning or p-tuning of a checkpoint on a task of input/output pairs: "
                           "the base stays frozen; across simulated pods, or --workers")
    add_ptune_arguments(ptune)
    add_local_options(ptune)
    add_train_options(ptune)
    add_report_option(ptune)

    from multipod.controller.commands.generate_options import add_arguments as add_generate_arguments
    generate = sub.add_parser("generate", help="generate text from a checkpoint (KV cache, one pod: local, or "
                                               "running with --workers)")
    add_generate_arguments(generate)

    report = sub.add_parser("report", help="draw a run's metrics and events as one picture (report.png)")
    report.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (holds metrics.jsonl)")
    report.add_argument("--out", metavar="PATH", help="where the PNG goes (default: RUN_DIR/report.png)")


def parse_spares(spec: str, hosts_per_pod: int) -> list[list[str]]:
    """--spares, in the --workers format (one spare pod of two hosts: 'a:1,b:1;'); ConfigError
    naming --spares unless every spare pod has the run's number of hosts."""
    from multipod.controller.cluster.addresses import parse_workers
    from multipod.controller.core.run_config import ConfigError
    try:
        spares = parse_workers(spec)
    except ConfigError as exc:
        raise ConfigError("--spares", str(exc).split(": ", 1)[-1]) from None
    wrong = [",".join(pod) for pod in spares if len(pod) != hosts_per_pod]
    if wrong:
        raise ConfigError("--spares", f"each spare pod needs the run's {hosts_per_pod} host(s) (';' separates pods, "
                          f"',' a pod's hosts, as in --workers): {'; '.join(wrong)}")
    return spares


def attach(args: argparse.Namespace) -> int:
    """`multipod attach RUN_DIR --worker ADDRESSES`: offer a standby pod to a running run."""
    from multipod.controller.cluster.spares import offer
    from multipod.controller.core.run_config import ConfigError
    run_dir = pathlib.Path(args.run_dir)
    if not (run_dir / "config.json").is_file():
        raise ConfigError("RUN_DIR", f"{run_dir} is not a run directory (it has no config.json)")
    from multipod.controller.cluster.addresses import check_pod_hosts
    from multipod.controller.core.run_lock import running_controller
    hosts = check_pod_hosts("--worker", [a.strip() for a in args.worker.split(",") if a.strip()])
    if not hosts:
        raise ConfigError("--worker", "give the standby pod's HOST:PORT (its hosts separated by ',')")
    path = offer(run_dir, hosts)
    if running_controller(run_dir) is None:
        print(f"offered {','.join(hosts)} to the run in {run_dir} ({path}), but no controller is running it now: "
              f"the offer is checked when the run is resumed (--resume --run-dir {run_dir})")
    else:
        print(f"offered {','.join(hosts)} to the run in {run_dir} ({path}): the controller checks it within a "
              f"second and prints 'spare ready' or why it refused it")
    return 0


def cache_command(args: argparse.Namespace) -> int:
    """`multipod cache list|prune`: what the data cache holds, and removing what no run used lately."""
    from multipod.controller.core.run_config import ConfigError
    from multipod.controller.data import cache_store
    root = pathlib.Path(args.cache_dir).expanduser() if args.cache_dir else cache_store.default_root()
    if args.cache_dir and not root.is_dir():
        raise ConfigError("--cache-dir", f"{root} is not a directory")
    if args.cache_command == "list":
        print(f"cache {root}:")
        print(cache_store.table(cache_store.entries(root)))
        return 0
    if not args.older_than_days >= 0:
        raise ConfigError("--older-than-days", f"must be 0 or more, got {args.older_than_days:g}")
    gone = cache_store.prune(root, args.older_than_days, dry_run=args.dry_run)
    print(f"cache {root}: {'would remove' if args.dry_run else 'removed'} what no run used for "
          f"{args.older_than_days:g} days:")
    print(cache_store.table(gone))
    return 0


def run(args: argparse.Namespace) -> int:
    """Run one controller command; returns the exit code (errors are printed, not raised)."""
    from multipod.controller.cluster.client import WorkerError
    from multipod.controller.commands.train import Fixed, Local, train_run
    from multipod.controller.core.errors import RunError
    from multipod.controller.core.run_config import ConfigError
    from multipod.controller.data.batches import DataError
    from multipod.controller.launch.local import LaunchError
    try:
        if args.command == "train":
            from multipod.controller.cluster.addresses import parse_workers
            addresses = parse_workers(args.workers)     # [pod][host]; before anything else is done
            spares = parse_spares(args.spares, len(addresses[0])) if args.spares else []
            return train_run(args, lambda run_dir, config: Fixed(addresses, spares))
        if args.command == "attach":
            return attach(args)
        if args.command == "local":
            return train_run(args, lambda run_dir, config: Local(args, run_dir, config))
        if args.command == "ptune":
            from multipod.controller.commands.ptune import derived_overrides
            args.overrides = derived_overrides(args) + args.overrides     # the user's --set come last
            if args.workers:
                from multipod.controller.cluster.addresses import parse_workers
                addresses = parse_workers(args.workers)
                return train_run(args, lambda run_dir, config: Fixed(addresses))
            return train_run(args, lambda run_dir, config: Local(args, run_dir, config))
        if args.command == "ray":
            from multipod.controller.launch.ray_cluster import check_request, import_ray, parse_resources
            from multipod.controller.launch.ray_context import RayContext
            # Everything that can be checked without a cluster, before the data is prepared.
            import_ray()
            parse_resources(args.resources_per_host)
            check_request(args.pods, args.hosts_per_pod, args.placement_strategy, args.devices_per_host)
            return train_run(args, lambda run_dir, config: RayContext(args, run_dir, config))
        if args.command == "report":
            from multipod.controller.observe.report import write_report
            print(write_report(pathlib.Path(args.run_dir), args.out and pathlib.Path(args.out)))
            return 0
        if args.command == "generate":
            from multipod.controller.commands.generate import main as generate_main
            return generate_main(args)
        if args.command == "tokenizer":
            from multipod.controller.data.tokenizer import train_main
            return train_main(args)
        if args.command == "cache":
            return cache_command(args)
        if args.command == "tune":
            from multipod.controller.commands.tune import main as tune_main
            return tune_main(args)
        if args.command == "plan":
            from multipod.controller.commands.plan import main as plan_main
            return plan_main(args)
        if args.command == "peak-flops":
            from multipod.controller.observe.metrics import store_measured_peak
            from multipod.controller.observe.peak import measure
            for flag, value in (("--devices", args.devices), ("--size", args.size)):
                if value < 1:
                    raise ConfigError(flag, f"must be >= 1, got {value}")
            try:
                result = measure(args.devices, args.size)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:     # the probe's own failure, its log
                raise RunError(str(exc)) from None
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


