"""The cross-pod gradient exchange over the DCN data plane (ZeroMQ; gRPC stays the control plane).

One job per module, each read top to bottom:
  wire.py         the wire codec: none, bf16, int8 with one scale per block of <= 256 values
  packing.py      lossless zstd packing of a chunk's bytes (dcn.lossless) and when to pack
  plan.py         who sends which slice of which leaf to whom, in which chunks
  transport.py    the protocol: the HMAC handshake that binds a connection to a pod, frames,
                  addresses, CURVE keys, socket monitors
  listener.py     Listener: this worker's ROUTER socket, the server's side of the handshake
  connection.py   Connection: one DEALER stream to a peer, the client's side of the handshake
  inbox.py        validation of every chunk, preallocated receive buffers, waiting for leaves and
                  for the peers' state votes
  outbox.py       the links to the peers (threads that send queued chunks) and the slow-link Pacer
  collectives.py  WholeGradient (2 pods), ReduceScatterAllGather (N > 2) and SlotGather (degraded
                  mode: failed pods' slots computed by survivors), one interface
  exchange.py     Exchange.all_reduce: the public entry that puts them together; Exchange.abort
  transfer.py     send_state / StateReceiver: a live pod's state to a rejoining pod
  curve_rate.py   this host's data-plane rate over loopback, CURVE-encrypted and plain (what
                  encryption costs, for `multipod tune --dcn`)
"""
from multipod.pod_worker.dcn.exchange import Exchange, ExchangeStats
from multipod.pod_worker.dcn.inbox import ExchangeError, InvalidChunk, StateVoteError
from multipod.pod_worker.dcn.listener import Listener
from multipod.pod_worker.dcn.outbox import Pacer
from multipod.pod_worker.dcn.plan import (
    PHASE_GATHER,
    PHASE_REDUCE,
    PHASE_SLOT_BASE,
    PHASE_STATE,
    PHASE_STATE_MANIFEST,
    PHASE_WHOLE,
    LeafSpec,
    Plan,
)
from multipod.pod_worker.dcn.transfer import StateReceiver, TransferError, TransferStats, send_state
from multipod.pod_worker.dcn.wire import BLOCK, WireCodec

__all__ = ["BLOCK", "PHASE_GATHER", "PHASE_REDUCE", "PHASE_SLOT_BASE", "PHASE_STATE", "PHASE_STATE_MANIFEST",
           "PHASE_WHOLE", "Exchange", "ExchangeError", "ExchangeStats", "InvalidChunk", "LeafSpec", "Listener", "Pacer",
           "Plan", "StateReceiver", "StateVoteError", "TransferError", "TransferStats", "WireCodec", "send_state"]
