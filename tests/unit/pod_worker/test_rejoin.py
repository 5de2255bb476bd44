"""Membership changes and rejoining (issue 10), on two in-process Pods over loopback listeners:

  - Pod.set_membership cuts a step stuck waiting for a silent peer short, leaves the state as it
    was before that step, and the same step then runs alone with the peer's shard as an extra;
    hosts that do not fit are refused with the right error, changing nothing.
  - Pod.send_state / Pod.receive_state: a freshly configured pod takes a live peer's state (same
    step and fingerprint) and steps on with it. A transfer cut off mid-stream, stalled past its
    deadline, or whose arrays do not hash to the donor's fingerprint raises and leaves the
    receiving pod exactly as it was (state, step, checksum, sequencer): never half-updated, and a
    later transfer still works.
  - Pod.reattach keeps the state with the same configuration, refuses (NotReady) any other.
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
import time

import jax
import numpy as np
import pytest
import zmq

from multipod import protos
from multipod.pod_worker.dcn import (
    PHASE_STATE,
    PHASE_STATE_MANIFEST,
    ExchangeError,
    Listener,
    StateReceiver,
    TransferError,
    send_state,
    transfer as transfer_module,
)
from multipod.pod_worker.dcn.connection import Connection
from multipod.pod_worker.dcn.transport import HEADER, LinkError
from multipod.pod_worker.errors import CorruptTransfer, InvalidRequest, NotReady, StepAborted
from multipod.pod_worker.pod import Pod
from multipod.pod_worker.trainer import fingerprint
from multipod.protos import multipod_pb2 as pb
from tests.helpers import tiny_worker_config

SECRET = "rejoin-test-secret-0123456789abcdef"
# The default exchange deadline (60 s) is long on purpose: a step stuck on a silent peer must end
# because of set_membership, not because its deadline passed.
CONFIG = tiny_worker_config()
assert CONFIG.dcn.timeout_s >= 60
NUM_PODS = 2
ROWS, COLS = CONFIG.train.global_batch // NUM_PODS, CONFIG.train.seq_len + 1
GLOBAL_TOKENS = NUM_PODS * ROWS * (COLS - 1)
DEADLINE_S = 10.0
_ids = itertools.count()


# The Pods of this module run side by side in threads: on one device (conftest.py says why).
pytestmark = pytest.mark.usefixtures("pods_on_device_0")


def _id(prefix: str) -> str:
    return f"{prefix}-{next(_ids)}"


def _deadline(seconds: float = DEADLINE_S) -> float:
    return time.monotonic() + seconds


def tokens(step: int, slot: int) -> np.ndarray:
    return np.random.default_rng([step, slot]).integers(0, 256, (ROWS, COLS), dtype=np.int32)


class Call(threading.Thread):
    """fn(*args) in a thread, started at once; result() re-raises its exception."""

    def __init__(self, fn, *args, **kwargs):
        super().__init__(daemon=True)
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.value, self.error = None, None
        self.start()

    def run(self):
        try:
            self.value = self.fn(*self.args, **self.kwargs)
        except BaseException as exc:    # re-raised by result()
            self.error = exc

    def result(self, timeout: float = 60.0):
        self.join(timeout)
        assert not self.is_alive(), f"{self.fn.__name__} did not return within {timeout} s"
        if self.error is not None:
            raise self.error
        return self.value


class Pair:
    """Pods 0 and 1 of a two-pod run, each with its own listener (same secret)."""

    def __init__(self):
        self.listeners = [Listener(i, "127.0.0.1:0", SECRET) for i in range(NUM_PODS)]
        self.addresses = [lst.address for lst in self.listeners]
        self.pods = [Pod(i, lst) for i, lst in enumerate(self.listeners)]
        for pod in self.pods:
            pod.configure(CONFIG, NUM_PODS, self.addresses, _id("configure"))

    def train_alone(self, steps: int) -> None:
        """Pod 0 trains `steps` steps on its own (pod 1 gone: pod 0 computes slot 1 too)."""
        pod = self.pods[0]
        pod.set_membership(_id("alone"), [0, 0], _deadline())
        for _ in range(steps):
            step = pod.trainer.step
            pod.step(pod.setup(), step, tokens(step, 0), GLOBAL_TOKENS, _deadline(), lambda: True,
                     extra={1: tokens(step, 1)})

    def transfer(self):
        """Pod 0's state to pod 1 (both sides at once, as the controller asks them)."""
        donor, receiver = self.pods
        transfer_id = _id("transfer")
        receiving = Call(receiver.receive_state, transfer_id, 0, _deadline())
        sent = donor.send_state(transfer_id, 1, self.addresses[1], _deadline())
        return sent, receiving.result()

    def step_together(self) -> list:
        """Both pods back in a healthy membership, one step together; their outcomes."""
        run_id = _id("healthy")
        for pod in self.pods:
            pod.set_membership(run_id, None, _deadline())
        step = self.pods[0].trainer.step
        assert self.pods[1].trainer.step == step
        calls = [Call(pod.step, pod.setup(), step, tokens(step, pod.pod_index), GLOBAL_TOKENS, _deadline(),
                      lambda: True, take_fingerprint=True) for pod in self.pods]
        return [call.result()[0] for call in calls]

    def close(self):
        for pod in self.pods:
            pod.close()


