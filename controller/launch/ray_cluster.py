"""`multipod ray`'s request to a Ray cluster, and the connection to it: the resources JSON, the
checks that refuse a request before anything is placed (a bad one, or one the cluster could
never place), and connecting with a deadline. Ray is imported lazily (an optional extra);
without it, a LaunchError names the install command."""
from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading

from multipod.controller.launch.local import LaunchError

INSTALL_HINT = "pip install 'multipod[ray]'"
STRATEGIES = ("STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK")
NAMESPACE = "multipod"
CONNECT_TIMEOUT_S = 30.0     # ray.init's deadline (it retries a silent address for good)


def import_ray():
    """The ray module, or a LaunchError that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise LaunchError(f"multipod ray needs Ray, which is not installed here ({exc}): {INSTALL_HINT}") from None
    return ray


def parse_resources(text: str) -> dict[str, float]:
    """--resources-per-host: a JSON object of resource name -> amount (e.g. '{"TPU": 4}',
    '{"GPU": 8, "CPU": 8}'); ValueError naming what is wrong."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--resources-per-host: not JSON ({exc.msg} at column {exc.colno}): {text!r}; "
                         f"e.g. '{{\"CPU\": 1}}' or '{{\"TPU\": 4}}'") from None
    if not isinstance(value, dict) or not value:
        raise ValueError(f"--resources-per-host: a JSON object of resource -> amount, e.g. '{{\"TPU\": 4}}'; "
                         f"got {text!r}")
    resources = {}
    for name, amount in value.items():
        if isinstance(amount, bool) or not isinstance(amount, int | float) or not math.isfinite(amount) \
                or amount < 0:
            raise ValueError(f"--resources-per-host: {name!r} must be a number >= 0, got {amount!r}")
        resources[name] = float(amount)
    if not any(resources.values()):
        raise ValueError("--resources-per-host: every amount is 0; a host must ask for something (e.g. CPU)")
    return resources


def actor_options(resources: dict[str, float]) -> dict:
    """Ray's options for a task or actor that takes exactly one bundle of `resources` (CPU, GPU
    and memory have their own keywords; everything else, e.g. TPU, goes under `resources`)."""
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU", "memory")}
    options = {"num_cpus": resources.get("CPU", 0.0), "num_gpus": resources.get("GPU", 0.0)}
    if "memory" in resources:
        options["memory"] = resources["memory"]
    if custom:
        options["resources"] = custom
    return options


def check_request(pods: int, hosts_per_pod: int, strategy: str, devices_per_host: int) -> None:
    """ValueError for a request that cannot make sense, before Ray is contacted."""
    if pods < 1:
        raise ValueError(f"--pods must be >= 1, got {pods}")
    if hosts_per_pod < 1:
        raise ValueError(f"--hosts-per-pod must be >= 1, got {hosts_per_pod}")
    if devices_per_host < 0:
        raise ValueError(f"--devices-per-host must be >= 0 (0: the devices jax finds), got {devices_per_host}")
    if strategy not in STRATEGIES:
        raise ValueError(f"--placement-strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")


def check_capacity(pods: int, hosts_per_pod: int, strategy: str, resources: dict[str, float],
                   total: dict[str, float], nodes: int) -> None:
    """LaunchError if the cluster could never place the run, whatever else it runs: not enough of
    some resource in all, or STRICT_SPREAD over more hosts per pod than it has nodes."""
    hosts = pods * hosts_per_pod
    for name, amount in resources.items():
        need = hosts * amount
        if need > total.get(name, 0.0) + 1e-9:
            raise LaunchError(f"the Ray cluster cannot place {pods} pod(s) x {hosts_per_pod} host(s) asking for "
                              f"{fmt(resources)} each: that is {need:g} {name} in all, and the cluster has "
                              f"{total.get(name, 0.0):g} (cluster resources: {fmt(total)})")
    if strategy == "STRICT_SPREAD" and hosts_per_pod > nodes:
        raise LaunchError(f"STRICT_SPREAD puts each of a pod's {hosts_per_pod} hosts on a node of its own, and the "
                          f"Ray cluster has {nodes} node(s); add nodes, or pass --placement-strategy PACK to let "
                          f"them share")


def fmt(resources: dict) -> str:
    """A resources dict as compact JSON, whole numbers without ".0" (for messages)."""
    return json.dumps({k: (int(v) if float(v).is_integer() else v) for k, v in sorted(resources.items())
                       if not k.startswith("node:")})


def connect(address: str, timeout_s: float = CONNECT_TIMEOUT_S):
    """Connect this process to the Ray cluster at `address` ("auto": the one started on this
    machine with `ray start`); returns the ray module. LaunchError, within timeout_s, if there is
    no cluster there."""
    ray = import_ray()
    if address and address not in ("auto", "local") and "://" not in address:
        # ray.init retries an address where nothing answers for good: check that something listens.
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
        except ValueError:
            raise LaunchError(f"--address {address}: expected HOST:PORT of the Ray head (GCS), or auto") from None
        except OSError as exc:
            raise LaunchError(f"no Ray cluster at --address {address}: {exc.strerror or exc}. Start one with "
                              f"`ray start --head` (docs/deploy.md), or pass --address auto on one of its "
                              f"nodes") from None
    result: dict = {}

    def init():
        try:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
            result["ok"] = True
        except Exception as exc:    # ConnectionError, RuntimeError, ...: reported below
            result["error"] = exc

    # In a thread, so that the deadline holds even when something that is not Ray answers there.
    logging.getLogger("ray._private.worker").addFilter(_NoSignalWarning())
    thread = threading.Thread(target=init, daemon=True, name="ray-connect")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise LaunchError(f"could not connect to a Ray cluster at --address {address} within {timeout_s:g}s")
    if "error" in result:
        hint = ""
        if address not in ("auto", "") and "RAY_AUTH_MODE" not in os.environ:
            # Ray turns its token authentication on by itself only for --address auto.
            hint = (" (if the cluster uses Ray's token authentication, set RAY_AUTH_MODE=token, with the "
                    "cluster's token in RAY_AUTH_TOKEN or ~/.ray/auth_token)")
        raise LaunchError(f"could not connect to a Ray cluster at --address {address}: {result['error']}{hint}")
    return ray


class _NoSignalWarning(logging.Filter):
    """ray.init off the main thread warns that it set no SIGTERM handler: the controller has its own."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()
