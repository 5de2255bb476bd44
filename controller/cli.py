"""The `multipod` command: worker, train, local, peak-flops.

Kept free of jax imports at module level: `multipod worker` must set the simulated device count
before jax initialises.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import secrets
import sys


def _add_train_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML config file (see configs/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value, e.g. --set model.d_model=128 (repeatable)")
    parser.add_argument("--steps", type=int, help="training steps (run.steps)")
    parser.add_argument("--seed", type=int, help="seed for parameters and data (run.seed)")
    parser.add_argument("--data", help="a text file or a directory of text files (default: Python's stdlib)")
    parser.add_argument("--peak-flops", type=float,
                        help="peak FLOP/s of one device, for MFU (default: the value `multipod peak-flops` measured)")
    parser.add_argument("--run-dir", help="where config, metrics and logs go (default: a new folder under runs/)")


def build_parser() -> argparse.ArgumentParser:
    from pod_worker.main import add_arguments as add_worker_arguments
    parser = argparse.ArgumentParser(prog="multipod", description="Multi-pod language-model training on JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    worker = sub.add_parser("worker", help="serve one pod")
    add_worker_arguments(worker)

    train = sub.add_parser("train", help="run the controller against running pod workers")
    train.add_argument("--workers", required=True, help="HOST:PORT of every pod worker, comma-separated, in pod order")
    _add_train_options(train)

    local = sub.add_parser("local", help="simulate pods on this machine and train")
    local.add_argument("--pods", type=int, default=2, help="number of simulated pods (default 2)")
    local.add_argument("--devices-per-pod", type=int, default=2, help="simulated devices per pod (default 2)")
    _add_train_options(local)

    peak = sub.add_parser("peak-flops", help="measure per-device matmul FLOP/s and remember it for MFU")
    peak.add_argument("--devices", type=int, default=1, help="simulated devices sharing this machine (default 1)")
    peak.add_argument("--size", type=int, default=1024, help="matmul size")
    return parser


def resolve_config(args: argparse.Namespace):
    """Defaults <- --config <- --set <- the dedicated flags (--steps, --seed, --data, --peak-flops)."""
    from controller.config import load_config
    overrides = list(args.overrides)
    for flag, key in (("steps", "run.steps"), ("seed", "run.seed"), ("peak_flops", "run.peak_flops")):
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={value}")
    if args.data is not None:
        overrides.append(f"data.path={json.dumps(args.data)}")
    return load_config(args.config, overrides)


def _run_dir(args: argparse.Namespace) -> pathlib.Path:
    if args.run_dir:
        return pathlib.Path(args.run_dir)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return pathlib.Path("runs") / f"{stamp}-{secrets.token_hex(2)}"


def _train(args, addresses_fn) -> int:
    from controller.training import print_summary, run_training
    from controller.metrics import out
    config = resolve_config(args)
    run_dir = _run_dir(args)
    run_dir.mkdir(parents=True, exist_ok=True)
    out(f"run directory: {run_dir}")
    with addresses_fn(run_dir) as addresses:
        summary = run_training(config, addresses, run_dir)
    print_summary(summary)
    return 0


class _Fixed:
    def __init__(self, addresses):
        self.addresses = addresses

    def __enter__(self):
        return self.addresses

    def __exit__(self, *exc):
        return False


class _Local:
    def __init__(self, args, run_dir):
        from controller.launcher import LocalPods
        self.pods = LocalPods(args.pods, args.devices_per_pod, run_dir)

    def __enter__(self):
        from controller.metrics import out
        self.pods.__enter__()
        out(f"started {self.pods.num_pods} pod worker(s) with {self.pods.devices_per_pod} simulated device(s) each: "
            + ", ".join(self.pods.addresses) + f" (logs in {self.pods.log_dir})")
        return self.pods.addresses

    def __exit__(self, *exc):
        self.pods.__exit__(*exc)
        return False


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "worker":
        from pod_worker.main import run
        return run(args)

    from controller.client import WorkerError
    from controller.config import ConfigError
    from controller.data import DataError
    from controller.launcher import LaunchError
    from controller.training import RunError
    try:
        if args.command == "train":
            addresses = [a.strip() for a in args.workers.split(",") if a.strip()]
            return _train(args, lambda run_dir: _Fixed(addresses))
        if args.command == "local":
            return _train(args, lambda run_dir: _Local(args, run_dir))
        if args.command == "peak-flops":
            from controller.metrics import store_measured_peak
            from controller.peak import measure
            result = measure(args.devices, args.size)
            path = store_measured_peak(result["device_kind"], result["devices"], result["per_device_flops"])
            print(json.dumps(result))
            print(f"stored in {path}: {result['per_device_flops'] / 1e9:.1f} GFLOP/s per device "
                  f"({result['device_kind']}, {result['devices']} device(s))", file=sys.stderr)
            return 0
    except ConfigError as exc:
        print(f"error: config: {exc}", file=sys.stderr)
        return 2
    except (WorkerError, RunError, LaunchError, DataError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: workers stopped", file=sys.stderr)
        return 130
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
