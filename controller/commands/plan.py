"""`multipod plan`: project the cross-pod sync settings onto a cluster on paper (issue 23).

The model comes from a run config (--config: its [model], and data.global_batch x data.seq_len as
the tokens per step), a parameter count (--params: 6N FLOPs per token), or a [model] table in the
--from file. The cluster: pods, hosts and chips per pod, a chip's peak and expected MFU, the ICI
and DCN links. Every candidate of controller/tune/cost.py (every-step sync fused or overlapped,
with each compression; DiLoCo over H, fragments and outer dtype) is projected, ranked by step time
in two tiers (exact sync; the math-changing ones), and the recommended [dcn]/[sync] settings are
printed as TOML. `--json` prints one JSON object instead.

--from FILE reads the same inputs from the file's [plan] table (keys as the flags, with `_` for
`-`; `config = PATH` is relative to the file), an optional [model] table (a model config's keys)
and an optional [calibration] table (cost_inputs.Calibration's fields); flags given as well override the
file. A missing or bad input is a ConfigError naming its flag or its key.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import tomllib

# Inputs every plan needs (the model and the tokens per step have rules of their own).
REQUIRED = ("pods", "hosts_per_pod", "chips_per_pod", "peak_tflops", "mfu", "ici_gbps", "dcn_gbps", "dcn_latency_ms")
DEFAULT_LAYERS = 32        # --params without --layers: the overlapped step's program count and tail
SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
LOSSY_SHOWN = 8            # lossy rows printed without --all


def parse_count(text: str) -> int:
    """A count such as 540000000000, 540e9 or 540B (k, M, B/G, T suffixes)."""
    text = text.strip()
    scale = SUFFIXES.get(text[-1:].lower(), 1.0)
    try:
        value = float(text[:-1] if scale != 1.0 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (e.g. 540e9 or 540B)") from None
    if value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole count: {text!r}")
    return int(value)


# key -> (type, help); each is a flag --key-with-dashes and a key of the [plan] table.
FIELDS: dict[str, tuple] = {
    "config": (str, "a run config TOML (see configs/): its [model], and data.global_batch x data.seq_len "
                    "as the tokens per step unless given"),
    "params": (parse_count, "a parameter count instead of --config (540e9, 540B): 6N FLOPs per token"),
    "layers": (int, f"layers of the --params model (default {DEFAULT_LAYERS})"),
    "flops_per_token": (float, "training FLOPs per token of the --params model (default 6N)"),
    "grad_dtype": (str, "bytes of a gradient value: float32 or bfloat16 (default: the config's param_dtype, "
                        "else float32)"),
    "pods": (int, "pods"),
    "hosts_per_pod": (int, "hosts per pod"),
    "chips_per_pod": (int, "chips (accelerators) per pod"),
    "peak_tflops": (float, "one chip's peak TFLOP/s (e.g. 275 for TPU v4 bf16)"),
    "mfu": (float, "expected MFU of one pod's step, a fraction (0.462 for 46.2%%)"),
    "ici_gbps": (float, "one chip's ICI bandwidth, Gb/s"),
    "ici_latency_ms": (float, "ICI latency, ms (default 0.001)"),
    "dcn_gbps": (float, "one pod's DCN bandwidth each way (the sum over its hosts), Gb/s"),
    "dcn_latency_ms": (float, "DCN one-way latency, ms"),
    "streams": (int, "data-plane connections per peer (default: the config's dcn.streams, else 4; "
                     "\"auto\" counts as on hosts of 8 or more CPUs: 4)"),
    "tokens_per_step": (parse_count, "tokens of one global step over all pods (or --batch and --seq-len)"),
    "batch": (int, "sequences of one global step over all pods"),
    "seq_len": (int, "tokens per sequence (also the attention FLOPs' length)"),
    "microbatches": (int, "microbatches per pod step (default: the config's, else 1)"),
    "model_parallel": (int, "the pod mesh's model axis (default: the config's mesh.model, else 1)"),
}
FLAGS = ("fully_sharded", "allow_lossy")


def flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `multipod plan`."""
    for key, (kind, text) in FIELDS.items():
        metavar = {"config": "FILE", "grad_dtype": "DTYPE", "mfu": "FRACTION", "peak_tflops": "TFLOPS",
                   "flops_per_token": "FLOPS"}.get(key) or \
            ("GBPS" if key.endswith("gbps") else "MS" if key.endswith("_ms") else "N")
        parser.add_argument(flag(key), dest=key, type=kind, help=text, metavar=metavar)
    parser.add_argument("--fully-sharded", action="store_true", default=None,
                        help="the pod shards the gradient over all its chips (as PaLM and MaxText do): no "
                             "gather over ICI after the exchange (multipod replicates it over the data axis)")
    parser.add_argument("--allow-lossy", action="store_true", default=None,
                        help="may recommend a candidate that changes the math (compression, DiLoCo)")
    parser.add_argument("--from", dest="from_file", metavar="FILE",
                        help="a TOML file with these inputs in a [plan] table (and optional [model] and "
                             "[calibration] tables); flags override it")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--all", action="store_true", help=f"print every lossy candidate, not the best "
                                                           f"{LOSSY_SHOWN}")


