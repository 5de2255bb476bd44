"""`multipod tune --dcn`: choose the cross-pod settings ([dcn] and [sync]) for the link the pods
actually have (issue 23).

  1. the pods: started here (--pods of --hosts-per-pod hosts sharing --devices, in network
     namespaces with --netns and a shaped rate with --netns-rate-gbps, as `multipod local` starts
     them) or the user's (--workers, as `multipod train` takes them: pods of one host or several);
  2. the link, measured on their data plane, every host of every pod at once (controller/tune/
     dcn_probe.py; or --link-gbps and --latency-ms as given), and one pod's compute for the run's
     layout (the layout probe; a pod of several hosts as one process with all of its devices);
  3. calibration runs, each trained --trial-steps steps on those pods, for what only a real run
     shows (compute while every pod computes, update, the per-step overhead of the control plane):
     the reference candidate (exact, fastest link variant) fused and overlapped, and (unless
     --no-diloco, or DiLoCo is not proposed for pods of several hosts: dcn_tuner.diloco_proposed)
     DiLoCo's inner steps alone (dcn_tuner.diloco_reference);
  4. every candidate predicted with the cost model so calibrated (controller/tune/dcn_tuner.py);
  5. the best --run-exact exact and --run-lossy lossy candidates trained --trial-steps steps each
     on those pods (controller/tune/dcn_trials.py), predicted against measured, ranked by measured,
     the lossy ones with their loss against exact sync's;
  6. the choice (exact unless --allow-lossy) written as a config for --config (as `multipod tune`
     writes its layout: controller/tune/table.py write_config), and the report printed
     (controller/tune/dcn_report.py) and, with --json, written; with --plan-out, the measured
     cluster and calibration as a `multipod plan --from` file (controller/tune/dcn_plan_file.py).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import pathlib
import secrets
import time

from multipod.controller.tune.grid import parse_bytes, parse_int_list

PROBE_BYTES_MIN = 4 << 20      # the throughput rounds: at least this, or the gradient if larger
PROBE_BYTES_MAX = 64 << 20
COMPUTE_REPEATS = 3            # layout probes one after another; each figure their median


def _byte_list(text: str) -> list[int]:
    return [parse_bytes(part) for part in text.split(",") if part.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `multipod tune --dcn` (beside tune's --config, --set, --devices, --pods,
    --steps, --candidate-timeout, --out and --json)."""
    from multipod.protos.cli_flags import add_security_arguments
    group = parser.add_argument_group("cross-pod settings (--dcn)")
    group.add_argument("--dcn", action="store_true",
                       help="choose the cross-pod [dcn]/[sync] settings for the measured link instead of the layout")
    group.add_argument("--workers", help="--dcn against running workers (as `multipod train` takes them: ';' between "
                                         "pods, ',' between a pod's hosts) instead of pods started here; --devices "
                                         "is then each pod's device count")
    group.add_argument("--hosts-per-pod", type=int, metavar="K",
                       help="--dcn: worker processes per pod started here, one jax.distributed cluster per pod (as "
                            "`multipod local --hosts-per-pod`); --devices stays the pod's devices, all its hosts "
                            "together, split evenly over them (as `multipod local --devices-per-pod`). With "
                            "--workers: the hosts it lists per pod (default 1, or --workers')")
    group.add_argument("--netns", action="store_true", help="--dcn: start the pods in network namespaces (as "
                                                            "`multipod local --netns`)")
    group.add_argument("--netns-rate-gbps", type=float, metavar="R",
                       help="with --netns: shape each pod's link to R Gb/s")
    group.add_argument("--netns-subnet", metavar="CIDR", help="with --netns: the run's private IPv4 range")
    group.add_argument("--insecure", action="store_true", help="with --netns: no TLS and no CURVE")
    group.add_argument("--link-gbps", type=float, help="take the link's rate as given (Gb/s each way per pod, all its "
                                                       "hosts together) and measure no link")
    group.add_argument("--latency-ms", type=float, help="with --link-gbps: the latency of one exchange round (ms)")
    group.add_argument("--streams", type=parse_int_list, default=[1, 4],
                       help="data-plane streams per peer to measure and try (default 1,4)")
    group.add_argument("--chunk-bytes", type=_byte_list, default=[1 << 20, 4 << 20],
                       help="dcn.chunk_bytes to measure and try (default 1MiB,4MiB)")
    group.add_argument("--compressions", default="none,bf16,int8",
                       help="dcn.compression values to try (default none,bf16,int8)")
    group.add_argument("--no-diloco", action="store_true", help="leave DiLoCo candidates out")
    group.add_argument("--probe-rounds", type=int, default=3, help="timed exchange rounds per link measurement")
    group.add_argument("--run-exact", type=int, default=3, help="exact candidates to run (default 3)")
    group.add_argument("--run-lossy", type=int, default=2, help="lossy candidates to run (default 2)")
    group.add_argument("--trial-steps", type=int, default=12, help="steps of each trial run (default 12)")
    group.add_argument("--warmup-steps", type=int, default=2, help="first steps of a trial not timed (default 2)")
    group.add_argument("--max-trial-steps", type=int, default=60,
                       help="a DiLoCo trial trains the warm-up, each fragment's first outer sync untimed (it "
                            "compiles the fragment's outer programs: H steps and the overlap steps after them) "
                            "and two or more timed periods (at least --trial-steps in all); candidates that "
                            "would need more are not run (default 60)")
    group.add_argument("--allow-lossy", action="store_true",
                       help="may choose a candidate that changes the math (compression, DiLoCo)")
    group.add_argument("--plan-out", metavar="FILE",
                       help="also write the measured cluster and the calibrated cost model's terms as a "
                            "`multipod plan --from FILE` input")
    add_security_arguments(parser)


