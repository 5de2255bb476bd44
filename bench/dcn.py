"""Benchmark: the DCN gradient exchange between two pods, against a raw TCP socket transfer and a
jax.distributed (gloo) cross-process all-reduce of the same bytes, in one run on one machine.

    python bench/dcn.py                      # prints one JSON object

Two processes (started with subprocess, never a fork after importing jax) play pod 0 and pod 1.
The payload is a gradient the size of a ~25M-parameter model (float32, ~103 MB), exchanged in
both directions at once, as the pods do. The contenders are measured *interleaved*: every round
runs raw TCP, then gloo, then each data-plane variant, each started by a barrier between the two
processes, so a busy machine slows them all alike. Variants: `transport` (the ZeroMQ links and
listener alone: every frame lands in its place in a preallocated buffer, no sum), `exchange`
(Exchange.all_reduce: chunking, validation, the pod-order sum), `_curve` (CURVE encryption on),
`_bf16`/`_int8` (compressed transport). Times are medians over --repeats rounds after one warm-up
round (a round's time is the slower pod's); MB/s is payload bytes per direction / time (1 MB = 1e6
bytes).

Nothing waits for ever. Every contender has --deadline-s per round; a contender that misses it is
reported as {"status": "timeout", "deadline_s": ...} and is not run again (its link may hold
stale bytes), and the others carry on. The barriers and the pods' exchange of outcomes run on a
control connection of their own, with deadlines; a pod that stops answering ends the run with
"peer_lost", and the driver kills a pod process that outlives its peer.

Where the pods run: --pod-prefix (a command prefix per pod, e.g. "ip netns exec NS") and --pod-host
(the address each pod binds and is reached at) place them; the default is both on 127.0.0.1.

    python bench/dcn.py --netns [--netns-rate-gbps R]    # root: over kernel links between namespaces

--netns builds the network of `multipod local --netns` for 2 pods of 1 host
(controller/launch/netns.py: a namespace per pod, veth pairs through bridges, each pod's link
shaped with tbf when R is given), runs each pod in its namespace bound to its own address, and
removes the network at the end, also on an error, Ctrl-C, SIGTERM or SIGHUP. The report gains
"link": the namespaces, addresses, path, MTU and segmentation offload sizes. The plain contenders
run unencrypted between the namespaces (a bench, not a run); the _curve ones use CURVE as always.

Test hook (not a production setting): --stall-peer NAME[:ROUND[:SECONDS]] makes pod 1 stall for
SECONDS (default: for good) in contender NAME's round ROUND (default: the last) before taking part;
it may be given several times (tests/e2e/test_bench_dcn.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import shlex
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# A PaLM-style model of 25.7M parameters: the leaves of its gradient are what travels.
MODEL = dict(d_model=512, n_layers=8, n_heads=8, head_dim=64, mlp_dim=1536, vocab_size=4096)
VARIANTS = ("transport", "transport_curve", "exchange", "exchange_curve", "exchange_bf16", "exchange_int8")
OK, TIMEOUT, ERROR, PEER_LOST = "ok", "timeout", "error", "peer_lost"
_CODES = {OK: 0, TIMEOUT: 1, ERROR: 2}
_STATUS = {v: k for k, v in _CODES.items()}
_OUTCOME = struct.Struct("<Bd")        # status code, this pod's seconds


def leaf_shapes() -> list[tuple[int, ...]]:
    import jax

    from multipod.model import abstract_params
    from multipod.model.config import ModelConfig
    return [tuple(l.shape) for l in jax.tree.leaves(abstract_params(ModelConfig(**MODEL)))]


def payload_shapes(nbytes: int) -> list[tuple[int, ...]]:
    """--payload-bytes: four float32 leaves of about nbytes in all (no model, no jax import)."""
    values = max(4, nbytes // 4)
    return [(values // 4 + (i < values % 4),) for i in range(4)]


class _Timeout(Exception):
    """A contender missed its deadline."""


class _PeerLost(Exception):
    """The other pod stopped answering on the control connection."""


def _wait_file(path: pathlib.Path, deadline: float) -> str:
    while not (path.exists() and path.read_text().strip()):
        if time.monotonic() > deadline:
            raise _PeerLost(f"timed out waiting for {path.name} from the other pod")
        time.sleep(0.02)
    return path.read_text().strip()


def _write_file(path: pathlib.Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    data = b""
    while len(data) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _PeerLost(f"no answer from the other pod within its deadline ({len(data)}/{n} bytes)")
        sock.settimeout(remaining)
        try:
            part = sock.recv(n - len(data))
        except TimeoutError:
            continue
        except OSError as exc:
            raise _PeerLost(f"the control connection broke: {exc}") from None
        if not part:
            raise _PeerLost("the other pod closed the control connection")
        data += part
    return data


# -- one pod's side (runs in its own process) ------------------------------------------------------
class _Control:
    """The pods' control connection: barriers and each contender's outcome, every wait bounded."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _send(self, data: bytes, deadline: float) -> None:
        self.sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            self.sock.sendall(data)
        except OSError as exc:
            raise _PeerLost(f"the control connection broke: {exc}") from None

    def barrier(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        self._send(b"b", deadline)
        if _recv_exact(self.sock, 1, deadline) != b"b":
            raise _PeerLost("the control connection is out of step")

    def agree(self, status: str, seconds: float, deadline: float) -> tuple[str, float]:
        """Tell the peer this pod's outcome of a contender's round; returns the peer's."""
        self._send(_OUTCOME.pack(_CODES[status], seconds), deadline)
        code, theirs = _OUTCOME.unpack(_recv_exact(self.sock, _OUTCOME.size, deadline))
        return _STATUS.get(code, ERROR), theirs


class _Contender:
    name = ""

    def run(self, step: int, deadline: float) -> float | None:
        """One round, done by `deadline` (time.monotonic) or _Timeout; returns idle seconds if known."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class _RawTcp(_Contender):
    """The payload over one TCP socket each way at once, received into a preallocated buffer."""

    name = "raw_tcp"

    def __init__(self, conn: socket.socket, nbytes: int):
        self.conn, self.nbytes = conn, nbytes
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.payload = os.urandom(1 << 20) * (nbytes >> 20) + os.urandom(nbytes & ((1 << 20) - 1))
        self.inbox = memoryview(bytearray(nbytes))

    def run(self, step: int, deadline: float) -> None:
        failed: list[BaseException] = []

        def send() -> None:
            try:
                self.conn.sendall(self.payload)     # bounded: the timeout set below covers all of it
            except OSError as exc:
                failed.append(exc)

        self.conn.settimeout(max(0.001, deadline - time.monotonic()))
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        got = 0
        while got < self.nbytes:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Timeout
            self.conn.settimeout(remaining)
            try:
                n = self.conn.recv_into(self.inbox[got:], min(self.nbytes - got, 4 << 20))
            except TimeoutError:
                raise _Timeout from None
            if not n:
                raise ConnectionError("the peer closed the socket")
            got += n
        sender.join(max(0.0, deadline - time.monotonic()))
        if sender.is_alive() or (failed and isinstance(failed[0], TimeoutError)):
            raise _Timeout
        if failed:
            raise failed[0]

    def close(self) -> None:
        self.conn.close()


class _Gloo(_Contender):
    """A jitted cross-process psum of nbytes of float32 (jax.distributed, gloo CPU collectives).
    A collective cannot be interrupted: it runs on a thread, and one that misses its deadline is
    left behind (`stuck`: the process then exits without jax's shutdown, a barrier with the peer)."""

    name = "gloo_allreduce"

    def __init__(self, pod: int, host: str, coordinator: str, nbytes: int, timeout_s: float):
        import jax
        import numpy as np
        from jax._src import xla_bridge
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        make = xla_bridge._jax.make_gloo_tcp_collectives
        # gloo binds to the host name's address unless told: bind it to this pod's own (in a
        # network namespace that is the only one the peer can reach).
        xla_bridge._jax.make_gloo_tcp_collectives = lambda distributed_client, hostname=None, interface=None: make(
            distributed_client=distributed_client, hostname=host)
        seconds = max(1, math.ceil(timeout_s))
        jax.distributed.initialize(coordinator, num_processes=2, process_id=pod, initialization_timeout=seconds,
                                   shutdown_timeout_seconds=seconds)
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        mesh = Mesh(np.array(jax.devices()), ("pods",))
        n = nbytes // 4
        local = np.random.default_rng(pod).standard_normal((1, n), dtype=np.float32)
        x = jax.make_array_from_single_device_arrays(
            (2, n), NamedSharding(mesh, P("pods")), [jax.device_put(local, jax.local_devices()[0])])
        reduce = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "pods"), mesh=mesh, in_specs=P("pods"),
                                       out_specs=P("pods")))
        self.call = lambda: reduce(x).block_until_ready()
        self.stuck = False

    def run(self, step: int, deadline: float) -> None:
        failed: list[BaseException] = []

        def call() -> None:
            try:
                self.call()
            except Exception as exc:
                failed.append(exc)

        thread = threading.Thread(target=call, daemon=True)
        thread.start()
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            self.stuck = True
            raise _Timeout
        if failed:
            raise failed[0]

    def close(self) -> None:
        if not self.stuck:
            import jax
            jax.distributed.shutdown()