class Inputs:
    """The resolved inputs and, for errors, the name each came by (a flag or a [plan] key)."""

    def __init__(self, args: argparse.Namespace):
        from multipod.model.config import ConfigError
        self.values: dict = {}
        self.names: dict[str, str] = {}
        self.model_table = self.calibration_table = None
        self.base = pathlib.Path(".")
        self.file = args.from_file
        if self.file:
            try:
                data = tomllib.loads(pathlib.Path(self.file).read_text())
            except FileNotFoundError:
                raise ConfigError("--from", f"no such file: {self.file}") from None
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError("--from", f"{self.file} is not valid TOML: {exc}") from None
            unknown = sorted(set(data) - {"plan", "model", "calibration"})
            if unknown or not isinstance(data.get("plan"), dict):
                raise ConfigError("--from", f"{self.file} needs a [plan] table (and may have [model] and "
                                            f"[calibration]){'; unknown: ' + ', '.join(unknown) if unknown else ''}")
            for key, value in data["plan"].items():
                if key not in FIELDS and key not in FLAGS:
                    raise ConfigError(f"plan.{key}", f"unknown key in {self.file}; [plan] has: "
                                                     f"{', '.join([*FIELDS, *FLAGS])}")
                self.values[key], self.names[key] = value, f"plan.{key}"
            self.model_table, self.calibration_table = data.get("model"), data.get("calibration")
            self.base = pathlib.Path(self.file).parent
        for key in (*FIELDS, *FLAGS):
            value = getattr(args, key, None)
            if value is not None:
                self.values[key], self.names[key] = value, flag(key)

    def name(self, key: str) -> str:
        return self.names.get(key) or (f"plan.{key}" if self.file else flag(key))

    def missing(self, key: str, what: str = ""):
        from multipod.model.config import ConfigError
        where = f"missing from [plan] in {self.file} (or give {flag(key)})" if self.file else "missing"
        return ConfigError(self.name(key), where + (f": {what}" if what else ""))

    def number(self, key: str, kind=float, default=None):
        """The input `key` checked to be a number (an int for kind=int), or default if absent."""
        from multipod.model.config import ConfigError
        value = self.values.get(key, default)
        if value is None:
            return None
        if kind is int and isinstance(value, str) and FIELDS[key][0] is parse_count:   # "540B" in a TOML file
            try:
                value = parse_count(value)
            except argparse.ArgumentTypeError as exc:
                raise ConfigError(self.name(key), str(exc)) from None
        if kind is int and isinstance(value, float) and value.is_integer():    # 5.4e11 in a TOML file
            value = int(value)
        wrong = not isinstance(value, int) if kind is int else not isinstance(value, (int, float))
        if isinstance(value, bool) or wrong:
            raise ConfigError(self.name(key), f"expected {'an integer' if kind is int else 'a number'}, got {value!r}")
        return kind(value)

    def switch(self, key: str) -> bool:
        """The on/off input `key` (false if absent)."""
        from multipod.model.config import ConfigError
        value = self.values.get(key, False)
        if not isinstance(value, bool):
            raise ConfigError(self.name(key), f"expected true or false, got {value!r}")
        return value


def _streams(config) -> int:
    """The config's dcn.streams as plan counts it: "auto" as on the hosts of a pod (8 or more
    CPUs, MAX_AUTO_STREAMS), not as on the machine that runs plan; 4 without a config."""
    from multipod.pod_worker.schema import MAX_AUTO_STREAMS
    if config is None or config.dcn.streams == "auto":
        return MAX_AUTO_STREAMS
    return config.dcn.streams