def check_args(args: argparse.Namespace) -> None:
    """ConfigError naming the flag of a bad or contradictory input."""
    from multipod.controller.core.run_config import ConfigError
    from multipod.controller.tune.cost_inputs import check_number
    from multipod.pod_worker.schema import Compression
    if args.workers and args.netns:
        raise ConfigError("--netns", "starts the pods itself: it does not go with --workers")
    if args.hosts_per_pod is not None and args.hosts_per_pod < 1:
        raise ConfigError("--hosts-per-pod", f"must be >= 1, got {args.hosts_per_pod}")
    if not args.netns:
        for flag, value in (("--netns-rate-gbps", args.netns_rate_gbps), ("--netns-subnet", args.netns_subnet)):
            if value is not None:
                raise ConfigError(flag, "only goes with --netns")
    if args.netns_rate_gbps is not None:
        check_number("--netns-rate-gbps", args.netns_rate_gbps)
    if args.link_gbps is not None:
        check_number("--link-gbps", args.link_gbps)
    elif args.latency_ms is not None:
        raise ConfigError("--latency-ms", "goes with --link-gbps (without it the link is measured)")
    if args.latency_ms is not None:
        check_number("--latency-ms", args.latency_ms, strict=False)
    for flag, value in (("--probe-rounds", args.probe_rounds), ("--trial-steps", args.trial_steps),
                        ("--steps", args.steps)):
        if value < 1:
            raise ConfigError(flag, f"must be >= 1, got {value}")
    for flag, value in (("--run-exact", args.run_exact), ("--run-lossy", args.run_lossy),
                        ("--warmup-steps", args.warmup_steps)):
        if value < 0:
            raise ConfigError(flag, f"must be >= 0, got {value}")
    if args.warmup_steps >= args.trial_steps:
        raise ConfigError("--warmup-steps", f"must be below --trial-steps ({args.trial_steps})")
    if args.max_trial_steps < args.trial_steps:
        raise ConfigError("--max-trial-steps", f"must be at least --trial-steps ({args.trial_steps}), "
                                               f"got {args.max_trial_steps}")
    if not args.streams or not args.chunk_bytes:
        raise ConfigError("--streams", "give at least one stream count and one chunk size")
    # The data plane's own bounds, here: a worker refuses them only once the pods are up, where it
    # read as a link that could not be reached.
    from multipod.pod_worker.schema import MAX_STREAMS
    from multipod.protos import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES
    for streams in args.streams:
        if not 1 <= streams <= MAX_STREAMS:
            raise ConfigError("--streams", f"each must be in [1, {MAX_STREAMS}], got {streams}")
    for size in args.chunk_bytes:
        if not MIN_CHUNK_BYTES <= size <= MAX_CHUNK_BYTES:
            raise ConfigError("--chunk-bytes", f"each must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}] bytes "
                                               f"({MIN_CHUNK_BYTES >> 20}-{MAX_CHUNK_BYTES >> 20} MiB), got {size}")
    args.compressions = [c.strip() for c in args.compressions.split(",") if c.strip()]
    for c in args.compressions:
        try:
            Compression(c)
        except ValueError:
            raise ConfigError("--compressions", f"{c!r} is not one of {', '.join(x.value for x in Compression)}") \
                from None


