"""`multipod ray`: the pods of a run on a Ray cluster.

Each pod is one placement group of `hosts_per_pod` bundles (one per host, each with the resources
a host asks for, e.g. {"TPU": 4}), gang-scheduled with STRICT_SPREAD by default (each host on a
node of its own). Each host's worker runs under a Ray actor (controller/launch/ray_worker.py
`WorkerHost`) pinned to its bundle. The launcher:
  - picks each host's ports once, on its node (a task in its bundle), so every incarnation of
    its actor listens on the same addresses and a restarted pod rejoins like a restarted local one
    (its flags and environment: controller/launch/ray_host_specs.py);
  - hands the auth token to the actors as a constructor argument (never a command line);
  - learns the workers' addresses from the actors and gives them to the controller;
  - watches the actors: Ray restarts a dead one (max_restarts); a pod that Ray cannot bring back
    within the deadline, or will not restart any more, is reported, and the run goes on with the
    surviving pods (degraded mode);
  - replaces a pod that Ray will not bring back at its address, through a spare that the
    controller hot-swaps the failed slot to (controller/launch/ray_replacement.py);
  - removes every actor and placement group it made when the run ends, fails or is interrupted.
    If the controller is killed outright, Ray itself removes them: they belong to its job.

The request's checks and the connection are controller/launch/ray_cluster.py's; the training run
enters it through controller/launch/ray_context.py `RayContext`."""
from __future__ import annotations

import pathlib
import secrets
import threading
import time

from multipod.controller.launch.local import Launched, LaunchError
from multipod.controller.launch.ray_cluster import NAMESPACE, actor_options, check_capacity, check_request, fmt
from multipod.controller.launch.ray_host_specs import check_exposure, worker_env, worker_flags
from multipod.controller.launch.ray_replacement import RayReplacement
from multipod.controller.launch.ray_worker import HostSpec, WorkerHost, free_ports
from multipod.controller.observe.metrics import out
from multipod.protos.channels import Security, default_security

MONITOR_S = 1.0              # how often the actors are checked
PING_S = 5.0                 # an actor that does not answer a ping within this is counted as down


