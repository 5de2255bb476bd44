"""The inference probe: compile and time generation layouts of one pod, in a process of its own.

    python -m multipod.pod_worker.inference_probe < spec.json

`multipod tune --inference` (controller/tune/inference.py) starts this module as a subprocess, as
`multipod tune` starts the layout probe (pod_worker/layout_probe.py): a candidate that crashes or
hangs takes down only this process, and the pod's simulated device count is set before jax
initialises. The controller never imports it: they speak the layout probe's line protocol.

stdin, one JSON line:
    {"devices": N (0: the devices jax finds), "prompt_len": P, "tokens": T (>= 2), "steps": repeats,
     "memory_limit": bytes or null, "candidates": [[index, {"worker": WorkerConfig JSON, "batch": B}], ...]}
stdout, one JSON object per line: "ready", then "start" / "result" per candidate, then "done"
(as the layout probe's). A result: {"status": "ok" | "over memory limit" | "error", ...}.

A candidate is the pod's mesh (the WorkerConfig's mesh section) and a generation batch. Its
parameters are random (init_params with the run's seed, laid out as the trainer lays them out),
its prompts B random rows of P token ids. The pod's Generator (pod_worker/generation.py: the
decode programs of model/decode.py compiled with the rules table's shardings) generates T tokens
after every prompt, greedily: once as warm-up (which compiles the programs and gives their memory),
then `steps` times. Each program call is waited for before the stream goes on, so its time is its
own (on a CPU the next decode step would otherwise be computed while the first token is handed
out, and counted in the time to the first token):
    ttft_s            request -> first token of every row known (init_cache + prefill), median
    token_latency_s   one decode step (one new token for every row), median over all steps
    generate_s        request -> last token on the host, median
The controller derives tokens/s (batch x tokens / generate_s) and the latency limit.
"""
from __future__ import annotations

import statistics
import sys
import time

from multipod.pod_worker.layout_probe import serve


def timed_generator(model_cfg, mesh, param_sharding):
    """The pod's Generator, with every program call timed to completion ({name: [(start, end)]})
    and compiled ahead of time on its first call (XLA's memory analysis per program)."""
    import jax

    from multipod.pod_worker.generation import Generator

    class TimedGenerator(Generator):
        def __init__(self, *args):
            self.calls: dict[str, list[tuple[float, float]]] = {}
            self.executables: dict = {}
            super().__init__(*args)

        def compile(self, name, fn):
            jitted = super().compile(name, fn)

            def call(*args):
                key = (name, tuple((leaf.shape, str(leaf.dtype)) for leaf in jax.tree.leaves(args)))
                if key not in self.executables:
                    self.executables[key] = jitted.lower(*args).compile()
                return self.executables[key](*args)
            return call

        def run(self, name, *args):
            start = time.perf_counter()
            out = jax.block_until_ready(super().run(name, *args))
            self.calls.setdefault(name, []).append((start, time.perf_counter()))
            return out

    return TimedGenerator(model_cfg, mesh, param_sharding)


def probe(candidate: dict, devices: list, prompt_len: int, tokens: int, steps: int,
          memory_limit: int | None) -> dict:
    """Build, compile and time one (mesh, batch) layout; a result dict, or raises."""
    import numpy as np

    from multipod.model import Sampling, abstract_params, init_params
    from multipod.model.partitioning import make_mesh, param_shardings
    from multipod.pod_worker import programs
    from multipod.pod_worker.schema import WorkerConfig

    config = WorkerConfig.from_json(candidate["worker"])
    model_cfg, batch = config.model, int(candidate["batch"])
    data, model = config.mesh.resolve(len(devices))
    if batch % data:
        raise ValueError(f"a batch of {batch} does not split over the data axis of {data}")
    prompts = list(np.random.RandomState(0).randint(0, model_cfg.vocab_size, size=(batch, prompt_len)))
    result: dict = {}
    start = time.perf_counter()
    mesh = make_mesh(data, model, devices=devices)
    sharding = param_shardings(abstract_params(model_cfg), mesh)
    params = init_params(model_cfg, config.train.seed, shardings=sharding)
    generator = timed_generator(model_cfg, mesh, sharding)
    generator.check(prompts, tokens, Sampling())      # ValueError naming the limit, before compiling
    for _ in generator.stream(params, prompts, tokens, Sampling()):   # warm-up: compiles every program
        pass
    result["compile_s"] = time.perf_counter() - start
    memory = {key[0]: programs.memory_stats(exe)["peak_bytes"] for key, exe in generator.executables.items()}
    result["program_peak_bytes"] = memory
    peaks = [b for b in memory.values() if b is not None]
    result["memory_bytes"] = max(peaks) if peaks else None
    if memory_limit and result["memory_bytes"] is not None and result["memory_bytes"] > memory_limit:
        result["status"] = "over memory limit"
        return result
    ttfts, latencies, totals = [], [], []
    for _ in range(steps):
        generator.calls.clear()
        t0 = time.perf_counter()
        last = t0
        count = 0
        for _chunk in generator.stream(params, prompts, tokens, Sampling()):
            last = time.perf_counter()
            count += 1
        if count != tokens:
            raise RuntimeError(f"the stream gave {count} of {tokens} tokens")
        ttfts.append(generator.calls["prefill"][0][1] - t0)
        latencies.extend(end - begin for begin, end in generator.calls.get("decode", []))
        totals.append(last - t0)
    result.update(ttft_s=statistics.median(ttfts), ttfts_s=ttfts, token_latency_s=statistics.median(latencies),
                  token_latencies_s=latencies, generate_s=statistics.median(totals), generates_s=totals, status="ok")
    return result


def main() -> int:
    """Read the spec from stdin, probe every candidate in order, report each on stdout."""
    return serve(lambda candidate, devices, spec: probe(candidate, devices, spec["prompt_len"], spec["tokens"],
                                                        spec["steps"], spec["memory_limit"]))


if __name__ == "__main__":
    sys.exit(main())
