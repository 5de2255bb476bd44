"""`multipod ptune` on a base model trained here (tests/e2e/ptune_task.py's toy task): the task loss
falls by a clear margin, 2 pods train as 1 pod, the base stays bitwise as it was, the DCN carries
the prompt's gradient alone, and `multipod generate --prompt-checkpoint` writes after the learned
prompt, refusing one made for another base. Bad input is refused before a worker starts."""
from __future__ import annotations

import concurrent.futures
import json

import pytest

from tests.e2e import ptune_task
from tests.helpers import TINY, read_evals, read_metrics, run_cli, same_losses

STEPS = 60
# 2 pods against 1 over PARITY_STEPS steps, at a tenth of ptune's learning rate. The sum of two
# half-batch gradients differs from the whole batch's in its last bits. At ptune's 3e-2 (reached at
# the end of the warmup, step 10) the tiny prompt encoder's training is chaotic: each step multiplies
# such a difference about tenfold (gradient norms 1e-6 apart at step 3 and 15% apart at step 11 on
# one machine, 0.06% at step 11 on another), so two correct runs part ways at a step that depends
# on the CPU's rounding. At 3e-3 the same two runs stay within 3e-7 (loss) and 2e-6 (gradient norm)
# for all 15 steps.
PARITY_STEPS = 15
PARITY_LR = "optimizer.learning_rate=3e-3"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ptune")
    corpus, task = ptune_task.write(folder)
    base = folder / "base"
    # On 2 devices: the pods below tune and generate on 1, reading the base resharded.
    result = run_cli("local", "--config", TINY, "--pods", "1", "--devices-per-pod", "2", "--steps", "300",
                     "--data", str(corpus), "--run-dir", str(base), "--no-report", "--set", "sample.tokens=0",
                     "--set", "eval.batches=0")
    assert result.returncode == 0, result.stdout + result.stderr
    return folder, base / "checkpoints", task


def _ptune(files, name: str, pods: int, steps: int = STEPS, kind: str = "mlp", *extra: str):
    folder, checkpoints, task = files
    run_dir = folder / name
    # The schedule is fixed (decay_steps), so a shorter run follows the longer one's first steps.
    result = run_cli("ptune", "--checkpoint", str(checkpoints), "--data", str(task), "--kind", kind,
                     "--virtual-tokens", "4", "--pods", str(pods), "--devices-per-pod", "1", "--steps", str(steps),
                     "--eval-every", str(PARITY_STEPS), "--set", f"optimizer.decay_steps={STEPS}", "--no-peak",
                     "--run-dir", str(run_dir), "--no-report", *extra)
    assert result.returncode == 0, result.stdout + result.stderr
    return run_dir, result


@pytest.fixture(scope="module")
def two_pods(files):
    return _ptune(files, "two", 2)


def test_two_pods_train_as_one(files):
    runs = [("one", 1), ("two-parity", 2)]
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        (one, _), (two, _) = pool.map(lambda run: _ptune(files, *run, PARITY_STEPS, "mlp", "--set", PARITY_LR,
                                                         "--set", "sample.tokens=0"), runs)
    steps_two, steps_one = read_metrics(two), read_metrics(one)
    assert len(steps_two) == len(steps_one) == PARITY_STEPS
    same_losses(steps_two, steps_one)
    for a, b in zip(steps_two, steps_one):
        if not a.get("partial_loss"):
            assert a["tokens"] == b["tokens"]    # the output tokens of the batch, the same on any pods
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), a["step"]
    evals_two, evals_one = read_evals(two), read_evals(one)
    assert evals_two[-1]["trained_steps"] == evals_one[-1]["trained_steps"] == PARITY_STEPS
    assert evals_two[-1]["eval_loss"] == pytest.approx(evals_one[-1]["eval_loss"], rel=1e-5)


def test_the_task_loss_falls(two_pods):
    two, result = two_pods
    steps = read_metrics(two)
    assert len(steps) == STEPS
    # Clearly lower: the learned prompt picks the mode the task's outputs are in, and makes the
    # end-of-text after them likelier (the base only saw it after a document's last line). Measured
    # on this base with one pod (2026-12-07): the first letter's loss 2.54 -> 1.39 (1.40 with the
    # base's own embeddings of "xy\nA" as the prompt), the end-of-text's 7.7 -> 5.3. On other bases
    # of the same quality (another init's draws) 60 steps can learn neither: docs/benchmarks.md.
    assert read_evals(two)[-1]["eval_loss"] < steps[0]["loss"] - 0.3
    assert "frozen base" in result.stdout and "sample:" in result.stdout
    # dcn.overlap's default cannot overlap prompt tuning's step: it says so, once.
    assert result.stdout.count("dcn.overlap = auto: the pods run the fused step (prompt tuning") == 1