@pytest.fixture(scope="module")
def pair():
    made = Pair()
    yield made
    made.close()


def snapshot(pod: Pod) -> dict:
    """Everything that must not change when a request fails (read while the pod is idle)."""
    trainer = pod.trainer
    return {"status": pod.status(), "fingerprint": trainer.fingerprint(), "checksum": trainer.checksum(),
            "step": trainer.step, "next_step": pod.seq.next_step, "epoch": pod.seq.epoch, "state": pod.seq.state,
            "setup": pod.setup(), "exchange": pod.exchange, "serving": pod.listener._sink is pod.exchange.inbox}


def state_leaves(pod: Pod) -> tuple[list[np.ndarray], int, str]:
    """A host copy of the pod's state as it travels: (flat leaves in order, step, fingerprint)."""
    state = pod.trainer.host_state()
    leaves = [np.array(leaf).reshape(-1) for leaf in jax.tree.leaves((state["params"], state["opt_state"]))]
    return leaves, state["step"], fingerprint(state["params"], state["opt_state"])


# -- set_membership ----------------------------------------------------------------------------------
def test_set_membership_cuts_a_step_stuck_on_a_silent_peer_short(pair, monkeypatch):
    pod = pair.pods[0]
    pod.set_membership(_id("healthy"), None, _deadline())     # pod 1 is never asked to step
    before = snapshot(pod)
    step, setup = pod.trainer.step, pod.setup()
    exchange, waiting = pod.exchange, threading.Event()
    all_reduce = exchange.all_reduce

    def entered(*args, **kwargs):
        waiting.set()
        return all_reduce(*args, **kwargs)
    monkeypatch.setattr(exchange, "all_reduce", entered)
    stuck = Call(pod.step, setup, step, tokens(step, 0), GLOBAL_TOKENS, _deadline(), lambda: True)
    assert waiting.wait(30)
    time.sleep(0.2)         # let it settle into waiting for pod 1's gradient
    assert stuck.is_alive() and pod.status().state == pb.WORKER_STATE_STEPPING

    membership = Call(pod.set_membership, _id("alone"), [0, 0], _deadline()).result(timeout=15)
    with pytest.raises(ExchangeError, match="the controller changed the pods taking part"):
        stuck.result(timeout=15)        # long before the 60 s exchange deadline
    assert membership.aborted_step
    assert (membership.step, membership.checksum, membership.fingerprint) == (
        step, before["checksum"], before["fingerprint"])
    assert membership.config_hash == CONFIG.config_hash()
    assert pod.trainer.fingerprint() == before["fingerprint"] and pod.trainer.step == step
    status = pod.status()
    assert status.state == pb.WORKER_STATE_READY and status.step == step
    assert status.checksum == before["status"].checksum
    assert pod.setup().hosts == (0, 0) and pod.setup().extra_slots(0) == [1]

    # The step of the abandoned membership is refused; the same step with slot 1's shard runs alone.
    with pytest.raises(StepAborted):
        pod.step(setup, step, tokens(step, 0), GLOBAL_TOKENS, _deadline(), lambda: True)
    outcome, _ = pod.step(pod.setup(), step, tokens(step, 0), GLOBAL_TOKENS, _deadline(), lambda: True,
                          extra={1: tokens(step, 1)})
    assert [shard[0] for shard in outcome.shards] == [None, 1]
    assert outcome.tokens == GLOBAL_TOKENS and not outcome.skipped
    assert pod.trainer.step == step + 1 and pod.status().step == step + 1
    assert outcome.checksum != before["checksum"] and pod.status().checksum == outcome.checksum


