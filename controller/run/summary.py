"""The end of a run: a sample from the model, summary.json and the summary printed for the user
(the final held-out evaluation is the Evaluator's, at the last step boundary)."""
from __future__ import annotations

import json
import pathlib
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from multipod.controller.data.batches import narrow
from multipod.controller.observe.metrics import out
from multipod.protos import codec, multipod_pb2 as pb

if TYPE_CHECKING:
    from multipod.controller.core.run_config import Config
    from multipod.controller.observe.records import StepRecord


@dataclass
class Summary:
    """What a finished run reports (also written to summary.json)."""
    steps: int
    first_loss: float
    final_loss: float
    eval_loss: float | None
    eval_bits_per_byte: float | None
    checksum: str                 # the final state checksum (the same on every pod)
    median_step_time_s: float
    median_tokens_per_s: float
    median_mfu: float | None
    median_hfu: float | None
    sample: str | None
    run_dir: str
    # Per pod ("0", "1", ...), the median over the timed steps of its peer_wait_s: how long it waited
    # each step on a pod that had not begun sending its gradient (a slower pod, not the link).
    median_peer_wait_s: dict[str, float] = field(default_factory=dict)
    # Per pod, the median of its wire_wait_s: how long it waited each step while a peer's chunks
    # were landing (the link, not a slower pod).
    median_wire_wait_s: dict[str, float] = field(default_factory=dict)
    # What `checksum` is of: the whole state in every-step sync; in DiLoCo only the agreed state
    # (the agreed parameters and the outer optimizer's), since each pod's own parameters and inner
    # optimizer state differ from the others' between outer steps by design.
    checksum_of: str = "state"


# A wait on slower pods under this share of the median step is not worth a line of its own.
STRAGGLER_SHARE = 0.05


WaitKind = Literal["peer_wait_s", "wire_wait_s"]     # the PodTimings fields that split idle_s


def median_waits(records: list[StepRecord], kind: WaitKind = "peer_wait_s") -> dict[str, float]:
    """Per pod, the median of its wait of this kind over the steps it took part in (none for one
    pod)."""
    waits: dict[int, list[float]] = {}
    for record in records:
        if len(record.pods) > 1:
            for pod in record.pods:
                waits.setdefault(pod.pod, []).append(getattr(pod, kind))
    return {str(pod): statistics.median(values) for pod, values in sorted(waits.items())}


def _noticeable(waits: dict[str, float], summary: Summary) -> str | None:
    """Each pod's median wait ("pod 0 40 ms, pod 1 0 ms") when pods wait on each other and the
    longest is a noticeable share of the step (STRAGGLER_SHARE); None otherwise."""
    if len(waits) < 2 or max(waits.values()) < STRAGGLER_SHARE * summary.median_step_time_s:
        return None
    return ", ".join(f"pod {pod} {1e3 * wait:.0f} ms" for pod, wait in waits.items())


def straggler_line(summary: Summary) -> str | None:
    """A line naming the waits on slower pods when they are a noticeable share of the step, and
    the pod the others waited for (the one that waited least); None otherwise."""
    waits = summary.median_peer_wait_s
    each = _noticeable(waits, summary)
    if each is None:
        return None
    slowest = min(waits, key=lambda pod: (waits[pod], int(pod)))
    return (f"waiting on slower pods, median per step: {each} (of a {summary.median_step_time_s:.3f}s step); "
            f"the others waited on pod {slowest}, the last to reach the exchange")


def link_line(summary: Summary) -> str | None:
    """A line naming the waits on the link (peers' chunks landing) when they are a noticeable
    share of the step, with the command that picks settings for it; None otherwise."""
    each = _noticeable(summary.median_wire_wait_s, summary)
    if each is None:
        return None
    return (f"waiting on the link, median per step: {each} (of a {summary.median_step_time_s:.3f}s step); "
            "`multipod tune --dcn` picks the cross-pod settings for this link (docs/usage.md)")


def sample(client, config: Config, tokenizer) -> str | None:
    """sample.tokens tokens the model writes after sample.prompt at sample.temperature, drawn with
    run.seed (None if none asked); `config` is the run's Config."""
    run, asked = config.run, config.sample
    if not asked.tokens:
        return None
    prompt = tokenizer.encode(asked.prompt or " ")
    if prompt.size == 0:
        prompt = tokenizer.encode(" ")
    # shift_context: a sample longer than the model's context goes on from the last half of it.
    reply = client.generate(pb.GenerateRequest(
        prompt=codec.encode(narrow(prompt)), num_tokens=asked.tokens, temperature=asked.temperature,
        seed=run.seed, shift_context=True),
        run.step_timeout_s)
    return tokenizer.decode(list(prompt) + list(codec.decode(reply.tokens)))


def finish(config: Config, client, run_dir: pathlib.Path, tokenizer, last_eval: dict | None,
           records: list[StepRecord], extra: dict | None = None) -> Summary:
    """Sample on `client` (one pod: every pod holds the same parameters), then summarise the step
    records and the last evaluation into summary.json; `extra` adds fields to the file."""
    text = sample(client, config, tokenizer)
    timed = records[1:] or records   # the first step includes warm-up
    mfus = [r.mfu for r in timed if r.mfu is not None]
    hfus = [r.hfu for r in timed if r.hfu is not None]
    summary = Summary(
        steps=len(records), first_loss=records[0].loss if records else float("nan"),
        final_loss=records[-1].loss if records else float("nan"),
        eval_loss=last_eval["eval_loss"] if last_eval else None,
        eval_bits_per_byte=last_eval["eval_bits_per_byte"] if last_eval else None,
        checksum=records[-1].checksums[0] if records else "",
        median_step_time_s=statistics.median(r.step_time_s for r in timed) if timed else 0.0,
        median_tokens_per_s=statistics.median(r.tokens_per_s for r in timed) if timed else 0.0,
        median_mfu=statistics.median(mfus) if mfus else None,
        median_hfu=statistics.median(hfus) if hfus else None, sample=text, run_dir=str(run_dir),
        median_peer_wait_s=median_waits(timed, "peer_wait_s"), median_wire_wait_s=median_waits(timed, "wire_wait_s"),
        checksum_of="agreed state" if config.sync.diloco else "state")
    (run_dir / "summary.json").write_text(json.dumps({**summary.__dict__, **(extra or {})}, indent=2) + "\n")
    return summary


def print_summary(summary: Summary) -> None:
    """The run's summary (and sample) on stdout."""
    hfu_text = f", HFU {summary.median_hfu:.1%}" if summary.median_hfu is not None else ""
    mfu_text = f"{summary.median_mfu:.1%}{hfu_text}" if summary.median_mfu is not None else "n/a (no peak FLOP/s known)"
    out("")
    out(f"done: {summary.steps} steps, loss {summary.first_loss:.4f} -> {summary.final_loss:.4f}"
        + (f", held-out loss {summary.eval_loss:.4f}" if summary.eval_loss is not None else "")
        + (f" ({summary.eval_bits_per_byte:.3f} bits/byte)" if summary.eval_bits_per_byte is not None else ""))
    out(f"median step {summary.median_step_time_s:.3f}s, {summary.median_tokens_per_s:,.0f} tokens/s, MFU {mfu_text}")
    for line in (straggler_line(summary), link_line(summary)):
        if line:
            out(line)
    out(f"final {summary.checksum_of} checksum {summary.checksum} (identical on every pod)")
    out(f"run directory: {summary.run_dir}")
    if summary.sample is not None:
        out("sample:\n" + "-" * 60 + "\n" + summary.sample + "\n" + "-" * 60)