class _Landing:
    """Transport-only sink for a Listener: each frame is copied into its place in a preallocated
    buffer (the one user-space copy), no decoding, no sum. Bytes are counted per step, whenever
    they come: a faster peer's frames of a round may land before this pod starts waiting on it."""

    def __init__(self, run_id: str, nbytes: int):
        import numpy as np
        self.run_id, self.nbytes = run_id, nbytes
        self.buffer = np.empty(nbytes, np.uint8)
        self._got: dict[int, int] = {}
        self._oldest = 0            # steps before it were given up: their stragglers are dropped
        self._cond = threading.Condition()

    def receive(self, pod, step, phase, leaf, offset, payload) -> None:
        import numpy as np
        view = np.frombuffer(payload, np.uint8)
        self.buffer[offset:offset + view.size] = view
        with self._cond:
            if step >= self._oldest:
                self._got[step] = self._got.get(step, 0) + view.size
                self._cond.notify_all()

    def wait(self, step: int, deadline: float) -> bool:
        """True once every byte of `step` is in, False at the deadline."""
        with self._cond:
            self._oldest = step
            for old in [s for s in self._got if s < step]:
                del self._got[old]
            return self._cond.wait_for(lambda: self._got.get(step, 0) >= self.nbytes,
                                       max(0.0, deadline - time.monotonic()))

    def refused_chunk(self, pod, why) -> None:
        print(f"transport: a frame was refused: {why}", file=sys.stderr)

    def lost(self, pod, steps, why) -> None:
        pass