@pytest.mark.parametrize("pod_index,hosts,error,match", [
    (0, [0], InvalidRequest, "for each of the 2 slots"),                  # wrong length
    (0, [0, 0, 0], InvalidRequest, "for each of the 2 slots"),
    (0, [0, 2], InvalidRequest, r"in \[0, 2\)"),
    (0, [-1, 1], InvalidRequest, r"in \[0, 2\)"),
    (0, [1, 0], InvalidRequest, "a live pod must compute its own shard"),
    (1, [1, 0], InvalidRequest, "a live pod must compute its own shard"),
    (0, [1, 1], NotReady, "pod 0 is not among the hosts"),                # this pod must rejoin first
    (1, [0, 0], NotReady, "pod 1 is not among the hosts"),
])
def test_hosts_that_do_not_fit_are_refused_and_change_nothing(pair, pod_index, hosts, error, match):
    pod = pair.pods[pod_index]
    before = snapshot(pod)
    with pytest.raises(error, match=match):
        pod.set_membership(_id("bad"), hosts, _deadline())
    assert snapshot(pod) == before      # same setup, same exchange, still serving it


def test_identity_hosts_mean_every_pod_computes_its_own_shard(pair):
    pod = pair.pods[0]
    run_id = _id("identity")
    membership = pod.set_membership(run_id, [0, 1], _deadline())
    assert not membership.aborted_step         # no step was running
    assert pod.setup().hosts is None and pod.setup().extra_slots(0) == []
    assert pod.status().run_id == run_id and pod.exchange.run_id == run_id
    assert not pod.exchange.plan.degraded


# -- state transfer ----------------------------------------------------------------------------------
@pytest.mark.parametrize("awaits_state", [False, True])
def test_a_freshly_configured_pod_takes_a_live_peers_state_and_steps_on(pair, awaits_state):
    # awaits_state: configured without an initial state (ConfigureRequest.awaits_state), the peer's
    # state is its first.
    donor, receiver = pair.pods
    receiver.configure(CONFIG, NUM_PODS, pair.addresses, _id("restarted"), awaits_state=awaits_state)
    pair.train_alone(2)
    assert receiver.trainer.step == 0 and donor.trainer.step >= 2
    if awaits_state:
        assert not receiver.trainer.has_state
        with pytest.raises(NotReady, match="first Restore"):
            receiver.trainer.fingerprint()
    else:
        assert receiver.trainer.fingerprint() != donor.trainer.fingerprint()
    epoch = receiver.seq.epoch

    sent, got = pair.transfer()
    total = sum(leaf.nbytes for leaf in state_leaves(donor)[0])
    assert got.step == sent.step == donor.trainer.step == receiver.trainer.step
    assert got.fingerprint == sent.fingerprint == donor.trainer.fingerprint()
    assert receiver.trainer.fingerprint() == donor.trainer.fingerprint()
    assert receiver.status().checksum == donor.status().checksum == donor.trainer.checksum()
    assert receiver.status().step == donor.trainer.step
    assert got.bytes == sent.bytes == total
    assert receiver.seq.epoch == epoch + 1 and receiver.seq.next_step == donor.trainer.step
    assert receiver.status().state == pb.WORKER_STATE_READY

    # It takes its shard back at the next step boundary: both pods step on, bitwise together.
    outcomes = pair.step_together()
    assert outcomes[0].fingerprint == outcomes[1].fingerprint
    assert outcomes[0].checksum == outcomes[1].checksum
    assert donor.trainer.fingerprint() == receiver.trainer.fingerprint() == outcomes[0].fingerprint


@pytest.mark.parametrize("call,pod_index,other", [
    ("send_state", 0, 0), ("send_state", 0, 2), ("receive_state", 1, 1), ("receive_state", 1, -1)])
def test_a_transfer_with_itself_or_a_pod_outside_the_run_is_refused(pair, call, pod_index, other):
    pod = pair.pods[pod_index]
    before = snapshot(pod)
    args = (_id("transfer"), other, pair.addresses[1], _deadline()) if call == "send_state" else (
        _id("transfer"), other, _deadline())
    with pytest.raises(InvalidRequest, match=f"pod {other} is not another pod of the run"):
        getattr(pod, call)(*args)
    assert snapshot(pod) == before