def resolve(args: argparse.Namespace):
    """(ModelShape, Layout, Chip, Links, Calibration, allow_lossy, notes) from the flags and --from;
    ConfigError naming the flag or the [plan] key of a missing or bad input."""
    from multipod.controller.core.run_config import load_config
    from multipod.controller.tune import cost_inputs
    from multipod.model.config import ConfigError, ModelConfig
    from multipod.pod_worker.schema import build
    inputs = Inputs(args)
    v, notes = inputs.values, []
    sources = [key for key in ("config", "params") if key in v]
    sources += ["[model]"] if inputs.model_table is not None else []
    if not sources:
        raise inputs.missing("params", "give --config FILE or --params N (in [plan]: config or params, or a "
                                       "[model] table)")
    if len(sources) > 1:
        raise ConfigError(inputs.name("config" if "config" in v else "params"),
                          f"give one model, not {' and '.join(sources)}")
    for key in ("layers", "flops_per_token"):
        if key in v and "params" not in v:
            raise ConfigError(inputs.name(key), "goes with a parameter count (params), not a model config")
    config = model = None
    if "config" in v:
        path = pathlib.Path(str(v["config"]))
        config = load_config(str(path if path.is_absolute() or not inputs.file else inputs.base / path))
        model = config.model
        notes.append(f"model from {path}: vocab_size {model.vocab_size:,} as the file gives it (a tokenizer "
                     f"may pad it)")
    elif inputs.model_table is not None:
        model = build(ModelConfig, inputs.model_table, "model")
        model.validate()
    seq_len = inputs.number("seq_len", int, config.data.seq_len if config else model.max_seq_len if model else None)
    grad_dtype = v.get("grad_dtype", model.param_dtype if model else "float32")
    if grad_dtype not in ("float32", "bfloat16"):
        raise ConfigError(inputs.name("grad_dtype"), f"must be float32 or bfloat16, got {grad_dtype!r}")
    if model is not None:
        shape = cost_inputs.ModelShape.from_config(model, seq_len)
        if grad_dtype != model.param_dtype:
            shape = dataclasses.replace(shape, grad_bytes=2 if grad_dtype == "bfloat16" else 4)
    else:
        shape = cost_inputs.ModelShape.from_params(inputs.number("params", int),
                                                   inputs.number("layers", int, DEFAULT_LAYERS),
                                                   2 if grad_dtype == "bfloat16" else 4,
                                                   inputs.number("flops_per_token"))
    tokens = inputs.number("tokens_per_step", int)
    if tokens is None:
        batch = inputs.number("batch", int, config.data.global_batch if config else None)
        if batch is None or seq_len is None:
            raise inputs.missing("tokens_per_step", "give --tokens-per-step, or --batch and --seq-len")
        tokens = batch * seq_len
    for key in REQUIRED:
        if key not in v:
            raise inputs.missing(key)
    cost_inputs.check_number(inputs.name("peak_tflops"), inputs.number("peak_tflops"))
    layout = cost_inputs.Layout(inputs.number("pods", int), inputs.number("hosts_per_pod", int),
                                inputs.number("chips_per_pod", int), tokens,
                                inputs.number("microbatches", int, model.microbatches if model else 1),
                                inputs.number("model_parallel", int, config.mesh.model if config else 1),
                                inputs.switch("fully_sharded"))
    chip = cost_inputs.Chip(inputs.number("peak_tflops") * 1e12, inputs.number("mfu"))
    links = cost_inputs.Links(inputs.number("dcn_gbps"), inputs.number("dcn_latency_ms"), inputs.number("ici_gbps"),
                              inputs.number("ici_latency_ms", float, 0.001),
                              inputs.number("streams", int, _streams(config)))
    calibration = build(cost_inputs.Calibration, inputs.calibration_table, "calibration") \
        if inputs.calibration_table is not None else cost_inputs.Calibration()
    names = {"peak_flops": inputs.name("peak_tflops"), "layers": inputs.name("layers")}
    try:
        for part in (shape, layout, chip, links):
            part.validate()
    except ConfigError as exc:
        raise ConfigError(names.get(exc.field) or inputs.name(exc.field), exc.message) from None
    try:
        calibration.validate()
    except ConfigError as exc:
        raise ConfigError(f"calibration.{exc.field}", exc.message) from None
    return shape, layout, chip, links, calibration, inputs.switch("allow_lossy"), notes


def seconds(value: float) -> str:
    return f"{value:.3f} s" if value >= 1 else f"{value * 1e3:.2f} ms" if value >= 1e-3 else \
        f"{value * 1e6:.1f} us" if value > 0 else "0"


