"""`multipod generate` on a checkpoint of a tiny run trained here: the text streams to stdout and
tokens/s to stderr; a jsonl of prompts gives a jsonl of completions; greedy output is the same
on a model-parallel mesh of 2 devices as on one; bad input is refused quickly, naming the problem."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

import pytest

from tests.helpers import TINY, cli_env, run_cli


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> pathlib.Path:
    run_dir = tmp_path_factory.mktemp("generate") / "run"
    result = run_cli("local", "--config", TINY, "--pods", "1", "--devices-per-pod", "1", "--steps", "10",
                     "--run-dir", str(run_dir), "--no-report", "--set", "sample.tokens=0", "--set", "eval.batches=0")
    assert result.returncode == 0, result.stdout + result.stderr
    return run_dir / "checkpoints"


def _generate(*args: str):
    return run_cli("generate", *args, timeout=120)


GREEDY = ("--prompt", "def ", "--max-tokens", "8", "--temperature", "0")


@pytest.fixture(scope="module")
def one_host(checkpoints):
    """Greedy text from the newest checkpoint on the default pod: one host, one device."""
    return _generate("--checkpoint", str(checkpoints), *GREEDY)


def test_a_prompt_streams_its_text_and_the_same_on_a_model_parallel_mesh(checkpoints, one_host):
    one, two = one_host, _generate("--checkpoint", str(checkpoints), *GREEDY, "--devices", "2", "--model-parallel", "2")
    assert one.returncode == 0, one.stdout + one.stderr
    assert one.stdout.startswith("def ") and len(one.stdout) > len("def \n")
    assert "8 token(s) in" in one.stderr and "tokens/s" in one.stderr
    assert "(step 10)" in one.stderr
    assert two.returncode == 0, two.stdout + two.stderr
    assert "mesh data=1 model=2" in two.stderr
    assert two.stdout == one.stdout


def test_a_pod_of_two_hosts_local_or_running_generates_the_one_host_text(checkpoints, one_host, tmp_path):
    """--hosts-per-pod 2 starts the local pod as two worker processes (one jax.distributed
    cluster); --workers generates on a pod of two hosts started by hand with `multipod worker`, as
    usage.md starts them, with its secret. The greedy text is the one-host pod's, token for token."""
    from multipod.controller.launch.ports import free_ports
    token = {"MULTIPOD_AUTH_TOKEN": "token-for-the-generate-hosts-test-0123"}
    (coordinator,) = free_ports(1)
    workers, ports = [], [tmp_path / f"host-{h}.port" for h in (0, 1)]
    try:
        for host, port in enumerate(ports):
            log = (tmp_path / f"host-{host}.log").open("w")
            workers.append(subprocess.Popen(
                [sys.executable, "-m", "multipod.cli", "worker", "--pod-index", "0", "--host-index", str(host),
                 "--hosts-per-pod", "2", "--pod-coordinator", f"127.0.0.1:{coordinator}", "--listen", "127.0.0.1:0",
                 "--devices", "1", "--port-file", str(port)],
                env={**cli_env(), **token}, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        local = _generate("--checkpoint", str(checkpoints), *GREEDY, "--devices", "2", "--hosts-per-pod", "2")
        deadline = time.monotonic() + 120
        while not all(p.exists() and p.read_text().strip() for p in ports):
            assert all(w.poll() is None for w in workers), (tmp_path / "host-0.log").read_text()
            assert time.monotonic() < deadline, "the pod's hosts did not start listening"
            time.sleep(0.1)
        hosts = ",".join(f"127.0.0.1:{p.read_text().strip()}" for p in ports)
        running = run_cli("generate", "--checkpoint", str(checkpoints), *GREEDY, "--workers", hosts, env=token,
                          timeout=120)
        refused = run_cli("generate", "--checkpoint", str(checkpoints), *GREEDY, "--workers", hosts,
                          "--model-parallel", "2", env=token, timeout=60)
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.wait(timeout=30)
    assert one_host.returncode == 0, one_host.stderr
    assert local.returncode == 0, local.stdout + local.stderr
    assert "2 simulated device(s) on 2 hosts, mesh data=2 model=1" in local.stderr
    assert running.returncode == 0, running.stdout + running.stderr
    assert f"generating on the pod at {hosts.replace(',', ', ')}: 2 device(s) on 2 host(s)" in running.stderr
    for host in (0, 1):     # the command configured its pod to generate: nothing built that a restore replaces
        assert "configured to generate only: no step programs, no initial state" in \
            (tmp_path / f"host-{host}.log").read_text()
    assert local.stdout == running.stdout == one_host.stdout
    assert refused.returncode == 2 and "the model axis stays inside a host" in refused.stderr, refused.stderr


def test_a_jsonl_of_prompts_gives_a_jsonl_of_completions(checkpoints, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def "}\n{"prompt": "import os\\n", "id": 7}\n\n{"prompt": ""}\n')
    out = tmp_path / "out.jsonl"
    result = _generate("--checkpoint", str(checkpoints / "10"), "--prompts", str(prompts), "--out", str(out),
                       "--max-tokens", "5", "--temperature", "0")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["prompt"] for line in lines] == ["def ", "import os\n", ""]
    for line in lines:
        assert line["tokens"] == 5 and line["finish"] == "length" and isinstance(line["completion"], str)
    assert "tokens/s" in result.stderr and result.stdout == ""


@pytest.mark.parametrize("case", ["missing checkpoint", "prompt longer than max_seq_len",
                                  "jsonl line without the field", "prompt + max tokens beyond max_seq_len",
                                  "a directory without checkpoints"])
def test_bad_input_is_refused_quickly_naming_the_problem(checkpoints, tmp_path, case):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "def "}\n{"text": "no prompt here"}\n')
    empty = tmp_path / "empty"
    empty.mkdir()
    args, message = {
        "missing checkpoint": (["--checkpoint", str(tmp_path / "nope"), "--prompt", "x"],
                               f"checkpoint {tmp_path / 'nope'} does not exist"),
        "prompt longer than max_seq_len": (["--checkpoint", str(checkpoints), "--prompt", "x" * 40],
                                           "40 tokens, more than the model's context of 32 tokens"),
        "jsonl line without the field": (["--checkpoint", str(checkpoints), "--prompts", str(bad)],
                                         f"{bad}:2: no 'prompt' field"),
        "prompt + max tokens beyond max_seq_len": (["--checkpoint", str(checkpoints), "--prompt", "abc",
                                                    "--max-tokens", "40"], "ask for at most 29"),
        "a directory without checkpoints": (["--checkpoint", str(empty), "--prompt", "x"], "is not a checkpoint"),
    }[case]
    started = time.monotonic()
    result = _generate(*args)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "error: " in result.stderr and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert "starting a pod worker" not in result.stderr      # refused before any worker starts
    assert time.monotonic() - started < 30


def test_an_out_file_that_cannot_be_written_is_refused_before_any_worker_starts(checkpoints, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def "}\n')
    result = _generate("--checkpoint", str(checkpoints), "--prompts", str(prompts),
                       "--out", str(tmp_path / "no-such-dir" / "out.jsonl"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "error: config: --out" in result.stderr and "no-such-dir" in result.stderr
    assert "starting a pod worker" not in result.stderr and "Traceback" not in result.stderr
