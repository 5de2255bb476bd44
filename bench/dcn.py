"""Benchmark: the DCN gradient exchange between two pods, against a raw TCP socket transfer and a
jax.distributed (gloo) cross-process all-reduce of the same bytes, in one run on one machine.

    python bench/dcn.py                      # prints one JSON object

Two processes (started with subprocess, never a fork after importing jax) play pod 0 and pod 1.
The payload is a gradient the size of a ~25M-parameter model (float32, ~103 MB), exchanged in
both directions at once, as the pods do. The contenders are measured *interleaved*: every round
runs raw TCP, then gloo, then each data-plane variant, each started by a one-byte barrier between
the two processes, so a busy machine slows them all alike. Variants: `transport` (the ZeroMQ
links and listener alone: every frame lands in its place in a preallocated buffer, no sum),
`exchange` (Exchange.all_reduce: chunking, validation, the pod-order sum), `_curve` (CURVE
encryption on), `_bf16`/`_int8` (compressed transport). Times are medians over --repeats
rounds after one warm-up round (a round's time is the slower pod's); MB/s is payload bytes per
direction / time (1 MB = 1e6 bytes).
"""
from __future__ import annotations

import argparse
import json
import math
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

    from multipod.model import abstract_params
    from multipod.model.config import ModelConfig
    return [tuple(l.shape) for l in jax.tree.leaves(abstract_params(ModelConfig(**MODEL)))]


def _wait_file(path: pathlib.Path, timeout_s: float = 180.0) -> str:
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


# -- one pod's side (runs in its own process) ------------------------------------------------------
class _Tcp:
    """A socket pair between the two processes: the raw-TCP contender and the round barrier."""

    def __init__(self, pod: int, folder: pathlib.Path, nbytes: int):
        if pod == 0:
            listener = socket.socket()
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            _write_file(folder / "tcp.port", str(listener.getsockname()[1]))
            self.conn, _ = listener.accept()
            listener.close()
        else:
            self.conn = socket.create_connection(("127.0.0.1", int(_wait_file(folder / "tcp.port"))))
        self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.nbytes = nbytes
        self.payload = os.urandom(1 << 20) * (nbytes >> 20) + os.urandom(nbytes & ((1 << 20) - 1))
        self.inbox = memoryview(bytearray(nbytes))

    def barrier(self) -> None:
        self.conn.sendall(b"b")
        if self.conn.recv(1) != b"b":
            raise SystemExit("barrier broken")

    def exchange(self) -> None:
        """Send the payload while receiving the peer's into a preallocated buffer."""
        sender = threading.Thread(target=self.conn.sendall, args=(self.payload,))
        sender.start()
        got = 0
        while got < self.nbytes:
            n = self.conn.recv_into(self.inbox[got:], min(self.nbytes - got, 4 << 20))
            if not n:
                raise SystemExit("peer closed the socket")
            got += n
        sender.join()


def _gloo(pod: int, port: int, nbytes: int):
    """A jitted cross-process psum of nbytes of float32 (jax.distributed, gloo CPU collectives)."""
    import jax
    import numpy as np
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pod)
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()), ("pods",))
    n = nbytes // 4
    local = np.random.default_rng(pod).standard_normal((1, n), dtype=np.float32)
    x = jax.make_array_from_single_device_arrays(
        (2, n), NamedSharding(mesh, P("pods")), [jax.device_put(local, jax.local_devices()[0])])
    reduce = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "pods"), mesh=mesh, in_specs=P("pods"),
                                   out_specs=P("pods")))
    return lambda: reduce(x).block_until_ready()


class _Landing:
    """Transport-only sink for a Listener: each frame is copied into its place in a preallocated
    buffer (the one user-space copy), no decoding, no sum; `done` is set when every byte is in."""

    def __init__(self, run_id: str, nbytes: int):
        import numpy as np
        self.run_id, self.nbytes = run_id, nbytes
        self.buffer = np.empty(nbytes, np.uint8)
        self.got = 0
        self.done = threading.Event()

    def receive(self, pod, step, phase, leaf, offset, payload) -> None:
        import numpy as np
        view = np.frombuffer(payload, np.uint8)
        self.buffer[offset:offset + view.size] = view
        self.got += view.size
        if self.got >= self.nbytes:
            self.done.set()

    def refused_chunk(self, pod, why) -> None:
        raise SystemExit(f"refused: {why}")

    def lost(self, pod, steps, why) -> None:
        pass


VARIANTS = ("transport", "transport_curve", "exchange", "exchange_curve", "exchange_bf16", "exchange_int8")


