"""Pods of several hosts: one worker process per host; the hosts of a pod form one jax.distributed
cluster of their own and run the pod's step as one SPMD program over all its devices.

  * layout      HostLayout: this host's index, the pod's host count, the pod's coordinator.
  * bootstrap   start_distributed, before jax's backend starts (gloo collectives on CPU).
  * host reads  host_value: a device array's value on this host (every host of a pod holds a
                full replica of the parameters: the model axis stays inside one host).
  * exchange    the host-parallel DCN exchange: host h of every pod owns block h of every
                gradient leaf (Assembler.block), exchanges only that block with host h of the other
                pods, and one compiled program (the Assembler) puts the summed blocks back
                together on every device of the pod (an all-gather over the hosts).

One cluster per pod: a failure inside one pod never aborts another pod's processes.
"""
from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class HostLayout:
    """Where this worker sits in its pod."""
    host_index: int = 0
    hosts_per_pod: int = 1
    coordinator: str = ""      # HOST:PORT of the pod's jax.distributed coordinator (host 0 serves it)

    @property
    def multi(self) -> bool:
        return self.hosts_per_pod > 1

    @property
    def primary(self) -> bool:
        """Host 0: the one that writes what only one host should write (checkpoints)."""
        return self.host_index == 0

    def name(self, pod_index: int | None) -> str:
        """How logs and errors name this host: "pod P" ("spare" before a spare has a slot), with
        its host index in a pod of several hosts."""
        pod = "spare" if pod_index is None else f"pod {pod_index}"
        return pod if not self.multi else f"{pod} host {self.host_index}"

    def check(self) -> HostLayout:
        """ValueError naming the flag if the layout is inconsistent."""
        if self.hosts_per_pod < 1:
            raise ValueError(f"--hosts-per-pod must be >= 1, got {self.hosts_per_pod}")
        if not 0 <= self.host_index < self.hosts_per_pod:
            raise ValueError(f"--host-index {self.host_index} is out of range for --hosts-per-pod "
                             f"{self.hosts_per_pod} (0..{self.hosts_per_pod - 1})")
        if self.multi:
            host, _, port = self.coordinator.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--pod-coordinator must be HOST:PORT with --hosts-per-pod {self.hosts_per_pod}, "
                                 f"got {self.coordinator!r}")
        return self


def start_distributed(layout: HostLayout, timeout_s: float = 120.0, heartbeat_s: float = 10.0) -> None:
    """Join the pod's jax.distributed cluster (no-op for a single-host pod). Must run before jax
    starts its backend; on CPU the collectives between the hosts use gloo. When a host of the pod
    dies, jax's coordination service stops the others within `heartbeat_s` (they would otherwise
    wait forever in a collective): the pod fails as a whole and comes back as a whole."""
    if not layout.multi:
        return
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    log.info("joining pod cluster at %s as host %d of %d", layout.coordinator, layout.host_index,
             layout.hosts_per_pod)
    jax.distributed.initialize(layout.coordinator, num_processes=layout.hosts_per_pod,
                               process_id=layout.host_index, initialization_timeout=int(timeout_s),
                               heartbeat_timeout_seconds=max(1, int(heartbeat_s)))
    # Starting the backend is itself a meeting of every host (they exchange their devices): do
    # it now, while every host is starting, not on some later request that only one host gets.
    log.info("pod cluster: %d devices, %d on this host", len(jax.devices()), jax.local_device_count())


def meet(name: str, timeout_s: float, what: str = "step") -> None:
    """Wait until every host of the pod reaches the barrier `name`, at most timeout_s;
    TimeoutError otherwise (naming `what` the hosts were to start). Before a step's (or a
    generation's) first collective: a host that started a step its peer never starts (refused,
    cancelled) would otherwise wait in that collective for good, since gloo's collectives have no
    deadline. A name may be met again: each host's n-th wait at it meets the others' n-th."""
    from jax._src import distributed
    client = distributed.global_state.client
    try:
        client.wait_at_barrier(name, max(1, int(timeout_s * 1000)))
    except Exception as exc:   # noqa: BLE001 - the runtime raises its own error type
        raise TimeoutError(f"the pod's other host(s) did not start the same {what} within {timeout_s:.1f}s "
                           f"({type(exc).__name__}: {str(exc)[:200]})") from None


def _distinct_shards(x) -> list:
    """This host's shards of a multi-host array, one per distinct index (a replicated leaf has a
    copy on every local device; one of them is enough)."""
    seen, out = set(), []
    for shard in x.addressable_shards:
        key = tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s for s in shard.index)
        if key not in seen:
            seen.add(key)
            out.append(shard)
    return out


def host_value(x) -> np.ndarray:
    """The value of a (possibly multi-host) array on this host. A single-host array is read as
    is; a multi-host one is put together from this host's shards, which must cover it (they do for
    everything a pod replicates over its data axis: parameters, optimizer state, gradients)."""
    import jax
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    out = np.empty(x.shape, x.dtype)
    covered = np.zeros(x.shape, bool) if x.ndim else None
    for shard in _distinct_shards(x):
        out[shard.index] = np.asarray(shard.data)
        if covered is not None:
            covered[shard.index] = True
    if covered is not None and not covered.all():
        raise ValueError(f"this host holds only part of an array of shape {x.shape}: the model axis must stay "
                         f"inside one host")
    return out


