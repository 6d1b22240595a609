"""Engine benchmarks: ``python -m engine.bench [all|latency|prefill|throughput|prefix|chunked]``.

Every figure is printed next to a ceiling or a baseline measured in the same run:
device copy bandwidth (bytes read + written) and a large matmul give the ceilings; HF
transformers on the same weights gives the baseline. Speed does not depend on weight values,
so ``--load-format dummy`` with ``engine/configs/llama-3.1-8b.json`` benchmarks the 8B shape
with random weights (the output says so).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import random
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.engine_builder import build_engine
from engine.engine_core import EngineCore
from engine.loaded_model import LoadedModel
from engine.kernels.gemv_policy import PROJECTIONS, GemvPolicy
from engine.memory import storage_bytes, tensor_bytes
from engine.metrics import StepTimes
from engine.quantization import Int4Linear
from engine.sampling import SamplingParams
from engine.sync_debug import report_host_syncs

SUITES = ("latency", "prefill", "throughput", "prefix", "chunked")  # plus "serve": engine/bench_serve.py


@dataclass
class Row:
    figure: str
    value: float
    unit: str
    reference: str = ""
    ref_value: float | None = None
    higher_is_better: bool = True
    is_check: bool = False  # a pass/fail bound, not a comparison

    @property
    def ratio(self) -> float | None:
        """value / reference (a fraction of a ceiling, or a multiple of a baseline)."""
        if not self.ref_value:
            return None
        return self.value / self.ref_value

    def verdict(self) -> str:
        r = self.ratio
        if r is None:
            return ""
        if self.is_check:
            return "pass" if self.value <= self.ref_value else "FAIL"
        if not self.higher_is_better and r < 1:
            return f"{1 / r:.1f}x lower"
        return f"{r:.2f}x"


@dataclass
class Sizes:
    """Workload sizes; CPU defaults are small enough for a 2-core machine."""

    decode_prompt: int
    decode_tokens: int
    prefill_batch: int
    prefill_len: int
    throughput_requests: int
    throughput_in: tuple[int, int]
    throughput_out: tuple[int, int]
    prefix_len: int
    question_len: int
    prefix_runs: int
    chunked_streams: int
    chunked_long: int
    chunked_budgets: tuple[int, ...]  # the first is the headline; the others show the ITL / TTFT trade-off
    # The engine of every suite but throughput; it leaves room for the HF baseline.
    max_num_seqs: int
    max_num_batched_tokens: int
    # The throughput suite's own engine, built after the HF baseline and the first engine are
    # released: a serving-scale batch (vLLM's offline defaults on an H100/H200) and KV pool.
    throughput_max_num_seqs: int
    throughput_max_num_batched_tokens: int
    throughput_gpu_memory_utilization: float

    @classmethod
    def for_device(cls, device: torch.device) -> "Sizes":
        if device.type == "cuda":
            # 2026-11-30 H200 (docs/performance.md): the throughput run at max_num_seqs 256 /
            # 8,192 tokens a step: 9,326 out tok/s; 512 / 16,384: 10,002; 1,024 / 16,384: 10,241
            # (all at 0.9 of the memory: the last 256 requests' tail is shorter in a wider batch).
            return cls(512, 128, 8, 2048, 1000, (128, 1024), (128, 512), 32000, 30, 10, 32, 32000, (64, 128, 256, 512),
                       256, 8192, 1024, 16384, 0.9)
        return cls(128, 48, 2, 256, 32, (64, 192), (32, 64), 2000, 30, 5, 8, 1500, (64, 32), 32, 512, 32, 512, 0.9)


# ---- ceilings ---------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeat: int) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs after one warm-up."""
    fn()
    sync(device)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a large device-to-device copy (rotating buffers)."""
    n = (1 << 30 if device.type == "cuda" else 1 << 28) // 4
    bufs = [torch.randn(n, device=device) for _ in range(3)]
    out = torch.empty_like(bufs[0])
    i = [0]

    def run():
        out.copy_(bufs[i[0] % 3])
        i[0] += 1

    return 2 * n * 4 / timed(run, device, 10)


def matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    n = 8192 if device.type == "cuda" else 1024
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / timed(lambda: a @ b, device, 10)


def decode_step_bytes(core: EngineCore, context: int) -> int:
    """Bytes one batch-1 decode step must read: the weights a one-row step multiplies by (the
    native step's GGUF blocks, or int4 blocks where the model has them; the embedding table is only indexed unless it is the head)
    plus the request's KV."""
    mc = core.model_config
    elem = torch.empty((), dtype=core.dtype).element_size()
    kv = mc.kv_bytes_per_token(elem) * context
    if core.runner.native is not None:  # the native step reads its own block copy of the weights
        return core.runner.native.weight_bytes_per_step + kv
    model = core.model
    int4 = [m for m in model.modules() if isinstance(m, Int4Linear)]
    if int4:  # dense copies, the indexed embedding and the RoPE table are not read by a one-row step
        skip = {t.untyped_storage().data_ptr() for t in (*(m.weight for m in int4), model.embed_tokens.weight, model.rope.cos_sin)}
        return storage_bytes(t for t in [*model.parameters(), *model.buffers()] if t.untyped_storage().data_ptr() not in skip) + kv
    weights = mc.num_parameters * elem
    if not mc.tie_word_embeddings:
        weights -= mc.vocab_size * mc.hidden_size * elem
    return weights + kv


# ---- workloads ----------------------------------------------------------------------------------
def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 1) for _ in range(n)]


