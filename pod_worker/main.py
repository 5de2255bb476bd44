"""`multipod worker`: serve one pod.

The simulated device count must be in XLA_FLAGS before jax initialises, so this module sets it
before importing anything that imports jax.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from multipod.pod_worker.devices import simulate_cpu_devices
from multipod.protos.cli_flags import add_security_arguments, host_port_problem, security_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pod-index", type=int, help="this pod's index (0-based); or --spare")
    parser.add_argument("--spare", action="store_true",
                        help="a standby worker: it serves no pod until a controller hands it a failed pod's slot "
                             "(multipod train --spares, multipod attach); its first Configure sets the pod index")
    parser.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT to serve on")
    parser.add_argument("--devices", type=int, default=0,
                        help="simulate N CPU devices (0: use the real devices jax finds)")
    parser.add_argument("--host-index", type=int, default=0,
                        help="this host's index within its pod (pods of several hosts; 0-based)")
    parser.add_argument("--hosts-per-pod", type=int, default=1,
                        help="hosts in this pod: its workers form one jax.distributed cluster and run the pod's "
                             "step as one program over all its devices")
    parser.add_argument("--pod-coordinator", default="",
                        help="HOST:PORT of the pod's jax.distributed coordinator (host 0 serves it; every host of "
                             "the pod passes the same); required with --hosts-per-pod > 1")
    parser.add_argument("--distributed-timeout", type=float, default=120.0,
                        help="seconds to wait for the pod's other hosts to join")
    parser.add_argument("--distributed-heartbeat", type=float, default=10.0,
                        help="seconds after which the pod's other hosts stop when one of its hosts is gone")
    parser.add_argument("--port-file", help="write the bound port here once serving (for launchers)")
    parser.add_argument("--exit-with-parent", action="store_true",
                        help="shut down when the process that started this worker exits")
    add_security_arguments(parser)
    parser.add_argument("--insecure-no-auth", action="store_true",
                        help="serve without a shared secret (only for a trusted single-machine setup)")
    parser.add_argument("--dcn-listen", help="HOST:PORT of the data plane (gradients between pods; default: the "
                        "--listen host, an ephemeral port)")
    parser.add_argument("--dcn-encrypt", action="store_true",
                        help="encrypt the data plane (ZeroMQ CURVE, keys derived from the auth token)")
    parser.add_argument("--insecure", action="store_true",
                        help="listen beyond loopback without encryption (gRPC without TLS, data plane without "
                             "--dcn-encrypt): only on a network you trust")


def run(args: argparse.Namespace) -> int:
    if (args.pod_index is None) == (not args.spare):
        raise SystemExit("error: give exactly one of --pod-index N or --spare")
    if args.pod_index is not None and args.pod_index < 0:
        raise SystemExit("--pod-index must be >= 0")
    if args.devices < 0:
        raise SystemExit("--devices must be >= 0")
    for flag, address in (("--listen", args.listen), ("--dcn-listen", args.dcn_listen)):
        problem = address is not None and host_port_problem(address, listen=True)
        if problem:
            raise SystemExit(f"error: {flag}: {problem}")
    if args.port_file:      # written once serving: refused now, before jax starts and the ports are bound
        folder = os.path.dirname(os.path.abspath(args.port_file))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
            raise SystemExit(f"error: --port-file {args.port_file}: cannot write in {folder} (no such folder, "
                             f"or no permission)")
    # Before anything imports jax, which reads its cache settings when it starts.
    from multipod.pod_worker.compile_cache import default_cache_env, remove_orphans
    os.environ.update(default_cache_env(os.environ))
    from multipod.pod_worker.hosts import HostLayout, start_distributed
    try:
        layout = HostLayout(args.host_index, args.hosts_per_pod, args.pod_coordinator).check()
    except ValueError as exc:
        raise SystemExit(f"error: {_who(args)} host {args.host_index}: {exc}") from None
    if args.devices:
        simulate_cpu_devices(args.devices)
    who = ("spare" if args.spare else f"pod{args.pod_index}") + (f"h{layout.host_index}" if layout.multi else "")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {who} %(levelname)s %(name)s: %(message)s")
    for chatty in ("absl", "orbax"):    # orbax narrates every save at INFO; its warnings still show
        logging.getLogger(chatty).setLevel(logging.WARNING)
    remove_orphans(os.environ)      # what a killed worker left would stop jax writing the cache
    from multipod.protos.channels import SecurityError, set_default_security
    try:
        security = security_from_args(args)
    except SecurityError as exc:
        raise SystemExit(f"error: {exc}") from None
    if not security.token and not args.insecure_no_auth:
        raise SystemExit("error: no auth token: pass --auth-token or set MULTIPOD_AUTH_TOKEN (the same secret "
                         "the controller uses), or --insecure-no-auth for a trusted single-machine setup")
    if not security.token:
        logging.getLogger(__name__).warning("serving WITHOUT authentication (--insecure-no-auth)")
    check_exposure(args, security)
    set_default_security(security)   # the worker's DCN links carry the same credentials
    try:
        start_distributed(layout, args.distributed_timeout, args.distributed_heartbeat)
    except Exception as exc:     # e.g. the coordinator never answered, or another host has this index
        raise SystemExit(f"error: {layout.name(args.pod_index)}: cannot join the pod's cluster at "
                         f"{layout.coordinator}: {exc}") from None
    if layout.multi:
        from multipod.pod_worker.compile_cache import let_this_host_write
        let_this_host_write(layout.host_index)
    from multipod.pod_worker.lifecycle import serve
    serve(args.pod_index, args.listen, port_file=args.port_file, exit_with_parent=args.exit_with_parent,
          security=security, dcn_listen=args.dcn_listen, dcn_encrypt=args.dcn_encrypt, layout=layout)
    if layout.multi:
        # Leave the pod's jax.distributed cluster in step with the other hosts (what jax's exit
        # handler would do), then skip the rest of the interpreter's teardown as one host does.
        import jax
        jax.distributed.shutdown()
    exit_served()
    return 0


def exit_served() -> None:
    """End a worker whose serve() has returned, without the interpreter's teardown.

    serve() has stopped the server, let pending checkpoint writes finish and closed the data
    plane: nothing is left to save. The teardown would clear jax's backends and caches and run
    every module's finalisers, about 0.2 s of CPU per worker (measured), paid by every run and
    test. A host of a pod of several hosts leaves the pod's jax.distributed cluster first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def _who(args: argparse.Namespace) -> str:
    return "spare" if args.spare else f"pod {args.pod_index}"


def check_exposure(args: argparse.Namespace, security) -> None:
    """Refuse to listen beyond loopback unencrypted, on either plane, unless --insecure."""
    from multipod.protos.channels import is_loopback
    if args.dcn_encrypt and not security.token:
        raise SystemExit("error: --dcn-encrypt needs the auth token (the data plane's keys are derived from it)")
    exposed = []
    if not is_loopback(args.listen) and not security.tls_cert:
        exposed.append(f"the control plane (--listen {args.listen}) without TLS (--tls-cert/--tls-key)")
    dcn = args.dcn_listen or f"{args.listen.rsplit(':', 1)[0]}:0"
    if not is_loopback(dcn) and not args.dcn_encrypt:
        exposed.append(f"the data plane ({dcn}) without encryption (--dcn-encrypt)")
    if exposed and not args.insecure:
        raise SystemExit("error: refusing to listen beyond loopback unencrypted: " + "; ".join(exposed)
                         + ". Encrypt both planes, or pass --insecure on a network you trust.")
    if exposed:
        logging.getLogger(__name__).warning("listening beyond loopback UNENCRYPTED (--insecure): %s",
                                            "; ".join(exposed))