def start_host_copy(x) -> None:
    """Start the device->host copy of what host_value(x) will read, without waiting for it (nor for
    the program computing x)."""
    if x.is_fully_addressable:
        x.copy_to_host_async()
        return
    for shard in _distinct_shards(x):
        shard.data.copy_to_host_async()


class HostBlock:
    """Elements [start, stop) of a gradient leaf flattened, as this host sends them: read
    (np.asarray) only when the exchange takes the leaf, so that the leaves after it may still be
    computing or copying."""

    def __init__(self, leaf, start: int, stop: int):
        self.leaf, self.start, self.stop = leaf, start, stop

    @property
    def shape(self) -> tuple[int]:
        """The block's shape as the exchange sends it (flat), without reading it."""
        return (self.stop - self.start,)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.leaf.dtype)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        values = host_value(self.leaf).reshape(-1)[self.start:self.stop]
        return values if dtype is None else values.astype(dtype)


class Assembler:
    """Puts the summed blocks of every host back together as the pod's gradient: one compiled
    program whose input is one flat array per leaf, sharded over the mesh's data axis so that
    host h's devices hold block h, and whose output has the parameters' shardings (XLA inserts
    the all-gather over the hosts).

    `align`: every block starts at a multiple of it (the wire codec's scale blocks with int8 and
    int4: a host's block then quantises in the very blocks one host's whole leaf does)."""

    def __init__(self, mesh, leaf_shapes: list[tuple[int, ...]], leaf_shardings: list, layout: HostLayout,
                 align: int = 1):
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        self.mesh, self.leaf_shardings, self.layout, self.align = mesh, list(leaf_shardings), layout, align
        self.shapes = [tuple(s) for s in leaf_shapes]
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        data = mesh.shape["data"]
        if data % layout.hosts_per_pod:
            raise ValueError(f"the data axis ({data}) must split evenly over the pod's {layout.hosts_per_pod} hosts")
        # Host h holds data rows [h * D/K, (h + 1) * D/K): its block is split over those rows.
        self.rows_per_host = data // layout.hosts_per_pod
        unit = math.lcm(self.rows_per_host, align)
        self.padded = [-(-size // layout.hosts_per_pod) for size in self.sizes]   # block length
        self.padded = [-(-p // unit) * unit for p in self.padded]
        self.flat_sharding = NamedSharding(mesh, P("data"))
        shapes, sizes = self.shapes, self.sizes

        def assemble(flats, flags):
            return [f[:n].reshape(s) for f, n, s in zip(flats, sizes, shapes)], jnp.min(flags)
        self._program = jax.jit(assemble, out_shardings=(list(leaf_shardings), NamedSharding(mesh, P())))

    def subset(self, indices: list[int]) -> Assembler:
        """An Assembler of leaves `indices` only, cut in the same blocks (a DiLoCo fragment's)."""
        return Assembler(self.mesh, [self.shapes[i] for i in indices], [self.leaf_shardings[i] for i in indices],
                         self.layout, self.align)

    def block(self, index: int) -> tuple[int, int]:
        """The range of leaf `index` this host exchanges (the unpadded part of its block)."""
        per = self.padded[index]
        start = min(self.sizes[index], self.layout.host_index * per)
        return start, min(self.sizes[index], start + per)

    def __call__(self, blocks: list[np.ndarray] | None, dtypes: list[np.dtype]) -> tuple[list | None, bool]:
        """This host's summed blocks (host arrays, by leaf; None if its exchange failed) -> the
        pod's summed leaves on its devices, and whether every host of the pod had its blocks.

        Every host calls this after every exchange, failed or not: it is a collective, and a host
        that skipped it would leave the others waiting in it. If any host failed, every host
        learns it here and the step fails alike on all of them (the state stays as it was)."""
        import jax
        flats = []
        for index, dtype in enumerate(dtypes):
            local = np.zeros(self.padded[index], dtype)
            if blocks is not None:
                local[:blocks[index].size] = blocks[index]
            global_shape = (self.padded[index] * self.layout.hosts_per_pod,)
            flats.append(jax.make_array_from_process_local_data(self.flat_sharding, local, global_shape))
        flag = np.full(self.rows_per_host, 0 if blocks is None else 1, np.int32)
        flags = jax.make_array_from_process_local_data(self.flat_sharding, flag,
                                                       (self.rows_per_host * self.layout.hosts_per_pod,))
        leaves, every_host = self._program(flats, flags)
        return (leaves, True) if bool(host_value(every_host)) else (None, False)


def check_multi_host(mesh_shape: tuple[int, int], local_devices: int, layout: HostLayout) -> None:
    """ConfigError naming the field if a pod of several hosts cannot run this config: the model
    axis must stay inside one host (every host then holds whole parameters), and the data axis
    must split over the hosts."""
    from multipod.model.config import ConfigError
    data, model = mesh_shape
    if local_devices % model:
        raise ConfigError("mesh.model", f"{model} does not fit inside one host's {local_devices} device(s): with "
                          f"{layout.hosts_per_pod} hosts per pod the model axis must stay inside a host")
    if data % layout.hosts_per_pod:
        raise ConfigError("mesh.data", f"{data} does not split over {layout.hosts_per_pod} hosts")
