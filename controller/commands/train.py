"""A training run started by a command: `train` (the user's workers), `local` (simulated pods),
`ray` (pods on a Ray cluster) and `ptune` (a training run of a prompt): the run directory, the
run's secret, the data prepared before any worker starts, the run itself, and report.png at the
end of a run whose workers we started.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import pathlib
import secrets
import sys

from multipod.controller.commands.options import check_local_flags, local_devices, resolve_config
from multipod.protos.cli_flags import security_from_args


def _run_dir(args: argparse.Namespace) -> pathlib.Path:
    if args.run_dir:
        return pathlib.Path(args.run_dir)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return pathlib.Path("runs") / f"{stamp}-{secrets.token_hex(2)}"


def train_run(args, addresses_fn) -> int:
    from multipod.controller.core.run_config import ConfigError
    from multipod.controller.core.run_lock import RunDirLock
    from multipod.controller.data.corpus import prepare
    from multipod.controller.observe.metrics import out
    from multipod.controller.run.summary import print_summary
    from multipod.controller.run.training import check_batch_splits, run_training
    from multipod.protos.channels import set_default_security
    given: set = set()
    config = resolve_config(args, given)
    mode = _mode(args)
    check_netns_args(args, mode)
    if mode == "local":
        check_local_flags(args)
        config.mesh.resolve(local_devices(args))     # the pods' mesh fits their devices (ConfigError)
    if mode in LAUNCHERS and getattr(args, "pods", None):     # before the corpus is read and the workers start
        check_batch_splits(config, args.pods)
    if mode == "train" and not config.checkpoint.dir:
        # Pod 0 writes the checkpoints: the default, under the controller's run directory, would
        # land on pod 0's own disk, where the other pods cannot read it when they restore.
        raise ConfigError("checkpoint.dir", "multipod train with --workers needs a checkpoint directory "
                          "that every pod can read (shared storage): pass --checkpoint-dir DIR or "
                          "--set checkpoint.dir=DIR")
    if args.resume and not (args.run_dir or config.checkpoint.dir):
        raise ConfigError("--resume", "say which run to continue: --run-dir of that run, or --checkpoint-dir")
    if config.checkpoint.warm_start_from and not args.resume:
        raise ConfigError("checkpoint.warm_start_from", "a warm start is how --resume begins a DiLoCo run that "
                          "has saved no checkpoint yet: run with --resume")
    security = security_from_args(args)
    launched = mode in LAUNCHERS     # we start the workers (local, ray), not the user
    if launched and not security.token:
        # Workers we start still authenticate: a fresh secret per run, handed over in their
        # environment (local) or as an actor's constructor argument (ray), never on a command line.
        security = dataclasses.replace(security, token=secrets.token_urlsafe(32))
    set_default_security(security)
    run_dir = _run_dir(args)
    if args.resume and mode == "local" and not run_dir.exists():    # before a folder is made for nothing
        check_something_to_resume(config, run_dir)
    if config.checkpoint.dir and (mode == "local" or pathlib.Path(config.checkpoint.dir).exists()):
        # Local pods write where this process can see; remote pods' shared storage may not be
        # mounted here, but if the path is here it must be a folder.
        make_folder(pathlib.Path(config.checkpoint.dir), "checkpoint.dir")
    make_folder(run_dir, "--run-dir")
    with RunDirLock(run_dir):       # one controller per run directory
        if not args.resume:
            check_no_earlier_run(config, run_dir)
        elif mode == "local":       # here, under the lock: a controller running the run is named first
            check_something_to_resume(config, run_dir)
        out(f"run directory: {run_dir}")
        # The data first: a bad corpus or tokenizer is reported before any worker starts, and the
        # model's vocabulary (which follows the tokenizer) is known when the pods configure.
        data = prepare(config, vocab_given="model.vocab_size" in given)
        try:
            context = addresses_fn(run_dir, config)
            with context as addresses:
                summary = run_training(data.config, addresses, run_dir, resume=args.resume,
                                       supervisor=getattr(context, "pods", None), data=data,
                                       local=mode == "local", spares=getattr(context, "spares", None))
            print_summary(summary)
        finally:
            if launched and not getattr(args, "no_report", False):   # after the workers stopped, whatever the outcome
                write_report_quietly(run_dir)
    return 0


def make_folder(path: pathlib.Path, field: str) -> None:
    """Create the folder `path` (and its parents) unless it exists; ConfigError naming `field` if
    it is a file or cannot be made. Checked before the data and the workers: a checkpoint folder
    that is a file failed every save of a run that went on to the end."""
    from multipod.controller.core.run_config import ConfigError
    if path.exists() and not path.is_dir():
        raise ConfigError(field, f"{path} is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(field, f"cannot create the folder {path}: {exc.strerror or exc}") from None


def check_something_to_resume(config, run_dir: pathlib.Path) -> None:
    """ConfigError if `multipod local --resume` has nothing to continue from: no checkpoint in the
    run's checkpoint folder and no warm start. Its pods start afresh, so there are no live
    workers to reattach to (as `multipod train --resume` may), and the run would fail only once
    they had started and been asked to restore."""
    from multipod.controller.commands.checkpoints import saved_steps
    from multipod.controller.core.run_config import ConfigError
    from multipod.controller.run.training import checkpoint_dir
    directory = pathlib.Path(checkpoint_dir(config, run_dir))
    if not config.checkpoint.warm_start_from and not saved_steps(directory):
        raise ConfigError("--resume", f"no checkpoint to resume from in {directory}: give the --run-dir (or "
                          f"--checkpoint-dir) of the run to continue, or leave out --resume to start one")


def check_no_earlier_run(config, run_dir: pathlib.Path) -> None:
    """ConfigError if a fresh run (no --resume) would write its checkpoints where an earlier run's
    are: its steps would land among the other run's, and generate and --resume would then take
    the newest of either run's."""
    from multipod.controller.commands.checkpoints import saved_steps
    from multipod.controller.core.run_config import ConfigError
    from multipod.controller.run.training import checkpoint_dir
    directory = pathlib.Path(checkpoint_dir(config, run_dir))
    steps = saved_steps(directory)
    if steps:
        shown = ("..., " if len(steps) > 3 else "") + ", ".join(map(str, steps[-3:]))
        flag = "--checkpoint-dir" if config.checkpoint.dir else "--run-dir"
        raise ConfigError("checkpoint.dir" if config.checkpoint.dir else "--run-dir",
                          f"{directory} already holds an earlier run's checkpoints (steps {shown}): --resume "
                          f"continues that run; to start a new one, give another {flag} (or delete them)")