def run_to_completion(core: EngineCore) -> None:
    while core.has_unfinished_requests():
        core.step()


def engine_decode(core: EngineCore, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(ttft s, tpot s) of one request alone."""
    req = core.add_request(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    run_to_completion(core)
    return req.metrics.ttft, req.metrics.tpot


def hf_decode(hf, prompt: list[int], tokens: int, device: torch.device) -> tuple[float, float]:
    x = torch.tensor([prompt], device=device)
    gen = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        hf.generate(x, max_new_tokens=2, min_new_tokens=2, **gen)  # warm-up
        t1 = timed(lambda: hf.generate(x, max_new_tokens=1, min_new_tokens=1, **gen), device, 2)
        tn = timed(lambda: hf.generate(x, max_new_tokens=tokens + 1, min_new_tokens=tokens + 1, **gen), device, 1)
    return t1, (tn - t1) / tokens


HF_BASELINE_MEMORY = "HF baseline's weights (bench only, float32 at its check)"


def check_against_hf(core: EngineCore, hf, rng: random.Random, results: dict) -> Row:
    """Correctness before speed: the log-probs the engine gives its own greedy tokens (prefill,
    then decode steps: CUDA graphs on the GPU) against a float32 forward of HF over the same
    sequence. In bf16 the bound is twice HF's own bf16 error against that float32 reference."""
    prompt = random_prompt(rng, 61, core.model_config.vocab_size)
    req = core.add_request(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0))
    ours = []
    while core.has_unfinished_requests():
        for out in core.step():
            ours += [lp[t] for lp, t in zip(out.logprobs or [], out.token_ids)]
    tokens = req.output_token_ids
    x = torch.tensor([prompt + tokens], device=core.device)
    rows = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens), device=core.device)
    picked = torch.tensor(tokens, device=core.device)

    def chosen_logprobs() -> list[float]:
        with torch.inference_mode():
            logits = hf(x).logits[0, rows].float()
        return torch.log_softmax(logits, -1)[torch.arange(len(tokens), device=core.device), picked].tolist()

    low = chosen_logprobs()
    dtype = next(hf.parameters()).dtype
    if dtype != torch.float32:
        hf.float()
        exact = chosen_logprobs()
    else:
        exact = low
    # The baseline shares the device with the engine in this process: its float32 weights are an
    # owner of the peak, not "other".
    core.memory.record(HF_BASELINE_MEMORY, tensor_bytes(hf))
    if dtype != torch.float32:
        hf.to(dtype)
        torch.cuda.empty_cache() if core.device.type == "cuda" else None
    err = max(abs(a - b) for a, b in zip(ours, exact))
    hf_err = max(abs(a - b) for a, b in zip(low, exact))
    tolerance = max(2 * hf_err, 1e-3)
    print(f"check: per-token |ours - fp32| {[round(abs(a - b), 4) for a, b in zip(ours, exact)]}", file=sys.stderr)
    print(f"check: per-token |HF {dtype} - fp32| {[round(abs(a - b), 4) for a, b in zip(low, exact)]}", file=sys.stderr)
    results.update(check_max_abs_logprob_diff=err, check_hf_same_dtype_diff=hf_err)
    if err > tolerance:
        raise SystemExit(f"correctness check failed: max |logprob diff| vs float32 = {err:.4f} > {tolerance:.4f}")
    return Row(f"correctness: max |logprob - fp32 ref| over {len(tokens)} tokens", err, "nats",
               "bound: 2 x HF's own error at this dtype", tolerance, False, is_check=True)