class _Transport(_Contender):
    def __init__(self, name: str, pod: int, peer_address: str, listener, flat, streams: int, chunk_bytes: int,
                 secret: str):
        from multipod.pod_worker.dcn.outbox import Outbox, Pacer
        self.name, self.flat, self.chunk_bytes, self.peer = name, flat, chunk_bytes, 1 - pod
        self.errors: list[str] = []
        self.landing = _Landing(name, flat.size)
        listener.attach(self.landing)
        self.outbox = Outbox(pod, name, {self.peer: peer_address}, streams, secret, Pacer(),
                             lambda step, peer, why: self.errors.append(f"step {step}: {why}"))

    def run(self, step: int, deadline: float) -> None:
        for start in range(0, self.flat.size, self.chunk_bytes):
            self.outbox.put(step, deadline, self.peer, 0, 0, start, self.flat[start:start + self.chunk_bytes])
        if not self.landing.wait(step, deadline):
            raise _Timeout
        if self.errors:
            raise ConnectionError(self.errors[0])

    def close(self) -> None:
        self.outbox.close()


class _Exchange(_Contender):
    def __init__(self, name: str, pod: int, addresses: list[str], listener, specs, leaves, streams: int,
                 chunk_bytes: int, secret: str, timeout_s: float):
        from multipod.pod_worker.dcn import Exchange
        compression = name.split("_")[1] if "_" in name and not name.endswith("_curve") else "none"
        self.name, self.leaves = name, leaves
        self.exchange = Exchange(name, pod, addresses, specs, listener, chunk_bytes=chunk_bytes, timeout_s=timeout_s,
                                 streams=streams, compression=compression, secret=secret,
                                 lossless="off")    # the transport against raw TCP, byte for byte

    def run(self, step: int, deadline: float) -> float:
        from multipod.pod_worker.dcn import ExchangeError
        self.exchange.timeout_s = deadline - time.monotonic()   # all_reduce's deadline is this round's
        self.exchange.inbox.set_next_step(step)
        try:
            _, stats = self.exchange.all_reduce(step, self.leaves)
        except ExchangeError:
            if time.monotonic() >= deadline:
                raise _Timeout from None
            raise
        return stats.idle_s

    def close(self) -> None:
        self.exchange.close()


