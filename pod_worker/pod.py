"""One pod's domain logic, without the transport: configure (-> trainer + DCN exchange), step,
evaluate, generate, status. Mixins of Pod hold the rest: who the pod exchanges with after
configure (reattach, set_membership) and the state transfer to a rejoining pod (send_state,
receive_state) in membership.py; saving and restoring checkpoints in checkpoint_pod.py.

Refusals are the typed errors of pod_worker/errors.py (the gRPC adapter in server.py maps them
to status codes); when a step may run is the Sequencer's decision (pod_worker/sequencer.py).
Guarantees kept here: a failed step or restore leaves the state as it was; a restore starts a new
timeline (steps queued before it are refused), with a fresh DCN exchange if given a new run id.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator

import numpy as np

from multipod.model import Chunk, Sampling
from multipod.pod_worker import faults, link_probe
from multipod.pod_worker.checkpoint_pod import CheckpointPod
from multipod.pod_worker.checkpoint_writer import Writer
from multipod.pod_worker.dcn import Exchange, Listener
from multipod.pod_worker.diloco_pod import DilocoPod
from multipod.pod_worker.errors import (
    Busy,
    InvalidRequest,
    NotReady,
    StepAborted,
)
from multipod.pod_worker.hosts import HostLayout, meet
from multipod.pod_worker.link_probe import LinkProbePod
from multipod.pod_worker.membership import PodMembership
from multipod.pod_worker.outcome import StepOutcome
from multipod.pod_worker.prompt_trainer import PromptTrainer
from multipod.pod_worker.schema import WorkerConfig
from multipod.pod_worker.sequencer import Sequencer
from multipod.pod_worker.split import Piece, Relay, my_run
from multipod.pod_worker.trainer import PodTrainer
from multipod.protos import multipod_pb2 as pb

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Setup:
    """What Configure built. Replaced as a whole, never changed in place, so one request sees one
    consistent setup; `epoch` is the sequencer's timeline it belongs to."""
    trainer: PodTrainer
    config: WorkerConfig
    num_pods: int
    epoch: int
    # hosts[slot]: the pod computing slot's shard (SetMembership); None while every pod is live.
    hosts: tuple[int, ...] | None = None
    run_id: str = ""

    def extra_slots(self, pod_index: int) -> list[int]:
        """The failed pods' slots this pod computes besides its own (degraded mode)."""
        if self.hosts is None:
            return []
        return [slot for slot, host in enumerate(self.hosts) if host == pod_index and slot != pod_index]


@dataclasses.dataclass(frozen=True)
class PodStatus:
    configured: bool
    step: int
    state: int      # pb.WorkerState
    config_hash: str = ""
    checksum: str = ""   # on-device checksum of the state ("" if not configured or busy)
    run_id: str = ""


