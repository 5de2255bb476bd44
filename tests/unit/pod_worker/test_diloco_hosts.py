"""DiLoCo's outer exchange on pods of several hosts (pod_worker/diloco_hosts.py), the part that can
be checked in one process: host h of each of 2 pods exchanges block h of a fragment's
pseudo-gradient (HostFragments.blocks, on the blocks of hosts.Assembler) with host h of the other
pod over the real data plane, and the hosts' summed blocks, put end to end, are bitwise the sum
pods of one host exchange whole, in every outer dtype. With int8 and int4 that needs the blocks
aligned to the codec's scale blocks (Assembler's `align`). The gather over the hosts is a
collective of several processes (tests/e2e/test_diloco.py runs it on pods of two hosts); here a
stand-in for it checks what OuterSync does around it when a host's exchange fails: every host
still takes part, and the outer step is applied on none, its sync kept to be exchanged again."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools

import jax
import numpy as np
import pytest

from multipod.model.partitioning import make_mesh, replicated
from multipod.pod_worker.dcn import BLOCK, Exchange, ExchangeError, LeafSpec, Listener
from multipod.pod_worker.diloco import OuterSync
from multipod.pod_worker.diloco_hosts import HostFragments
from multipod.pod_worker.hosts import Assembler, HostLayout
from multipod.pod_worker.schema import SyncConfig
from multipod.pod_worker.trainer import PodTrainer, fingerprint
from tests.helpers import tiny_worker_config

SECRET = "diloco-hosts-test-secret-0123456789"
SYNC = 3            # the outer sync's number: the exchange's key
HOSTS = 2
# Leaves of several sizes: a few values, under one scale block, not a multiple of it, and over a
# chunk (1 KiB chunks: 256-2048 values by codec, so the larger leaves span several).
SHAPES = [(259, 32), (32,), (3,), (32, 64), (5000,)]
FRAGMENTS = [[1, 3], [0, 2, 4]]
FRAGMENT = 1
CHUNK = 1024


def _pseudo_gradients(pods: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(7)
    return [[(rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 2)).astype(np.float32) for shape in SHAPES]
            for _ in range(pods)]


def _exchange(specs: list[LeafSpec], full: list[list], compression: str) -> list[list]:
    """Each pod's outer exchange of the fragment's leaves in `full` (its leaf list, None outside
    the fragment) over loopback listeners: the summed leaves, by pod."""
    pods = len(full)
    listeners = [Listener(p, "127.0.0.1:0", SECRET) for p in range(pods)]
    addresses = [listener.address for listener in listeners]
    exchanges = [Exchange(f"hosts-{compression}", p, addresses, specs, listeners[p], chunk_bytes=CHUNK,
                          timeout_s=20.0, compression=compression, secret=SECRET) for p in range(pods)]
    try:
        for exchange in exchanges:
            exchange.inbox.set_next_step(SYNC)
        with concurrent.futures.ThreadPoolExecutor(pods) as pool:
            futures = [pool.submit(ex.all_reduce, SYNC, leaves, order=FRAGMENTS[FRAGMENT], subset=True)
                       for ex, leaves in zip(exchanges, full)]
            return [future.result(timeout=60)[0] for future in futures]
    finally:
        for exchange in exchanges:
            exchange.close()
        for listener in listeners:
            listener.close()


def _hosts(align: int) -> list[HostFragments]:
    """Host h of a pod of 2 hosts (of one device each), for h = 0, 1: its HostFragments."""
    mesh = make_mesh(HOSTS, 1, devices=jax.devices()[:HOSTS])
    shardings = [replicated(mesh)] * len(SHAPES)
    return [HostFragments(Assembler(mesh, SHAPES, shardings, HostLayout(h, HOSTS, "127.0.0.1:1"), align=align),
                          FRAGMENTS, [np.dtype(np.float32)] * len(SHAPES)) for h in range(HOSTS)]


def _fragment(grads: list[np.ndarray]) -> list:
    return [g if i in FRAGMENTS[FRAGMENT] else None for i, g in enumerate(grads)]


def _by_hosts(grads: list[list[np.ndarray]], hosts: list[HostFragments], compression: str) -> list[np.ndarray]:
    """The fragment's sum as pods of two hosts compute it: each host exchanges its blocks with the
    same host of the other pod; then pod 0's blocks, host by host, end to end (what the gather puts
    together), checked equal to pod 1's."""
    per_host = []
    for host in hosts:
        specs = [LeafSpec((b - a,), np.dtype(np.float32))
                 for a, b in (host.assembler.block(i) for i in range(len(SHAPES)))]
        summed = _exchange(specs, [host.blocks(_fragment(g)) for g in grads], compression)
        for i in FRAGMENTS[FRAGMENT]:
            assert summed[0][i].tobytes() == summed[1][i].tobytes(), "the pods' sums differ"
        per_host.append(summed[0])
    return [np.concatenate([blocks[i] for blocks in per_host]) for i in FRAGMENTS[FRAGMENT]]


@pytest.mark.parametrize("compression", ["none", "bf16", "int8", "int4"])
def test_the_hosts_summed_blocks_end_to_end_are_bitwise_the_sum_of_pods_of_one_host(compression):
    grads = _pseudo_gradients(2)
    whole = _exchange([LeafSpec(s, np.dtype(np.float32)) for s in SHAPES], [_fragment(g) for g in grads],
                      compression)
    align = BLOCK if compression in ("int8", "int4") else 1     # as PodTrainer builds its Assembler
    hosts = _hosts(align)
    for index, shape in enumerate(SHAPES):     # the blocks cover each leaf, host 1's on the codec's grid
        (a0, b0), (a1, b1) = (host.assembler.block(index) for host in hosts)
        size = int(np.prod(shape))
        assert (a0, b1) == (0, size) and b0 == a1 and (a1 % align == 0 or a1 == size)    # (or empty)
    got = _by_hosts(grads, hosts, compression)
    for value, i in zip(got, FRAGMENTS[FRAGMENT]):
        assert value.tobytes() == whole[0][i].reshape(-1).tobytes(), f"leaf {i}"