def _connect_pods(args, folder: pathlib.Path, deadline: float) -> tuple[_Control, socket.socket]:
    """The control connection and the raw-TCP data connection (pod 1 connects to pod 0)."""
    if args.pod == 0:
        with socket.create_server((args.host, 0)) as server:
            _write_file(folder / "tcp.address", json.dumps([args.host, server.getsockname()[1]]))
            conns = {}
            while len(conns) < 2:
                server.settimeout(max(0.001, deadline - time.monotonic()))
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    raise _PeerLost("pod 1 did not connect") from None
                conns[_recv_exact(conn, 1, deadline)] = conn
        return _Control(conns[b"c"]), conns[b"d"]
    host, port = json.loads(_wait_file(folder / "tcp.address", deadline))
    conns = {}
    for tag in (b"c", b"d"):
        conn = socket.create_connection((host, port), timeout=max(0.001, deadline - time.monotonic()))
        conn.sendall(tag)
        conns[tag] = conn
    return _Control(conns[b"c"]), conns[b"d"]


def pod_main(args) -> tuple[dict, _Control | None]:
    """This pod's report, and the control connection if the peer is still there."""
    import numpy as np

    from multipod.pod_worker.dcn import LeafSpec, Listener

    secret = "bench-secret-of-at-least-16-chars"
    folder = pathlib.Path(args.dir)
    setup_deadline = time.monotonic() + args.setup_s
    peer = 1 - args.pod
    contenders: list[_Contender] = []
    report: dict = {"contenders": {}, "peer_lost": None, "gloo_error": None}
    gloo = None
    if not args.skip_gloo:
        try:
            if args.pod == 0:
                with socket.create_server((args.host, 0)) as s:    # a free port for the coordinator
                    coordinator = f"{args.host}:{s.getsockname()[1]}"
                _write_file(folder / "gloo.address", coordinator)
            else:
                coordinator = _wait_file(folder / "gloo.address", setup_deadline)
            gloo = _Gloo(args.pod, args.host, coordinator, args.nbytes, args.setup_s)
        except Exception as exc:   # recorded in the report, not fatal for the rest
            report["gloo_error"] = f"{type(exc).__name__}: {exc}"[:500]
    control, data = _connect_pods(args, folder, setup_deadline)
    contenders.append(_RawTcp(data, args.nbytes))
    if gloo is not None:
        contenders.append(gloo)

    shapes = [tuple(s) for s in json.loads(args.shapes)]
    rng = np.random.default_rng(args.pod)
    leaves = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    specs = [LeafSpec(s, np.dtype(np.float32)) for s in shapes]
    flat = np.concatenate([l.reshape(-1) for l in leaves]).view(np.uint8)
    variants = [v for v in args.variants.split(",") if v]
    listeners = {v: Listener(args.pod, f"{args.host}:0", secret, curve=v.endswith("_curve")) for v in variants}
    _write_file(folder / f"pod{args.pod}.json", json.dumps({v: l.address for v, l in listeners.items()}))
    theirs = json.loads(_wait_file(folder / f"pod{peer}.json", setup_deadline))
    for v in variants:
        if v.startswith("transport"):
            contenders.append(_Transport(v, args.pod, theirs[v], listeners[v], flat, args.streams, args.chunk_bytes,
                                         secret))
        else:
            addresses = [listeners[v].address, theirs[v]][::1 if args.pod == 0 else -1]
            contenders.append(_Exchange(v, args.pod, addresses, listeners[v], specs, leaves, args.streams,
                                        args.chunk_bytes, secret, args.deadline_s))

    results = {c.name: {"status": OK, "times": [], "idle": []} for c in contenders}
    stalls = _stalls(args.stall_peer, args.repeats)
    try:
        control.barrier(max(0.001, setup_deadline - time.monotonic()))    # both pods can receive now
        for step in range(args.repeats + 1):
            for c in contenders:
                result = results[c.name]
                if result["status"] != OK:      # both pods skip it: the outcomes are agreed
                    continue
                control.barrier(args.deadline_s)
                deadline = time.monotonic() + args.deadline_s
                start = time.perf_counter()
                status, idle = OK, None
                try:
                    if args.pod == 1 and (c.name, step) in stalls:
                        time.sleep(stalls[c.name, step])        # the test hook: a peer that stalls
                        if time.monotonic() >= deadline:
                            raise _Timeout
                    idle = c.run(step, deadline)
                except _Timeout:
                    status = TIMEOUT
                except Exception as exc:
                    status, result["error"] = ERROR, f"pod {args.pod}: {type(exc).__name__}: {exc}"[:500]
                seconds = time.perf_counter() - start
                if status != OK:
                    result.update(status=status, round=step, deadline_s=args.deadline_s)
                # The peer's outcome is due at its deadline too (its waits are bounded by it); a
                # second deadline's worth of slack before it counts as lost.
                theirs_status, theirs_seconds = control.agree(status, seconds, deadline + args.deadline_s)
                if status == OK and theirs_status != OK:
                    result.update(status=theirs_status, round=step, deadline_s=args.deadline_s,
                                  error=f"pod {peer} reported {theirs_status}")
                if result["status"] != OK:
                    print(f"{c.name}: {result['status']} in round {step}", file=sys.stderr)
                    continue
                result["times"].append(max(seconds, theirs_seconds))   # the round ends with the slower pod
                if idle is not None:
                    result["idle"].append(idle)
        control.barrier(args.deadline_s)    # neither pod closes its sockets while the other still sends
    except _PeerLost as exc:
        report["peer_lost"] = f"pod {peer}: {exc}"
        for result in results.values():
            if result["status"] == OK and len(result["times"]) < args.repeats + 1:
                result["status"] = PEER_LOST
    if gloo is not None and (report["peer_lost"] or results[gloo.name]["status"] != OK):
        gloo.stuck = True   # jax's shutdown is a barrier with a peer that will not come
    for c in contenders:
        try:
            c.close()
        except Exception as exc:
            print(f"closing {c.name}: {exc}", file=sys.stderr)
    for listener in listeners.values():
        listener.close()
    for result in results.values():     # the warm-up round is not counted
        result["times"], result["idle"] = result["times"][1:], result["idle"][1:]
    report["contenders"] = results
    return report, None if report["peer_lost"] else control


