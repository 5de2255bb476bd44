"""Exchange: this pod's side of one run's gradient exchange, assembled from the package's parts
(plan, inbox on the worker's listener, outbox to the live peers, one of the collectives).

Healthy, every pod computes its own slot of the pod-ordered sum. Degraded (`hosts`), a live pod
also computes the slots of failed pods the controller gave it; the sum is bitwise the healthy one
(collectives.SlotGather); a failed slot's microbatches may be split over several live pods, which
pass its partial sum on (send_partial, receive_partial). abort() ends a step stuck waiting on a
hung pod at once."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from multipod.model.config import ConfigError
from multipod.pod_worker.dcn.collectives import ReduceScatterAllGather, SlotGather, WholeGradient
from multipod.pod_worker.dcn.inbox import ExchangeError, Inbox, StateVoteError
from multipod.pod_worker.dcn.listener import Listener
from multipod.pod_worker.dcn.outbox import Outbox, Pacer
from multipod.pod_worker.dcn.packing import MIN_PACK_BYTES, LosslessPolicy
from multipod.pod_worker.dcn.plan import PARTIAL_DTYPE, PHASE_VOTE, VOTE_DTYPE, LeafSpec, Plan, partial_phase
from multipod.pod_worker.dcn.transport import parse_address
from multipod.pod_worker.schema import Compression, DcnConfig, Lossless, streams_per_peer

log = logging.getLogger(__name__)


@dataclass
class ExchangeStats:
    """What one step's exchange cost this pod."""
    bytes_sent: int = 0        # payload bytes this pod put on the wire this step (after encoding)
    bytes_received: int = 0
    idle_s: float = 0.0        # time the step thread sat waiting on peers' chunks
    # The part of idle_s before every peer's first chunk of the step had landed: waiting on a pod
    # still computing (a straggler), not on the link. The rest is not all the wire's: with the
    # overlapped step a peer may still be computing a later leaf (wire_wait_s tells them apart).
    peer_wait_s: float = 0.0
    # The part of idle_s from the first chunk that landed during each wait to the wait's end: the
    # link delivering bytes while the step thread waited. What dcn.lossless = auto goes by: a wait
    # on a peer still computing a leaf (none of its chunks landing) is not the link's doing, and
    # the overlapped step makes such waits after the peer's first chunk, which peer_wait_s misses.
    wire_wait_s: float = 0.0
    packed: bool = False       # this step's chunks were queued to go zstd-packed (dcn.lossless)
    first_wait_at: float | None = None     # when the step thread first waited (time.monotonic())

    def began_waiting(self, now: float) -> None:
        """The step thread starts waiting on peers' chunks at `now`."""
        if self.first_wait_at is None:
            self.first_wait_at = now


_MALLOC_TUNED = False


def tune_malloc() -> None:
    """Keep freed chunk-sized buffers in the process heap (glibc only; a no-op elsewhere).

    Every step allocates and frees a gradient's worth of buffers (receive targets, encoded
    chunks). By default glibc serves each from a fresh mmap and unmaps it on free, so every step
    pays a page fault per 4 KiB touched: copying 100 MB into fresh 2 MiB buffers took 3-5x longer
    than into reused heap memory here."""
    global _MALLOC_TUNED
    if _MALLOC_TUNED:
        return
    _MALLOC_TUNED = True
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 256 << 20)    # M_MMAP_THRESHOLD: serve blocks below 256 MiB from the heap
        libc.mallopt(-1, 1 << 30)      # M_TRIM_THRESHOLD: keep up to 1 GiB of freed heap
    except (OSError, AttributeError):
        pass