def count(value: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if value >= size:
            return f"{value / size:.2f}{unit}"
    return f"{value:,.0f}"


def nbytes(value: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def report(shape, layout, chip, links, calibration, allow_lossy, ranked, best, notes) -> dict:
    """The plan as one JSON-ready dict."""
    first = ranked[0]
    return {"inputs": {"model": dataclasses.asdict(shape), "layout": dataclasses.asdict(layout),
                       "chip": dataclasses.asdict(chip), "links": dataclasses.asdict(links),
                       "allow_lossy": allow_lossy},
            "calibration": dataclasses.asdict(calibration),
            "compute": {"forward_s": first.forward_s, "backward_s": first.backward_s,
                        "one_pod_step_s": first.one_pod_step_s},
            "candidates": [{"rank": i, **p.as_dict()} for i, p in enumerate(ranked, 1)],
            "recommended": best.as_dict(), "notes": notes}


def print_report(shape, layout, chip, links, calibration, ranked, best, allow_lossy, show_all, notes) -> None:
    """The plan as a readable table, the recommendation as TOML and as --set options."""
    import tomli_w

    from multipod.controller.tune.cost import effective_dcn_bytes_per_s
    first = ranked[0]
    rate = effective_dcn_bytes_per_s(links, layout, best.choice.streams or links.streams, calibration)
    print(f"multipod plan: {layout.pods} pod(s) x {layout.hosts_per_pod} host(s) x {layout.chips_per_pod} chip(s), "
          f"{count(shape.params)} parameters, {layout.tokens_per_step:,} tokens per step "
          f"({layout.tokens_per_pod:,.0f} per pod)")
    print(f"  one pod's step: {seconds(first.one_pod_step_s)} (forward {seconds(first.forward_s)}, backward "
          f"{seconds(first.backward_s)}) at {chip.mfu:.1%} MFU of {chip.peak_flops / 1e12:g} TFLOP/s per chip")
    print(f"  DCN: {links.dcn_gbps:g} Gb/s per pod each way ({rate * 8 / 1e9:,.1f} Gb/s effective), "
          f"{links.dcn_latency_ms:g} ms; ICI {links.ici_gbps:g} Gb/s per chip")
    print()
    header = f"{'#':>3}  {'tier':<5}  {'candidate':<40} {'step':>11} {'exposed comm':>13} {'weak scaling':>13} " \
             f"{'DCN bytes/step':>15}"
    print(header)
    print("-" * len(header))
    lossy_seen = 0
    for i, p in enumerate(ranked, 1):
        if p.choice.lossy:
            lossy_seen += 1
            if lossy_seen > LOSSY_SHOWN and not show_all:
                continue
        mark = " *" if p is best else ""
        print(f"{i:>3}  {p.tier:<5}  {p.choice.label():<40} {seconds(p.step_s):>11} "
              f"{seconds(p.exposed_s + p.ici_s):>13} {p.weak_scaling:>12.1%} {nbytes(p.dcn_bytes_per_step):>15}{mark}")
    hidden = lossy_seen - LOSSY_SHOWN
    if hidden > 0 and not show_all:
        print(f"     ... {hidden} more lossy candidate(s): --all prints them")
    print()
    why = "exact sync" if not best.choice.lossy else "changes the math: check its loss against exact sync"
    print(f"recommended (*): {best.choice.label()} ({why}), {seconds(best.step_s)} per step, "
          f"{best.weak_scaling:.1%} weak scaling")
    if not allow_lossy:
        fastest = min(ranked, key=lambda p: p.step_s)
        if fastest.choice.lossy and fastest.step_s < best.step_s:
            print(f"  the fastest overall is lossy: {fastest.choice.label()} at {seconds(fastest.step_s)} "
                  f"(--allow-lossy may choose it)")
    print(tomli_w.dumps(best.choice.settings()).rstrip())
    print("--set " + " --set ".join(f"{section}.{key}={json.dumps(value)}" for section, table in
                                    best.choice.settings().items() for key, value in table.items()))
    for note in notes:
        print(f"note: {note}")


def main(args: argparse.Namespace) -> int:
    """Run `multipod plan`; returns the exit code."""
    from multipod.controller.tune.cost import DILOCO_ON_SEVERAL_HOSTS, plan
    shape, layout, chip, links, calibration, allow_lossy, notes = resolve(args)
    ranked, best = plan(shape, layout, chip, links, allow_lossy, calibration)
    notes = notes + ["DiLoCo's step is an inner step; its loss per token is not exact sync's (measure it: "
                     "bench/diloco.py, `multipod tune --dcn`)"]
    if layout.hosts_per_pod > 1 and not DILOCO_ON_SEVERAL_HOSTS:
        notes.append("no DiLoCo candidates: multipod runs DiLoCo on pods of one host only for now")
    if args.json:
        print(json.dumps(report(shape, layout, chip, links, calibration, allow_lossy, ranked, best, notes)))
        return 0
    print_report(shape, layout, chip, links, calibration, ranked, best, allow_lossy, args.all, notes)
    return 0
