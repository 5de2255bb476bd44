"""A replacement for a pod that Ray will not bring back at its address (its actor is dead for
good, or Ray placed it again on another node), a mixin of RayPods (ray_pods.py): a new placement
group wherever Ray finds room, its workers started with --spare, offered to the run (RUN_DIR/spares,
controller/cluster/spares.py) so that the controller hot-swaps the failed slot to it; once it has,
`swapped` makes the replacement the slot's pod (the old actors are killed for good)."""
from __future__ import annotations

from multipod.controller.launch.local import LaunchError
from multipod.controller.launch.ray_cluster import NAMESPACE, actor_options, fmt
from multipod.controller.launch.ray_worker import WorkerHost
from multipod.controller.observe.metrics import out


class RayReplacement:
    """The replacement part of RayPods: it works on RayPods' state (ray, groups, actors, the
    addresses, the monitor's bookkeeping) and its helpers (_host_specs, _bundle, _ready)."""

    def _replace(self, pod: int) -> None:
        """A replacement for `pod` wherever Ray finds room (a placement group of its own, its
        workers started with --spare), offered to the run as a spare; said if Ray cannot."""
        from ray.util.placement_group import placement_group, remove_placement_group

        from multipod.controller.cluster.spares import offer
        ray = self.ray
        self._spare_count += 1
        number = self._spare_count
        group = placement_group([dict(self.resources)] * self.hosts_per_pod, strategy=self.strategy,
                                name=f"multipod-{self.run_id}-spare{number}")
        actors: list = []
        try:
            ready, _ = ray.wait([group.ready()], timeout=self.place_timeout_s)
            if not ready:
                raise LaunchError(f"Ray could not place it within {self.place_timeout_s:g}s; free now: "
                                  f"{fmt(ray.available_resources())}")
            specs = self._host_specs([group], spare=number)[0]
            Host = ray.remote(WorkerHost)
            actors = [Host.options(name=f"multipod-{self.run_id}-spare{number}-host{host}", namespace=NAMESPACE,
                                   max_restarts=self.max_restarts, max_task_retries=0, max_concurrency=4,
                                   scheduling_strategy=self._bundle(0, host, group), **actor_options(self.resources))
                      .remote(specs[host], self.security.token) for host in range(self.hosts_per_pod)]
            infos = self._ready(actors, spare=number)
        except (LaunchError, ray.exceptions.RayError) as exc:
            out(f"pod {pod}: no replacement: {exc}")
            for actor in actors:
                ray.kill(actor, no_restart=True)
            remove_placement_group(group)
            self._replacing.discard(pod)
            return
        if self._stopping.is_set():
            return
        hosts = [info["address"] for info in infos]
        self._spares[",".join(hosts)] = (group, actors, hosts, [i["node"] for i in infos], [i["pid"] for i in infos])
        out(f"pod {pod}: Ray placed a replacement (spare {number}) at {','.join(hosts)} on node(s) "
            f"{', '.join(i['node'] for i in infos)}; offered to the run")
        offer(self.run_dir, hosts)

    def swapped(self, slot: int, address: str) -> None:
        """The controller hot-swapped `slot` to the pod at `address`: a replacement of ours becomes
        the slot's pod (watched, stopped at the end), and the slot's old actors go for good."""
        spare = self._spares.pop(address, None)
        if spare is None:
            return
        group, actors, hosts, nodes, pids = spare
        old_actors, old_group = self.actors[slot], self.groups[slot]
        self.groups[slot], self.actors[slot] = group, actors
        self.host_addresses[slot], self.nodes[slot], self.pids[slot] = hosts, nodes, pids
        self._down_since.pop(slot, None)
        self._reported.pop(slot, None)
        self._stopped.pop(slot, None)
        self._replacing.discard(slot)
        from ray.util.placement_group import remove_placement_group
        for actor in old_actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:   # already gone
                pass
        try:
            remove_placement_group(old_group)
        except Exception:
            pass