def bench_latency(core, hf, sizes, rng, bw, results) -> list[Row]:
    prompt = random_prompt(rng, sizes.decode_prompt, core.model_config.vocab_size)
    engine_decode(core, prompt, 4)  # warm-up
    core.block_manager.reset_prefix_cache()
    ttft, tpot = engine_decode(core, prompt, sizes.decode_tokens)
    ceiling = bw / decode_step_bytes(core, sizes.decode_prompt + sizes.decode_tokens // 2)
    rows = [Row(f"decode batch 1 (prompt {sizes.decode_prompt})", 1 / tpot, "tok/s", "bandwidth ceiling (bytes/step / copy bw)", ceiling)]
    results.update(decode_bs1_tok_s=1 / tpot, decode_bs1_roofline_frac=(1 / tpot) / ceiling, decode_bs1_ceiling_tok_s=ceiling)
    graphs = core.runner.graphs
    if graphs is not None and graphs.bucket(1) == 1:
        # The device alone: replay the batch-1 graph back to back (last request's buffers).
        gpu_ms = replay_ms(graphs.graphs[1])
        rows.append(Row("decode batch 1: device time per step (graph replay)", gpu_ms, "ms", "engine time per token (tpot)", tpot * 1e3, False))
        results.update(decode_bs1_graph_ms=gpu_ms, decode_bs1_tpot_ms=tpot * 1e3)
        if core.runner.gemv.max_rows:
            rows += decode_path_ab(core, prompt, sizes, tpot, gpu_ms, results)
    if core.async_scheduling:  # what async scheduling buys: the same decode with it off
        core.async_scheduling = False
        core.block_manager.reset_prefix_cache()
        _, tpot_sync = engine_decode(core, prompt, sizes.decode_tokens)
        core.async_scheduling = True
        rows.append(Row("decode batch 1, async scheduling", 1 / tpot, "tok/s", "same, async scheduling off", 1 / tpot_sync))
        results.update(decode_bs1_sync_tok_s=1 / tpot_sync)
    if hf is not None:
        # HF's best: on a CPU float32 can beat bf16 (no AMX path for its small matmuls), so both run.
        dtype = next(hf.parameters()).dtype
        by_dtype = {str(dtype).removeprefix("torch."): 1 / hf_decode(hf, prompt, sizes.decode_tokens, core.device)[1]}
        if core.device.type == "cpu" and dtype != torch.float32:
            hf.float()
            by_dtype["float32"] = 1 / hf_decode(hf, prompt, sizes.decode_tokens, core.device)[1]
            hf.to(dtype)
        best = max(by_dtype, key=by_dtype.get)
        rows.append(Row("decode batch 1 vs HF generate()", 1 / tpot, "tok/s", f"HF generate() same model ({best}, best of {'/'.join(by_dtype)})", by_dtype[best]))
        results.update(hf_decode_bs1_tok_s=by_dtype[best], hf_decode_bs1_tok_s_by_dtype=by_dtype)
    return rows


def replay_ms(graph: torch.cuda.CUDAGraph, times: int = 50) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(times):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / times


def decode_path_variants(path: GemvPolicy) -> dict[str, GemvPolicy]:
    """What each part of the batch-1 decode path buys: the path with one part changed."""
    variants = {"cuBLAS projections, separate SwiGLU": replace(path, max_rows=0)}
    if path.pdl:
        variants["same, PDL off"] = replace(path, pdl=False)
        for late in sorted({(), *((name,) for name in PROJECTIONS), ("o", "gate_up"), PROJECTIONS} - {path.late_release}):
            variants[f"same, late PDL release: {'+'.join(late) or 'none'}"] = replace(path, late_release=late)
    if path.fused_swiglu:
        variants["same, SwiGLU as its own kernel"] = replace(path, fused_swiglu=False)
    down = "on cuBLAS" if path.gemv_down else f"as a GEMV too (split-K {path.down_split_k})"
    variants[f"same, down_proj {down}"] = replace(path, gemv_down=not path.gemv_down)
    for split in sorted({1, 2, 4} - {path.o_split_k}):
        variants[f"same, o_proj split-K {split}"] = replace(path, o_split_k=split)
    if path.gemv_down:
        for split in sorted({1, 2, 4} - {path.down_split_k}):
            variants[f"same, down_proj split-K {split}"] = replace(path, down_split_k=split)
    return variants


def decode_path_ab(core, prompt, sizes, tpot, gpu_ms, results) -> list[Row]:
    """The batch-1 graph captured again for each variant of the decode path (GemvPolicy): its
    replay time and the engine's decode speed with it, against the configured path."""
    from engine.cuda_graph import CudaGraphRunner

    runner, graphs, path = core.runner, core.runner.graphs, core.runner.gemv
    rows, by_variant = [], {}
    for name, variant in decode_path_variants(path).items():
        try:
            other = CudaGraphRunner(core.model, runner.backend, runner.kv_layers, [1], graphs.block_tables.shape[1], len(graphs.tokens),
                                    core.device, variant)
            runner.graphs = other
            core.block_manager.reset_prefix_cache()
            _, other_tpot = engine_decode(core, prompt, sizes.decode_tokens)
            other_ms = replay_ms(other.graphs[1])  # like the other replay: with the decoded request's context
        finally:
            runner.graphs = graphs
        del other
        by_variant[name] = {"tok_s": 1 / other_tpot, "graph_ms": other_ms}
        rows += [Row(f"decode batch 1 ({path_name(path)})", 1 / tpot, "tok/s", name, 1 / other_tpot),
                 Row("  graph replay", gpu_ms, "ms", name, other_ms, False)]
    results.update(decode_bs1_path=asdict(path), decode_bs1_variants=by_variant)
    return rows


def path_name(path: GemvPolicy) -> str:
    if not path.max_rows:
        return "cuBLAS"
    parts = ["GEMVs", "SwiGLU in gate|up" if path.fused_swiglu else "", f"o_proj split-K {path.o_split_k}" if path.o_split_k > 1 else "",
             f"down GEMV split-K {path.down_split_k}" if path.gemv_down else "",
             "PDL" if path.pdl else "", f"late release {'+'.join(path.late_release)}" if path.pdl and path.late_release else ""]
    return ", ".join(p for p in parts if p)


def bench_prefill(core, hf, sizes, rng, flops, results) -> list[Row]:
    vocab = core.model_config.vocab_size
    prompts = [random_prompt(rng, sizes.prefill_len, vocab) for _ in range(sizes.prefill_batch)]
    saved = core.scheduler.config.max_num_batched_tokens
    core.scheduler.config.max_num_batched_tokens = sizes.prefill_batch * sizes.prefill_len

    def once():
        core.block_manager.reset_prefix_cache()
        for p in prompts:
            core.add_request(p, SamplingParams(max_tokens=1, ignore_eos=True))
        run_to_completion(core)

    seconds = timed(once, core.device, 3)
    core.scheduler.config.max_num_batched_tokens = saved
    tokens = sizes.prefill_batch * sizes.prefill_len
    ours = tokens / seconds
    ceiling = flops / (2 * core.model_config.num_parameters)
    rows = [Row(f"prefill {sizes.prefill_batch} x {sizes.prefill_len}", ours, "tok/s", "matmul ceiling (2 FLOP/param/token)", ceiling)]
    results.update(prefill_tok_s=ours)
    if hf is not None:
        x = torch.tensor(prompts, device=core.device)
        with torch.inference_mode():
            hf_seconds = timed(lambda: hf(x, logits_to_keep=1), core.device, 3)
        rows.append(Row(f"prefill {sizes.prefill_batch} x {sizes.prefill_len} vs HF forward", ours, "tok/s", "HF forward same batch", tokens / hf_seconds))
        results.update(hf_prefill_tok_s=tokens / hf_seconds)
    return rows


@dataclass(frozen=True)
class ThroughputBounds:
    """How fast a batch of requests could run on this device: its FLOPs at the measured matmul
    rate and its bytes at the measured copy bandwidth. ``roofline_s``: the two fully overlapped
    (the larger one); ``serial_s``: one after the other, as an engine whose compute-bound and
    memory-bound kernels never run at the same time (ours: prefill and decode GEMMs, then decode
    attention) at best."""

    flops: float
    bytes: float
    compute_s: float
    memory_s: float

    @property
    def roofline_s(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def serial_s(self) -> float:
        return self.compute_s + self.memory_s


def throughput_bounds(mc, lengths: list[tuple[int, int]], steps: int, weight_bytes: int, elem: int, flops: float,
                      bw: float) -> ThroughputBounds:
    """Bounds for requests of (prompt, output) ``lengths`` served in ``steps`` steps: FLOPs 2 per
    parameter per token plus causal attention (prefill) and attention over the context (each
    output token but the last is decoded); bytes the weights once a step plus each decoded token's
    read of its request's K/V (prefill's own K/V traffic left out: small beside the decode's)."""
    attn = 4 * mc.num_hidden_layers * mc.num_attention_heads * mc.head_dim  # FLOPs per (query, key) pair
    kv = mc.kv_bytes_per_token(elem)
    total_flops, kv_reads = 0.0, 0
    for prompt, out in lengths:
        decoded = max(0, out - 1)  # the first output token comes from the prefill
        reads = decoded * prompt + decoded * (decoded + 1) // 2  # contexts prompt+1 .. prompt+decoded
        total_flops += 2 * mc.num_parameters * (prompt + decoded) + attn * (prompt * (prompt + 1) // 2 + reads)
        kv_reads += reads
    total_bytes = float(steps) * weight_bytes + float(kv_reads) * kv
    return ThroughputBounds(total_flops, total_bytes, total_flops / flops, total_bytes / bw)


def bench_throughput(core, sizes, rng, results, bw: float, flops: float) -> list[Row]:
    vocab = core.model_config.vocab_size

    def run(n: int) -> tuple[list, float]:
        core.block_manager.reset_prefix_cache()
        reqs = []
        t = time.perf_counter()
        for _ in range(n):
            prompt = random_prompt(rng, rng.randint(*sizes.throughput_in), vocab)
            out_len = rng.randint(*sizes.throughput_out)
            reqs.append(core.add_request(prompt, SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0)))
        run_to_completion(core)
        return reqs, time.perf_counter() - t

    # Warm-up on a fifth of the workload: the attention kernels' Triton specializations for its
    # step shapes compile here, not inside the timed run (on a fresh H200 lease they cost 1.4-2.7
    # s each, ~9 s of a ~36 s run: 7.1k vs 8.9k out tok/s, docs/performance.md).
    run(max(1, sizes.throughput_requests // 5))
    print(f"    warm-up's {slowest_steps(core.step_times)}", file=sys.stderr)
    core.step_times = StepTimes()
    reqs, seconds = run(sizes.throughput_requests)
    out_tokens = sum(len(r.output_token_ids) for r in reqs)
    tput = out_tokens / seconds
    decode_rate = core.step_times.decode_rate
    bounds = throughput_bounds(core.model_config, [(r.num_prompt_tokens, len(r.output_token_ids)) for r in reqs],
                               core.step_times.steps, decode_step_bytes(core, 0), core.dtype.itemsize, flops, bw)
    results.update(throughput_output_tok_s=tput, throughput_requests=len(reqs), throughput_decode_phase_tok_s=decode_rate,
                   throughput_roofline_tok_s=out_tokens / bounds.roofline_s, throughput_serial_bound_tok_s=out_tokens / bounds.serial_s,
                   throughput_compute_s=bounds.compute_s, throughput_memory_s=bounds.memory_s)
    ref = results.get("hf_decode_bs1_tok_s")
    label = "HF generate() batch 1" if ref else ""
    name = f"throughput, {len(reqs)} requests at once (whole run, prefill included)"
    return [Row(name, tput, "out tok/s", label, ref),
            Row(name, tput, "out tok/s", f"roofline: {bounds.compute_s:.2f} s FLOPs, {bounds.memory_s:.2f} s bytes, overlapped",
                out_tokens / bounds.roofline_s),
            Row(name, tput, "out tok/s", "the same one after the other (no overlap)", out_tokens / bounds.serial_s),
            Row(f"throughput, {len(reqs)} requests, decode-only steps", decode_rate, "out tok/s", label, ref)]


def bench_prefix(core, sizes, rng, results) -> list[Row]:
    vocab = core.model_config.vocab_size
    prefix = random_prompt(rng, sizes.prefix_len, vocab)

    def ttft(question):
        req = core.add_request(prefix + question, SamplingParams(max_tokens=1, ignore_eos=True))
        run_to_completion(core)
        return req.metrics.ttft

    core.block_manager.reset_prefix_cache()
    ttft(random_prompt(rng, sizes.question_len, vocab))  # warm: the prefix is now cached
    cached = [ttft(random_prompt(rng, sizes.question_len, vocab)) for _ in range(sizes.prefix_runs)]
    uncached = []
    for _ in range(max(2, sizes.prefix_runs // 2)):
        core.block_manager.reset_prefix_cache()
        uncached.append(ttft(random_prompt(rng, sizes.question_len, vocab)))
    c50, u50 = statistics.median(cached) * 1e3, statistics.median(uncached) * 1e3
    results.update(prefix_ttft_p50_ms=c50, uncached_ttft_p50_ms=u50)
    return [Row(f"TTFT, {sizes.question_len}-token question after a cached {sizes.prefix_len}-token prefix", c50, "ms p50",
                "same question, prefix not cached", u50, higher_is_better=False)]


def bench_chunked(core, sizes, rng, results) -> list[Row]:
    """ITL of running streams while a long prompt arrives, with chunked prefill on and off.

    Each run's baseline is the same streams decoding for as many steps without the long prompt:
    the streams' own contexts grow as they decode (by ~1,000 tokens over a prompt chunked 32
    tokens a step), which costs decode attention with or without the prompt."""
    vocab = core.model_config.vocab_size
    cfg = core.scheduler.config
    saved = (cfg.enable_chunked_prefill, cfg.max_num_batched_tokens)
    rows = []

    def phase(long_prompt: bool, chunked: bool, budget: int, steps: int = 0) -> tuple[float, float, float | None, int]:
        """(ITL p50, ITL p99, the long prompt's TTFT, steps) of one run; without the long prompt
        the streams decode for ``steps`` steps."""
        cfg.enable_chunked_prefill, cfg.max_num_batched_tokens = chunked, budget
        core.block_manager.reset_prefix_cache()
        streams = [core.add_request(random_prompt(rng, 64, vocab), SamplingParams(max_tokens=100_000, ignore_eos=True))
                   for _ in range(sizes.chunked_streams)]
        while any(len(r.output_token_ids) < 3 for r in streams):
            core.step()
        start = [len(r.metrics.token_times) for r in streams]
        long_req = None
        taken = 0
        if long_prompt:
            long_req = core.add_request(random_prompt(rng, sizes.chunked_long, vocab), SamplingParams(max_tokens=4, ignore_eos=True))
            while long_req.metrics.first_token_time is None:
                core.step()
                taken += 1
        else:
            for _ in range(steps):
                core.step()
                taken += 1
        for _ in range(3):
            core.step()
        # from the gap that ends with the first token after the long prompt arrived
        itl = [g for r, s in zip(streams, start) for g in r.metrics.inter_token_latencies[s - 1 :]]
        for r in streams:
            core.abort_request(r.request_id)
        if long_req is not None and not long_req.status.finished:
            core.abort_request(long_req.request_id)
        itl.sort()
        p99 = itl[min(len(itl) - 1, int(0.99 * len(itl)))]
        return itl[len(itl) // 2], p99, long_req.metrics.ttft if long_req is not None else None, taken

    def with_base(chunked: bool, budget: int) -> tuple[float, float, float, float, float, tuple[int, int]]:
        """(ITL p50, p99, TTFT, baseline p50, baseline p99, (steps, baseline steps)) for one setting."""
        p50, p99, ttft, steps = phase(True, chunked, budget)
        base_p50, base_p99, _, base_steps = phase(False, True, budget, steps)
        return p50, p99, ttft, base_p50, base_p99, (steps, base_steps)

    headline = sizes.chunked_budgets[0]
    by_budget = {b: with_base(True, b) for b in sizes.chunked_budgets}
    _, no_chunk, ttft_whole, _, no_chunk_base, _ = with_base(False, headline)
    cfg.enable_chunked_prefill, cfg.max_num_batched_tokens = saved
    _, with_chunk, ttft_chunk, base_p50, base, _ = by_budget[headline]
    results.update(chunked_itl_p99_ratio=with_chunk / base, unchunked_itl_p99_ratio=no_chunk / no_chunk_base,
                   long_prompt_ttft_chunked_ms=ttft_chunk * 1e3, long_prompt_ttft_unchunked_ms=ttft_whole * 1e3,
                   chunked_headline_budget=headline, chunked_itl_base_ms={"p50": base_p50 * 1e3, "p99": base * 1e3},
                   chunked_by_budget={str(b): {"itl_p99_ratio": p / bp, "itl_p50_ms": m * 1e3, "itl_p99_ms": p * 1e3,
                                               "base_itl_p50_ms": bm * 1e3, "base_itl_p99_ms": bp * 1e3, "long_prompt_ttft_ms": t * 1e3,
                                               "steps": n[0], "base_steps": n[1]}
                                      for b, (m, p, t, bm, bp, n) in by_budget.items()})
    label = f"{sizes.chunked_streams} streams, {sizes.chunked_long}-token prompt arrives"
    for b, (_, p99, ttft, _, bp, _) in by_budget.items():
        rows.append(Row(f"ITL p99, {label}, chunked ({b}/step)", p99 * 1e3, "ms", "same steps without the long prompt", bp * 1e3, False))
        rows.append(Row(f"long prompt TTFT, chunked ({b}/step)", ttft * 1e3, "ms", "not chunked", ttft_whole * 1e3, False))
    rows.append(Row(f"ITL p99, {label}, not chunked", no_chunk * 1e3, "ms", "same steps without the long prompt", no_chunk_base * 1e3, False))
    return rows


# ---- report --------------------------------------------------------------------------------------
def same_engine(a: EngineConfig, b: EngineConfig, device: torch.device) -> bool:
    """Whether the throughput suite can run on the first engine: same batch limits, and off
    CUDA the memory fraction is not read (the CPU pool has a fixed size)."""
    return (a.max_num_seqs, a.max_num_batched_tokens) == (b.max_num_seqs, b.max_num_batched_tokens) and (
        device.type != "cuda" or a.gpu_memory_utilization == b.gpu_memory_utilization)


def engine_settings(config: EngineConfig) -> dict[str, float]:
    """What the JSON record says about an engine the suites ran on."""
    return {"max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
            "gpu_memory_utilization": config.gpu_memory_utilization}


def throughput_engine(config: EngineConfig, loaded: LoadedModel) -> EngineCore:
    """A second engine on the same weights for the throughput suite, after the first one's KV
    pool and graphs are freed (its memory then goes to this one's pool)."""
    import gc

    gc.collect()
    if loaded.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(loaded.device)
    core = build_engine(config, loaded)
    print(f"# throughput engine: max_num_seqs {config.max_num_seqs}, max_num_batched_tokens {config.max_num_batched_tokens}, "
          f"gpu_memory_utilization {config.gpu_memory_utilization}: {core.kv_cache.num_blocks:,} KV blocks", flush=True)
    return core


def slowest_steps(st: StepTimes) -> str:
    """The five slowest steps: by their device spans where recorded (CUDA), else by host time
    (which, with async scheduling, includes waiting for the step before)."""
    if st.slowest_device:
        return f"slowest steps on the device (s, mode, requests, tokens): {[(round(a, 3), m, r, t) for a, m, r, t in st.slowest_device]}"
    return f"slowest steps by host time (s, requests, tokens): {[(round(a, 3), r, t) for a, r, t in st.slowest]}"


def format_device_time(device_time: dict[str, dict]) -> str:
    """The report's device-time section from each suite's ``StepTimes.device_summary()``."""
    lines = ["\nwhere the device time went (CUDA events around each step: seconds of step spans by mode, mean ms a "
             "step; idle: with async scheduling, gaps between a step and the one launched behind it that the host did not hide):"]
    for suite, d in device_time.items():
        lines.append(f"  {suite:<11} busy {d['busy_s']:.2f} s, idle {d['idle_s']:.2f} s;  "
                     + "  ".join(f"{m} {t['s']:.2f} s ({t['ms_per_step']:.2f} ms/step)" for m, t in sorted(d["by_mode"].items())))
    return "\n".join(lines)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def format_table(rows: list[Row]) -> str:
    lines = [f"{'figure':<78} {'value':>12} {'unit':<10} {'ceiling / baseline':<44} {'ref':>12} {'ratio':>11}"]
    for r in rows:
        ref = f"{r.ref_value:,.2f}" if r.ref_value is not None else ""
        lines.append(f"{r.figure:<78} {r.value:>12,.2f} {r.unit:<10} {r.reference:<44} {ref:>12} {r.verdict():>11}")
    return "\n".join(lines)


def run_suites(core, hf, sizes, rng, bw, flops, suites, rows, results, breakdown, device_time) -> None:
    for suite in suites:
        print(f"... {suite}", file=sys.stderr, flush=True)
        core.step_times = StepTimes()
        if suite == "latency":
            rows += bench_latency(core, hf, sizes, rng, bw, results)
        elif suite == "prefill":
            rows += bench_prefill(core, hf, sizes, rng, flops, results)
        elif suite == "throughput":
            rows += bench_throughput(core, sizes, rng, results, bw, flops)
        elif suite == "prefix":
            rows += bench_prefix(core, sizes, rng, results)
        elif suite == "chunked":
            rows += bench_chunked(core, sizes, rng, results)
        st = core.step_times
        breakdown[suite] = st.per_step_ms() | {"steps": st.steps, "graph_steps": st.graph_steps, "mixed_steps": st.mixed_steps, "piecewise_steps": st.piecewise_steps,
                                               "native_steps": st.native_steps, "decode_only_steps": st.decode_only_steps,
                                               "decode_only_s": st.decode_only_time, "decode_only_tokens": st.decode_only_tokens}
        if st.device_span:
            device_time[suite] = st.device_summary()
        print(f"    {slowest_steps(st)}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # the load generator against an OpenAI-compatible server
        from engine.bench_serve import main as serve_main

        return serve_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m engine.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", nargs="*", metavar="SUITE", help=f"one or more of all, {', '.join(SUITES)} (default: all)")
    p.add_argument("--model", help="model path, or a config.json with --load-format dummy (default: embedded SmolLM2)")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--quantization", default="none", choices=("none", "int4"),
                   help="int4: the GGUF's own Q4_1/Q8_0 blocks with bf16 activations (CPU)")
    p.add_argument("--native-decode-step", default="auto", choices=("auto", "on", "off"),
                   help="with int4 on the CPU: small decode-only steps as one native call (engine/native_decode.py)")
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
    args = p.parse_args(argv)
    # checked here, not by argparse's choices: with nargs="*" an empty list fails them on some
    # Python versions (3.11) and a list default on others (3.12)
    unknown = [name for name in args.suite if name not in ("all", *SUITES)]
    if unknown:
        p.error(f"unknown suite(s) {', '.join(unknown)}: choose from all, {', '.join(SUITES)}")

    model = args.model
    if model is None:
        from importlib.util import find_spec

        if find_spec("assistant") is None:
            p.error("--model is required")
        from assistant.models import resolve

        model = str(resolve("llm"))
    config = EngineConfig(model=model, load_format=args.load_format, dtype=args.dtype, device=args.device, seed=args.seed,
                          quantization=args.quantization, native_decode_step=args.native_decode_step, async_scheduling=args.async_scheduling,
                          pdl=args.pdl, gpu_memory_utilization=args.gpu_memory_utilization)
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
    print(f"# engine.bench on {device_name(device)} — model {Path(model).name} ({core.model_config.num_parameters/1e6:,.0f}M params, "
          f"{core.dtype}, {'RANDOM weights (--load-format dummy): speed only' if args.load_format == 'dummy' else 'real weights'})", flush=True)
    if core.runner.native is not None:
        print(f"# native CPU decode step ({core.runner.native.simd}) for decode-only steps of <= {core.runner.native.max_batch} requests", flush=True)
    bw = copy_bandwidth(device)
    flops = matmul_flops(device, core.dtype)
    rows = [Row("device copy bandwidth (read + write)", bw / 1e9, "GB/s"), Row(f"matmul {core.dtype}", flops / 1e12, "TFLOP/s")]
    results.update(copy_bandwidth_gbs=bw / 1e9, matmul_tflops=flops / 1e12)
    suites = SUITES if not args.suite or "all" in args.suite else tuple(dict.fromkeys(args.suite))
    hf = None
    if not args.no_hf:
        from engine.hf_reference import build_hf_model

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
                   breakdown, device_time)
        if separate:
            memory["engine of the other suites"] = core.memory_rows()  # its peak, before the next engine's
            hf = core = None  # release the HF copy, the first KV pool and its graphs before sizing the next pool
            core = throughput_engine(tput_config, loaded)
            run_suites(core, None, sizes, rng, bw, flops, ["throughput"], rows, results, breakdown, device_time)
    if syncs:
        print(f"host syncs during the suites: {sum(syncs.values())} at {len(syncs)} places (stacks above, on stderr)", file=sys.stderr)
    hf = None
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
    if args.json:
        record = {
            "gpu" if device.type == "cuda" else "device": device_name(device),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": "python -m engine.bench " + " ".join(argv),
            "versions": {"torch": torch.__version__, "python": platform.python_version()},
            "model": Path(model).name, "random_weights": args.load_format == "dummy",
            "sizes": asdict(sizes), "results": results, "step_breakdown_ms": breakdown, "device_time_s": device_time, "rows": [asdict(r) | {"ratio": r.ratio} for r in rows],
            "memory": {name: dict(memory_rows) for name, memory_rows in memory.items()},
            "engines": {"main": engine_settings(config), **({"throughput": engine_settings(tput_config)} if separate else {})},
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