def pod_main(args) -> dict:
    import numpy as np

    from multipod.pod_worker.dcn import Exchange, LeafSpec, Listener
    from multipod.pod_worker.dcn.outbox import Outbox, Pacer

    secret = "bench-secret-of-at-least-16-chars"
    folder = pathlib.Path(args.dir)
    gloo = None
    gloo_error = None
    if args.gloo_port:
        try:
            gloo = _gloo(args.pod, args.gloo_port, args.nbytes)
        except Exception as exc:   # recorded in the report, not fatal for the rest
            gloo_error = f"{type(exc).__name__}: {exc}"[:500]
    tcp = _Tcp(args.pod, folder, args.nbytes)

    shapes = [tuple(s) for s in json.loads(args.shapes)]
    rng = np.random.default_rng(args.pod)
    leaves = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    specs = [LeafSpec(s, np.dtype(np.float32)) for s in shapes]
    flat = np.concatenate([l.reshape(-1) for l in leaves]).view(np.uint8)
    variants = args.variants.split(",")
    listeners = {v: Listener(args.pod, "127.0.0.1:0", secret, curve=v.endswith("_curve")) for v in variants}
    _write_file(folder / f"pod{args.pod}.json", json.dumps({v: l.address for v, l in listeners.items()}))
    tcp.barrier()
    peer = 1 - args.pod
    theirs = json.loads(_wait_file(folder / f"pod{peer}.json"))
    runners = {}
    for v in variants:
        if v.startswith("transport"):
            landing = _Landing(v, args.nbytes)
            listeners[v].attach(landing)
            outbox = Outbox(args.pod, v, {peer: theirs[v]}, args.streams, secret, Pacer(), lambda *e: print(e))

            def send_all(step, landing=landing, outbox=outbox):
                landing.got, deadline = 0, time.monotonic() + 300
                landing.done.clear()
                for start in range(0, flat.size, args.chunk_bytes):
                    outbox.put(step, deadline, peer, 0, 0, start, flat[start:start + args.chunk_bytes])
                if not landing.done.wait(300):
                    raise SystemExit("transport round timed out")
                return None, None
            runners[v] = (send_all, outbox)
        else:
            compression = v.split("_")[1] if v.count("_") and not v.endswith("_curve") else "none"
            addresses = [None, None]
            addresses[args.pod], addresses[peer] = listeners[v].address, theirs[v]
            ex = Exchange(v, args.pod, addresses, specs, listeners[v], chunk_bytes=args.chunk_bytes, timeout_s=300.0,
                          streams=args.streams, compression=compression, secret=secret)

            def reduce(step, ex=ex):
                ex.inbox.set_next_step(step)
                return ex.all_reduce(step, leaves)
            runners[v] = (reduce, ex)
    tcp.barrier()    # both pods can receive now

    times: dict[str, list[float]] = {"raw_tcp": [], "gloo_allreduce": [], **{v: [] for v in variants}}
    idle: dict[str, list[float]] = {v: [] for v in variants}

    def timed(name, fn):
        tcp.barrier()
        start = time.perf_counter()
        result = fn()
        times[name].append(time.perf_counter() - start)
        return result

    for step in range(args.repeats + 1):
        timed("raw_tcp", tcp.exchange)
        if gloo is not None:
            timed("gloo_allreduce", gloo)
        for v in variants:
            _, stats = timed(v, lambda v=v, step=step: runners[v][0](step))
            if stats is not None:
                idle[v].append(stats.idle_s)
    tcp.barrier()
    for _, owner in runners.values():
        owner.close()
    for listener in listeners.values():
        listener.close()
    if gloo is not None:
        import jax
        jax.distributed.shutdown()
    return {"times": {k: t[1:] for k, t in times.items()}, "idle": {k: t[1:] for k, t in idle.items()},
            "gloo_error": gloo_error}


# -- the driver ------------------------------------------------------------------------------------
def _summary(per_pod: list[list[float]], nbytes: int) -> dict:
    per_round = [max(t) for t in zip(*per_pod)]     # a round ends when both pods have everything
    median = statistics.median(per_round)
    return {"median_s": round(median, 4), "MB_per_s": round(nbytes / median / 1e6, 1),
            "rounds_s": [round(t, 4) for t in per_round]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pod", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--gloo-port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--shapes", help=argparse.SUPPRESS)
    parser.add_argument("--nbytes", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--chunk-bytes", type=int, default=2 << 20)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"data-plane variants, comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--streams", type=int, default=2, help="data-plane connections per peer")
    parser.add_argument("--skip-gloo", action="store_true")
    args = parser.parse_args()
    if args.pod is not None:
        print(json.dumps(pod_main(args)))
        return

    shapes = leaf_shapes()
    nbytes = sum(math.prod(s) for s in shapes) * 4
    gloo_port = 0
    if not args.skip_gloo:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            gloo_port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        procs = []
        for pod in range(2):
            cmd = [sys.executable, __file__, "--pod", str(pod), "--dir", folder, "--gloo-port", str(gloo_port),
                   "--shapes", json.dumps(shapes), "--nbytes", str(nbytes), "--repeats", str(args.repeats),
                   "--chunk-bytes", str(args.chunk_bytes), "--variants", args.variants,
                   "--streams", str(args.streams)]
            env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
            env.pop("XLA_FLAGS", None)
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        results = []
        for pod, proc in enumerate(procs):
            out, err = proc.communicate(timeout=1800)
            if proc.returncode:
                raise SystemExit(f"pod {pod} failed ({proc.returncode}):\n{err[-3000:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))

    report = {"benchmark": "dcn", "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
              "params": nbytes // 4, "leaves": len(shapes), "payload_bytes": nbytes, "repeats": args.repeats,
              "chunk_bytes": args.chunk_bytes, "streams": args.streams, "load_average": os.getloadavg()}
    times = lambda name: [r["times"][name] for r in results]
    report["raw_tcp"] = _summary(times("raw_tcp"), nbytes)
    if results[0]["times"]["gloo_allreduce"]:
        report["gloo_allreduce"] = _summary(times("gloo_allreduce"), nbytes)
    else:
        report["gloo_allreduce"] = {"error": results[0]["gloo_error"] or "skipped"}
    report["multipod"] = {}
    for v in args.variants.split(","):
        summary = _summary(times(v), nbytes)
        if results[0]["idle"][v]:
            summary["idle_s_median"] = round(statistics.median(results[0]["idle"][v]), 4)
        report["multipod"][v] = summary
    tcp = report["raw_tcp"]["median_s"]
    gloo = report["gloo_allreduce"].get("median_s")
    report["ratios"] = {
        v: {"throughput_vs_raw_tcp": round(tcp / r["median_s"], 3),
            "speedup_vs_gloo": round(gloo / r["median_s"], 3) if gloo else None}
        for v, r in report["multipod"].items()}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
