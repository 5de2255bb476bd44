"""The CLI's errors for bad input: they name what is wrong, and come within a deadline."""
import contextlib
import socket
import time

import grpc
import pytest

from multipod import protos
from multipod.controller.launch.local import LocalPods
from multipod.protos import multipod_pb2 as pb, multipod_pb2_grpc as pb_grpc
from tests.helpers import TINY, run_cli


@contextlib.contextmanager
def _port_nobody_listens_on():
    """A loopback port held bound but not listening while the block runs: a connection to it is
    refused, and no other process (the other test process, say) can take it meanwhile."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def test_unknown_config_key_names_the_field():
    result = run_cli("train", "--workers", "127.0.0.1:1", "--set", "model.d_modle=64", timeout=60)
    assert result.returncode == 2
    assert "model.d_modle" in result.stderr and "unknown key" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_config_value_names_the_field(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("[optimizer]\nlearning_rate = -1.0\n")
    result = run_cli("local", "--config", str(config), timeout=60)
    assert result.returncode == 2
    assert "optimizer.learning_rate" in result.stderr


def test_train_without_a_checkpoint_dir_is_refused_before_contacting_a_worker(tmp_path):
    """With remote workers the default checkpoint directory (under the controller's run
    directory) would be on pod 0's own disk: `multipod train` needs one every pod can read."""
    with socket.socket() as worker:     # stands in for a worker; nothing may connect to it
        worker.bind(("127.0.0.1", 0))
        worker.listen()
        worker.setblocking(False)
        address = f"127.0.0.1:{worker.getsockname()[1]}"
        result = run_cli("train", "--workers", address, "--config", TINY, "--run-dir", str(tmp_path / "run"),
                         timeout=60)
        with pytest.raises(BlockingIOError):
            worker.accept()             # no connection is waiting: the controller never dialled
    assert result.returncode == 2, result.stdout + result.stderr
    assert "error: config: checkpoint.dir:" in result.stderr and "--checkpoint-dir" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_unreachable_worker_is_reported_by_address_within_the_deadline(tmp_path):
    with _port_nobody_listens_on() as port:
        address = f"127.0.0.1:{port}"
        start = time.monotonic()
        result = run_cli("train", "--workers", address, "--config", TINY, "--set", "run.connect_timeout_s=2",
                         "--set", f"checkpoint.dir={tmp_path / 'checkpoints'}", "--run-dir", str(tmp_path / "run"),
                         timeout=60)
    assert result.returncode == 1
    assert f"pod 0 ({address}) is unreachable" in result.stderr
    assert time.monotonic() - start < 30


@pytest.fixture(scope="module")
def mismatched_pods(tmp_path_factory):
    """Two live workers that disagree: pod 0 has 2 devices, pod 1 has 1."""
    with LocalPods(2, [2, 1], tmp_path_factory.mktemp("mismatch")) as pods:
        yield pods


def test_pods_with_different_mesh_shapes_are_refused_before_compiling(mismatched_pods, tmp_path):
    result = run_cli("train", "--workers", ",".join(mismatched_pods.addresses), "--config", TINY,
                     "--run-dir", str(tmp_path), "--checkpoint-dir", str(tmp_path / "checkpoints"), timeout=120)
    assert result.returncode == 1
    assert "pods disagree on device count, so on mesh shape" in result.stderr
    assert "pod 0" in result.stderr and "pod 1" in result.stderr


