"""Benchmark: multipod's 2-pod step against MaxText 0.2.5's 2-slice step on the same model, batch,
CPU and kernel-shaped link (issue 20, item 5). Not part of the test suite; needs root.

    python bench/vs_maxtext.py [--links 0,1,0.2] [--bf16-at 0.2] [--fused-at 0] [--rounds 3] [--steps 17]
                               [--also-set KEY=VALUE ...]

The model is configs/vs_maxtext.toml on both sides (emb 256, 4 layers, 4 heads, head_dim 64, mlp
1024, vocab 256, seq 256, global batch 8, float32). Each side runs two processes, each in a
network namespace of its own, made with controller/launch/netns.py (Network: one namespace per
process, the two joined through a bridge by veth links whose tbf qdiscs shape each process's
traffic to R Gb/s each way; 0 = unshaped), and each pinned to its own core (taskset):
- MaxText: 2 processes as 2 slices (dcn_data_parallelism=2, per_device_batch_size=4, synthetic
  data), started through bench/maxtext_launch.py with MaxText's own Python (--maxtext-python;
  shared/peers/maxtext/setup.sh installs it), gloo bound to the namespace's address.
- multipod: 2 pods of 1 device (bench/pods.py: NetnsPods pinned), the controller in the root
  namespace (`multipod train --workers`), the config's defaults (dcn.overlap as the config says;
  exact float32 sync), with dcn.compression = "bf16" at the --bf16-at links, and with the fused
  step (dcn.overlap = false) at the --fused-at links, and with the --also-set settings at every
  link (contender "multipod_set"). Both planes plain (--insecure), as gloo is.
Every round runs every link's every contender, one after another, in an order that alternates
between rounds, so that the machine's load hits them alike. A run's step time is the median over
its steps >= --warmup (MaxText: "completed step" lines of process 0; multipod: metrics.jsonl
step_time_s). Per link and contender: the median over all rounds' timed steps, and multipod /
MaxText, of those medians and round by round (each round's run against that round's MaxText).
Every process has a deadline (--run-timeout): a run that misses it is killed and reported as a
timeout, never waited for. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.pods import controller_flags, pin, pinned_pods  # noqa: E402
from multipod.controller.launch.netns import Network, check_available  # noqa: E402

CONFIG = ROOT / "configs" / "vs_maxtext.toml"
LAUNCH = ROOT / "bench" / "maxtext_launch.py"
DEFAULT_MAXTEXT_PYTHON = "/tmp/maxtextprobe/venv/bin/python"
# The same model and batch as configs/vs_maxtext.toml, in MaxText's terms (shared/peers/maxtext/runmp.sh).
MAXTEXT_ARGS = [
    "hardware=cpu", "dataset_type=synthetic", "per_device_batch_size=4",
    "base_emb_dim=256", "base_num_decoder_layers=4", "base_num_query_heads=4", "base_num_kv_heads=4",
    "base_mlp_dim=1024", "head_dim=64", "vocab_size=256", "max_target_length=256", "dtype=float32",
    "enable_checkpointing=false", "attention=dot_product", 'jax_cache_dir=""', "log_config=false",
    "enable_goodput_recording=false", "monitor_goodput=false", "jax_distributed_initialization_timeout=120",
    "num_slices=2", "dcn_data_parallelism=2", "ici_data_parallelism=1", "ici_fsdp_parallelism=1",
]
_STEP_LINE = re.compile(r"completed step: (\d+), seconds: ([\d.]+)")
_TOKEN = secrets.token_hex(24)


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def measure_rate(network: Network, nbytes: int, timeout_s: float = 30.0) -> float | None:
    """Gb/s of one TCP stream of `nbytes` from process 0's namespace to process 1's (first byte
    received to last); None if it fails or misses its deadline."""
    layout = network.layout
    assert layout is not None
    receiver = ("import socket, sys, time\n"
                "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
                f"s.bind(({layout.host_ip(1, 0)!r}, 0)); s.listen(1); s.settimeout({timeout_s})\n"
                "print(s.getsockname()[1], flush=True)\n"
                f"c, _ = s.accept(); c.settimeout({timeout_s}); buf = bytearray(1 << 20); got, t0 = 0, None\n"
                f"while got < {nbytes}:\n"
                "    k = c.recv_into(buf)\n"
                "    if not k: break\n"
                "    t0 = t0 or time.perf_counter(); got += k\n"
                "print(got, time.perf_counter() - t0, flush=True)\n")
    recv = subprocess.Popen(network.wrap(1, 0, [sys.executable, "-c", receiver]), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        assert recv.stdout is not None
        port = int(recv.stdout.readline())      # the receiver's own timeout bounds this read
        sender = (f"import socket; c = socket.create_connection(({layout.host_ip(1, 0)!r}, {port}), {timeout_s}); "
                  f"c.sendall(bytes({nbytes})); c.close()")
        subprocess.run(network.wrap(0, 0, [sys.executable, "-c", sender]), timeout=timeout_s, check=True,
                       capture_output=True, stdin=subprocess.DEVNULL)
        out, _ = recv.communicate(timeout=timeout_s)
        got, seconds = out.split()
        return round(int(got) * 8 / float(seconds) / 1e9, 4)
    except (subprocess.SubprocessError, ValueError, OSError):
        return None
    finally:
        _kill_group(recv)


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def run_maxtext(args, rate: float, folder: pathlib.Path) -> dict:
    """One MaxText 2-slice run in two namespaces; its step times."""
    base_yml = pathlib.Path(args.maxtext_config)
    network = Network(2, 1, rate_gbps=rate)
    procs: list[subprocess.Popen] = []
    started = time.monotonic()
    try:
        layout = network.create()
        measured = measure_rate(network, args.probe_bytes) if args.probe_bytes else None
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS", "VIRTUAL_ENV")}
        env.update(JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1", MT_PROCESS_IS_GRANULE="1",
                   JAX_COORDINATOR_ADDRESS=layout.host_ip(0, 0), JOB_INDEX="0", PROCESSES_IN_JOB="2",
                   JAX_PROCESS_COUNT="2")
        for i in (0, 1):
            cmd = [args.maxtext_python, str(LAUNCH), str(base_yml), *MAXTEXT_ARGS, f"steps={args.steps}",
                   f"run_name=vs{i}", f"base_output_directory={folder / 'out'}",
                   f"dump_hlo_local_dir={folder / 'hlo'}"]
            log = open(folder / f"maxtext-{i}.log", "w")
            procs.append(subprocess.Popen(network.wrap(i, 0, pin(i, cmd)), stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True,
                                          env=dict(env, JOB_COMPLETION_INDEX=str(i), JAX_PARTITION_INDEX=str(i),
                                                   MT_GLOO_HOST=layout.host_ip(i, 0))))
            log.close()
        deadline = started + args.run_timeout
        for proc in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return {"timeout_s": args.run_timeout, "log_tail": _tail(folder / "maxtext-0.log")}
        if any(p.returncode for p in procs):
            return {"failed": [p.returncode for p in procs], "log_tail": _tail(folder / "maxtext-0.log")}
        steps = [(int(n), float(s)) for n, s in _STEP_LINE.findall((folder / "maxtext-0.log").read_text())]
        timed = [s for n, s in steps if n >= args.warmup]
        return {"step_s": timed, "median_step_s": _median(timed), "measured_gbps": measured,
                "wall_s": round(time.monotonic() - started, 1)}
    finally:
        for proc in procs:
            _kill_group(proc)
        network.destroy()


def run_multipod(args, rate: float, folder: pathlib.Path, settings: list[str]) -> dict:
    """One multipod 2-pod run in two namespaces (bench/pods.py); its step times and the pods' parts."""
    started = time.monotonic()
    os.environ.update(JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1", MULTIPOD_AUTH_TOKEN=_TOKEN)
    os.environ.pop("XLA_FLAGS", None)
    pods = pinned_pods([0, 1], folder / "workers", netns=True, rate_gbps=rate, encrypt=False)
    with pods:
        cmd = [sys.executable, "-m", "multipod.cli", "train", "--workers", pods.workers, "--config", str(CONFIG),
               "--steps", str(args.steps), "--seed", "1", "--run-dir", str(folder / "run"),
               "--checkpoint-dir", str(folder / "checkpoints"), "--set", "checkpoint.every=0",
               *controller_flags(pods)]
        for s in settings:
            cmd += ["--set", s]
        left = args.run_timeout - (time.monotonic() - started)
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, stdin=subprocess.DEVNULL,
                                    timeout=max(1.0, left))
        except subprocess.TimeoutExpired:
            return {"timeout_s": args.run_timeout}
        if result.returncode:
            return {"failed": result.returncode, "log_tail": result.stderr[-2000:]}
    records = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r["step"] >= args.warmup]
    parts = {k: _median([p[k] for r in timed for p in r["pods"]])
             for k in ("compute_s", "exchange_s", "exposed_exchange_s", "idle_s", "update_s")}
    return {"step_s": [r["step_time_s"] for r in timed], "median_step_s": _median([r["step_time_s"] for r in timed]),
            "pods_median": parts,
            "dcn_bytes_sent_per_pod_per_step": _median([p["dcn_bytes_sent"] for r in timed for p in r["pods"]]),
            "pods_bitwise_identical_every_step": all(len(set(r["checksums"])) == 1 for r in timed),
            # dcn.lossless: the share of timed pod-steps whose chunks went zstd-packed
            "packed_share": round(sum(bool(p.get("dcn_packed")) for r in timed for p in r["pods"])
                                  / max(1, sum(len(r["pods"]) for r in timed)), 3),
            "wall_s": round(time.monotonic() - started, 1)}