class Receivers(StateReceiver):
    """StateReceiver, keeping every instance the pod makes."""

    made: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        Receivers.made.append(self)


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


class CutConnection(Connection):
    """The donor's connection, dying once the receiver holds `limit` state chunks (counted over
    the donor's streams): the transfer is cut off mid-stream, never before or after it."""

    limit = 0
    sent = 0

    def send(self, header, payload, deadline):
        if HEADER.unpack(header)[3] == PHASE_STATE:
            if CutConnection.sent >= CutConnection.limit:
                receiver = Receivers.made[-1]
                _wait_for(lambda: sum(map(len, receiver._seen)) == CutConnection.limit)
                raise LinkError("the donor died mid-stream (test)")
            CutConnection.sent += 1
        super().send(header, payload, deadline)


def stalled_donor(pair, transfer_id: str, chunks: int) -> Connection:
    """A donor that sends pod 0's manifest and only its first `chunks` state chunks, then stays
    silent with the connection open (the caller closes it)."""
    leaves, step, fp = state_leaves(pair.pods[0])
    conn = Connection(zmq.Context.instance(), pair.addresses[1], 0, 1, transfer_id, SECRET)
    deadline = _deadline()
    conn.handshake(deadline)
    manifest = HEADER.pack(protos.PROTOCOL_VERSION, 0, step, PHASE_STATE_MANIFEST, len(leaves),
                           sum(leaf.nbytes for leaf in leaves))
    assert not transfer_module._send_manifest(conn, manifest, fp.encode(), deadline)
    # Every leaf of the tiny model is one chunk (dcn.chunk_bytes >= 1 MiB).
    assert all(leaf.nbytes <= CONFIG.dcn.chunk_bytes for leaf in leaves) and chunks < len(leaves)
    for i in range(chunks):
        header = HEADER.pack(protos.PROTOCOL_VERSION, 0, step, PHASE_STATE, i, 0)
        conn.send(header, leaves[i].view(np.uint8), deadline)
    return conn


@pytest.mark.parametrize("how", ["cut", "stalled", "no donor"])
def test_a_failed_transfer_leaves_the_pod_as_it_was(pair, monkeypatch, how):
    donor, receiver = pair.pods
    pair.train_alone(1)                 # the donor's state differs from the receiver's
    before = snapshot(receiver)
    assert before["fingerprint"] != donor.trainer.fingerprint()
    donor_before = snapshot(donor)
    loaded = []
    load_state = receiver.trainer.load_state
    monkeypatch.setattr(receiver.trainer, "load_state", lambda *a: loaded.append(a) or load_state(*a))
    transfer_id = _id("transfer")
    sizes = [leaf.nbytes for leaf in state_leaves(donor)[0]]
    total = sum(sizes)

    if how == "cut":        # the real donor, whose connections break after 20 of 56 chunks
        monkeypatch.setattr(CutConnection, "limit", 20)
        monkeypatch.setattr(CutConnection, "sent", 0)
        monkeypatch.setattr(transfer_module, "Connection", CutConnection)
        monkeypatch.setattr(transfer_module, "StateReceiver", Receivers)
        monkeypatch.setattr(Receivers, "made", [])
        receiving = Call(receiver.receive_state, transfer_id, 0, _deadline())
        with pytest.raises(TransferError, match="died mid-stream"):
            donor.send_state(transfer_id, 1, pair.addresses[1], _deadline())
        with pytest.raises(TransferError, match=f"connection closed after {sum(sizes[:20])} of {total} bytes "
                                                f"arrived"):
            receiving.result(timeout=15)        # from the broken connection, before its deadline
        monkeypatch.setattr(transfer_module, "Connection", Connection)
        monkeypatch.setattr(transfer_module, "StateReceiver", StateReceiver)
    elif how == "stalled":  # the manifest and 5 chunks arrive, then nothing until the deadline
        receiving = Call(receiver.receive_state, transfer_id, 0, _deadline(3.0))
        conn = stalled_donor(pair, transfer_id, 5)
        try:
            with pytest.raises(TransferError, match=rf"{sum(sizes[:5])} of {total} bytes arrived within the "
                                                    rf"deadline \(manifest received\)"):
                receiving.result(timeout=15)
        finally:
            conn.close()
    else:                   # nobody sends
        with pytest.raises(TransferError, match=rf"0 of {total} bytes arrived within the deadline \(no manifest\)"):
            receiver.receive_state(transfer_id, 0, _deadline(0.5))

    assert not loaded                   # nothing was ever loaded ...
    assert snapshot(receiver) == before     # ... and everything is as it was, serving its exchange again
    assert snapshot(donor) == donor_before
    # Retried, the transfer works, and the pod steps on with its peer.
    sent, got = pair.transfer()
    assert got.fingerprint == sent.fingerprint == receiver.trainer.fingerprint()
    outcomes = pair.step_together()
    assert outcomes[0].fingerprint == outcomes[1].fingerprint