# The commands that start their own workers: a fresh auth token, and report.png at the end.
LAUNCHERS = ("local", "ray")


def _mode(args: argparse.Namespace) -> str:
    """Where the workers come from: "train" (the user's, --workers) or one of LAUNCHERS."""
    if args.command == "ptune":
        return "train" if args.workers else "local"
    return args.command


def check_netns_args(args: argparse.Namespace, mode: str) -> None:
    """--netns and its options, checked before the data is prepared: ConfigError for options that
    do not go together, NetnsError (controller/launch/netns.py) for what this machine lacks."""
    from multipod.controller.core.run_config import ConfigError
    netns = getattr(args, "netns", False)
    if not netns:
        for flag, value in (("--netns-rate-gbps", getattr(args, "netns_rate_gbps", None)),
                            ("--netns-subnet", getattr(args, "netns_subnet", None)),
                            ("--insecure", getattr(args, "insecure", False) if mode != "ray" else False)):
            if value not in (None, False):
                raise ConfigError(flag, "only goes with --netns (without it the workers listen on loopback)")
        return
    if mode != "local":
        raise ConfigError("--netns", "starts the pods itself: it does not go with --workers")
    if args.netns_rate_gbps is not None and not args.netns_rate_gbps > 0:
        raise ConfigError("--netns-rate-gbps", f"must be > 0, got {args.netns_rate_gbps}")
    if args.tls_cert or args.tls_key or args.tls_ca or args.tls_server_name:
        raise ConfigError("--netns", "makes the run's own CA and certificates: leave out --tls-cert, --tls-key, "
                          "--tls-ca and --tls-server-name")
    from multipod.controller.launch.netns import check_available
    check_available(shape=bool(args.netns_rate_gbps))