def _stalls(specs: list[str], repeats: int) -> dict[tuple[str, int], float]:
    """--stall-peer NAME[:ROUND[:SECONDS]] -> {(NAME, ROUND): SECONDS}; a peer that stalls for good
    by default (the driver kills it), in the last round."""
    stalls = {}
    for spec in specs:
        name, _, rest = spec.partition(":")
        round_, _, seconds = rest.partition(":")
        stalls[name, int(round_) if round_ else repeats] = float(seconds) if seconds else 3600.0
    return stalls


# -- the driver ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Place:
    """Where one pod process runs: a command prefix (e.g. ["ip", "netns", "exec", "NS"], empty for
    here) and the address it binds its sockets to and is reached at."""
    prefix: tuple[str, ...] = ()
    host: str = "127.0.0.1"


def places(prefixes: list[str] | None, hosts: list[str] | None) -> list[Place]:
    prefixes, hosts = prefixes or ["", ""], hosts or ["127.0.0.1", "127.0.0.1"]
    if len(prefixes) != 2 or len(hosts) != 2:
        raise SystemExit("--pod-prefix and --pod-host are given twice (pod 0, pod 1) or not at all")
    return [Place(tuple(shlex.split(p)), h) for p, h in zip(prefixes, hosts)]


def run_pods(pod_args: list[str], where: list[Place], timeout_s: float, grace_s: float = 5.0) -> list[dict]:
    """Run both pod processes; returns what each printed ({} for one that printed nothing: killed at
    the deadline, or `grace_s` after its peer finished, or failed; "stderr" holds its tail)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    with tempfile.TemporaryDirectory() as folder:
        procs, outputs = [], []
        try:
            for pod, place in enumerate(where):
                out = open(os.path.join(folder, f"pod{pod}.out"), "w+")
                err = open(os.path.join(folder, f"pod{pod}.err"), "w+")
                outputs.append((out, err))
                cmd = [*place.prefix, sys.executable, __file__, "--pod", str(pod), "--dir", folder, "--host",
                       place.host, *pod_args]
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, env=env))
            deadline = time.monotonic() + timeout_s
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                done = [pod for pod, p in enumerate(procs) if p.poll() is not None]
                if done:
                    # One pod is done: the other has nothing left to do but say goodbye, or, if it
                    # was found lost, nothing at all.
                    lost = any('"peer_lost": "' in _read(outputs[pod][0]) for pod in done)
                    deadline = min(deadline, time.monotonic() + (0.0 if lost else grace_s))
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        results = []
        for (out, err), proc in zip(outputs, procs):
            lines = _read(out).strip().splitlines()
            result = json.loads(lines[-1]) if proc.returncode == 0 and lines else {}
            result["returncode"] = proc.returncode
            result["stderr"] = _read(err)[-3000:]
            results.append(result)
            out.close()
            err.close()
        return results


def _read(file) -> str:
    file.seek(0)
    return file.read()


def _summary(result: dict, nbytes: int) -> dict:
    summary = {"status": result["status"]}
    for key in ("error", "round", "deadline_s"):
        if key in result:
            summary[key] = result[key]
    if result["times"]:
        median = statistics.median(result["times"])
        summary.update(median_s=round(median, 4), MB_per_s=round(nbytes / median / 1e6, 1),
                       rounds_s=[round(t, 4) for t in result["times"]])
    if result["idle"]:
        summary["idle_s_median"] = round(statistics.median(result["idle"]), 4)
    return summary


_TEARDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP stop the driver as Ctrl-C does (KeyboardInterrupt), so the `finally`
    that kills the pods and removes the network runs; inside `_uninterrupted()` they wait."""
    def stop(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, stop) for sig in _TEARDOWN_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def _uninterrupted() -> Iterator[None]:
    """Signals are held off while the network is removed: a second Ctrl-C must not leave half of
    it behind (every command of the removal has its own deadline, so this cannot hang)."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in _TEARDOWN_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _ip_link(argv: list[str]) -> dict:
    """`ip -j -d link show` of one interface: its MTU and segmentation-offload sizes ({} if `ip`
    cannot tell)."""
    try:
        shown = subprocess.run([*argv[:1], "-j", "-d", *argv[1:]], capture_output=True, text=True, timeout=10,
                               stdin=subprocess.DEVNULL)
        link = json.loads(shown.stdout)[0] if shown.returncode == 0 else {}
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return {}
    keys = ("ifname", "mtu", "gso_max_size", "gso_max_segs", "gro_max_size", "qdisc")
    return {k: link[k] for k in keys if k in link} | ({"kind": link["linkinfo"]["info_kind"]}
                                                      if "info_kind" in link.get("linkinfo", {}) else {})


def describe_link(network=None) -> dict:
    """What the pods' bytes cross: loopback, or the namespaces' path of `network` (a created
    controller/launch/netns.Network of 2 pods x 1 host)."""
    if network is None:
        return {"kind": "loopback", "interface": _ip_link(["ip", "link", "show", "lo"])}
    layout, ip = network.layout, network.tools["ip"]
    net = layout.bridge_namespace
    shaped = [subprocess.run([network.tools["tc"], "-n", net, "qdisc", "show", "dev", f"p{pod}up"],
                             capture_output=True, text=True, timeout=10).stdout.strip() for pod in range(2)
              ] if network.rate_gbps else []
    return {
        "kind": "netns",
        "namespaces": [layout.namespace(pod, 0) for pod in range(2)],
        "addresses": [layout.host_ip(pod, 0) for pod in range(2)],
        "subnet": str(layout.subnet),
        "rate_gbps": network.rate_gbps or "unshaped",
        # controller/launch/netns.py's topology: each pod's DCN link is the p<P>up = p<P>dcn pair.
        "path": "eth0 = p0h0 -> bridge pod0 -> p0up = p0dcn -> bridge dcn -> p1dcn = p1up -> bridge pod1 "
                "-> p1h0 = eth0 (veth pairs, bridges in namespace " + net + ")",
        "pod_interface": _ip_link([ip, "-n", layout.namespace(0, 0), "link", "show", "eth0"]),
        "dcn_link": _ip_link([ip, "-n", net, "link", "show", "p0up"]),
        **({"qdiscs": shaped} if shaped else {}),
    }


def _exit_with_parent(parent: int) -> None:
    """A pod process does not outlive the driver (killed, or ended by a test's timeout)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _run_in_namespaces(args, pod_args: list[str], timeout_s: float) -> tuple[list[dict], list[Place], dict]:
    """run_pods in the namespaces of a network made for the run, always removed afterwards."""
    from multipod.controller.launch.netns import NetnsError, Network
    network = Network(2, 1, args.netns_subnet, args.netns_rate_gbps)
    with _stopped_by_signals():
        try:
            try:
                layout = network.create()
            except NetnsError as exc:
                raise SystemExit(f"bench/dcn.py --netns: {exc}") from None
            if network.cleaned:
                print(f"netns: removed what killed runs had left: {', '.join(network.cleaned)}", file=sys.stderr)
            where = [Place(tuple(network.wrap(pod, 0, [])), layout.host_ip(pod, 0)) for pod in range(2)]
            link = describe_link(network)
            return run_pods(pod_args, where, timeout_s), where, link
        finally:
            with _uninterrupted():
                network.destroy()
                left = network.leftovers()
            if left:
                print(f"netns: could not remove {', '.join(left)} (python -m multipod.controller.launch.netns "
                      f"removes them once this process is gone)", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pod", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--shapes", help=argparse.SUPPRESS)
    parser.add_argument("--nbytes", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--chunk-bytes", type=int, default=2 << 20)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"data-plane variants, comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--streams", type=int, default=2, help="data-plane connections per peer")
    parser.add_argument("--skip-gloo", action="store_true")
    parser.add_argument("--payload-bytes", type=int, default=0,
                        help="this many bytes in four leaves instead of the 25.7M-parameter model's gradient")
    parser.add_argument("--deadline-s", type=float, default=30.0, help="per contender and round")
    parser.add_argument("--setup-s", type=float, default=180.0, help="deadline of the start (imports, gloo, links)")
    parser.add_argument("--pod-prefix", action="append",
                        help="command prefix of a pod's process (twice: pod 0, pod 1), e.g. 'ip netns exec NS'")
    parser.add_argument("--pod-host", action="append",
                        help="address a pod binds and is reached at (twice: pod 0, pod 1); default 127.0.0.1")
    parser.add_argument("--netns", action="store_true",
                        help="run the pods in network namespaces of their own, over veth pairs and bridges (root)")
    parser.add_argument("--netns-rate-gbps", type=float, default=0.0,
                        help="with --netns: shape each pod's link to this rate with tbf (default: unshaped)")
    parser.add_argument("--netns-subnet", help="with --netns: the IPv4 range (CIDR; default: a free /24 of "
                        "10.213.0.0/16)")
    parser.add_argument("--stall-peer", action="append", default=[], help=argparse.SUPPRESS)     # test hook
    args = parser.parse_args()
    if args.pod is not None:
        threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
        report, control = pod_main(args)
        print(json.dumps(report), flush=True)
        sys.stderr.flush()
        if args.pod == 0 and control is not None:
            # Pod 0 leaves last: it is jax.distributed's coordinator, and a worker that loses
            # it aborts. Pod 1's exit closes the control connection.
            try:
                _recv_exact(control.sock, 1, time.monotonic() + args.deadline_s)
            except _PeerLost:
                pass
        # A gloo collective left behind on a thread could block jax's exit handlers for ever.
        os._exit(0)

    if args.netns and (args.pod_prefix or args.pod_host):
        raise SystemExit("--netns places the pods itself: leave out --pod-prefix and --pod-host")
    if args.netns_rate_gbps and not args.netns:
        raise SystemExit("--netns-rate-gbps shapes the links of --netns: give --netns too")
    where = places(args.pod_prefix, args.pod_host)
    shapes = payload_shapes(args.payload_bytes) if args.payload_bytes else leaf_shapes()
    nbytes = sum(math.prod(s) for s in shapes) * 4
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    pod_args = ["--shapes", json.dumps(shapes), "--nbytes", str(nbytes), "--repeats", str(args.repeats),
                "--chunk-bytes", str(args.chunk_bytes), "--variants", ",".join(variants),
                "--streams", str(args.streams), "--deadline-s", str(args.deadline_s), "--setup-s", str(args.setup_s),
                *(f"--stall-peer={stall}" for stall in args.stall_peer)]
    _stalls(args.stall_peer, args.repeats)      # a malformed hook fails here, not in a pod
    if args.skip_gloo:
        pod_args.append("--skip-gloo")
    rounds = (args.repeats + 1) * (len(variants) + 2)
    # Each round of each contender: a barrier, the round and the outcomes, each bounded by deadline_s.
    timeout_s = args.setup_s + rounds * (3 * args.deadline_s + 5) + 30
    load_before = os.getloadavg()
    if args.netns:
        results, where, link = _run_in_namespaces(args, pod_args, timeout_s)
    else:
        results, link = run_pods(pod_args, where, timeout_s), describe_link()

    report = {"benchmark": "dcn", "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
              "params": nbytes // 4, "leaves": len(shapes), "payload_bytes": nbytes, "repeats": args.repeats,
              "chunk_bytes": args.chunk_bytes, "streams": args.streams, "deadline_s": args.deadline_s,
              "places": [{"prefix": shlex.join(p.prefix), "host": p.host} for p in where], "link": link,
              "load_average_before": load_before, "load_average_after": os.getloadavg()}
    # Both pods agreed every outcome and round time: either one's report is the run's.
    mine = next((r for r in results if r.get("contenders")), None)
    if mine is None:
        report["error"] = "no pod reported: " + "; ".join(
            f"pod {pod} exited {r['returncode']}: {r['stderr'][-1500:]}" for pod, r in enumerate(results))
        print(json.dumps(report, indent=2))
        return
    report["peer_lost"] = mine["peer_lost"]
    report["pod_exit_codes"] = [r["returncode"] for r in results]     # -9: killed, having outlived its peer
    contenders = mine["contenders"]
    for name in ("raw_tcp", "gloo_allreduce"):
        if name in contenders:
            report[name] = _summary(contenders[name], nbytes)
    if "gloo_allreduce" not in contenders:
        report["gloo_allreduce"] = {"status": "skipped" if args.skip_gloo else ERROR,
                                    **({"error": mine["gloo_error"]} if mine["gloo_error"] else {})}
    report["multipod"] = {v: _summary(contenders[v], nbytes) for v in variants if v in contenders}
    tcp = report["raw_tcp"].get("median_s")
    gloo = report["gloo_allreduce"].get("median_s")
    report["ratios"] = {
        v: {"throughput_vs_raw_tcp": round(tcp / r["median_s"], 3) if tcp else None,
            "speedup_vs_gloo": round(gloo / r["median_s"], 3) if gloo else None}
        for v, r in report["multipod"].items() if "median_s" in r}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt as exc:     # Ctrl-C, SIGTERM or SIGHUP: the pods and the network are gone
        print(f"bench/dcn.py: stopped ({exc or 'SIGINT'})", file=sys.stderr)
        sys.exit(130)
