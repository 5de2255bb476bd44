"""`multipod ray`'s launcher as the training run sees it: connect to the Ray cluster, start the
pods (controller/launch/ray_pods.py `RayPods`) and say where they run; at the end stop them and
disconnect."""
from __future__ import annotations

import pathlib
import threading

from multipod.controller.launch.ray_cluster import check_request, connect, fmt, parse_resources
from multipod.controller.launch.ray_pods import RayPods
from multipod.controller.observe.metrics import out

SHUTDOWN_TIMEOUT_S = 30.0


class RayContext:
    """`multipod ray`'s launcher for controller/commands/train.py `_train`: connect to the cluster, start the
    pods (entering gives their addresses, [pod][host]); leaving stops them and disconnects."""

    def __init__(self, args, run_dir: pathlib.Path, config):
        self.args, self.run_dir, self.config = args, run_dir, config
        self.pods: RayPods | None = None
        self._ray = None

    def __enter__(self) -> list[list[str]]:
        args, config = self.args, self.config
        resources = parse_resources(args.resources_per_host)
        check_request(args.pods, args.hosts_per_pod, args.placement_strategy, args.devices_per_host)
        self._ray = connect(args.address)
        try:
            self.pods = RayPods(self._ray, args.pods, args.hosts_per_pod, resources, self.run_dir,
                                strategy=args.placement_strategy, devices_per_host=args.devices_per_host,
                                max_restarts=config.recovery.max_restarts, place_timeout_s=args.place_timeout,
                                dcn_encrypt=config.dcn.encrypt, insecure=args.insecure)
            out(f"placing {args.pods} pod(s) x {args.hosts_per_pod} host(s) of {fmt(resources)} on the Ray cluster "
                f"({args.placement_strategy})")
            self.pods.__enter__()
            if not self.pods.on_this_machine and not config.checkpoint.dir:
                from multipod.controller.core.run_config import ConfigError
                raise ConfigError("checkpoint.dir", "the pods run on other nodes than the controller: pass "
                                  "--checkpoint-dir DIR on storage every node mounts at the same path")
        except BaseException:
            self.__exit__()
            raise
        pods = self.pods
        where = "; ".join(f"pod {p}: " + ", ".join(f"{a} (node {n})" for a, n in zip(addrs, nodes))
                          for p, (addrs, nodes) in enumerate(zip(pods.host_addresses, pods.nodes)))
        out(f"started {args.pods} pod(s) x {args.hosts_per_pod} host(s) on Ray: {where} "
            f"(logs in {self.run_dir} on each worker's node)")
        return pods.host_addresses

    def __exit__(self, *exc) -> bool:
        try:
            if self.pods is not None:
                self.pods.stop()
        finally:
            if self._ray is not None and self._ray.is_initialized():
                _disconnect(self._ray)
        return False


def _disconnect(ray, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    """ray.shutdown(), waited for at most timeout_s: a disconnect that hangs is said, not waited on
    for ever (the run's actors and placement groups are already gone by then)."""
    done = threading.Thread(target=ray.shutdown, name="ray-shutdown", daemon=True)
    done.start()
    done.join(timeout_s)
    if done.is_alive():
        out(f"warning: disconnecting from the Ray cluster did not finish within {timeout_s:g}s; leaving it")