@pytest.mark.parametrize("corruption", ["another fingerprint", "a flipped bit"])
def test_a_state_that_does_not_hash_to_the_donors_fingerprint_is_not_taken(pair, monkeypatch, corruption):
    donor, receiver = pair.pods
    pair.train_alone(1)
    before = snapshot(receiver)
    loaded = []
    load_state = receiver.trainer.load_state
    monkeypatch.setattr(receiver.trainer, "load_state", lambda *a: loaded.append(a) or load_state(*a))
    leaves, step, fp = state_leaves(donor)
    if corruption == "another fingerprint":
        fp = "0" * len(fp)
    else:
        leaves[3].view(np.uint8)[5] ^= 0x10
    transfer_id = _id("transfer")
    receiving = Call(receiver.receive_state, transfer_id, 0, _deadline())
    # The whole state arrives (the donor hears "complete"); only the hash check refuses it.
    stats = send_state(0, transfer_id, 1, pair.addresses[1], leaves, step, fp, SECRET, _deadline(),
                       chunk_bytes=CONFIG.dcn.chunk_bytes, streams=2)
    assert stats.bytes == sum(leaf.nbytes for leaf in leaves)
    with pytest.raises(CorruptTransfer, match="not taken"):
        receiving.result()
    assert not loaded
    assert snapshot(receiver) == before


# -- reattach ----------------------------------------------------------------------------------------
def test_reattach_with_the_same_config_keeps_the_state(pair):
    donor, receiver = pair.pods
    pair.train_alone(1)
    pair.transfer()                     # both pods in one state, past step 0
    run_id = _id("new-controller")
    befores = [snapshot(pod) for pod in pair.pods]
    for pod, before in zip(pair.pods, befores):
        trainer, fp = pod.reattach(CONFIG, NUM_PODS, pair.addresses, run_id, _deadline())
        assert trainer is before["setup"].trainer and trainer is pod.trainer
        assert fp == before["fingerprint"] == pod.trainer.fingerprint()
        assert pod.trainer.step == before["step"] > 0
        status = pod.status()
        assert (status.step, status.checksum, status.run_id) == (before["step"], before["checksum"], run_id)
        assert status.state == pb.WORKER_STATE_READY
        assert pod.setup().hosts is None and pod.exchange is not before["exchange"]
    assert befores[0]["fingerprint"] == befores[1]["fingerprint"]
    # Every pod takes part again, under the new run id: they step on together.
    step = donor.trainer.step
    calls = [Call(pod.step, pod.setup(), step, tokens(step, pod.pod_index), GLOBAL_TOKENS, _deadline(),
                  lambda: True, take_fingerprint=True) for pod in pair.pods]
    outcomes = [call.result()[0] for call in calls]
    assert outcomes[0].fingerprint == outcomes[1].fingerprint
    assert receiver.trainer.step == step + 1


def _other_config():
    return dataclasses.replace(CONFIG, optimizer=dataclasses.replace(CONFIG.optimizer, learning_rate=1e-3)).validate()


@pytest.mark.parametrize("what", ["another config", "another pod count", "other peers"])
def test_reattach_to_another_configuration_is_refused(pair, what):
    pod = pair.pods[0]
    config, num_pods, peers = CONFIG, NUM_PODS, list(pair.addresses)
    if what == "another config":
        config = _other_config()
        assert config.config_hash() != CONFIG.config_hash()
    elif what == "another pod count":
        num_pods, peers = 3, peers + [peers[1]]
    else:
        peers = peers[::-1]
    before = snapshot(pod)
    with pytest.raises(NotReady, match="runs another configuration"):
        pod.reattach(config, num_pods, peers, _id("new-controller"), _deadline())
    assert snapshot(pod) == before
