"""A failed pod's shard split by microbatch over the live pods (degraded mode).

The controller sends each live pod that computes part of failed slot s's shard the whole shard and
`microbatch_hosts`: the live pod computing each of its microbatches, in order. Each pod's
microbatches are one contiguous run [start, stop), and the runs chain: the pod of [0, a) sums its
microbatches (pod_worker/accumulate.py, float32 from g_0) and sends the partial sum to the pod of
[a, b), which adds its microbatches in order and passes it on, ..., and the pod computing the last
microbatch, which must be the slot's host (Cluster.hosts[s]), ends with the slot's gradient,
bitwise the one the failed pod would have computed; it then sums it in slot s like any hosted
slot (collectives.SlotGather). The loss sums travel with the partial sums and are added in the
same order, so the pod ending the chain reports the slot's loss (ShardResult), bitwise the failed
pod's; the others report none for it. The partial sums travel raw over the data plane
(Exchange.send_partial / receive_partial).

On pods of several hosts every host holds the whole partial sum (replicated: the pod runs one SPMD
program), and host h of a pod is linked to host h of the others. Host h sends only its block of
every leaf (hosts.Assembler.block, the blocks of the every-step exchange, whose plan is in blocks
there) to host h of the next pod, which gathers the blocks over its hosts (the Assembler): K times
fewer bytes per host than each host sending the whole sum, and the exchange needs nothing new.

Every pod adds in the same order whatever the split, so any split is bitwise right; the
controller's (controller/components/failover.py `split_microbatches`) balances the work.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np

from multipod.pod_worker.dcn import ExchangeError
from multipod.pod_worker.dcn.plan import PARTIAL_DTYPE
from multipod.pod_worker.hosts import HostBlock, host_value, start_host_copy


@dataclass(frozen=True)
class Piece:
    """This pod's part of failed slot `slot`'s shard: microbatches [start, stop) of `tokens` (the
    whole shard, on this pod's devices), continuing `source`'s partial sum (None iff start = 0)
    and passing its own on to `target` (None iff stop is the last microbatch: this pod hosts the
    slot, and its sum is the slot's gradient)."""
    slot: int
    tokens: jax.Array
    start: int
    stop: int
    source: int | None = None
    target: int | None = None


@dataclass(frozen=True)
class Relay:
    """How a step passes partial sums on: send(slot, pod, float32 leaves, float32 [ce, z]) and
    receive(slot, pod) -> (leaves, [ce, z]) (Exchange.send_partial / receive_partial bound to the
    step)."""
    send: Callable
    receive: Callable


def my_run(microbatch_hosts: list[int], pod: int, slot: int, hosts: tuple[int, ...] | list[int]
           ) -> tuple[int, int, int | None, int | None]:
    """(start, stop, source, target) of `pod`'s microbatches of failed slot `slot` from the step's
    microbatch_hosts. ValueError (a clear message) unless every microbatch is on a live pod, every
    pod's microbatches are one contiguous run, `pod` has one, and the slot's host computes the
    last microbatch."""
    live = set(hosts)
    if not microbatch_hosts:
        raise ValueError(f"slot {slot}: no microbatch hosts")
    if any(h not in live for h in microbatch_hosts):
        raise ValueError(f"slot {slot}: microbatch hosts {microbatch_hosts} name pods that are not live "
                         f"(live pods {sorted(live)})")
    runs = [h for i, h in enumerate(microbatch_hosts) if i == 0 or microbatch_hosts[i - 1] != h]
    if len(runs) != len(set(runs)):
        raise ValueError(f"slot {slot}: microbatch hosts {microbatch_hosts} give a pod two runs of microbatches")
    if microbatch_hosts[-1] != hosts[slot]:
        raise ValueError(f"slot {slot}: its last microbatch must be on its host, pod {hosts[slot]}, not on pod "
                         f"{microbatch_hosts[-1]}")
    mine = [m for m, h in enumerate(microbatch_hosts) if h == pod]
    if not mine:
        raise ValueError(f"slot {slot}: pod {pod} computes none of its microbatches {microbatch_hosts}")
    start, stop = mine[0], mine[-1] + 1
    source = microbatch_hosts[start - 1] if start else None
    target = microbatch_hosts[stop] if stop < len(microbatch_hosts) else None
    return start, stop, source, target


def launch_pieces(trainer, pieces: list[Piece], norm: jax.Array) -> list[tuple]:
    """A PodTrainer's step: dispatch every piece's microbatch programs, slot by slot (before the
    pod's own shard: the other pods of a slot's chain wait for them); a piece that starts its
    slot's chain is summed as it is dispatched. [(piece, its sums or None, [(gradient, ce, z)])]."""
    launched: list[tuple] = []
    for piece in pieces:
        if piece.source is None:
            total, ce, z = trainer.microbatches(piece.tokens, norm, piece.start, piece.stop)
            launched.append((piece, (total, (ce, z)), []))
        else:
            launched.append((piece, None, [trainer.microbatch_gradient(piece.tokens, norm, m)
                                           for m in range(piece.start, piece.stop)]))
    return launched


def relay_pieces(trainer, launched: list[tuple], relay: Relay | None) -> tuple[dict, list, Exception | None]:
    """A PodTrainer's step, after launch_pieces: each piece's place in its slot's chain, slot by
    slot (every pod goes through the slots in the same order, so no two pods wait for each
    other): add its gradients and loss sums to the partial sums its source sends, then send them
    to its target, or keep them: the slot's gradient and losses, bitwise the failed pod's.
    ({slot: gradient leaves} of the slots this pod ends, [(slot, loss, z_loss, targets)] of them,
    a failed send on a pod of several hosts: the step must fail, but only after this host has
    met its pod's other hosts in every gather they go through, so the caller raises it there)."""
    assembled, shards, failure = {}, [], None
    for piece, sums, grads in launched:
        if sums is None:
            assert relay is not None
            total, losses = _receive(trainer, relay, piece)
            loss_sums = tuple(jax.device_put(np.float32(v), trainer.scalar_sharding) for v in losses)
            for m, (g, ce, z) in zip(range(piece.start, piece.stop), grads):
                total = trainer.summer.fold(total, g, m)
                loss_sums = trainer.summer.add_losses(loss_sums, ce, z)
            sums = (total, loss_sums)
        total, (ce, z) = sums
        leaves = jax.tree.leaves(total)
        if piece.target is not None:
            assert relay is not None
            losses = np.array([host_value(ce), host_value(z)], np.float32)
            if trainer.assembler is None:
                relay.send(piece.slot, piece.target, leaves, losses)
                continue
            try:    # this host's block of every leaf, read as it is sent
                relay.send(piece.slot, piece.target, partial_blocks(trainer.assembler, leaves), losses)
            except Exception as exc:   # noqa: BLE001 - returned, raised after the pod's gathers
                failure = failure or exc
            continue
        for leaf in leaves:
            start_host_copy(leaf)
        assembled[piece.slot] = leaves
        shards.append((piece.slot, float(host_value(ce)) + float(host_value(z)), float(host_value(z)),
                       trainer.target_count(piece.tokens)))
    return assembled, shards, failure


def partial_blocks(assembler, leaves: list) -> list[HostBlock]:
    """This host's block of every leaf of a partial sum (flat; hosts.Assembler.block), as host h
    sends it to host h of the next pod."""
    return [HostBlock(leaf, *assembler.block(index)) for index, leaf in enumerate(leaves)]


def _receive(trainer, relay: Relay, piece: Piece) -> tuple[dict, np.ndarray]:
    """The partial sum `piece`'s source sends, as a tree on this pod's devices laid out as the
    gradient, and its loss sums. On a pod of several hosts each host receives its block and the
    pod gathers them: every host takes part in the gather, received or not, so that none waits in
    it alone (gloo's collectives have no deadline); then every host fails alike if any did."""
    if trainer.assembler is None:
        leaves, losses = relay.receive(piece.slot, piece.source)
        return trainer.put_partial(leaves), losses
    failure, blocks, losses = None, None, np.zeros(2, PARTIAL_DTYPE)
    try:
        blocks, losses = relay.receive(piece.slot, piece.source)
    except Exception as exc:   # noqa: BLE001 - re-raised below, after the pod's hosts agree
        failure = exc
    gathered, every_host = trainer.assembler(blocks, [PARTIAL_DTYPE] * len(trainer.leaf_specs))
    if failure is not None:
        raise failure
    if not every_host:
        raise ExchangeError(f"slot {piece.slot}: another host of this pod did not receive its block of the partial "
                            f"sum from pod {piece.source}; the step is undone on every host")
    return jax.tree.unflatten(jax.tree.structure(trainer.params), gathered), losses