def _tail(path: pathlib.Path) -> str:
    try:
        return path.read_text(errors="replace")[-2000:]
    except OSError:
        return ""


def _link_name(rate: float) -> str:
    return "unshaped" if not rate else f"{rate:g} Gb/s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", default="0,1,0.2", help="comma-separated link rates in Gb/s (0: unshaped veth)")
    parser.add_argument("--bf16-at", default="0.2", help="links (Gb/s) where multipod also runs with bf16 compression")
    parser.add_argument("--fused-at", default="",
                        help="links (Gb/s) where multipod also runs the fused step (dcn.overlap=false)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--also-set", action="append", default=[], metavar="KEY=VALUE",
                        help="also run multipod with these settings (contender multipod_set), at every link")
    parser.add_argument("--steps", type=int, default=17)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of every run's medians")
    parser.add_argument("--run-timeout", type=float, default=600.0, help="seconds per run, start to end")
    parser.add_argument("--probe-bytes", type=int, default=24_000_000,
                        help="bytes of a TCP stream that measures each MaxText run's link first (0: skip)")
    parser.add_argument("--maxtext-python", default=os.environ.get("MAXTEXT_PYTHON", DEFAULT_MAXTEXT_PYTHON))
    args = parser.parse_args()
    if (os.cpu_count() or 1) < 2 or not shutil.which("taskset"):
        raise SystemExit("needs 2 CPU cores and taskset (one process per core)")
    links = [float(x) for x in args.links.split(",") if x.strip()]
    bf16_at = {float(x) for x in args.bf16_at.split(",") if x.strip()}
    fused_at = {float(x) for x in args.fused_at.split(",") if x.strip()}
    check_available(shape=any(links))
    found = subprocess.run([args.maxtext_python, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
                           capture_output=True, text=True, timeout=120)
    if found.returncode:
        raise SystemExit(f"MaxText is not importable with {args.maxtext_python} (shared/peers/maxtext/setup.sh "
                         f"installs it): {found.stderr[-500:]}")
    args.maxtext_config = str(pathlib.Path(found.stdout.strip()) / "configs" / "base.yml")
    from multipod.controller.core.run_config import load_config
    config = load_config(str(CONFIG))
    contenders = [("maxtext", None), ("multipod", [])]
    load_start, started = _load(), datetime.datetime.now(datetime.UTC)
    runs: dict = {}
    with tempfile.TemporaryDirectory(prefix="vs-maxtext-") as tmp:
        for round_ in range(args.rounds):
            plan = [(rate, name, settings) for rate in links
                    for name, settings in contenders
                    + ([("multipod_bf16", ['dcn.compression="bf16"'])] if rate in bf16_at else [])
                    + ([("multipod_fused", ["dcn.overlap=false"])] if rate in fused_at else [])
                    + ([("multipod_set", list(args.also_set))] if args.also_set else [])]
            for rate, name, settings in (plan if round_ % 2 == 0 else plan[::-1]):
                folder = pathlib.Path(tmp) / f"r{round_}-{name}-{rate:g}"
                folder.mkdir()
                result = (run_maxtext(args, rate, folder) if settings is None
                          else run_multipod(args, rate, folder, settings))
                result["round"], result["load"] = round_, _load()
                runs.setdefault(_link_name(rate), {}).setdefault(name, []).append(result)
                print(f"round {round_} {_link_name(rate)} {name}: {result.get('median_step_s')} s/step",
                      file=sys.stderr, flush=True)
    summary: dict = {}
    for link, per in runs.items():
        row: dict = {}
        for name, results in per.items():
            steps = [s for r in results for s in r.get("step_s", [])]
            row[name] = {"median_step_s": _median(steps), "per_run_median_step_s": [r.get("median_step_s")
                                                                                     for r in results],
                         "runs_failed_or_timed_out": sum(1 for r in results if "step_s" not in r)}
        mt = row.get("maxtext", {}).get("median_step_s")
        mt_rounds = {r["round"]: r.get("median_step_s") for r in per.get("maxtext", [])}
        for name in row:
            if name != "maxtext" and mt and row[name]["median_step_s"]:
                row[name]["ratio_to_maxtext"] = round(row[name]["median_step_s"] / mt, 4)
                # Each round's runs against that round's MaxText: load that changes between rounds
                # (the machine is shared) moves both sides of a round's ratio alike.
                pairs = [r["median_step_s"] / mt_rounds[r["round"]] for r in per[name]
                         if r.get("median_step_s") and mt_rounds.get(r["round"])]
                row[name]["per_round_ratio"] = [round(x, 4) for x in pairs]
                row[name]["median_of_round_ratios"] = _median(pairs)
        probes = [r["measured_gbps"] for r in per.get("maxtext", []) if r.get("measured_gbps")]
        row["measured_link_gbps"] = _median(probes)
        summary[link] = row
    for per in runs.values():       # the step lists were pooled above; keep the JSON readable
        for results in per.values():
            for r in results:
                r.pop("step_s", None)
    print(json.dumps({
        "benchmark": "vs_maxtext", "date": started.isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "load_average_start": load_start, "load_average_end": _load(), "config": str(CONFIG.relative_to(ROOT)),
        "multipod_params": config.model.param_count(), "multipod_dcn_overlap": str(config.dcn.overlap),
        "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup, "summary": summary, "runs": runs,
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
