"""The dcn section: the cross-pod gradient link's settings (DcnConfig), its encodings
(Compression), its lossless packing (Lossless), and its streams per peer (the bound, and what
`dcn.streams = "auto"` comes to on a host: streams_for_cpus)."""
from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Literal

from multipod.model.config import ConfigError, to_enum
from multipod.pod_worker.schema.loader import non_negative, positive
from multipod.pod_worker.schema.overlap import Overlap
from multipod.protos import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES


class Compression(enum.StrEnum):
    """Gradient encodings on the DCN link (pod_worker/dcn/wire.py implements them)."""
    NONE = "none"
    BF16 = "bf16"
    INT8 = "int8"     # one scale per block of <= 256 values
    INT4 = "int4"     # two values per byte, one scale per block of <= 256 values


class Lossless(enum.StrEnum):
    """dcn.lossless: whether chunks travel zstd-packed (pod_worker/dcn/packing.py), losslessly, so
    the sum stays bitwise what it is unpacked. Float32 gradients pack to about 0.84 of their bytes,
    bf16 to about 0.68 (docs/benchmarks.md); packing costs CPU (about 30 ms per 17 MB here), so it
    pays only where the link, not the pod, sets the pace.
      auto  pack once an exchange (after the first two, which wait on peers still compiling)
            left this pod waiting on its peers' bytes for over twice what packing them would
            cost; stop after 8 exchanges in a row that waited less than that cost
            (LosslessPolicy);
      on    pack every chunk of 16 KiB or more;
      off   never pack."""
    AUTO = "auto"
    ON = "on"
    OFF = "off"


# Data-plane connections (ZeroMQ streams) per peer, at most.
MAX_STREAMS = 8
# dcn.streams = "auto": one stream per two of the worker's CPUs, 1 to this many.
MAX_AUTO_STREAMS = 4


def streams_for_cpus(cpus: int, overlapped: bool = False) -> int:
    """What dcn.streams = "auto" comes to for a worker that may run on `cpus` CPUs. The fused step
    queues the whole gradient at once, and each stream is a sending thread beside the pod's update
    and next step, its listener and ZeroMQ's I/O thread: where they outnumber the cores they take
    turns and a peer's chunks arrive with gaps, so one stream per two CPUs, 1 to MAX_AUTO_STREAMS.
    The overlapped step's chunks leave a layer at a time during the backward pass, and there 4
    streams were no slower than 1 even on 2 cores: MAX_AUTO_STREAMS. Both measured side by side
    on 2 cores with 2 pods (docs/benchmarks.md, "dcn.streams = auto"). Hosts of 8 CPUs or more
    keep the 4 streams that long links need to fill their windows either way."""
    if overlapped:
        return MAX_AUTO_STREAMS
    return max(1, min(MAX_AUTO_STREAMS, cpus // 2))


def this_host_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, which a pinned worker narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):      # not Linux
        return os.cpu_count() or 1


def streams_per_peer(streams: int | str, overlapped: bool = False, cpus: int | None = None) -> int:
    """dcn.streams as a count: itself if a number, else streams_for_cpus for a pod whose step is
    overlapped or not (False: what travels in one burst, as the fused step's gradient, DiLoCo's
    outer gradients or a state transfer) on `cpus` CPUs (default: this host's, this_host_cpus)."""
    if streams != "auto":
        return int(streams)
    return streams_for_cpus(this_host_cpus() if cpus is None else cpus, overlapped)


@dataclass(frozen=True)
class DcnConfig:
    """The cross-pod gradient link."""
    chunk_bytes: int = 2 << 20    # gradient chunk size on the wire, 1-4 MiB
    timeout_s: float = 60.0       # deadline for a peer's gradient to arrive
    # parallel data-plane connections per peer: 1-8, or auto (streams_for_cpus: by the host's CPUs
    # and the pod's step)
    streams: int | Literal["auto"] = "auto"
    compression: Compression = Compression.NONE
    link_gbps: float = 0.0        # slow-link mode: simulated egress bandwidth per pod (0: off)
    link_latency_ms: float = 0.0  # slow-link mode: simulated one-way latency (0: off)
    encrypt: bool = False         # refuse peers whose data plane is not CURVE-encrypted (worker --dcn-encrypt)
    overlap: Overlap = Overlap.AUTO   # per-layer backward programs; each block's gradient leaves when ready
    lossless: Lossless = Lossless.AUTO    # zstd-packed chunks where the link sets the pace (exact)

    def __post_init__(self):
        object.__setattr__(self, "compression", to_enum("dcn.compression", Compression, self.compression))
        object.__setattr__(self, "overlap", to_enum("dcn.overlap", Overlap, self.overlap))
        object.__setattr__(self, "lossless", to_enum("dcn.lossless", Lossless, self.lossless))

    def validate(self) -> None:
        if not MIN_CHUNK_BYTES <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ConfigError("dcn.chunk_bytes",
                              f"must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], got {self.chunk_bytes}")
        positive("dcn.timeout_s", self.timeout_s)
        if self.streams != "auto" and (isinstance(self.streams, bool) or not isinstance(self.streams, int)
                                       or not 1 <= self.streams <= MAX_STREAMS):
            raise ConfigError("dcn.streams",
                              f'must be "auto" or an integer in [1, {MAX_STREAMS}], got {self.streams!r}')
        non_negative("dcn.link_gbps", self.link_gbps)
        non_negative("dcn.link_latency_ms", self.link_latency_ms)

