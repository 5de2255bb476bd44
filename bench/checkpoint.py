"""How long a checkpoint holds up the step loop: background save (what the controller does) vs a
synchronous one, on one in-process worker. Prints one JSON object.

    python -m bench.checkpoint [--config configs/bench.toml] [--repeats 5]

stall_s: the Save(background=True) RPC, the only part the step loop waits for (host copy of the
state). write_s: from that reply until the background write is confirmed. sync_s: a blocking
Save of the same state. step_s: one training step, for scale. Medians over --repeats.
"""
from __future__ import annotations

import pathlib

from multipod.pod_worker.devices import simulate_cpu_devices

simulate_cpu_devices(2, overwrite=False)

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from multipod import protos  # noqa: E402
from multipod.controller.core.run_config import load_config  # noqa: E402
from multipod.pod_worker.server import start_server  # noqa: E402
from multipod.protos import (  # noqa: E402
    codec,
    multipod_pb2 as pb,
    multipod_pb2_grpc as pb_grpc,
)
from multipod.protos.channels import Security, open_channel  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=str(ROOT / "configs" / "bench.toml"),
                        help="TOML config (default: configs/bench.toml, the model docs/benchmarks.md measures)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    config = load_config(args.config, ["sample.tokens=0"])
    rows, cols = config.data.global_batch, config.data.seq_len + 1
    server, service, _, port = start_server(0, "127.0.0.1:0", Security())
    address = f"127.0.0.1:{port}"
    channel = open_channel(address, Security())
    stub = pb_grpc.PodWorkerStub(channel)
    stub.Configure(pb.ConfigureRequest(protocol_version=protos.PROTOCOL_VERSION, pod_index=0, num_pods=1,
                                       peer_addresses=[address], run_id="bench",
                                       worker_config_json=config.worker_config().to_json()),
                   timeout=600)
    step = 0

    def train() -> float:
        nonlocal step
        tokens = np.random.default_rng(step).integers(0, 256, (rows, cols), dtype=np.int32)
        start = time.perf_counter()
        stub.Step(pb.StepRequest(step=step, tokens=codec.encode(tokens), global_tokens=rows * (cols - 1),
                                 run_id="bench"), timeout=600)
        step += 1
        return time.perf_counter() - start

    stall, write, sync, steps = [], [], [], []
    train()   # warm-up
    with tempfile.TemporaryDirectory() as root:
        for _ in range(args.repeats):
            steps.append(train())
            t0 = time.perf_counter()
            stub.Save(pb.SaveRequest(step=step, directory=root, background=True, keep=2), timeout=600)
            t1 = time.perf_counter()
            stub.WaitSave(pb.WaitSaveRequest(step=step, directory=root), timeout=600)
            t2 = time.perf_counter()
            stall.append(t1 - t0)
            write.append(t2 - t1)
            steps.append(train())
            t0 = time.perf_counter()
            stub.Save(pb.SaveRequest(step=step, directory=root, keep=2), timeout=600)
            sync.append(time.perf_counter() - t0)
    params = sum(s.nbytes // s.dtype.itemsize for s in service.pod.trainer.leaf_specs)
    channel.close()
    server.stop(0).wait()
    service.pod.close()
    med = statistics.median
    print(json.dumps({"params": params, "repeats": args.repeats, "step_s": med(steps), "stall_s": med(stall),
                      "write_s": med(write), "sync_s": med(sync), "sync_over_stall": med(sync) / med(stall)}))


if __name__ == "__main__":
    main()
