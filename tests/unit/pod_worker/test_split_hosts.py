"""A failed slot's split microbatches on pods of several hosts (pod_worker/split.py), the part that
can be checked in one process: host h of a pod relays its block of a partial sum
(split.partial_blocks, the blocks of hosts.Assembler) to host h of the next pod over the real data
plane, and the blocks the hosts receive, put end to end, are bitwise the partial sum. The gather
over the hosts is a collective of several processes (tests/e2e/test_split_failover.py runs it on
pods of two hosts); here a stand-in for it checks what the relay does around it when a host's
part fails: every host still takes part in every gather, and the step fails on all of them."""
from __future__ import annotations

import concurrent.futures
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from multipod.model.partitioning import make_mesh, replicated
from multipod.pod_worker import split
from multipod.pod_worker.dcn import BLOCK, Exchange, ExchangeError, LeafSpec, Listener
from multipod.pod_worker.hosts import Assembler, HostLayout
from multipod.pod_worker.split import Piece, Relay
from multipod.pod_worker.trainer import PodTrainer

SECRET = "split-hosts-test-secret-0123456789"
HOSTS = 2
MEMBERSHIP = [0, 0, 2]      # pod 1 failed; pod 2 passes slot 1's partial sum on to pod 0
SHAPES = [(259, 32), (32,), (3,), (1,), (5000,)]     # sizes under, over and not a multiple of a block


def _assemblers(align: int) -> list[Assembler]:
    """Host h's Assembler in a pod of 2 hosts (of one device each), for h = 0, 1."""
    mesh = make_mesh(HOSTS, 1, devices=jax.devices()[:HOSTS])
    return [Assembler(mesh, SHAPES, [replicated(mesh)] * len(SHAPES), HostLayout(h, HOSTS, "127.0.0.1:1"),
                      align=align) for h in range(HOSTS)]