class RayPods(RayReplacement, Launched):
    """The pods of one run as Ray placement groups and actors; the controller's supervisor
    (kill(pod), like LocalPods). Use start() then stop(), or as a context manager."""

    def __init__(self, ray, num_pods: int, hosts_per_pod: int, resources: dict[str, float], run_dir: pathlib.Path,
                 strategy: str = "STRICT_SPREAD", devices_per_host: int = 0, max_restarts: int = 3,
                 place_timeout_s: float = 60.0, start_timeout_s: float = 120.0, security: Security | None = None,
                 dcn_encrypt: bool = False, insecure: bool = False):
        """resources: what each host's bundle and actor ask for. max_restarts: Ray restarts of
        each host's actor. place_timeout_s: the deadline to place the pods, at the start and
        again after a failure. start_timeout_s: the deadline for the workers to serve.
        insecure: let workers on other nodes than the controller's listen unencrypted."""
        check_request(num_pods, hosts_per_pod, strategy, devices_per_host)
        self.ray = ray
        self.num_pods, self.hosts_per_pod, self.resources = num_pods, hosts_per_pod, resources
        self.run_dir, self.strategy, self.devices_per_host = run_dir, strategy, devices_per_host
        self.max_restarts, self.place_timeout_s, self.start_timeout_s = max_restarts, place_timeout_s, start_timeout_s
        self.security = security or default_security()
        self.dcn_encrypt, self.insecure = dcn_encrypt, insecure
        self.run_id = secrets.token_hex(4)
        self.groups: list = []                      # [pod]: placement groups
        self.actors: list[list] = []                # [pod][host]
        self.host_addresses: list[list[str]] = []   # [pod][host]: gRPC HOST:PORT
        self.nodes: list[list[str]] = []            # [pod][host]: the node's IP
        self.pids: list[list[int]] = []             # [pod][host]: the worker's pid, as last seen
        self.on_this_machine = True                 # every host runs on the controller's node
        self._stopping = threading.Event()
        self._down_since: dict[int, float] = {}     # pod -> when the monitor first saw it down
        self._reported: dict[int, str] = {}         # pod -> what was said about it ("late" | "dead")
        self._stopped: dict[int, dict[int, int]] = {}   # pod -> {host: pid} of the workers check() stopped
        self._replacing: set[int] = set()           # pods whose replacement is being placed or waits as a spare
        # replacements started: their (group, actors, addresses, nodes, pids), by their pod address
        self._spares: dict[str, tuple] = {}
        self._spare_count = 0
        self._monitor = threading.Thread(target=self._watch, daemon=True, name="ray-monitor")

    @property
    def multi_host(self) -> bool:
        return self.hosts_per_pod > 1

    def log_path(self, pod: int, host: int = 0, spare: bool = False) -> pathlib.Path:
        kind = "spare" if spare else "worker"
        name = f"{kind}-{pod}.log" if not self.multi_host else f"{kind}-{pod}-host-{host}.log"
        return (self.run_dir / name).absolute()

    # -- start -----------------------------------------------------------------------------------
    def start(self) -> None:
        """Place the pods, start their workers, wait until every one serves (LaunchError naming
        what failed, within the deadlines)."""
        ray = self.ray
        from ray.util.placement_group import placement_group
        nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        check_capacity(self.num_pods, self.hosts_per_pod, self.strategy, self.resources, ray.cluster_resources(),
                       nodes)
        for pod in range(self.num_pods):
            self.groups.append(placement_group([dict(self.resources)] * self.hosts_per_pod, strategy=self.strategy,
                                               name=f"multipod-{self.run_id}-pod{pod}"))
        # One ready() object per group, kept: each call of ready() makes a new one.
        waits = [g.ready() for g in self.groups]
        ready, _ = ray.wait(waits, num_returns=len(waits), timeout=self.place_timeout_s)
        if len(ready) < len(waits):
            placed = {r.hex() for r in ready}
            missing = [p for p, w in enumerate(waits) if w.hex() not in placed]
            raise LaunchError(f"Ray could not place pod(s) {missing} within {self.place_timeout_s:g}s "
                              f"({self.hosts_per_pod} host(s) of {fmt(self.resources)} each, {self.strategy}); "
                              f"free now: {fmt(ray.available_resources())}. Free resources, add nodes, or ask for "
                              f"fewer pods (--place-timeout sets the deadline)")
        specs = self._host_specs()
        check_exposure(self.security, self.dcn_encrypt, self.insecure, self.on_this_machine)
        Host = ray.remote(WorkerHost)
        for pod in range(self.num_pods):
            self.actors.append([
                Host.options(name=f"multipod-{self.run_id}-pod{pod}-host{host}", namespace=NAMESPACE,
                             max_restarts=self.max_restarts, max_task_retries=0, max_concurrency=4,
                             scheduling_strategy=self._bundle(pod, host), **actor_options(self.resources))
                .remote(specs[pod][host], self.security.token)
                for host in range(self.hosts_per_pod)])
        infos = self._ready([a for hosts in self.actors for a in hosts])
        for pod in range(self.num_pods):
            mine = infos[pod * self.hosts_per_pod:(pod + 1) * self.hosts_per_pod]
            self.host_addresses.append([info["address"] for info in mine])
            self.nodes.append([info["node"] for info in mine])
            self.pids.append([info["pid"] for info in mine])
        self._monitor.start()

    def _ready(self, actors: list, spare: int | None = None) -> list[dict]:
        """Each actor's ready() (its worker's addresses), within the start deadline: the pods'
        actors in pod-major order, or with `spare` (its number) the hosts of one replacement. An
        actor that dies while it starts (its worker exited: a crash, or a port taken on the node
        between the probe and the worker's bind) is what Ray restarts: it is asked again, of its
        next incarnation, up to max_restarts times, instead of failing the start."""
        ray = self.ray
        deadline = time.monotonic() + self.start_timeout_s + 30
        infos = []
        for index, actor in enumerate(actors):
            name, log = self._where(index, spare)
            for attempt in range(self.max_restarts + 1):
                try:
                    infos.append(ray.get(actor.ready.remote(self.start_timeout_s),
                                         timeout=max(deadline - time.monotonic(), 0.1)))
                    break
                except ray.exceptions.GetTimeoutError:
                    raise LaunchError(f"could not start {name} within {self.start_timeout_s + 30:g}s "
                                      f"(see {log})") from None
                except ray.exceptions.ActorUnavailableError as exc:
                    if attempt == self.max_restarts:
                        raise LaunchError(f"could not start {name}: its actor died while starting {attempt + 1} "
                                          f"times; last: {exc} (see {log})") from None
                    out(f"{name}'s actor died while starting; asking its restarted incarnation (see {log})")
                    time.sleep(0.5)
                except ray.exceptions.RayError as exc:
                    raise self._failure(exc, "start", name) from None
        return infos

    def _where(self, index: int, spare: int | None = None) -> tuple[str, pathlib.Path]:
        """The name and worker log of the host at `index` (pod-major over the pods, or over one
        spare's hosts), as errors and progress lines say them."""
        pod, host = divmod(index, self.hosts_per_pod)
        name = (f"pod {pod}" if spare is None else f"spare {spare}") + (f" host {host}" if self.multi_host else "")
        return name, self.log_path(pod if spare is None else spare, host, spare is not None)

    def _failure(self, exc, what: str, name: str) -> LaunchError:
        """Ray's error from a host's task as a LaunchError: a task's own exception by its cause."""
        cause = exc.cause if isinstance(exc, self.ray.exceptions.RayTaskError) else exc
        return LaunchError(f"could not {what} {name}: {cause}")

    def _bundle(self, pod: int, host: int, group=None):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        return PlacementGroupSchedulingStrategy(placement_group=group or self.groups[pod],
                                                placement_group_bundle_index=host)

    def _host_specs(self, groups: list | None = None, spare: int | None = None) -> list[list[HostSpec]]:
        """Each host's ports, picked on its own node (a task in its bundle), and its worker's spec:
        for every pod, or with `spare` (its number) for the one replacement pod in groups[0]."""
        probe = self.ray.remote(free_ports)
        count = 3 if self.multi_host else 2     # gRPC, data plane (and host 0's coordinator)
        groups = groups or self.groups
        refs = [[probe.options(scheduling_strategy=self._bundle(pod, host, group), **actor_options(self.resources))
                 .remote(count) for host in range(self.hosts_per_pod)] for pod, group in enumerate(groups)]
        found = self._get([r for hosts in refs for r in hosts], self.place_timeout_s, "probe ports on", spare)
        here = self.ray.util.get_node_ip_address()
        # Loopback when the whole run is on the controller's machine: nothing then leaves it (and
        # the workers need no encryption); otherwise each worker listens on its node's address.
        if spare is None:
            self.on_this_machine = all(ip == here for ip, _ in found)
        loopback = self.on_this_machine and all(ip == here for ip, _ in found)
        flags = worker_flags(self.security, self.dcn_encrypt, self.insecure)
        env = worker_env(self.run_dir)
        specs = []
        for pod in range(len(groups)):
            mine = found[pod * self.hosts_per_pod:(pod + 1) * self.hosts_per_pod]
            hosts = ["127.0.0.1" if loopback else ip for ip, _ in mine]
            coordinator = f"{hosts[0]}:{mine[0][1][2]}" if self.multi_host else ""
            index = pod if spare is None else spare
            specs.append([HostSpec(run_id=self.run_id if spare is None else f"{self.run_id}-spare{spare}", pod=index,
                                   host=h, hosts_per_pod=self.hosts_per_pod, listen_host=hosts[h], port=ports[0],
                                   dcn_port=ports[1], coordinator=coordinator, devices=self.devices_per_host,
                                   log_path=str(self.log_path(index, h, spare is not None)), flags=flags, env=env,
                                   spare=spare is not None)
                          for h, (_, ports) in enumerate(mine)])
        return specs

    def _get(self, refs: list, timeout_s: float, what: str, spare: int | None = None) -> list:
        """ray.get with a deadline; a failure is a LaunchError saying which host and why."""
        ray = self.ray
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        done = {r.hex() for r in ready}
        results = []
        for index, ref in enumerate(refs):
            name, log = self._where(index, spare)
            if ref.hex() not in done:
                raise LaunchError(f"could not {what} {name} within {timeout_s:g}s (see {log})")
            try:
                results.append(ray.get(ref))
            except ray.exceptions.RayError as exc:
                raise self._failure(exc, what, name) from None
        return results

    # -- while the run goes on -------------------------------------------------------------------
    def kill(self, pod: int, host: int | None = None, pid: int | None = None) -> None:
        """Kill a pod's workers (e.g. one that hangs), or one host's (only if its worker is still
        `pid`): their actors exit and Ray restarts them."""
        for h, actor in enumerate(self.actors[pod]):
            if host is None or h == host:
                actor.kill_worker.remote(pid)

    def _state(self, pod: int, host: int) -> tuple[str, str, int | None]:
        """("up" | "down" | "moved" | "dead", why, its worker's pid if it answered) of one host's actor."""
        actor = self.actors[pod][host]
        ray = self.ray
        try:
            node, pid = ray.get(actor.ping.remote(), timeout=PING_S)
            if not node:
                return "down", "its worker exited", pid
            if node != self.nodes[pod][host]:
                # Its bundle was placed again on another node: the worker listens there, but the
                # controller and the peers know only its old address.
                return "moved", (f"Ray placed it again on node {node}, not {self.nodes[pod][host]}: a pod must "
                                 f"come back at its old address to rejoin"), pid
            return "up", "", pid
        except ray.exceptions.ActorDiedError as exc:
            return "dead", str(exc).splitlines()[0], None
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            return "down", "Ray is restarting its actor", None
        except ray.exceptions.RayError as exc:
            return "down", str(exc).splitlines()[0], None

    def _watch(self) -> None:
        """The monitor thread: check every pod's actors every MONITOR_S."""
        while not self._stopping.wait(MONITOR_S):
            for pod, actors in enumerate(self.actors):
                looks = [self._state(pod, host) for host in range(len(actors))]
                if self._stopping.is_set():
                    return
                self.look(pod, looks, time.monotonic())

    def look(self, pod: int, looks: list[tuple[str, str, int | None]], now: float) -> None:
        """One look at a pod's hosts, (state, why, pid) each: a host up with another worker pid
        than the last look's restarted in between, unseen (down for this look), unless it is
        one check() stopped. Then check(), with the last look's pids; then remember these."""
        states = []
        for host, (state, why, pid) in enumerate(looks):
            before = self.pids[pod][host]
            if state == "up" and pid and before and pid != before:
                if self._stopped.get(pod, {}).get(host) == before:
                    del self._stopped[pod][host]         # the restart check() asked for
                else:
                    state, why = "down", "its worker was restarted"
            states.append((state, why))
        self.check(pod, states, now)
        for host, (_, _, pid) in enumerate(looks):
            if pid:
                self.pids[pod][host] = pid

    def check(self, pod: int, states: list[tuple[str, str]], now: float) -> None:
        """One look at a pod's hosts (each ("up" | "down" | "dead", why)): say when the pod is
        down longer than the placement deadline, or for good, and when it is back; stop the other
        hosts of a pod one of whose hosts went down, so that the pod restarts as a whole (a
        jax.distributed cluster cannot take a lost host back). The controller's degraded mode
        carries the run meanwhile."""
        down_since, reported = self._down_since, self._reported
        if all(s == "up" for s, _ in states):
            if self._stopped.get(pod):
                return      # a host it stopped has not restarted yet: the pod is not back as a whole
            if pod in reported:
                out(f"pod {pod}: Ray has placed it again")
            down_since.pop(pod, None)
            reported.pop(pod, None)
            return
        if pod not in down_since:
            down_since[pod] = now
            if self.multi_host:
                for host, (state, _) in enumerate(states):
                    if state == "up":
                        self._stopped.setdefault(pod, {})[host] = self.pids[pod][host]
                        self.kill(pod, host, self.pids[pod][host])
        dead = [(h, why) for h, (s, why) in enumerate(states) if s in ("dead", "moved")]
        if dead and reported.get(pod) != "dead":
            reported[pod] = "dead"
            host, why = dead[0]
            gone = (f"{why}" if states[host][0] == "moved" else
                    f"host {host}'s actor is gone: {why}; --max-restarts {self.max_restarts} per host")
            out(f"pod {pod}: it cannot rejoin ({gone}); the run goes on with the surviving pods, and Ray is "
                f"asked for a replacement")
            if pod not in self._replacing:
                self._replacing.add(pod)
                threading.Thread(target=self._replace, args=(pod,), daemon=True, name=f"replace-{pod}").start()
        elif not dead and pod not in reported and now - down_since[pod] > self.place_timeout_s:
            reported[pod] = "late"
            why = "; ".join(f"host {h}: {w}" for h, (s, w) in enumerate(states) if s != "up")
            out(f"pod {pod}: Ray could not place it again within {self.place_timeout_s:g}s ({why}); "
                f"the run goes on with the surviving pods")

    # -- the end ---------------------------------------------------------------------------------
    def stop(self, grace_s: float = 5.0) -> None:
        """Stop every worker, then remove every actor and placement group of the run (each step
        bounded; what fails to answer is killed)."""
        ray = self.ray
        started = time.monotonic()
        self._stopping.set()
        if self._monitor.is_alive():
            self._monitor.join(timeout=PING_S * self.hosts_per_pod * 2 + 5)
        actors = [a for hosts in self.actors for a in hosts] + [a for s in self._spares.values() for a in s[1]]
        groups = list(self.groups) + [s[0] for s in self._spares.values()]
        if actors or groups:
            # Said as it starts and ends, so that a teardown that hangs shows where.
            out(f"stopping {len(actors)} worker actor(s) and {len(groups)} placement group(s) on Ray")
        if actors:
            try:
                ray.wait([a.stop.remote(grace_s) for a in actors], num_returns=len(actors), timeout=grace_s + 10)
            except Exception:   # dead or restarting actors: ray.kill below covers them
                pass
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        from ray.util.placement_group import remove_placement_group
        for group in groups:
            try:
                remove_placement_group(group)
            except Exception:
                pass
        self.actors, self.groups, self._spares = [], [], {}
        if actors or groups:
            out(f"stopped the run's Ray actors and placement groups in {time.monotonic() - started:.1f}s")
