"""The ProbeLink RPC's work: measure the data-plane link between pods with the Exchange a run uses.

Every probing pod gets the same request (but its own pod index) at once. Each builds an Exchange
under the probe's own run id with one float32 "leaf" of `nbytes`, and runs `rounds + 1`
all-reduces of it (the first connects and is not timed); the seconds of each timed round are the
reply. Its sum is thrown away: only the time matters. `multipod tune --dcn`
(controller/tune/dcn_probe.py) turns rounds of several sizes and stream counts into bandwidth and
latency.

With measure_encryption the request asks for something else: no exchange and no peer, this host's
data plane timed over loopback with CURVE and without (pod_worker/dcn/curve_rate.py), for what
encryption costs apart from the link (EncryptionProbe).

The request is checked here, field by field (InvalidRequest naming it), before anything is built;
the pod runs it inside a sequencer hold (pod.py Pod.probe_link), so never during a step, and puts
its own exchange's inbox back on the listener afterwards.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from multipod.pod_worker.dcn import Exchange, ExchangeError, Listener, curve_rate
from multipod.pod_worker.dcn.plan import LeafSpec
from multipod.pod_worker.errors import InvalidRequest, NotReady
from multipod.pod_worker.schema import MAX_STREAMS, Compression
from multipod.protos import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES

MAX_PROBE_BYTES = 1 << 30      # one round's buffer, at most
MAX_ROUNDS = 1000
MAX_PROBE_PODS = 32            # as server.MAX_PODS
MAX_ENCRYPTION_SECONDS = 1.0   # per rate: the tuner asks for a fraction of a second


@dataclass(frozen=True)
class LinkProbe:
    """One probe, as the request gives it."""
    run_id: str
    pod_index: int
    addresses: tuple[str, ...]
    nbytes: int
    streams: int
    chunk_bytes: int
    rounds: int
    compression: Compression = Compression.NONE

    @classmethod
    def from_request(cls, request) -> LinkProbe:
        """From a pb.ProbeLinkRequest; InvalidRequest naming the field that is wrong."""
        try:
            compression = Compression(request.compression or Compression.NONE.value)
        except ValueError:
            raise InvalidRequest(f"compression: {request.compression!r} is not one of "
                                 f"{', '.join(c.value for c in Compression)}") from None
        probe = cls(request.run_id, int(request.pod_index), tuple(request.dcn_addresses), int(request.bytes),
                    int(request.streams), int(request.chunk_bytes), int(request.rounds), compression)
        probe.validate()
        return probe

    def validate(self) -> None:
        if not self.run_id:
            raise InvalidRequest("run_id is empty")
        if not 2 <= len(self.addresses) <= MAX_PROBE_PODS:
            raise InvalidRequest(f"dcn_addresses: a probe needs 2 to {MAX_PROBE_PODS} pods' data-plane "
                                 f"addresses, got {len(self.addresses)}")
        if not all(self.addresses):
            raise InvalidRequest("dcn_addresses: an address is empty")
        if not 0 <= self.pod_index < len(self.addresses):
            raise InvalidRequest(f"pod_index {self.pod_index} is not one of the {len(self.addresses)} probing pods")
        if not 4 <= self.nbytes <= MAX_PROBE_BYTES or self.nbytes % 4:
            raise InvalidRequest(f"bytes: must be a multiple of 4 in [4, {MAX_PROBE_BYTES}], got {self.nbytes}")
        if not 1 <= self.streams <= MAX_STREAMS:
            raise InvalidRequest(f"streams: must be in [1, {MAX_STREAMS}], got {self.streams}")
        if not MIN_CHUNK_BYTES <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise InvalidRequest(f"chunk_bytes: must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], "
                                 f"got {self.chunk_bytes}")
        if not 1 <= self.rounds <= MAX_ROUNDS:
            raise InvalidRequest(f"rounds: must be in [1, {MAX_ROUNDS}], got {self.rounds}")


@dataclass(frozen=True)
class EncryptionProbe:
    """ProbeLink with measure_encryption, as the request gives it."""
    pod_index: int
    chunk_bytes: int
    seconds: float

    @classmethod
    def from_request(cls, request) -> EncryptionProbe:
        """From a pb.ProbeLinkRequest; InvalidRequest naming the field that is wrong."""
        probe = cls(int(request.pod_index), int(request.chunk_bytes), float(request.encryption_seconds))
        if not MIN_CHUNK_BYTES <= probe.chunk_bytes <= MAX_CHUNK_BYTES:
            raise InvalidRequest(f"chunk_bytes: must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], "
                                 f"got {probe.chunk_bytes}")
        if not 0 < probe.seconds <= MAX_ENCRYPTION_SECONDS:     # NaN fails this too
            raise InvalidRequest(f"encryption_seconds: must be in (0, {MAX_ENCRYPTION_SECONDS:g}], "
                                 f"got {probe.seconds}")
        return probe


def open_exchange(listener: Listener, probe: LinkProbe, deadline: float) -> Exchange:
    """The probe's Exchange, its inbox on the listener from now on (the peers may send)."""
    return Exchange(probe.run_id, probe.pod_index, list(probe.addresses),
                    [LeafSpec((probe.nbytes // 4,), np.dtype(np.float32))], listener,
                    chunk_bytes=probe.chunk_bytes, timeout_s=max(0.1, deadline - time.monotonic()),
                    streams=probe.streams, compression=probe.compression,
                    lossless="off")     # the probe's buffer of ones would pack to nothing: it measures the link


def run(exchange: Exchange, probe: LinkProbe, deadline: float) -> tuple[list[float], int]:
    """Exchange the probe's buffer rounds + 1 times on its prepared exchange, then close it;
    (seconds of each timed round, bytes one round sent). ExchangeError if a peer does not take
    part by `deadline`."""
    values = np.ones(probe.nbytes // 4, np.float32)
    seconds: list[float] = []
    sent = 0
    try:
        for round_ in range(probe.rounds + 1):
            exchange.timeout_s = max(0.1, deadline - time.monotonic())
            exchange.inbox.set_next_step(round_)
            start = time.perf_counter()
            _, stats = exchange.all_reduce(round_, [values])
            if round_:
                seconds.append(time.perf_counter() - start)
                sent = stats.bytes_sent
        # Closing drops chunks still queued, which a peer may need for its last timed round. One
        # more round settles it: this pod ends it only once every peer has sent its chunks of it,
        # which they do only after finishing their last timed round. Its own outcome is not needed.
        exchange.timeout_s = max(0.1, min(deadline - time.monotonic(), 4 * max(seconds) + 1.0))
        exchange.inbox.set_next_step(probe.rounds + 1)
        try:
            exchange.all_reduce(probe.rounds + 1, [values])
        except ExchangeError:
            pass
    finally:
        exchange.close()
    return seconds, sent


class LinkProbePod:
    """Pod's ProbeLink (a mixin of pod_worker/pod.py Pod: its listener, exchange, sequencer and
    `_probe`, the prepared probe)."""

    pod_index: int | None
    listener: Listener | None
    exchange: Exchange | None
    seq: Any
    _probe: tuple[LinkProbe, Exchange] | None

    def probe_link(self, probe: LinkProbe, deadline: float, prepare: bool = False
                   ) -> tuple[list[float], int]:
        """Measure the data plane with the probing pods (pod_worker/link_probe.py), between steps:
        waits for a running step until `deadline` (Busy then). prepare: only build the probe's
        exchange (it takes the listener until the probe runs; a newer one replaces it); else run
        the rounds on it (built now if not prepared), and give the listener back to the pod's own
        exchange."""
        if self.listener is None:
            raise NotReady(f"pod {self.pod_index} has no data-plane listener")
        if self.pod_index is None or self.pod_index != probe.pod_index:
            raise NotReady(f"this worker serves pod {self.pod_index}, not pod {probe.pod_index}")
        with self.seq.hold("a link probe", deadline=deadline):
            prepared, self._probe = self._probe, None
            if prepared is not None and (prepare or prepared[0] != probe):
                prepared[1].close()
                prepared = None
            try:
                exchange = prepared[1] if prepared is not None else open_exchange(self.listener, probe, deadline)
                if prepare:
                    self._probe = (probe, exchange)
                    return [], 0
                return run(exchange, probe, deadline)
            finally:
                if self._probe is None and self.exchange is not None:
                    self.listener.attach(self.exchange.inbox)

    def measure_encryption(self, probe: EncryptionProbe, deadline: float) -> curve_rate.HostRates:
        """This host's data plane over loopback with CURVE and without (pod_worker/dcn/curve_rate.py),
        between steps (a step would share the cores with it): Busy if a step runs past `deadline`,
        NotReady if the loopback pair fails. A prepared probe stays prepared."""
        if self.pod_index is None or self.pod_index != probe.pod_index:
            raise NotReady(f"this worker serves pod {self.pod_index}, not pod {probe.pod_index}")
        with self.seq.hold("an encryption probe", deadline=deadline):
            try:
                return curve_rate.measure(probe.chunk_bytes, probe.seconds, deadline)
            except curve_rate.RateError as exc:
                raise NotReady(f"pod {self.pod_index} could not time its data plane on this host: {exc}") from None