def test_prompt_tuning_itself_lowers_the_task_loss_as_clearly(files):
    # --kind prompt: the virtual tokens' embeddings are the parameters (no encoder). They move
    # slowly at the encoder's learning rate (2.63 -> 2.35 here at 3e-2: a margin that depends on the
    # base, which depends on the CPU's rounding); Lester et al. tune prompts at 0.3.
    run_dir, _ = _ptune(files, "prompt", 1, STEPS, "prompt", "--set", "optimizer.learning_rate=0.3",
                        "--set", "sample.tokens=0")
    steps, evals = read_metrics(run_dir), read_evals(run_dir)
    assert len(steps) == STEPS and evals[-1]["eval_loss"] < steps[0]["loss"] - 0.3


def test_the_base_stays_frozen_and_only_the_prompt_travels_and_is_saved(files, two_pods):
    from multipod.pod_worker import checkpoint
    two, _ = two_pods
    summary = json.loads((two / "summary.json").read_text())
    at_configure = summary["base_fingerprint"]
    assert at_configure and summary["last_checkpoint"].endswith(f"/{STEPS}")
    # Every prompt checkpoint checksums the pods' base anew when it is written: the first (step 0)
    # and the last show the base as the pods loaded it.
    for step in (0, STEPS):
        saved = checkpoint.read_metadata(str(two / "checkpoints" / str(step)))
        assert saved["base_fingerprint"] == at_configure
        assert saved["base_checksum"] == saved["base_checksum_loaded"]
    import jax

    from multipod.model.prompt import init_prompt
    d_model = json.loads((files[1] / "run_config.json").read_text())["model"]["d_model"]
    prompt_bytes = sum(leaf.size * 4 for leaf in jax.tree.leaves(init_prompt("mlp", 4, d_model, 128, 0)))
    for record in read_metrics(two):
        # Each of the 2 pods sends its prompt gradient to the other: nothing of the base travels.
        assert record["dcn_bytes_sent"] == 2 * prompt_bytes


def test_generation_uses_the_prompt_checkpoint_and_refuses_another_base(files, two_pods):
    folder, checkpoints, _ = files
    two, _ = two_pods
    args = ("generate", "--checkpoint", str(checkpoints), "--prompt", ">", "--max-tokens", "8", "--temperature", "0")
    prompt = ("--prompt-checkpoint", str(two / "checkpoints"))
    runs = [args, args + prompt, args[:2] + (str(checkpoints / "200"),) + args[3:] + prompt]
    # Side by side: most of each is a worker starting and waiting for its compiles.
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        plain, tuned, other = pool.map(lambda a: run_cli(*a), runs)
    assert plain.returncode == 0 and tuned.returncode == 0, plain.stderr + tuned.stderr
    assert "virtual tokens of prompt checkpoint" in tuned.stderr and f"checkpoints/{STEPS}" in tuned.stderr
    assert tuned.stdout != plain.stdout
    assert other.returncode == 1
    assert "was tuned on a base model with fingerprint" in other.stderr and "give the base" in other.stderr


@pytest.mark.parametrize("case", ["missing checkpoint", "line without the output", "example beyond the context",
                                  "a corpus, not a task", "a prompt checkpoint as the base"])
def test_bad_input_is_refused_before_a_worker_starts(files, two_pods, tmp_path, case):
    folder, checkpoints, task = files
    data, message = str(task), ""
    if case == "missing checkpoint":
        checkpoints, message = tmp_path / "nothing", "does not exist"
    elif case == "a prompt checkpoint as the base":
        checkpoints, message = two_pods[0] / "checkpoints", "is a prompt checkpoint (of a multipod ptune run)"
    elif case == "line without the output":
        (tmp_path / "t.jsonl").write_text('{"input": ">", "output": "ab"}\n{"input": ">", "answer": "b"}\n')
        data, message = str(tmp_path / "t.jsonl"), "t.jsonl:2: no 'output' field"
    elif case == "example beyond the context":
        (tmp_path / "t.jsonl").write_text(json.dumps({"input": ">", "output": "a" * 40}) + "\n")
        data, message = str(tmp_path / "t.jsonl"), "t.jsonl:1: input + output + end-of-text are 42 tokens"
    else:
        data, message = str(folder / "corpus.jsonl"), "no 'input' field"
    result = run_cli("ptune", "--checkpoint", str(checkpoints), "--data", data, "--pods", "1", "--no-peak",
                     "--run-dir", str(tmp_path / "run"), timeout=60)
    assert result.returncode != 0 and message in result.stderr, result.stdout + result.stderr
    assert "started" not in result.stdout
