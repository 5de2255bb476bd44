"""The cluster: the watchdog, the diagnosis, the typed health verdicts, the typed RPCs' deadlines
and errors, and the configure check that a restarted pod matches the pods that stayed up."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from multipod.controller.cluster.client import Verdict, WorkerClient, WorkerError
from multipod.controller.cluster.compile_marks import CompileMarks
from multipod.controller.cluster.pods import Cluster, Watchdog
from multipod.controller.core.errors import RunError
from multipod.protos import multipod_pb2 as pb
from tests.unit.controller.fakes import DEAD, HUNG, SERVING, FakePod, configure_reply, make_config


def _watch(clients):
    dog = Watchdog(clients, interval_s=0.01, timeout_s=0.01)
    deadline = time.monotonic() + 10
    while dog.failure is None and time.monotonic() < deadline:
        time.sleep(0.01)
    dog.stop()
    assert dog.failure is not None
    return dog.failure


def test_watchdog_names_a_pod_after_two_missed_health_checks_and_tells_hung_from_dead():
    # Pod 0 misses one check only (forgiven); pod 1 stops answering; pod 2 serves.
    failure = _watch([FakePod(0, probes=[HUNG], probe_then=SERVING), FakePod(1, probes=[SERVING], probe_then=HUNG),
                      FakePod(2)])
    assert failure.pods == (1,) and failure.hung == (1,)
    assert str(failure).startswith(f"pod 1 (fake:1) is not responding: {HUNG.detail}")
    # A dead pod (connection refused) is reported too, but not as hung: the controller never
    # kills it (its supervisor may already be starting the new incarnation).
    failure = _watch([FakePod(0), FakePod(1, probe_then=DEAD)])
    assert failure.pods == (1,) and failure.hung == ()


def test_diagnose_names_the_silent_pods_and_keeps_the_context():
    cluster = Cluster([FakePod(0), FakePod(1, probe_then=HUNG), FakePod(2, probe_then=DEAD)], make_config())
    failure = cluster.diagnose("step 4 failed: boom")
    assert failure.pods == (1, 2) and failure.hung == (1,)
    assert str(failure).endswith("(step 4 failed: boom)") and "pod 2 (fake:2) is not responding" in str(failure)
    quiet = Cluster([FakePod(0)], make_config()).diagnose("step 4 failed: boom")
    assert quiet.pods == () and str(quiet) == "step 4 failed: boom"


class _RpcError(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return "pod-looking text that must not matter"


class _Health:
    def __init__(self, code):
        self.code = code

    def Check(self, request, timeout):
        raise _RpcError(self.code)


@pytest.mark.parametrize("code, verdict", [(grpc.StatusCode.DEADLINE_EXCEEDED, Verdict.HUNG),
                                           (grpc.StatusCode.UNAVAILABLE, Verdict.DEAD)])
def test_probe_tells_hung_from_dead_by_status_code(code, verdict):
    client = WorkerClient(0, "127.0.0.1:1")    # the channel is lazy: nothing is contacted
    try:
        client.health = _Health(code)
        probe = client.probe(0.5)
        assert probe.verdict is verdict and not probe.serving
        # DEADLINE_EXCEEDED always means this call's own deadline, whatever the details say.
        error = client._error("Step", _RpcError(code))
        assert error.code is code
        assert ("no answer within the call's deadline" in str(error)) == (code is grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        client.close()


class _Rpc:
    """A stub's method: records each call's deadline; answers `reply`, or raises _RpcError(code)."""

    def __init__(self, reply=None, code=None):
        self.reply, self.code, self.timeouts = reply, code, []

    def __call__(self, request, timeout):
        self.timeouts.append(timeout)
        if self.code is not None:
            raise _RpcError(self.code)
        return self.reply

    def future(self, request, timeout):
        return SimpleNamespace(result=lambda: self(request, timeout))


def test_the_typed_rpcs_keep_their_deadline_and_name_the_pod_and_the_rpc_on_failure():
    client = WorkerClient(3, "127.0.0.1:1")    # the channel is lazy: nothing is contacted
    chunks = [pb.GenerateChunk(index=0), pb.GenerateChunk(index=1)]
    try:
        client.stub = stub = SimpleNamespace(
            Step=_Rpc(pb.StepReply(step=4)), Save=_Rpc(code=grpc.StatusCode.UNAVAILABLE),
            Restore=_Rpc(code=grpc.StatusCode.DEADLINE_EXCEEDED), GenerateStream=_Rpc(chunks),
            Status=_Rpc(pb.StatusReply(step=4)))
        assert client.step(pb.StepRequest(step=4), 7.5) == client.step_async(pb.StepRequest(step=4), 2.5).result()
        assert stub.Step.timeouts == [7.5, 2.5] and client.status(1.5).step == 4 and stub.Status.timeouts == [1.5]
        assert list(client.generate_stream(pb.GenerateRequest(), 9.0)) == chunks
        assert stub.GenerateStream.timeouts == [9.0]
        with pytest.raises(WorkerError, match=r"^pod 3 \(127.0.0.1:1\): Save failed: UNAVAILABLE: ") as info:
            client.save(pb.SaveRequest(step=1), 4.0)
        assert info.value.code is grpc.StatusCode.UNAVAILABLE and stub.Save.timeouts == [4.0]
        with pytest.raises(WorkerError, match=r"^pod 3 \(127.0.0.1:1\): Restore failed: DEADLINE_EXCEEDED: no answer "
                                              r"within the call's deadline"):
            client.restore_async(pb.RestoreRequest(path="x"), 6.0).result()
        stub.GenerateStream.code = grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(WorkerError, match=r"GenerateStream failed: INVALID_ARGUMENT"):
            list(client.generate_stream(pb.GenerateRequest(), 9.0))
    finally:
        client.close()


def _configured(pods):
    cluster = Cluster(pods, make_config())
    cluster.configure()
    return cluster


@pytest.mark.parametrize("field, value, what", [("mesh_shape", [1, 2], "mesh shape"),
                                                ("num_devices", 2, "device count"),
                                                ("config_hash", "other", "config hash"),
                                                ("protocol_version", 999, "protocol version"),
                                                ("fingerprint", "other-init", "initial state fingerprint")])
def test_a_restarted_pod_that_differs_from_the_pods_that_stayed_up_is_refused(field, value, what):
    pods = [FakePod(0), FakePod(1), FakePod(2)]
    cluster = _configured(pods)
    # Pod 1 comes back as a different worker (another device count, mesh, version or config).
    pods[1].on_configure = lambda request: configure_reply(1, **{field: value})
    with pytest.raises(RunError, match=what) as info:
        cluster.configure_restarted([1])
    message = str(info.value)
    assert "pod 1 (fake:1) has" in message and "pod 0 (fake:0)" in message and "stayed up" in message


def test_a_restarted_pod_that_matches_the_survivors_is_accepted():
    pods = [FakePod(0), FakePod(1)]
    cluster = _configured(pods)
    replies = cluster.configure_restarted([1])
    assert [r.pod_index for r in replies] == [1]
    assert [m for m, _ in pods[1].calls] == ["Configure", "Configure"] and len(pods[0].calls) == 1


def test_pods_that_disagree_at_the_first_configure_are_refused():
    pods = [FakePod(0), FakePod(1)]
    pods[1].on_configure = lambda request: configure_reply(1, mesh_shape=[2, 1])
    with pytest.raises(RunError, match=r"pods disagree on mesh shape"):
        Cluster(pods, make_config()).configure()


def test_pods_with_different_device_counts_are_refused_before_any_compiles():
    pods = [FakePod(0), FakePod(1)]
    pods[0].num_devices, pods[1].num_devices = 2, 1
    with pytest.raises(RunError, match=r"pods disagree on device count, so on mesh shape: pod 0 \(fake:0\) has 2, "
                                       r"pod 1 \(fake:1\) has 1"):
        Cluster(pods, make_config()).configure()
    assert pods[0].calls == [] and pods[1].calls == []     # no Configure: nothing was compiled


def _configure_in_order(cluster_pods: int, marks: CompileMarks | None, num_devices: int = 2,
                        awaits_state: bool = False, cold: bool | None = None):
    """Configure fake pods; (the events of their Configure calls, what `announce` was told). The
    pods expected to be configured at once meet at a barrier: configured one after another, the
    first would wait there alone, the barrier would break, and the configure would fail. `cold`:
    whether pod 0 is expected to configure first (default: unless the marks hold the fresh
    configuration's mark)."""
    events: list[tuple[str, int]] = []
    told: list[bool] = []
    pods = [FakePod(p) for p in range(cluster_pods)]
    if cold is None:
        cold = marks is not None and not marks.holds(
            marks.key(make_config().worker_config().to_json(), cluster_pods, [num_devices] * cluster_pods, 1,
                      make_config().eval.batches > 0))
    together = list(range(1, cluster_pods)) if cold else list(range(cluster_pods))
    meeting = threading.Barrier(len(together), timeout=30)
    for pod in pods:
        pod.num_devices = num_devices

        def answer(request, pod=pod):
            events.append(("start", pod.pod_index))
            if pod.pod_index in together:
                meeting.wait()
            events.append(("end", pod.pod_index))
            return configure_reply(pod.pod_index)
        pod.on_configure = answer
    replies = Cluster(pods, make_config()).configure(shared_cache=marks, announce=told.append,
                                                     awaits_state=awaits_state)
    assert [r.pod_index for r in replies] == list(range(cluster_pods))
    assert all(r.awaits_state == awaits_state for pod in pods for m, r in pod.calls if m == "Configure")
    return events, told


def test_pods_sharing_a_cold_compilation_cache_configure_pod_0_first_then_all_at_once(tmp_path):
    marks = CompileMarks(tmp_path)
    events, told = _configure_in_order(3, marks)
    # Pod 0 alone, so the others load its programs; then pods 1 and 2 at once.
    assert told == [False]
    assert events[:2] == [("start", 0), ("end", 0)]
    assert {e for e in events[2:4]} == {("start", 1), ("start", 2)}
    # The configure left its mark: the next run of this configuration configures every pod at once.
    events, told = _configure_in_order(3, marks)
    assert told == [True] and {e for e in events[:3]} == {("start", 0), ("start", 1), ("start", 2)}
    # Another device count is another configuration, with programs of its own.
    events, told = _configure_in_order(3, marks, num_devices=4)
    assert told == [False] and events[:2] == [("start", 0), ("end", 0)]


def test_pods_without_a_shared_cache_configure_all_at_once():
    events, told = _configure_in_order(3, None)
    assert told == [True] and {e for e in events[:3]} == {("start", 0), ("start", 1), ("start", 2)}


def test_a_cache_folder_that_cannot_take_the_mark_keeps_the_cold_order(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache's folder would be")
    marks = CompileMarks(blocker)
    for _ in range(2):
        events, told = _configure_in_order(2, marks)
        assert told == [False] and events[:2] == [("start", 0), ("end", 0)]


@pytest.mark.parametrize("batches", [2, 0])
def test_pods_compile_the_evaluation_at_configure_only_if_the_run_evaluates(batches):
    """ConfigureRequest.evaluates follows eval.batches: a run that never evaluates does not have its
    pods compile the evaluation; one that does has it compiled with the rest, restarted pods included."""
    pods = [FakePod(0), FakePod(1)]
    cluster = Cluster(pods, make_config(eval={"batches": batches}))
    cluster.configure()
    cluster.configure_restarted([1])
    requests = [r for pod in pods for m, r in pod.calls if m == "Configure"]
    assert len(requests) == 3 and all(r.evaluates == (batches > 0) for r in requests)


@pytest.mark.parametrize("generation_only", [True, False])
def test_the_pods_of_multipod_generate_are_told_not_to_compile_the_step(generation_only):
    pods = [FakePod(0)]
    Cluster(pods, make_config(), generation_only=generation_only).configure()
    (request,) = [r for m, r in pods[0].calls if m == "Configure"]
    assert request.generation_only == generation_only


def test_a_resumed_run_s_pods_await_their_state_so_a_restarted_pod_has_no_initial_state_to_match():
    """Cluster.configure(awaits_state=True), a resumed run's: every pod is told to build no
    initial state (its restore gives it one). There is then no initial state for a pod restarted
    later to match: one whose initial fingerprint differs is accepted (it restores, or takes a
    peer's state, as the others did), while the static agreement still holds."""
    pods = [FakePod(0), FakePod(1)]
    for pod in pods:
        pod.on_configure = lambda request, pod=pod: configure_reply(pod.pod_index, fingerprint="")
    cluster = Cluster(pods, make_config())
    cluster.configure(awaits_state=True)
    assert [r.awaits_state for pod in pods for m, r in pod.calls if m == "Configure"] == [True, True]
    pods[1].on_configure = lambda request: configure_reply(1, fingerprint="an-initial-state")
    assert [r.pod_index for r in cluster.configure_restarted([1])] == [1]
    pods[1].on_configure = lambda request: configure_reply(1, config_hash="other")
    with pytest.raises(RunError, match="config hash"):
        cluster.configure_restarted([1])


def test_a_resumed_run_configures_at_once_where_a_fresh_run_left_its_mark_and_not_the_other_way_round(tmp_path):
    """A resumed run's pods compile a subset of a fresh run's programs (no parameter init): a fresh
    run's mark lets them configure at once; their own mark does not let a fresh run's pods, whose
    init program the cache may not hold."""
    fresh_first = CompileMarks(tmp_path / "fresh-first")
    assert _configure_in_order(2, fresh_first)[1] == [False]
    assert _configure_in_order(2, fresh_first, awaits_state=True, cold=False)[1] == [True]
    resumed_first = CompileMarks(tmp_path / "resumed-first")
    assert _configure_in_order(2, resumed_first, awaits_state=True, cold=True)[1] == [False]
    assert _configure_in_order(2, resumed_first, cold=True)[1] == [False]
    assert _configure_in_order(2, resumed_first, awaits_state=True, cold=False)[1] == [True]
    assert _configure_in_order(2, resumed_first, cold=False)[1] == [True]