def test_int4_blocks_off_the_codec_s_grid_decode_differently():
    # Why the alignment: a host's block quantises in scale blocks that restart where it starts.
    grads = _pseudo_gradients(2)
    whole = _exchange([LeafSpec(s, np.dtype(np.float32)) for s in SHAPES], [_fragment(g) for g in grads], "int4")
    got = _by_hosts(grads, _hosts(1), "int4")
    assert any(value.tobytes() != whole[0][i].reshape(-1).tobytes() for value, i in zip(got, FRAGMENTS[FRAGMENT]))


class _Gather:
    """Stands in for HostFragments on one host: blocks are the whole leaves, and the gather (the
    hosts' collective) fails as if another host's exchange had, while `fail` is set."""

    def __init__(self, shardings: list):
        self.shardings, self.fail, self.calls = shardings, True, []

    def blocks(self, full: list) -> list:
        return full

    def gather(self, fragment: int, summed: list | None) -> list:
        self.calls.append(("gather", fragment, summed is not None))
        if self.fail or summed is None:
            raise ExchangeError("another host of this pod failed its part")
        return [jax.device_put(np.asarray(v), s) for v, s in zip(summed, self.shardings)]

    def take_part(self, fragment: int) -> None:
        self.calls.append(("take_part", fragment))


def test_a_sync_that_fails_on_any_host_is_applied_on_none_and_exchanged_again_on_a_new_link():
    base = tiny_worker_config()
    config = dataclasses.replace(base, sync=SyncConfig(mode="diloco", inner_steps=2, overlap_steps=1)).validate()
    trainer = PodTrainer(config, devices=jax.devices()[:1])
    outer = OuterSync(config.sync, trainer.params, trainer.param_sharding, trainer.scalar_sharding,
                      config.model.n_layers, 2)
    stand_in = outer.hosts = _Gather(jax.tree.leaves(trainer.param_sharding))
    agreed = fingerprint(*outer.agreed_state())

    def lost(sync, leaves, order, extra):
        raise ExchangeError("test: the link to the other pod is gone")

    def echo(sync, leaves, order, extra):     # as if the other pod's pseudo-gradient were zero
        return leaves, None, (0, 1)

    moved = jax.tree.map(lambda leaf: leaf + 0.5, trainer.params)    # as if inner steps had moved it
    params, _ = outer.after_step(2, moved, lost)     # sync 1 starts, applied after step 3
    with pytest.raises(ExchangeError, match="link to the other pod is gone"):
        outer.after_step(3, params, lost)
    # This host's exchange failed: it still took part in the gather (no other host waits alone).
    assert stand_in.calls == [("take_part", 0)]
    with pytest.raises(ExchangeError, match="another host"):    # a new link: ok here, failed on another host
        outer.after_step(3, params, echo)
    assert stand_in.calls[-1] == ("gather", 0, True)
    assert outer.pending is not None and outer.version == 0 and fingerprint(*outer.agreed_state()) == agreed
    stand_in.fail = False
    params, report = outer.after_step(3, params, lambda *args: echo(*args))     # a new link: every host ends well
    assert report is not None and (report.sync, report.fragment) == (1, 0) and outer.pending is None
    assert outer.version == 1 and fingerprint(*outer.agreed_state()) != agreed


def _whole_zeros(leaves: list, fragments: list[list[int]], fragment: int) -> list[np.ndarray]:
    """The stand-in's zeros: whole leaves (its blocks are whole leaves)."""
    return [np.zeros(leaves[i].shape, leaves[i].dtype) for i in fragments[fragment]]


def test_the_warm_up_gathers_every_fragment_in_order_and_zeros_are_shaped_as_the_exchange_s_blocks():
    """At configure (OuterSync.warm_up) each host of a pod gathers every fragment once, in fragment
    order, as its hosts' collective needs, on zeros shaped as the exchange's sums of its blocks;
    with one pod there is nothing to gather (its sum is its own pseudo-gradient)."""
    base = tiny_worker_config()
    config = dataclasses.replace(base, sync=SyncConfig(mode="diloco", inner_steps=4, fragments=2)).validate()
    trainer = PodTrainer(config, devices=jax.devices()[:1])
    for pods, want in ((2, [("gather", 0, True), ("gather", 1, True)]), (1, [])):
        outer = OuterSync(config.sync, trainer.params, trainer.param_sharding, trainer.scalar_sharding,
                          config.model.n_layers, pods)
        # Replicated: valid whatever a fragment's leaves' ranks (the stand-in zips them in order).
        stand_in = outer.hosts = _Gather([trainer.scalar_sharding] * len(jax.tree.leaves(trainer.params)))
        stand_in.fail = False
        stand_in.zeros = functools.partial(_whole_zeros, jax.tree.leaves(trainer.params), outer.fragments)
        agreed = fingerprint(*outer.agreed_state())
        outer.warm_up(trainer.params, lambda *state: None)
        assert stand_in.calls == want
        assert fingerprint(*outer.agreed_state()) == agreed and outer.version == 0
    for host in _hosts(BLOCK):
        full = host.blocks(_fragment(_pseudo_gradients(1)[0]))
        assert [z.shape for z in host.zeros(FRAGMENT)] == [full[i].shape for i in FRAGMENTS[FRAGMENT]]
        assert all(z.dtype == np.float32 and not z.any() for z in host.zeros(FRAGMENT))