def _relay(assembler: Assembler, partial: list, losses: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """Host h's part: pod 2's host h sends its blocks of `partial`, pod 0's host h receives them,
    over exchanges planned in this host's blocks (PodTrainer.exchange_specs)."""
    specs = [LeafSpec((b - a,), np.dtype(np.float32)) for a, b in (assembler.block(i) for i in range(len(SHAPES)))]
    listeners = {p: Listener(p, "127.0.0.1:0", SECRET) for p in (0, 2)}
    addresses = [listeners[0].address, "127.0.0.1:1", listeners[2].address]
    exchanges = {p: Exchange("split-hosts", p, addresses, specs, listeners[p], chunk_bytes=1024, timeout_s=20.0,
                             compression="int8", secret=SECRET, hosts=MEMBERSHIP) for p in (0, 2)}
    try:
        for exchange in exchanges.values():
            exchange.inbox.set_next_step(0)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            received = pool.submit(exchanges[0].receive_partial, 0, 1, 2)
            exchanges[2].send_partial(0, 1, 0, split.partial_blocks(assembler, partial), losses)
            return received.result(timeout=60)
    finally:
        for exchange in exchanges.values():
            exchange.close()
        for listener in listeners.values():
            listener.close()


@pytest.mark.parametrize("align", [1, BLOCK])
def test_each_host_relays_its_block_and_the_blocks_end_to_end_are_the_partial_sum(align):
    rng = np.random.default_rng(5)
    partial = [jax.device_put((rng.standard_normal(s) * 10.0 ** rng.integers(-3, 3)).astype(np.float32))
               for s in SHAPES]      # device arrays, read by each host's block as it is sent
    partial[0] = partial[0].at[0, 0].set(-0.0)
    losses = np.array([7.25, -0.0], np.float32)
    per_host = [_relay(assembler, partial, losses) for assembler in _assemblers(align)]
    for i, leaf in enumerate(partial):
        got = np.concatenate([blocks[i] for blocks, _ in per_host])
        assert got.tobytes() == np.asarray(leaf).reshape(-1).tobytes(), f"leaf {i}"
    assert all(got_losses.tobytes() == losses.tobytes() for _, got_losses in per_host)


class _Gather:
    """Stands in for a host's Assembler: block i is the whole leaf i, and the gather (the hosts'
    collective) reports that another host failed while `other_failed` is set."""

    def __init__(self, other_failed: bool = False):
        self.other_failed, self.calls = other_failed, []

    def block(self, index: int) -> tuple[int, int]:
        return 0, int(np.prod(SHAPES[index]))

    def __call__(self, blocks, dtypes):
        self.calls.append(blocks is not None)
        if blocks is None or self.other_failed:
            return None, False
        return [jax.device_put(b.reshape(s)) for b, s in zip(blocks, SHAPES)], True


def _trainer(gather: _Gather) -> SimpleNamespace:
    zeros = {str(i): np.zeros(s, np.float32) for i, s in enumerate(SHAPES)}
    return SimpleNamespace(
        assembler=gather, leaf_specs=[LeafSpec(s, np.dtype(np.float32)) for s in SHAPES], params=zeros,
        scalar_sharding=replicated(make_mesh(1, 1, devices=jax.devices()[:1])), target_count=lambda tokens: 6,
        summer=SimpleNamespace(fold=lambda total, g, m: jax.tree.map(lambda a, b: a + b, total, g),
                               add_losses=lambda sums, ce, z: (sums[0] + ce, sums[1] + z)))


def _received(trainer) -> tuple:
    """A piece that continues pod 2's partial sum of slot 1 and ends the slot (pod 0's)."""
    g = jax.tree.map(lambda a: a + 1.0, trainer.params)
    return Piece(1, np.zeros((2, 4)), 1, 2, source=2), None, [(g, np.float32(1.0), np.float32(0.5))]


def _sent(trainer) -> tuple:
    """A piece that starts slot 1's chain and passes it to pod 0 (pod 2's)."""
    return Piece(1, np.zeros((2, 4)), 0, 1, target=0), (trainer.params, (np.float32(2.0), np.float32(0.25))), []


def _relay_of(receive=None, send=None) -> Relay:
    def lost(*args):
        raise ExchangeError("test: the link to pod 2 is gone")
    return Relay(send=send or lost, receive=receive or lost)


def test_a_host_that_received_its_block_ends_the_slot_from_the_gathered_sum():
    trainer = _trainer(_Gather())
    blocks = [np.full(int(np.prod(s)), 2.0, np.float32) for s in SHAPES]
    relay = _relay_of(receive=lambda slot, pod: (blocks, np.array([3.0, 1.0], np.float32)))
    assembled, shards, failure = split.relay_pieces(trainer, [_received(trainer)], relay)
    assert failure is None and trainer.assembler.calls == [True]
    assert all(np.all(np.asarray(leaf) == 3.0) for leaf in assembled[1])
    assert shards == [(1, 4.0 + 1.5, 1.5, 6)]


@pytest.mark.parametrize("mine_failed", [True, False])
def test_a_partial_sum_missing_on_any_host_fails_every_host_after_the_gather(mine_failed):
    # Every host takes part in the gather, received or not (gloo's collectives have no deadline).
    trainer = _trainer(_Gather(other_failed=not mine_failed))
    blocks = [np.zeros(int(np.prod(s)), np.float32) for s in SHAPES]
    relay = _relay_of(receive=None if mine_failed else lambda slot, pod: (blocks, np.zeros(2, np.float32)))
    with pytest.raises(ExchangeError, match="link to pod 2 is gone" if mine_failed else "another host"):
        split.relay_pieces(trainer, [_received(trainer)], relay)
    assert trainer.assembler.calls == [not mine_failed]


def test_a_failed_send_is_returned_so_the_host_still_meets_its_pod_s_gathers():
    trainer = _trainer(_Gather())
    blocks = [np.zeros(int(np.prod(s)), np.float32) for s in SHAPES]
    relay = _relay_of(receive=lambda slot, pod: (blocks, np.zeros(2, np.float32)))
    # A send that fails, then a slot this host ends: its gather still happens.
    sent = _sent(trainer)
    later = (Piece(3, np.zeros((2, 4)), 1, 2, source=2), *_received(trainer)[1:])
    assembled, _, failure = split.relay_pieces(trainer, [sent, later], relay)
    assert isinstance(failure, ExchangeError) and trainer.assembler.calls == [True] and list(assembled) == [3]
    # The step's exchange then skips the all-reduce, gathers nothing from this host, and fails.
    gathered = []
    fake = SimpleNamespace(assembler=lambda summed, dtypes: (gathered.append(summed), (None, False))[1],
                           _blocks=lambda leaves: leaves, leaf_specs=trainer.leaf_specs)

    def all_reduce(*args, **kwargs):
        raise AssertionError("a host that failed its part does not exchange")
    with pytest.raises(ExchangeError, match="link to pod 2 is gone"):
        PodTrainer._exchange(fake, all_reduce, [], {}, failed=failure)
    assert gathered == [None]