class Exchange:
    """`addresses`: every pod's data-plane address, in pod order (this pod's own included), one
    per slot of the sum. `listener`: this worker's Listener (needed with more than one live pod);
    `dcn` (a DcnConfig) overrides the keyword settings, whose defaults are DcnConfig's; `secret`
    defaults to the listener's (else the process's) token.

    `hosts` (degraded mode): hosts[slot] is the pod computing slot's shard; None (or the
    identity) when every pod computes its own. A pod that hosts any slot hosts its own; this pod
    must be one of them. Only the live pods (the hosts) are connected to or waited for.
    ValueError if the assignment does not fit."""

    def __init__(self, run_id: str, pod_index: int, addresses: list[str], leaves: list[LeafSpec],
                 listener: Listener | None = None, *, chunk_bytes: int = DcnConfig.chunk_bytes,
                 timeout_s: float = DcnConfig.timeout_s, streams: int | str = DcnConfig.streams,
                 compression: Compression | str = DcnConfig.compression, link_gbps: float = DcnConfig.link_gbps,
                 link_latency_ms: float = DcnConfig.link_latency_ms, encrypt: bool = DcnConfig.encrypt,
                 lossless: Lossless | str = DcnConfig.lossless, secret: str | None = None,
                 dcn: DcnConfig | None = None, hosts: list[int] | None = None):
        if dcn is not None:
            chunk_bytes, timeout_s, streams, compression = dcn.chunk_bytes, dcn.timeout_s, dcn.streams, dcn.compression
            link_gbps, link_latency_ms, encrypt = dcn.link_gbps, dcn.link_latency_ms, dcn.encrypt
            lossless = dcn.lossless
        streams = streams_per_peer(streams)     # "auto": as for a burst (the worker resolves its own)
        if streams < 1:
            raise ValueError("streams must be >= 1")
        if secret is None and listener is not None:
            secret = listener.secret        # the worker's own token proves it to the peers too
        if secret is None:
            from multipod.protos.channels import default_security
            secret = default_security().token
        tune_malloc()
        self.run_id, self.pod_index, self.timeout_s = run_id, pod_index, timeout_s
        self.num_pods = len(addresses)
        if not 0 <= pod_index < self.num_pods:
            raise ValueError(f"pod_index {pod_index} is not one of the {self.num_pods} pods")
        self.plan = Plan(self.num_pods, leaves, chunk_bytes, compression, hosts)
        if pod_index not in self.plan.live:
            raise ValueError(f"pod {pod_index} is not among the hosts {list(self.plan.hosts)}: it computes no slot")
        self.hosted = self.plan.hosted(pod_index)       # this pod's slots, its own first
        self.inbox = Inbox(run_id, pod_index, self.plan)
        self.listener = listener
        self.outbox: Outbox | None = None
        self._closed = ""       # why, once closed or aborted
        self._partial_bytes: dict[int, int] = {}    # by step: partial sums sent (send_partial)
        self.lossless = LosslessPolicy(lossless)
        if self.lossless.packing and len(self.plan.live) > 1:
            log.info("pod %d: chunks of %d bytes or more go zstd-packed (dcn.lossless = on)", pod_index,
                     MIN_PACK_BYTES)
        live = self.plan.live
        if len(live) > 1 or (listener is not None and self.num_pods > 1):
            if listener is None:
                raise ValueError("an exchange between several pods needs this worker's data-plane listener")
            for pod, address in ((p, addresses[p]) for p in live):
                try:
                    curve = parse_address(address)[1]
                except ValueError as exc:
                    raise ConfigError("dcn_addresses", f"pod {pod}: {exc}") from None
                if encrypt and not curve:
                    raise ConfigError("dcn.encrypt", f"pod {pod}'s data plane at {address} is not encrypted "
                                                     f"(start its worker with --dcn-encrypt)")
            peers = {p: addresses[p] for p in live if p != pod_index}     # never a failed pod's address
            if peers:
                self.outbox = Outbox(pod_index, run_id, peers, streams, secret,
                                     Pacer(link_gbps, link_latency_ms / 1e3), self.inbox.fail)
            listener.attach(self.inbox)
        algorithm = (SlotGather if self.plan.degraded
                     else WholeGradient if self.plan.whole else ReduceScatterAllGather)
        self.collective = algorithm(self.plan, pod_index, self.inbox, self.outbox)

    def close(self) -> None:
        """Stop receiving and sending (idempotent); a step still waiting fails at once."""
        if not self._closed:
            self._closed = f"the exchange of pod {self.pod_index} (run {self.run_id}) was closed"
        self.inbox.abort(self._closed)
        if self.listener is not None:
            self.listener.detach(self.inbox)
        if self.outbox is not None:
            self.outbox.close()

    def abort(self, why: str) -> None:
        """Make a step waiting in this exchange (now or later) fail at once with ExchangeError(why),
        e.g. one stuck on a hung pod; then close. The exchange cannot be used again: build a new
        one under a new run id."""
        if not self._closed:
            self._closed = why
        self.inbox.abort(self._closed)      # first: wakes the waiting step before the links stop
        self.close()

    def all_reduce(self, step: int, leaves, on_leaf=None, order: list[int] | None = None,
                   extra: dict[int, list] | None = None, subset: bool = False) -> tuple[list, ExchangeStats]:
        """Send this pod's gradient leaves, receive the peers', and return the sum over all pods in
        pod-index order (by leaf index), bitwise identical on every pod.

        `leaves` are host arrays or device arrays whose host copies are under way (or not yet
        computed); each is read only when its turn comes. `order`: the leaf indices in the order
        to take them (default 0, 1, ...); every pod must pass the same. `on_leaf(index, summed)`
        (e.g. an async host->device put) is called on each leaf as soon as it is summed; its
        results are returned.

        subset: `order` names only some of the leaves (a DiLoCo fragment's, keyed by its outer sync
        number as `step`); only those are read, sent and summed, the others' results are None.

        Degraded mode: `leaves` are this pod's own slot's; `extra` = {slot: leaves} of exactly the
        other slots `hosts` gives this pod (ValueError otherwise), each read in `order` too.
        ExchangeError if the exchange fails, times out, or was aborted or closed."""
        n = len(self.plan.leaves)
        order = list(range(n)) if order is None else [int(i) for i in order]
        if subset:
            if len(set(order)) != len(order) or not all(0 <= i < n for i in order):
                raise ValueError(f"order must name distinct leaves among the {n}")
        elif sorted(order) != list(range(n)):
            raise ValueError(f"order must be a permutation of the {n} leaf indices")
        extra = dict(extra or {})
        if sorted(extra) != self.hosted[1:]:
            raise ValueError(f"pod {self.pod_index} computes the extra slots {self.hosted[1:]} (hosts "
                             f"{list(self.plan.hosts) if self.plan.degraded else 'all healthy'}), got extra "
                             f"slots {sorted(extra)}")
        for slot, slot_leaves in extra.items():
            if len(slot_leaves) != n:
                raise ValueError(f"extra slot {slot}: {len(slot_leaves)} leaves, the gradient has {n}")
        if self._closed:
            raise ExchangeError(self._closed)
        on_leaf = on_leaf or (lambda index, value: value)
        stats = ExchangeStats()
        deadline = time.monotonic() + self.timeout_s
        state = self.inbox.state(step)
        if self.outbox is not None:
            self.outbox.packing = stats.packed = self.lossless.packing
        # Not waiting for the peers' acknowledgements: every byte they need is queued, and a peer
        # that does not get it fails its own step. The links drain while this pod updates.
        results = self.collective.run(step, leaves, order, on_leaf, deadline, stats, extra)
        stats.bytes_received = sum(s.bytes for s in state.slots.values())
        began = self.inbox.peers_began_at(step, [p for p in self.plan.live if p != self.pod_index])
        if began is not None and stats.first_wait_at is not None:
            stats.peer_wait_s = min(stats.idle_s, max(0.0, began - stats.first_wait_at))
        stats.bytes_sent += self._partial_bytes.pop(step, 0)
        # Packing pays only for waits on the wire, never for a wait on a pod still computing.
        if self.outbox is not None and self.lossless.update(stats.bytes_sent, stats.wire_wait_s):
            self._log_packing(step, stats)
        for old in [s for s in self._partial_bytes if s < step]:     # steps that failed before their exchange
            del self._partial_bytes[old]
        return results, stats

    def _log_packing(self, step: int, stats: ExchangeStats) -> None:
        assert self.outbox is not None
        raw, wire = self.outbox.packed_bytes
        so_far = f"; packed so far: {wire / raw:.3f} of the bytes" if raw else ""
        log.info("pod %d, exchange %d: waited %.3f s on peers' bytes on the wire for %d bytes sent: chunks go %s "
                 "from the next exchange on (dcn.lossless = auto%s)", self.pod_index, step,
                 stats.wire_wait_s, stats.bytes_sent,
                 "zstd-packed" if self.lossless.packing else "raw", so_far)

    # -- the state vote: every live pod starts a step from the same state -------------------------
    def send_vote(self, step: int, state: int) -> None:
        """Tell every live peer this pod's state checksum as `step` starts (a few bytes, sent first
        so that they are there when the step is about to be applied)."""
        if self.outbox is None:
            return
        deadline = time.monotonic() + self.timeout_s
        vote = np.array([state], VOTE_DTYPE)
        for pod in self.plan.live:
            if pod != self.pod_index:
                self.outbox.put(step, deadline, pod, PHASE_VOTE, 0, 0, vote)

    def check_votes(self, step: int, state: int) -> None:
        """Before `step` is applied: StateVoteError unless every live peer started it from this
        pod's state (their votes, within the exchange's deadline). A silently corrupted pod (its
        state differs from the others' after an update) is caught here, before its gradient,
        computed from that state, changes anyone's parameters."""
        if self.outbox is None:
            return
        votes = self.inbox.wait_votes(step, time.monotonic() + self.timeout_s)
        if any(v != state for v in votes.values()):
            raise StateVoteError(step, {self.pod_index: state, **votes})

    # -- a failed slot's microbatches split over the live pods -------------------------------------
    def _check_partial(self, slot: int, pod: int) -> None:
        if slot not in self.plan.failed:
            raise ValueError(f"slot {slot} is not a failed pod's slot (hosts {list(self.plan.hosts)}): "
                             f"its gradient is not split")
        if pod == self.pod_index or pod not in self.plan.live:
            raise ValueError(f"pod {pod} is not another live pod (the live pods are {self.plan.live})")
        if self._closed:
            raise ExchangeError(self._closed)

    def send_partial(self, step: int, slot: int, pod: int, leaves, losses) -> int:
        """Queue this pod's partial sum of failed slot `slot`'s gradient (float32 leaves in tree
        order, host or device arrays; the sum of the slot's microbatches up to this pod's last,
        pod_worker/accumulate.py) and of its loss sums (`losses`: float32 [ce, z]) for live pod
        `pod`, which continues it. Raw bytes whatever dcn.compression: the slot's gradient must
        come out bitwise. Returns the bytes queued (counted in the step's ExchangeStats.bytes_sent)."""
        self._check_partial(slot, pod)
        if self.outbox is None:     # there is another live pod, so there is an outbox
            raise RuntimeError(f"pod {self.pod_index} has no outbox")
        if len(leaves) != len(self.plan.leaves):
            raise ValueError(f"a partial sum of {len(leaves)} leaves, the gradient has {len(self.plan.leaves)}")
        deadline = time.monotonic() + self.timeout_s
        sent = 0
        for i, leaf in enumerate([*leaves, losses]):
            values = np.asarray(leaf).reshape(-1)
            if values.dtype != PARTIAL_DTYPE or values.size != self.plan.partial_sizes[i]:
                what = f"leaf {i}" if i < len(leaves) else "the losses"
                raise ValueError(f"{what} of a partial sum: {values.size} {values.dtype} values, expected "
                                 f"{self.plan.partial_sizes[i]} float32")
            for a, b in self.plan.partial_chunks(i):
                sent += self.outbox.put(step, deadline, pod, partial_phase(slot), i, a, values[a:b])
        self._partial_bytes[step] = self._partial_bytes.get(step, 0) + sent
        return sent

    def receive_partial(self, step: int, slot: int, pod: int) -> tuple[list[np.ndarray], np.ndarray]:
        """Wait (within the exchange's deadline) for failed slot `slot`'s partial sum from live
        pod `pod`: (its float32 leaves, shaped, in tree order; its loss sums [ce, z]).
        ExchangeError if it does not come."""
        self._check_partial(slot, pod)
        deadline = time.monotonic() + self.timeout_s
        leaves = [self.inbox.wait_partial(step, slot, pod, i, deadline).reshape(spec.shape)
                  for i, spec in enumerate(self.plan.leaves)]
        return leaves, self.inbox.wait_partial(step, slot, pod, len(leaves), deadline)