class Pod(PodMembership, CheckpointPod, DilocoPod, LinkProbePod):
    """All state of one pod worker: the trainer, the DCN exchange, the checkpoint writer and the
    step sequencer. Thread-safe: the gRPC adapter calls it from many handler threads. The
    sequencer is the lock: the setup, the exchange and the checksum change only while it has
    given the pod to one caller (a step between begin_step and finish_step, or a hold).
    Membership, takeover (reattach) and the state transfer to a rejoining pod are in
    membership.py (`PodMembership`), which works on this state."""

    def __init__(self, pod_index: int | None, listener: Listener | None = None, layout: HostLayout | None = None):
        self.pod_index = pod_index      # None: a spare, until its first configure gives it a slot
        self.layout = layout or HostLayout()     # this worker's host in a pod of several hosts
        self.listener = listener    # the worker's data-plane socket (needed with more than one pod)
        self.seq = Sequencer(f"pod {pod_index}")
        # Swapped only inside a sequencer hold (no step runs then); it attaches its inbox to the listener.
        self.exchange: Exchange | None = None
        self._setup: Setup | None = None
        self._peers: list[str] = []
        self._writer = Writer()
        # (step, on-device checksum) of the state as of its last change, for Status: never recomputed there.
        self._checksum: tuple[int, str] = (0, "")
        # A spare's trainer compiled on standby: (config hash, pod count, trainer), taken by the
        # configure that gives it a slot.
        self._standby: tuple[str, int, PodTrainer] | None = None
        # A prepared link probe (ProbeLink with prepare): its request and exchange, until it runs.
        self._probe: tuple[link_probe.LinkProbe, Exchange] | None = None

    @property
    def trainer(self) -> PodTrainer | None:
        setup = self._setup
        return setup.trainer if setup else None

    def setup(self) -> Setup:
        """The current setup; NotReady if the pod is not configured."""
        setup = self._setup
        if setup is None:
            raise NotReady(f"pod {self.pod_index} is not configured")
        return setup

    # -- configure -----------------------------------------------------------------------------
    def configure(self, config: WorkerConfig, num_pods: int, peers: list[str], run_id: str,
                  pod_index: int | None = None, standby: bool = False,
                  evaluates: bool = True, generation_only: bool = False,
                  awaits_state: bool = False) -> tuple[PodTrainer, str]:
        """Build the trainer (compiled for this pod's shard) and a DCN exchange under `run_id` with
        `peers` (every pod's data-plane address, in pod order);
        refused at once (Busy) while a step or another hold runs. Steps of an earlier setup are
        refused from now on. A spare (pod_index None) becomes pod `pod_index` here, for good once
        the configure succeeds. standby: a spare only builds and compiles the trainer, and stays a
        spare; a later configure of the same config and pod count takes that trainer at once.
        evaluates: the run evaluates, so the evaluation is compiled now too (TrainerPrograms.warm_up).
        generation_only: the pod will only generate, so the step's programs are not compiled now.
        awaits_state: its state will come from a Restore, so it builds no initial state (steps,
        saves, evaluations and generation are refused until then, NoState); a PromptTrainer or a
        DiLoCo pod, whose start is its initial state, builds it all the same."""
        with self.seq.hold("a configure", deadline=0.0, state=pb.WORKER_STATE_CONFIGURING):
            if standby:
                if self.pod_index is not None:
                    raise InvalidRequest(f"pod {self.pod_index} is not a spare: only a spare (worker --spare) "
                                         f"compiles on standby")
                trainer = self._build(config, num_pods, evaluates)
                self._standby = (config.config_hash(), num_pods, trainer)
                log.info("spare: compiled on standby for a run of %d pod(s), config %s", num_pods,
                         config.config_hash())
                return trainer, trainer.fingerprint()
            if self.pod_index is None:
                if pod_index is None:
                    raise InvalidRequest("a spare needs the pod index of the slot it takes")
                self._take_slot(pod_index)
                try:
                    return self._configure(config, num_pods, peers, run_id, evaluates, generation_only, awaits_state)
                except BaseException:
                    self._take_slot(None)      # still a spare: another run (or slot) may take it
                    raise
            return self._configure(config, num_pods, peers, run_id, evaluates, generation_only, awaits_state)

    def _build(self, config: WorkerConfig, num_pods: int, evaluates: bool = True,
               generation_only: bool = False, awaits_state: bool = False) -> PodTrainer:
        """A trainer for `config`, its programs compiled for this pod's shard of num_pods (the
        evaluation's too if the run `evaluates`); with generation_only, none of the step's: a pod
        of `multipod generate` compiles generation's own programs at its first request, and a
        training step its programs at its first call."""
        kind = PromptTrainer if config.prompt.enabled else PodTrainer
        # DiLoCo's outer state starts from initial parameters: such a pod builds them all the same.
        trainer = kind(config, layout=self.layout,
                       initial_state=not (awaits_state and kind.defers_initial_state and not config.sync.diloco))
        shard = (config.train.global_batch // num_pods, config.train.seq_len + 1)
        if not generation_only:
            trainer.compile_for(shard)
            trainer.warm_up(shard, evaluate=evaluates)
        if config.sync.diloco:
            trainer.start_outer(num_pods)
            if not generation_only:
                trainer.warm_up_outer()
        return trainer

    def _take_slot(self, pod_index: int | None) -> None:
        """A spare takes slot `pod_index` (None: gives it back): the data plane accepts that
        pod's peers from now on."""
        self.pod_index = pod_index
        if self.listener is not None:
            self.listener.pod_index = pod_index
        log.info("%s: %s", self.layout.name(pod_index), "a spare takes this slot" if pod_index is not None
                 else "the configure failed: a spare again")

    def _configure(self, config: WorkerConfig, num_pods: int, peers: list[str], run_id: str,
                   evaluates: bool = True, generation_only: bool = False,
                   awaits_state: bool = False) -> tuple[PodTrainer, str]:
        """configure's work, inside its hold."""
        standby, self._standby = self._standby, None
        if standby is not None and standby[:2] == (config.config_hash(), num_pods):
            trainer = standby[2]        # compiled on standby, still in its initial state
        else:
            trainer = self._build(config, num_pods, evaluates, generation_only, awaits_state)
        # Built before the old one closes: if it fails, the pod keeps a working exchange.
        exchange = self._new_exchange(run_id, trainer, config, list(peers))
        if self.exchange is not None:
            self.exchange.close()
        self._peers, self.exchange = list(peers), exchange
        self._checksum = (trainer.step, trainer.checksum() if trainer.has_state else "")
        epoch = self.seq.reset(trainer.step, "reconfigured")
        self._setup = Setup(trainer, config, num_pods, epoch, run_id=run_id)
        # Read inside the hold: a step may donate the state's buffers once it is released.
        fp = trainer.fingerprint() if trainer.has_state else ""
        if generation_only or not trainer.has_state:
            log.info("%s: configured %s", self.layout.name(self.pod_index), ", ".join(
                (["to generate only: no step programs"] if generation_only else []) +
                ([] if trainer.has_state else ["no initial state (its first Restore gives it one)"])))
        return trainer, fp

    # -- step ----------------------------------------------------------------------------------
    def step(self, setup: Setup, step: int, tokens: np.ndarray, global_tokens: int, deadline: float,
             is_active: Callable[[], bool], take_fingerprint: bool = False,
             extra: dict[int, np.ndarray] | None = None, loss_mask: np.ndarray | None = None,
             extra_masks: dict[int, np.ndarray | None] | None = None,
             splits: dict[int, list[int]] | None = None) -> tuple[StepOutcome, float]:
        """Run training step `step` on this pod's shard (validated against `setup`) once the steps
        before it are done; returns the outcome and the seconds spent waiting for them. The
        sequencer's errors say why a step cannot run; a step that fails leaves the state as it
        was and refuses later steps until the pod is restored or reconfigured. With
        take_fingerprint the outcome carries the new state's fingerprint too. extra: {slot:
        tokens} of the failed pods' shards this pod computes too (exactly setup.extra_slots).
        loss_mask, extra_masks: the targets the loss counts, for a prompt-tuning pod (None: all).
        splits: {slot: microbatch_hosts} of the extra shards split by microbatch over the live
        pods (pod_worker/split.py); this pod computes its run of each, and the slots it hosts
        are those extra shards or split ones it ends."""
        trainer = setup.trainer
        trainer.require_state("train")     # refused before it counts as a step: nothing failed
        extra = extra or {}
        if trainer.outer is not None and any(splits.values() if splits else ()):
            raise InvalidRequest(f"step {step}: a DiLoCo pod does not split a failed pod's shard")
        runs = {} if trainer.outer is not None else \
            self._split_runs(setup, step, extra, {s: list(h) for s, h in (splits or {}).items() if h})
        self.seq.check_not_done(step)
        # The shard goes to the devices now, while an earlier step may still be computing.
        extra_masks = extra_masks or {}
        on_device = trainer.put_batch(tokens, loss_mask)
        extra_on_device = {slot: trainer.put_batch(t, extra_masks.get(slot)) for slot, t in extra.items()}
        pieces = [Piece(slot, extra_on_device.pop(slot), *run) for slot, run in runs.items()]
        wait_start = time.perf_counter()
        self.seq.begin_step(step, setup.epoch, deadline, is_active)
        wait_s = time.perf_counter() - wait_start
        ok = False
        try:
            outcome = self._train(setup, step, on_device, global_tokens, take_fingerprint, extra_on_device, deadline,
                                  pieces)
            self._checksum = (trainer.step, outcome.checksum)
            ok = True
        finally:
            self.seq.finish_step(step, trainer.step, ok)
        return outcome, wait_s

    def _index(self) -> int:
        """This pod's index. A configured pod has one; a spare gets it from its first configure."""
        if self.pod_index is None:
            raise InvalidRequest("this worker is a spare that no configure has given a slot yet")
        return self.pod_index

    def _split_runs(self, setup: Setup, step: int, extra: dict, splits: dict[int, list[int]]
                    ) -> dict[int, tuple[int, int, int | None, int | None]]:
        """The extra shards checked against the membership: {slot: (start, stop, source, target)}
        of this pod's run of each split one (split.my_run) that is not the whole shard on its
        host (that one is computed as a whole extra shard). InvalidRequest, naming what does not fit."""
        hosted = setup.extra_slots(self._index())
        if sorted(s for s in extra if s not in splits) != [s for s in hosted if s not in splits] or \
                any(s not in extra for s in splits):
            raise InvalidRequest(f"step {step}: pod {self.pod_index} computes the extra shards of slots {hosted}, "
                                 f"the request carries {sorted(extra)}")
        runs = {}
        count = setup.config.model.microbatches
        for slot, microbatch_hosts in sorted(splits.items()):
            if setup.hosts is None or setup.hosts[slot] == slot:
                raise InvalidRequest(f"step {step}: slot {slot} is not a failed pod's slot: its shard is not split")
            if len(microbatch_hosts) != count:
                raise InvalidRequest(f"step {step}: slot {slot}: {len(microbatch_hosts)} microbatch hosts, the model "
                                     f"has {count} microbatches")
            try:
                run = my_run(microbatch_hosts, self._index(), slot, setup.hosts)
            except ValueError as exc:
                raise InvalidRequest(f"step {step}: {exc}") from None
            if run != (0, count, None, None):
                runs[slot] = run
        return runs

    def _train(self, setup: Setup, step: int, on_device, global_tokens: int,
               take_fingerprint: bool = False, extra: dict | None = None, deadline: float | None = None,
               pieces: list[Piece] | None = None) -> StepOutcome:
        trainer, exchange, index = setup.trainer, self.exchange, self._index()
        if exchange is None:    # configure makes one, for a single pod too
            raise RuntimeError(f"pod {index}: step {step} without an exchange")
        faults.hang_if_asked(index, step)     # test hook (pod_worker/faults.py)
        if self.layout.multi:
            # Every host of the pod starts this very step, or none runs it (see hosts.meet). A
            # DiLoCo inner step too: its gradient program sums over the hosts.
            wait = min(setup.config.dcn.timeout_s, (deadline or time.monotonic() + 60) - time.monotonic())
            try:
                meet(f"{setup.run_id}/{setup.epoch}/{step}", max(0.1, wait))
            except TimeoutError as exc:
                raise StepAborted(f"{self.layout.name(self.pod_index)}: step {step}: {exc}") from None
        if trainer.outer is not None:
            return self._train_inner(setup, step, on_device, take_fingerprint, extra, pieces)
        exchange.inbox.set_next_step(step)
        all_reduce = None
        if setup.num_pods > 1:
            # Leaf by leaf: host copy -> chunks on the wire -> pod-order sum (-> host->device with
            # overlap). The overlapped step (dcn.overlap) passes order= (leaves in the order they
            # become ready).
            on_leaf = trainer.summed_leaf_hook()
            all_reduce = lambda grads, **kw: exchange.all_reduce(step, grads, on_leaf=on_leaf, **kw)
        if faults.nan_gradient_at(index, step):   # test hook (pod_worker/faults.py)
            all_reduce = faults.poisoned(all_reduce)
        relay = None
        if pieces:      # partial sums of split shards, over this step's exchange
            relay = Relay(send=lambda slot, pod, leaves, losses: exchange.send_partial(step, slot, pod, leaves, losses),
                          receive=lambda slot, pod: exchange.receive_partial(step, slot, pod))
        if all_reduce is not None:
            # The state vote: the step is applied only if every live pod starts it from this state.
            state = int(self._checksum[1], 16)
            exchange.send_vote(step, state)
            all_reduce = _voted(all_reduce, lambda: exchange.check_votes(step, state))
        outcome = trainer.train_step(on_device, global_tokens, all_reduce, take_fingerprint=take_fingerprint,
                                     extra=extra, pieces=pieces, relay=relay)
        if faults.flip_bit_at(index, step):     # test hook (pod_worker/faults.py)
            trainer.params, leaf = faults.flip_bit(trainer.params)
            log.warning("test hook: flipped a bit of %s after step %d", leaf, step)
            outcome = dataclasses.replace(outcome, checksum=trainer.checksum(),
                                          fingerprint=trainer.fingerprint() if outcome.fingerprint else "")
        exchange.inbox.set_next_step(trainer.step)
        return outcome

    # -- using the state -----------------------------------------------------------------------
    def evaluate(self, tokens: np.ndarray, deadline: float, loss_mask: np.ndarray | None = None
                 ) -> tuple[float, int]:
        """Loss sum and target-token count of `tokens` (the targets loss_mask keeps, if given)
        under the current parameters (between steps: waits until `deadline` for a running one)."""
        with self.seq.hold("an evaluation", deadline):
            return self.setup().trainer.evaluate(tokens, loss_mask)

    def generate_stream(self, prompts: list[np.ndarray], num_tokens: int, sampling: Sampling, deadline: float,
                        eos_id: int | None = None, shift_context: bool = False) -> Iterator[Chunk]:
        """Generation with a KV cache on the pod's mesh (pod_worker/generation.py), streamed: one
        Chunk per new position. InvalidRequest at once if the request does not fit the model. The
        parameters are copied while no step runs (waiting until `deadline` for one, Busy after);
        steps may go on while the stream runs (not on a pod of several hosts: _generate_in_lockstep)."""
        try:
            prompts = self.setup().trainer.generator.check(prompts, num_tokens, sampling, eos_id, shift_context)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        if self.layout.multi:
            return self._generate_in_lockstep(prompts, num_tokens, sampling, deadline, eos_id, shift_context)
        with self.seq.hold("a copy of the parameters", deadline):
            trainer = self.setup().trainer
            params = trainer.params_copy()     # on the devices, as laid out for training
        return trainer.generator.stream(params, prompts, num_tokens, sampling, eos_id, shift_context)

    def _generate_in_lockstep(self, prompts: list[np.ndarray], num_tokens: int, sampling: Sampling,
                              deadline: float, eos_id: int | None, shift_context: bool) -> Iterator[Chunk]:
        """generate_stream on a pod of several hosts, where every host gets the same request and
        runs the same programs, whose collectives wait for the other hosts'. So the pod is held
        for the whole stream (a step's programs between generation's could meet another host's
        in another order); every host meets the others before the first program (Busy if they
        do not come: a host alone would wait in a collective for good); and the stream runs to
        its end even if the caller leaves (the other hosts' programs wait for this host's)."""
        with self.seq.hold("a generation", deadline):
            setup = self.setup()
            trainer = setup.trainer
            wait = min(setup.config.dcn.timeout_s, deadline - time.monotonic())
            try:
                meet(f"{setup.run_id}/{setup.epoch}/{trainer.step}/generate", max(0.1, wait), "generation")
            except TimeoutError as exc:
                raise Busy(f"{self.layout.name(self.pod_index)}: {exc}") from None
            chunks = trainer.generator.stream(trainer.params_copy(), prompts, num_tokens, sampling, eos_id,
                                              shift_context)
            for chunk in chunks:
                try:
                    yield chunk
                except GeneratorExit:
                    for _ in chunks:    # the caller left: finish in step with the other hosts
                        pass
                    raise

    def status(self) -> PodStatus:
        """What the pod is doing, with its state's step and checksum as of the last change; never waits."""
        setup = self._setup
        if setup is None:
            return PodStatus(configured=False, step=0, state=self.seq.state)
        step, checksum = self._checksum
        return PodStatus(configured=True, step=step, state=self.seq.state,
                         config_hash=setup.config.config_hash(), checksum=checksum, run_id=setup.run_id)

    def close(self) -> None:
        """Let pending checkpoint writes finish (bounded) and close the DCN exchange."""
        self._writer.close()
        if self.exchange is not None:
            self.exchange.close()
        if self.listener is not None:
            self.listener.close()


def _voted(all_reduce, check):
    """all_reduce, then `check()` (the state vote) before its sum is returned, so before any
    update uses it: a StateVoteError fails the step with the state untouched."""
    def exchange(*args, **kwargs):
        result = all_reduce(*args, **kwargs)
        check()
        return result
    return exchange
