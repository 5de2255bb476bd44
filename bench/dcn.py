"""Benchmark: the DCN gradient exchange between two pods, against a raw TCP socket transfer and a
jax.distributed (gloo) cross-process all-reduce of the same bytes, in one run on one machine.

    python bench/dcn.py                      # prints one JSON object

Every measurement uses two processes started with subprocess (never a fork after importing jax)
that exchange a gradient the size of a ~25M-parameter model (float32, ~103 MB) in both directions
at once, as the pods do. Times are medians over --repeats rounds after one warm-up round; MB/s is
payload bytes per direction / time (1 MB = 1e6 bytes).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# A PaLM-style model of 25.7M parameters: the leaves of its gradient are what travels.
MODEL = dict(d_model=512, n_layers=8, n_heads=8, head_dim=64, mlp_dim=1536, vocab_size=4096)


def leaf_shapes() -> list[tuple[int, ...]]:
    import jax
    from model import abstract_params
    from model.config import ModelConfig
    return [tuple(l.shape) for l in jax.tree.leaves(abstract_params(ModelConfig(**MODEL)))]


def _wait_file(path: pathlib.Path, timeout_s: float = 120.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and path.read_text().strip()):
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {path}")
        time.sleep(0.02)
    return path.read_text().strip()


def _write_file(path: pathlib.Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# -- roles (each runs in its own process) ----------------------------------------------------------
def role_exchange(args) -> dict:
    import concurrent.futures

    import grpc
    import numpy as np

    import protos
    from pod_worker.dcn import Exchange, LeafSpec
    from pod_worker.server import PodWorkerService
    from protos import multipod_pb2_grpc as pb_grpc
    from protos.transport import add_port

    shapes = [tuple(s) for s in json.loads(args.shapes)]
    rng = np.random.default_rng(args.pod)
    leaves = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(16), options=protos.channel_options())
    service = PodWorkerService(args.pod, threading.Event())
    pb_grpc.add_DcnServicer_to_server(service, server)
    port = add_port(server, "127.0.0.1:0")
    server.start()
    folder = pathlib.Path(args.dir)
    _write_file(folder / f"pod{args.pod}.port", str(port))
    addresses = [f"127.0.0.1:{_wait_file(folder / f'pod{p}.port')}" for p in range(2)]
    exchange = Exchange("bench", args.pod, addresses, [LeafSpec(s, np.dtype(np.float32)) for s in shapes],
                        args.chunk_bytes, 300.0, streams=args.streams, compression=args.compression)
    service.exchange = exchange
    # Both pods must be able to receive before either sends.
    _write_file(folder / f"pod{args.pod}.ready", "1")
    for p in range(2):
        _wait_file(folder / f"pod{p}.ready")
    times, idle = [], []
    sent = 0
    for step in range(args.repeats + 1):
        exchange.inbox.set_next_step(step)
        start = time.perf_counter()
        _, stats = exchange.all_reduce(step, leaves)
        times.append(time.perf_counter() - start)
        idle.append(stats.idle_s)
        sent = stats.bytes_sent
    time.sleep(0.5)   # let the peer finish its last step before this server goes away
    exchange.close()
    server.stop(0)
    return {"times": times[1:], "idle": idle[1:], "bytes_sent": sent}


def role_tcp(args) -> dict:
    nbytes = args.nbytes
    folder = pathlib.Path(args.dir)
    if args.pod == 0:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        _write_file(folder / "tcp.port", str(listener.getsockname()[1]))
        conn, _ = listener.accept()
    else:
        conn = socket.create_connection(("127.0.0.1", int(_wait_file(folder / "tcp.port"))))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = os.urandom(1 << 20) * (nbytes >> 20) + os.urandom(nbytes & ((1 << 20) - 1))
    inbox = bytearray(nbytes)
    view = memoryview(inbox)
    times = []
    for _ in range(args.repeats + 1):
        start = time.perf_counter()
        sender = threading.Thread(target=conn.sendall, args=(payload,))
        sender.start()
        got = 0
        while got < nbytes:
            n = conn.recv_into(view[got:], min(nbytes - got, 4 << 20))
            if not n:
                raise SystemExit("peer closed the socket")
            got += n
        sender.join()
        times.append(time.perf_counter() - start)
    conn.close()
    return {"times": times[1:]}


def role_gloo(args) -> dict:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.pop("XLA_FLAGS", None)
    import jax
    import numpy as np
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=2, process_id=args.pod)
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()), ("pods",))
    n = args.nbytes // 4
    local = np.random.default_rng(args.pod).standard_normal((1, n), dtype=np.float32)
    x = jax.make_array_from_single_device_arrays(
        (2, n), NamedSharding(mesh, P("pods")), [jax.device_put(local, jax.local_devices()[0])])
    reduce = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "pods"), mesh=mesh, in_specs=P("pods"),
                                   out_specs=P("pods")))
    times = []
    for _ in range(args.repeats + 1):
        start = time.perf_counter()
        reduce(x).block_until_ready()
        times.append(time.perf_counter() - start)
    jax.distributed.shutdown()
    return {"times": times[1:]}


ROLES = {"exchange": role_exchange, "tcp": role_tcp, "gloo": role_gloo}


# -- the driver ------------------------------------------------------------------------------------
def _pair(role: str, extra: list[str], timeout_s: float = 600.0) -> list[dict]:
    """Run `role` in two fresh processes (pod 0 and pod 1); return their JSON results."""
    with tempfile.TemporaryDirectory() as folder:
        procs = []
        for pod in range(2):
            cmd = [sys.executable, __file__, "--role", role, "--pod", str(pod), "--dir", folder, *extra]
            env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
            env.pop("XLA_FLAGS", None)
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=timeout_s)
            if proc.returncode:
                raise SystemExit(f"{role} pod failed ({proc.returncode}):\n{err[-3000:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results


def _summary(results: list[dict], nbytes: int) -> dict:
    # A round ends when both sides have everything: the slower side's time counts.
    per_round = [max(t) for t in zip(*(r["times"] for r in results))]
    median = statistics.median(per_round)
    return {"median_s": round(median, 4), "MB_per_s": round(nbytes / median / 1e6, 1),
            "rounds_s": [round(t, 4) for t in per_round]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=sorted(ROLES))
    parser.add_argument("--pod", type=int, default=0)
    parser.add_argument("--dir")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--shapes")
    parser.add_argument("--nbytes", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk-bytes", type=int, default=2 << 20)
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--compression", default="none")
    parser.add_argument("--variants", default="none:1,none:2,none:4,bf16:1,int8:1",
                        help="exchange variants COMPRESSION:STREAMS, comma-separated")
    parser.add_argument("--skip-gloo", action="store_true")
    args = parser.parse_args()
    if args.role:
        print(json.dumps(ROLES[args.role](args)))
        return

    shapes = leaf_shapes()
    params = sum(int(__import__("math").prod(s)) for s in shapes)
    nbytes = params * 4
    report = {"benchmark": "dcn", "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
              "params": params, "leaves": len(shapes), "payload_bytes": nbytes, "repeats": args.repeats,
              "chunk_bytes": args.chunk_bytes}
    common = ["--repeats", str(args.repeats), "--nbytes", str(nbytes)]
    report["raw_tcp"] = _summary(_pair("tcp", common), nbytes)
    if args.skip_gloo:
        report["gloo_allreduce"] = None
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            report["gloo_allreduce"] = _summary(_pair("gloo", common + ["--port", str(port)]), nbytes)
        except SystemExit as exc:
            report["gloo_allreduce"] = {"error": str(exc)[-500:]}
    report["multipod"] = {}
    for variant in args.variants.split(","):
        compression, streams = variant.split(":")
        results = _pair("exchange", common + ["--shapes", json.dumps(shapes), "--streams", streams,
                                              "--compression", compression,
                                              "--chunk-bytes", str(args.chunk_bytes)])
        summary = _summary(results, nbytes)
        summary["wire_bytes_per_pod"] = results[0]["bytes_sent"]
        summary["idle_s_median"] = round(statistics.median(results[0]["idle"]), 4)
        report["multipod"][variant] = summary
    tcp = report["raw_tcp"]["median_s"]
    gloo = (report["gloo_allreduce"] or {}).get("median_s")
    report["ratios"] = {
        variant: {"vs_raw_tcp_throughput": round(tcp / r["median_s"], 3),
                  "speedup_vs_gloo": round(gloo / r["median_s"], 3) if gloo else None}
        for variant, r in report["multipod"].items()}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