def test_wrong_protocol_version_is_refused_and_the_worker_keeps_serving(mismatched_pods):
    channel = grpc.insecure_channel(mismatched_pods.addresses[1])
    stub = pb_grpc.PodWorkerStub(channel)
    dcn = []
    for address in mismatched_pods.addresses:   # every pod's data-plane endpoint, as the controller sends them
        with grpc.insecure_channel(address) as other:
            dcn.append(pb_grpc.PodWorkerStub(other).Status(pb.StatusRequest(), timeout=10).dcn_address)
    with pytest.raises(grpc.RpcError) as info:
        stub.Configure(pb.ConfigureRequest(protocol_version=protos.PROTOCOL_VERSION + 1, pod_index=1, num_pods=2,
                                           peer_addresses=mismatched_pods.addresses, worker_config_json="{}",
                                           run_id="x"), timeout=30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "protocol version mismatch" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stub.Configure(pb.ConfigureRequest(protocol_version=protos.PROTOCOL_VERSION, pod_index=1, num_pods=2,
                                           peer_addresses=mismatched_pods.addresses, dcn_addresses=dcn,
                                           worker_config_json='{"model": {"d_model": "big"}}', run_id="x"), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model.d_model" in info.value.details()
    status = stub.Status(pb.StatusRequest(), timeout=10)
    assert status.pod_index == 1 and status.pid > 0
    channel.close()


def test_resume_without_saying_which_run_is_refused():
    result = run_cli("local", "--config", TINY, "--resume", timeout=60)
    assert result.returncode == 2 and "--resume" in result.stderr and "--run-dir" in result.stderr


def test_a_batch_that_does_not_split_over_the_pods_is_refused_before_any_worker_starts(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli("local", "--config", TINY, "--pods", "3", "--run-dir", str(run_dir), timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "data.global_batch: 8 does not split over 3 pods" in result.stderr
    assert "started" not in result.stdout and not list(run_dir.glob("worker-*.log"))


def test_pods_listing_different_numbers_of_hosts_are_refused_before_contacting_a_worker(tmp_path):
    """--workers lists each pod's hosts (";" between pods, "," between hosts, or @FILE): every pod
    must have as many hosts as the others, and the error names the pod that does not."""
    with socket.socket() as worker:     # stands in for a worker; nothing may connect to it
        worker.bind(("127.0.0.1", 0))
        worker.listen()
        worker.setblocking(False)
        address = f"127.0.0.1:{worker.getsockname()[1]}"
        hosts_file = tmp_path / "hosts.txt"
        hosts_file.write_text(f"# pod 0\n{address} 127.0.0.1:2\n# pod 1 has one host only\n127.0.0.1:3\n")
        for workers in (f"{address},127.0.0.1:2;127.0.0.1:3", f"@{hosts_file}"):
            result = run_cli("train", "--workers", workers, "--config", TINY, "--run-dir", str(tmp_path / "run"),
                             "--checkpoint-dir", str(tmp_path / "checkpoints"), timeout=60)
            assert result.returncode == 2, result.stdout + result.stderr
            assert "error: config: --workers: pod 1 lists 1 host(s) (127.0.0.1:3) but pod 0 lists 2" in result.stderr
            assert "Traceback" not in result.stderr
        with pytest.raises(BlockingIOError):
            worker.accept()             # no connection is waiting: the controller never dialled
    assert not (tmp_path / "run").exists()


def _bad_inputs(tmp_path):
    """(what, extra CLI args, the file the error must name) for each bad data input."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    no_field = tmp_path / "records.jsonl"
    no_field.write_text('{"body": "def f(): pass"}\n')
    parquet = tmp_path / "corrupt.parquet"
    parquet.write_bytes(b"PAR1 this is not a parquet file at all")
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text('{"version": "1.0", "model": 3')
    return [
        ("empty jsonl", ["--data", str(empty)], empty),
        ("jsonl without the text field", ["--data", str(no_field)], no_field),
        ("corrupt parquet", ["--data", str(parquet)], parquet),
        ("tokenizer that does not parse", ["--tokenizer", str(tokenizer)], tokenizer),
    ]


def test_bad_data_inputs_are_refused_naming_the_file_before_any_worker_starts(tmp_path):
    for what, args, named in _bad_inputs(tmp_path):
        run_dir = tmp_path / what.replace(" ", "-")
        result = run_cli("local", "--config", TINY, "--run-dir", str(run_dir), *args, timeout=120)
        assert result.returncode == 1, (what, result.stdout + result.stderr)
        assert str(named) in result.stderr and "Traceback" not in result.stderr, (what, result.stderr)
        assert not list(run_dir.glob("worker-*.log")), what      # refused before any worker started


def test_a_vocabulary_larger_than_the_model_allows_is_refused(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 300)
    result = run_cli("local", "--config", TINY, "--data", str(corpus), "--tokenizer", "bpe:400",
                     "--set", "model.vocab_size=256", "--set", "data.cache_dir=\"" + str(tmp_path / "cache") + "\"",
                     "--run-dir", str(tmp_path / "run"), timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "more than model.vocab_size = 256 allows" in result.stderr and "tokenizer.json" in result.stderr


def test_a_warm_start_from_elsewhere_needs_diloco_and_resume(tmp_path):
    """checkpoint.warm_start_from is where --resume begins a DiLoCo run: refused, before any worker
    starts, for every-step sync and without --resume."""
    elsewhere = f"checkpoint.warm_start_from={tmp_path / 'every-step'}"
    every_step = run_cli("local", "--config", TINY, "--run-dir", str(tmp_path / "a"), "--resume",
                         "--set", elsewhere, timeout=60)
    assert every_step.returncode == 2 and "checkpoint.warm_start_from" in every_step.stderr
    assert 'sync.mode = "diloco"' in every_step.stderr
    no_resume = run_cli("local", "--config", TINY, "--run-dir", str(tmp_path / "b"), "--set", "sync.mode=diloco",
                        "--set", elsewhere, timeout=60)
    assert no_resume.returncode == 2 and "checkpoint.warm_start_from" in no_resume.stderr
    assert "--resume" in no_resume.stderr
    assert not list((tmp_path / "b").glob("worker-*.log")), "no worker may start"


@pytest.mark.parametrize("flag", ["--devices", "--size"])
def test_peak_flops_refuses_a_count_below_one_naming_it(flag):
    result = run_cli("peak-flops", flag, "0", timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"error: config: {flag}: must be >= 1, got 0" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_new_run_where_an_earlier_run_s_checkpoints_are_is_refused_before_any_worker_starts(tmp_path):
    run_dir = tmp_path / "run"
    for step in ("0", "4"):
        (run_dir / "checkpoints" / step).mkdir(parents=True)
    result = run_cli("local", "--config", TINY, "--steps", "2", "--run-dir", str(run_dir), timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"--run-dir: {run_dir / 'checkpoints'} already holds an earlier run's checkpoints (steps 0, 4): " \
           "--resume continues that run" in result.stderr
    assert "started" not in result.stdout and not (run_dir / "config.json").exists()


@pytest.mark.parametrize("flag", ["--listen", "--dcn-listen"])
def test_a_worker_refuses_a_listen_address_that_is_not_host_port(flag):
    # gRPC took 99999 modulo 65536 and served on another port without a word.
    result = run_cli("worker", "--pod-index", "0", flag, "127.0.0.1:99999", "--insecure", timeout=60)
    assert result.returncode != 0
    assert f"error: {flag}: '127.0.0.1:99999': the port must be a number from 0 to 65535" in result.stderr
    assert "Traceback" not in result.stderr


def test_workers_that_are_not_addresses_are_refused_at_once_not_after_the_connect_deadline(tmp_path):
    started = time.monotonic()
    result = run_cli("train", "--config", TINY, "--workers", "foo", "--checkpoint-dir", str(tmp_path / "ck"),
                     timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--workers: pod 0 host 0: 'foo' is not HOST:PORT" in result.stderr
    assert time.monotonic() - started < 25, "refused before the 30-second connect deadline"


@pytest.mark.parametrize("flags, message", [
    (("--pods", "0"), "--pods: must be >= 1, got 0"),
    (("--spares", "-1"), "--spares: must be >= 0, got -1"),
    (("--hosts-per-pod", "0"), "--hosts-per-pod: must be >= 1, got 0"),
])
def test_simulated_pods_that_cannot_be_are_refused_before_the_data_is_prepared(tmp_path, flags, message):
    # --pods 0 came after the corpus was read (minutes on its first use), as exit 1.
    run_dir = tmp_path / "run"
    result = run_cli("local", "--config", TINY, "--steps", "2", "--run-dir", str(run_dir), *flags, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"error: config: {message}" in result.stderr
    assert "token cache" not in result.stdout + result.stderr and not run_dir.exists()


def test_a_worker_refuses_a_port_file_it_cannot_write_before_it_serves(tmp_path):
    # It ended in a FileNotFoundError traceback after binding its ports.
    port_file = tmp_path / "no-such-folder" / "worker.port"
    result = run_cli("worker", "--pod-index", "0", "--listen", "127.0.0.1:0", "--insecure-no-auth",
                     "--port-file", str(port_file), timeout=60)
    assert result.returncode != 0
    assert f"error: --port-file {port_file}: cannot write in {port_file.parent}" in result.stderr
    assert "Traceback" not in result.stderr and "serving on" not in result.stderr


def test_a_checkpoint_folder_that_is_a_file_is_refused_before_any_worker_starts(tmp_path):
    # The run trained to its end with every save failing, and exited 0.
    (tmp_path / "ck").write_text("not a folder")
    result = run_cli("local", "--config", TINY, "--steps", "2", "--run-dir", str(tmp_path / "run"),
                     "--checkpoint-dir", str(tmp_path / "ck"), timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"error: config: checkpoint.dir: {tmp_path / 'ck'} is a file, not a folder" in result.stderr
    assert not (tmp_path / "run").exists()


def test_a_local_resume_with_nothing_to_resume_is_refused_before_any_worker_starts(tmp_path):
    # The pods started, then failed to restore: "Restore failed: FAILED_PRECONDITION".
    missing, empty = tmp_path / "typo", tmp_path / "empty"
    empty.mkdir()
    for run_dir in (missing, empty):
        result = run_cli("local", "--config", TINY, "--steps", "2", "--resume", "--run-dir", str(run_dir), timeout=60)
        assert result.returncode == 2, result.stdout + result.stderr
        assert f"error: config: --resume: no checkpoint to resume from in {run_dir / 'checkpoints'}" in result.stderr
        assert "started" not in result.stdout
    assert not missing.exists() and not list(empty.glob("worker-*.log"))