def write_report_quietly(run_dir: pathlib.Path) -> None:
    """The end of `multipod local` and `multipod ray`: draw RUN_DIR/report.png if the run wrote metrics, and print its
    path; a report that cannot be drawn is a warning, never the run's failure."""
    from multipod.controller.observe.metrics import out
    metrics = run_dir / "metrics.jsonl"
    try:
        if not metrics.is_file() or metrics.stat().st_size == 0:
            return
        from multipod.controller.observe.report import write_report
        out(f"report: {write_report(run_dir)}")
    except Exception as exc:    # drawing is a convenience; metrics.jsonl is the record
        print(f"warning: no report drawn: {exc}", file=sys.stderr, flush=True)


class Fixed:
    """Workers the user started: their addresses (and the standby pods'), as a context like the
    launchers'."""
    def __init__(self, addresses, spares=()):
        self.addresses = addresses
        self.spares = list(spares)

    def __enter__(self):
        return self.addresses

    def __exit__(self, *exc):
        return False


class Local:
    """`multipod local`'s pods: started on enter, stopped on exit."""
    def __init__(self, args, run_dir, config):
        from multipod.controller.launch.local import LocalPods
        # Supervised: a worker that dies is started again on its port (recovery.max_restarts in all);
        # a pod of several hosts is restarted as a whole.
        common = dict(supervise=True, max_restarts=config.recovery.max_restarts, dcn_encrypt=config.dcn.encrypt,
                      hosts_per_pod=args.hosts_per_pod, spares=args.spares)
        self.netns = bool(getattr(args, "netns", False))
        if self.netns:
            from multipod.controller.launch.netns_pods import NetnsPods
            self.pods = NetnsPods(args.pods, local_devices(args), run_dir, subnet=args.netns_subnet,
                                  rate_gbps=args.netns_rate_gbps or 0.0, encrypt=not args.insecure,
                                  insecure=args.insecure, **common)
        else:
            self.pods = LocalPods(args.pods, local_devices(args), run_dir, **common)

    def __enter__(self):
        from multipod.controller.observe.metrics import out
        self.pods.__enter__()
        pods = self.pods
        where = ""
        if self.netns:     # the controller's channels carry its client certificate of the run's CA
            from multipod.protos.channels import set_default_security
            set_default_security(pods.controller_security)
            where = " " + pods.describe()
        if pods.multi_host:
            what = (f"{pods.num_pods} pod(s) of {pods.hosts_per_pod} worker(s) with "
                    f"{pods.host_devices[0][0]} simulated device(s) each: {pods.workers}")
        else:
            what = (f"{pods.num_pods} pod worker(s) with {pods.device_counts[0]} simulated device(s) each: "
                    + ", ".join(pods.addresses))
        out(f"started {what}{where} (logs in {pods.log_dir})")
        if pods.spares:
            out(f"started {pods.spares} spare pod(s) (worker --spare): {'; '.join(pods.spare_addresses)}")
        return pods.pod_host_addresses     # [pod][host]: controller/cluster/pods.py connect() takes them

    @property
    def spares(self) -> list[list[str]]:
        """The standby pods' hosts' addresses ([spare][host]), for the run's SparePool."""
        return self.pods.spare_host_addresses

    def __exit__(self, *exc):
        self.pods.__exit__(*exc)
        return False