def cluster_shape(args: argparse.Namespace) -> tuple[list[list[str]] | None, int, int]:
    """(the --workers addresses [pod][host] or None, pods, hosts per pod), from --workers or
    --pods and --hosts-per-pod; ConfigError naming the flag that contradicts."""
    from multipod.controller.cluster.addresses import parse_workers
    from multipod.controller.core.run_config import ConfigError
    if not args.workers:
        return None, 2 if args.pods is None else args.pods, args.hosts_per_pod or 1
    addresses = parse_workers(args.workers)
    hosts = len(addresses[0])
    if args.pods is not None and args.pods != len(addresses):
        raise ConfigError("--pods", f"{args.pods}, but --workers lists {len(addresses)} pod(s)")
    if args.hosts_per_pod is not None and args.hosts_per_pod != hosts:
        raise ConfigError("--hosts-per-pod", f"{args.hosts_per_pod}, but --workers lists {hosts} host(s) per pod")
    return addresses, len(addresses), hosts


def check_layout(config, pods: int, hosts: int, devices: int) -> None:
    """ConfigError naming what does not split over a pod's hosts (as the run would refuse it)."""
    from multipod.controller.core.run_config import ConfigError
    if devices < 1 or devices % hosts:
        raise ConfigError("--devices", f"{devices} devices per pod do not split evenly over {hosts} host(s) per pod "
                                       f"(--devices is the pod's, all its hosts together)")
    per_pod = config.data.global_batch // pods
    if per_pod % hosts:
        raise ConfigError("data.global_batch", f"a pod's {per_pod} sequences do not split over its {hosts} hosts")
    model = config.mesh.model
    if hosts > 1 and devices % model == 0 and (devices // model) % hosts:
        raise ConfigError("mesh.model", f"the mesh's data axis ({devices} devices / model {model}) must split evenly "
                                        f"over the pod's {hosts} hosts")


@contextlib.contextmanager
def pods_for(args: argparse.Namespace, workers: list[list[str]] | None, pods: int, hosts: int, devices: int,
             run_dir: pathlib.Path):
    """The pods' [pod][host] addresses: the user's (`workers`, from --workers) or `pods` of `hosts`
    hosts sharing `devices` started here, stopped after."""
    from multipod.protos.channels import default_security, set_default_security
    from multipod.protos.cli_flags import security_from_args
    security = security_from_args(args)
    if workers is not None:
        set_default_security(security)
        yield workers
        return
    if not security.token:
        security = dataclasses.replace(security, token=secrets.token_urlsafe(32))
    set_default_security(security)
    from multipod.controller.launch.local import LocalPods
    from multipod.controller.launch.netns_pods import NetnsPods
    launched: LocalPods
    if args.netns:
        from multipod.controller.launch.netns import check_available
        check_available(shape=bool(args.netns_rate_gbps))
        launched = NetnsPods(pods, devices, run_dir, subnet=args.netns_subnet, rate_gbps=args.netns_rate_gbps or 0.0,
                             encrypt=not args.insecure, insecure=args.insecure, security=security,
                             hosts_per_pod=hosts)
    else:
        launched = LocalPods(pods, devices, run_dir, security=security, hosts_per_pod=hosts)
    with launched:
        if isinstance(launched, NetnsPods):
            set_default_security(launched.controller_security)
        try:
            yield launched.pod_host_addresses
        finally:
            set_default_security(default_security())


def _measure_link(args, addresses: list, grad_bytes: int, timeout_s: float, say):
    """The link between the pods (dcn_probe.measure_link), every host of every pod at once, each
    host with a buffer of its block of the gradient; or --link-gbps as given."""
    from multipod.controller.cluster.client import WorkerClient
    from multipod.controller.core.run_config import ConfigError
    from multipod.controller.tune.dcn_probe import LinkProber, given_link, measure_link
    if args.link_gbps is not None:
        return given_link(args.link_gbps, args.latency_ms, args.streams, args.chunk_bytes)
    hosts = len(addresses[0])
    clients = [[WorkerClient(p, address, h if hosts > 1 else None) for h, address in enumerate(pod)]
               for p, pod in enumerate(addresses)]
    try:
        dcn: list[list[str]] = []
        for pod in clients:
            dcn.append([])
            for client in pod:
                try:
                    client.wait_serving(timeout_s=60)
                    dcn[-1].append(client.status(timeout_s=10).dcn_address)
                except Exception as exc:    # noqa: BLE001 -- WorkerError or a channel error: named below
                    raise ConfigError("--workers", f"{client.name} is not reachable: {exc}") from None
        if not all(a for pod in dcn for a in pod):
            raise ConfigError("link", f"a pod's host reports no data-plane address: {dcn}")
        size = min(max(grad_bytes // hosts, PROBE_BYTES_MIN), PROBE_BYTES_MAX)
        say(f"measuring the link between {len(clients)} pods on their data plane"
            + (f", all {hosts} hosts of each pod at once" if hosts > 1 else "") + f" ({args.probe_rounds} timed "
            f"rounds each):")
        lossy = [c for c in args.compressions if c != "none"]
        return measure_link(LinkProber(clients, dcn, args.probe_rounds, timeout_s), size, args.streams,
                            args.chunk_bytes, lossy, say)
    finally:
        for client in (c for pod in clients for c in pod):
            client.close()


def main(args: argparse.Namespace) -> int:
    """Run `multipod tune --dcn`; returns the exit code (0: a choice was written)."""
    from multipod.controller.core.run_config import ConfigError, load_config
    from multipod.controller.data.corpus import prepare
    from multipod.controller.observe.metrics import out
    from multipod.controller.tune import dcn_report
    from multipod.controller.tune.dcn_probe import measure_compute
    from multipod.controller.tune.dcn_trials import run_calibration, run_trial
    from multipod.controller.tune.dcn_tuner import (
        StepKind,
        calibrations,
        choose,
        diloco_proposed,
        diloco_reference,
        pick_trials,
        predict,
        rank_measured,
        reference,
        step_kind,
        trial_steps,
        trial_warmup,
        with_loss_deltas,
    )
    from multipod.controller.tune.table import write_config
    from multipod.pod_worker.schema import Compression, resolve_overlap
    check_args(args)
    workers, pods, hosts = cluster_shape(args)
    if pods < 2:
        raise ConfigError("--pods", f"tuning the cross-pod sync needs at least 2 pods, got {pods}")
    given: set = set()
    base = load_config(args.config, args.overrides, given)
    if base.data.global_batch % pods:
        raise ConfigError("data.global_batch", f"{base.data.global_batch} does not split over {pods} pods")
    config = prepare(base, vocab_given="model.vocab_size" in given, progress=False).config
    check_layout(config, pods, hosts, args.devices)
    per_pod = config.data.global_batch // pods
    work = pathlib.Path(args.out).with_suffix("")
    work = work.parent / f"{work.name}-runs-{time.strftime('%Y%m%d-%H%M%S')}"
    work.mkdir(parents=True, exist_ok=True)
    what = f"{hosts} host(s) sharing {args.devices} device(s)" if hosts > 1 else f"{args.devices} device(s)"
    out(f"tune --dcn: {pods} pods of {what}, {per_pod} sequences x {config.data.seq_len} tokens per pod; runs in "
        f"{work}")
    grad_bytes = config.model.param_count() * (2 if config.model.param_dtype == "bfloat16" else 4)
    diloco = not args.no_diloco and diloco_proposed(hosts)
    if not args.no_diloco and not diloco:
        out(f"no DiLoCo candidates: multipod runs DiLoCo on pods of one host only for now (these have {hosts})")
    with pods_for(args, workers, pods, hosts, args.devices, work) as addresses:
        link = _measure_link(args, addresses, grad_bytes, args.candidate_timeout, out)
        out(f"measuring one pod's compute with the layout probe (fused and overlapped step, forward alone; "
            f"{COMPUTE_REPEATS} probes one after another, medians)"
            + (f"; its {hosts} hosts as one process with all {args.devices} devices" if hosts > 1 else ""))
        compute = measure_compute(config, args.devices, per_pod, args.steps, args.candidate_timeout,
                                  repeats=COMPUTE_REPEATS)
        runs = []
        references = [reference(link, False), reference(link, True)]
        if diloco:
            references.append(diloco_reference(link, args.trial_steps))
        for choice in references:
            kind = step_kind(choice)
            what = f"{kind.value} steps (H beyond the run: no outer sync)" if choice.sync.diloco else choice.label()
            out(f"calibration run: {what}, {choice.streams} stream(s), {choice.chunk_bytes / 2**20:g} MiB "
                f"chunks, {args.trial_steps} steps")
            run = run_calibration(args.config, list(args.overrides), choice, addresses,
                                  work / f"calibration-{kind.name.lower().replace('_', '-')}", args.trial_steps,
                                  args.warmup_steps)
            out(f"  median step {run.step_s * 1e3:.1f} ms: compute {run.compute_s * 1e3:.1f} ms (slowest pod), "
                f"update + checksum {run.update_s * 1e3:.1f} ms, exposed exchange "
                f"{run.exposed_exchange_s * 1e3:.1f} ms")
            runs.append(run)
        compressions = tuple(Compression(c) for c in args.compressions)
        diloco_overlap = resolve_overlap(config.worker_config(), per_pod)[0]
        ranked = predict(config, compute, link, pods, args.devices, compressions, diloco=diloco, runs=tuple(runs),
                         diloco_overlap=diloco_overlap, hosts_per_pod=hosts)
        calibrated = calibrations(config, compute, link, pods, args.devices, tuple(runs), diloco_overlap, hosts)
        if not diloco:      # no DiLoCo candidate carries it: not reported
            calibrated.pop(StepKind.DILOCO_INNER)
        for kind, (_, _, _, calibration) in calibrated.items():
            out(f"  {kind.value} step overhead beyond compute, update and exchange: "
                f"{calibration.step_overhead_s * 1e3:.1f} ms (its calibration run's step minus the model's)")
        trials = pick_trials(ranked, args.run_exact, args.run_lossy, max_steps=args.max_trial_steps,
                             steps=args.trial_steps, warmup=args.warmup_steps)
        out(f"{len(ranked)} candidates predicted; running {len(trials)} for {args.trial_steps} steps each "
            f"(a DiLoCo one longer: each fragment's first outer sync untimed, then two or more periods timed)")
        ran = []
        for i, projection in enumerate(trials):
            steps = trial_steps(projection.choice, args.trial_steps, args.warmup_steps)
            out(f"  trial {i + 1}/{len(trials)}: {dcn_report.describe(projection)}, {steps} steps")
            trial = run_trial(args.config, list(args.overrides), projection, addresses, work / f"trial-{i + 1}",
                              steps, trial_warmup(projection.choice, args.warmup_steps), loss_at=args.trial_steps)
            out(f"    {dcn_report.trial_line(trial)}")
            ran.append(trial)
    ran = rank_measured(with_loss_deltas(ran))
    chosen = choose(ran, args.allow_lossy)
    dcn_report.print_report(link, compute, ranked, ran, chosen, args.allow_lossy, runs, calibrated)
    if args.json_path:
        dcn_report.write_json(args.json_path, link, compute, ranked, ran, chosen, runs, calibrated)
        out(f"report written to {args.json_path}")
    if chosen is None:
        out("no exact candidate ran: no config written")
        return 1
    from multipod.controller.tune.dcn_tuner import overrides as settings_overrides
    final = load_config(args.config, [*args.overrides, *settings_overrides(chosen.projection.choice)])
    header = [f"written by `multipod tune --dcn`: {dcn_report.describe(chosen.projection)}",
              f"measured {chosen.measured_step_s * 1e3:.1f} ms/step, predicted {chosen.projection.step_s * 1e3:.1f} ms "
              f"({dcn_report.link_line(link)})" if chosen.measured_step_s else "", ]
    write_config(args.out, final, [h for h in header if h])
    if args.plan_out:
        from multipod.controller.tune.dcn_plan_file import plan_document, write_plan_file
        _, _, chip, calibration = calibrated[step_kind(chosen.projection.choice)]
        write_plan_file(args.plan_out, plan_document(config, link, pods, args.devices, chip, calibration,
                                                     args.netns_rate_gbps if args.netns else None, hosts),
                        [f"written by `multipod tune --dcn` ({time.strftime('%Y-%m-%d %H:%M')}): this machine's "
                         f"cluster as measured, the cost model's terms calibrated on the run of "
                         f"{step_kind(chosen.projection.choice).value} steps (the chosen candidate's kind)",
                         f"`multipod plan --from {args.plan_out}` projects {dcn_report.describe(chosen.projection)} "
                         f"at {chosen.projection.step_s * 1e3:.1f} ms/step, as tune predicted "
                         f"(measured {chosen.measured_step_s * 1e3:.1f})" if chosen.measured_step_s else ""])
        out(f"the measured cluster and calibration written to {args.plan_out} (for `multipod plan --from`)")
    flags = f"--netns --netns-rate-gbps {args.netns_rate_gbps} " if args.netns and args.netns_rate_gbps else \
        "--netns " if args.netns else ""
    layout = f"--hosts-per-pod {hosts} " if hosts > 1 else ""
    out(f"chosen: {dcn_report.describe(chosen.projection)} -> {args.out} (train with `multipod local --pods {pods} "
        f"{layout}--devices-per-pod {args.devices} {flags}--config {args.out}`)")
    return 0
