"""Attention kernels alone: ``python -m engine.bench.kernels`` (CUDA).

Times the paged decode and prefill kernels on Llama-3.1-8B attention shapes (32 query heads,
8 KV heads, head dim 128, bf16, 16-token pages, shuffled block tables), checks each against
the torch reference, and prints achieved FLOP/s and bytes/s next to the ceilings measured in the
same run (a bf16 matmul, a device copy). Prefill is timed for several tile shapes.
"""

from __future__ import annotations

import argparse
import inspect
import random
import sys
import time

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention.backend import AttentionMetadata
from engine.attention.torch_ref import paged_attention_reference
from engine.attention.triton_paged import PrefillConfig, decode_attention, prefill_attention
from engine.config import ModelConfig
from engine.kv_cache import LayerKV, quantize

HQ, HKV, D, PAGE = 32, 8, 128, 16
PREFILL_VARIANTS = [PrefillConfig(), PrefillConfig(64, 64, 4, 2), PrefillConfig(128, 64, 8, 3), PrefillConfig(128, 32, 4, 4)]


def make_batch(query_lens: list[int], ctx_lens: list[int], device: torch.device, seed: int = 0):
    rng = random.Random(seed)
    seq = [c + q for c, q in zip(ctx_lens, query_lens)]
    need = [-(-s // PAGE) for s in seq]
    ids = list(range(1, sum(need) + 1))
    rng.shuffle(ids)
    it = iter(ids)
    tables = [[next(it) for _ in range(n)] for n in need]
    width = max(need)
    k = torch.randn(sum(need) + 1, PAGE, HKV, D, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.long, device=device),
        query_start_loc=torch.tensor(qsl, device=device),
        seq_lens=torch.tensor(seq, dtype=torch.int32, device=device),  # int32 as the engine's: the kernels compile as they run
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        query_lens_host=list(query_lens), seq_lens_host=seq,
        num_decodes=sum(1 for q in query_lens if q == 1), max_seq_len=max(seq),
    )
    q = torch.randn(sum(query_lens), HQ, D, device=device, dtype=torch.bfloat16)
    return q, LayerKV(k, v), meta


def fp8_copies(cases: list) -> list:
    """``make_batch`` results with their K/V cache in e4m3 and per-row scales (engine/kv_cache.py's rounding)."""
    out = []
    for q, cache, meta in cases:
        (kq, ks), (vq, vs) = quantize(cache.k), quantize(cache.v)
        out.append((q, LayerKV(kq, vq, ks, vs), meta))
    return out


@dataclass
class DecodeCases:
    """Copies of one decode batch (one query a request) with K/V in bf16 and in FP8, rotated
    through so that each timed call reads its cache from HBM, not L2; each copy's minimum bytes."""

    bf16: list
    fp8: list
    bf16_bytes: float
    fp8_bytes: float  # K/V halved, plus a float32 scale a (token, KV head) row


def decode_cases(batch: int, ctx: int, device: torch.device, total_bytes: int = 200_000_000) -> DecodeCases:
    """``batch`` requests of ``ctx`` cached tokens each (:func:`make_batch`), in as many copies as
    make ``total_bytes`` of bf16 K/V, and the same copies in FP8 (:func:`fp8_copies`)."""
    _, nbytes = attention_cost([1] * batch, [ctx] * batch)
    made = [make_batch([1] * batch, [ctx] * batch, device, seed=i) for i in range(max(1, -(-total_bytes // nbytes)))]
    return DecodeCases(made, fp8_copies(made), nbytes, nbytes / 2 + nbytes / 2 / D * 4 / 2)


# The 8B shape's strides in the attention kernels' launches (q|k|v rows of 6,144, q and out 4,096,
# the cache [blocks, 16, 8, 128] and its scales [blocks, 16, 8], the RoPE table's rows of 128).
LAUNCH_STRIDES = {"stride_qt": 6144, "stride_qh": 128, "stride_kt": 6144, "stride_kh": 128, "stride_vt": 6144, "stride_vh": 128,
                  "stride_cs": 128, "stride_cslot": 1024, "stride_ch": 128, "stride_sslot": 8, "stride_kb": 16384, "stride_ks": 1024,
                  "stride_out_t": 4096, "stride_out_h": 128, "stride_knt": 6144, "stride_knh": 128, "stride_vnt": 6144,
                  "stride_vnh": 128, "stride_sb": 128, "stride_ss": 8, "stride_sh": 1}


def compile_as_launched(fn, types: dict[str, str], constexprs: dict, strides: dict[str, int] = LAUNCH_STRIDES, **options):
    """``fn`` (a ``triton.jit`` kernel) compiled for sm_90 without a GPU (Triton's own ptxas),
    specialized as a launch with these ``strides`` specializes it: pointers 16-byte aligned, a
    stride the kernel does not exclude (``do_not_specialize``) known to be a multiple of 16 where
    it is one, and made a constant where it is 1; a ``tl.constexpr`` left out takes its default,
    as at a launch. ``types``: the pointers' and floats' Triton types (other arguments are i32);
    ``options``: num_warps, num_stages, maxnreg."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    specialized = {p.name: strides[p.name] for p in fn.params if p.name in strides and not p.do_not_specialize}
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.default is not inspect.Parameter.empty}
    constexprs = {**defaults, **constexprs, **{name: 1 for name, value in specialized.items() if value == 1}}
    names = [p.name for p in fn.params]
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
               if name not in constexprs and (signature[name].startswith("*") or specialized.get(name, 1) % 16 == 0)}
    return triton.compile(ASTSource(fn, signature, constexprs, aligned), target=GPUTarget("cuda", 90, 32), options=options)


def attention_cost(query_lens, ctx_lens) -> tuple[float, float]:
    """(FLOPs, minimum bytes): causal QK^T and PV, and each K/V/Q/O element moved once."""
    flops = sum(4 * HQ * D * sum(c + j + 1 for j in range(q)) for q, c in zip(query_lens, ctx_lens))
    kv = sum(2 * HKV * D * 2 * (c + q) for q, c in zip(query_lens, ctx_lens))
    qo = 2 * sum(query_lens) * HQ * D * 2
    return flops, kv + qo


def decode_batch_engine(model_config: str, batch: int, context: int, *, prefill: int = 0, steps: int = 10,
                        budget: int | None = None, **config: object):
    """An engine (random weights by default) with ``batch`` requests of ``context`` prompt tokens,
    all decoding, none of which can finish during 3 warm-up and ``2 * steps`` more steps: the
    first requests decode while the later prompts prefill ``budget`` tokens a step, so their
    output limit covers that too (with a fixed 64 the 256 x 736 profiles of 2026-11-30 had lost
    the early requests before the profile and measured a smaller batch than they said)."""
    from engine.config import EngineConfig
    from engine.engine_builder import build_engine
    from engine.sampling import SamplingParams

    budget = budget or max(2048, batch + prefill)
    headroom = -(-batch * context // budget) + 3 + 2 * steps + 8
    seqs = batch + 2 * steps  # room for the prompts a mixed profile adds; a captured graph bucket
    seqs = next((b for b in sorted(EngineConfig.cuda_graph_batch_sizes) if b >= seqs), seqs)
    options = dict(load_format="dummy", gpu_memory_utilization=0.5, async_scheduling="off") | config
    cfg = EngineConfig(model=model_config, max_model_len=context + prefill + headroom, max_num_seqs=seqs, max_num_batched_tokens=budget,
                       **options)
    cfg.piecewise_cuda_graph_sizes = tuple(t for t in cfg.piecewise_cuda_graph_sizes if prefill and t <= batch + prefill + 2 * steps)
    core = build_engine(cfg)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=headroom, ignore_eos=True)
    vocab = core.model_config.vocab_size
    for _ in range(batch):
        core.add_request([rng.randrange(min(100, vocab // 2), min(1000, vocab)) for _ in range(context)], params)
    while core.scheduler.waiting or any(len(r.output_token_ids) < 2 for r in core.scheduler.running):
        core.step()
    for _ in range(3):
        core.step()
    if len(core.scheduler.running) != batch:
        bm = core.block_manager
        need = batch * bm.blocks_needed(context + 5 + 2 * steps)  # the prompt, set-up's tokens and the profiled steps'
        why = (f"; the KV cache holds {bm.num_usable_blocks:,} blocks of {bm.block_size} tokens and the batch needs "
               f"{need:,}: profile a smaller --batch or --context") if need > bm.num_usable_blocks else ""
        raise RuntimeError(f"profile set-up: {len(core.scheduler.running)} of {batch} requests still running{why}")
    return core


def profile_decode_step(model_config: str, batch: int, context: int, pdl: str = "auto", prefill: int = 0,
                        quantization: str = "none", kv_cache_dtype: str = "auto") -> None:
    """Where the device time of a decode step goes, kernel by kernel (torch.profiler), for the
    model in ``model_config`` with random weights, run as the engine runs it (CUDA graphs, the
    batch-1 decode path): the kernels' summed time against the wall time of as many steps run
    unprofiled just before shows the gaps.
    With PDL a kernel's span includes its wait for the previous one: profile ``pdl="off"`` for
    kernel times that add up. ``prefill`` > 0: every profiled step also takes a new request's
    ``prefill``-token prompt (a mixed step, as in the throughput run: piecewise graphs + eager
    attention). Plain decode steps are also broken down by projection. ``quantization``: the
    engine's (fp8, int4); ``kv_cache_dtype``: its cache's (auto, fp8)."""
    from engine.sampling import SamplingParams

    steps = 10
    core = decode_batch_engine(model_config, batch, context, prefill=prefill, steps=steps, pdl=pdl, quantization=quantization,
                               kv_cache_dtype=kv_cache_dtype, gpu_memory_utilization=0.85)  # room for a throughput-sized batch
    rng = random.Random(1)

    def run_steps() -> None:
        for _ in range(steps):
            if prefill:
                core.add_request([rng.randrange(100, 1000) for _ in range(prefill)], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
            core.step()
        torch.cuda.synchronize()

    contexts = [r.num_tokens for r in core.scheduler.running]
    kind = f"decode step + a {prefill}-token prompt" if prefill else "decode step"
    print_step_profile(core, run_steps, steps, f"{kind}, batch {len(contexts)}, context {min(contexts)}-{max(contexts)} "
                       f"(mean {sum(contexts) / len(contexts):.0f}), weights {quantization}, cache {kv_cache_dtype}", by_projection=not prefill)


def print_step_profile(core, run_steps, steps: int, label: str, by_projection: bool = False) -> None:
    """Wall time of ``run_steps`` unprofiled (the profiler's own overhead would swamp it), then
    its kernels under torch.profiler: per-step kernel time, top kernels; ``by_projection``: also
    the time of each projection (decode steps only, :func:`print_projection_sites`)."""
    from torch.profiler import ProfilerActivity, profile

    from engine.metrics import StepTimes

    core.step_times = StepTimes()  # the paths of the profiled steps only
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run_steps()
    wall = (time.perf_counter() - t0) / steps * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_steps()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events) / steps / 1e3
    print(f"{label}, mode {'/'.join(sorted(core.step_times.device_span))}: {total:.3f} ms of kernel time "
          f"per step; {wall:.3f} ms wall per step unprofiled (the rest: gaps between kernels, host time)")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:20]:
        per_step = e.device_time_total / steps / 1e3
        print(f"  {per_step:8.3f} ms {100 * per_step / total:5.1f}%  x{e.count // steps:<4} {e.device_time_total / e.count:7.2f} us each  {e.key[:80]}")
    print_exposed_time(prof, steps)
    if by_projection:
        print_projection_sites(prof, steps, core)


def exposed_time(spans: list[tuple[str, float, float]]) -> tuple[dict[str, float], float]:
    """Kernel spans overlap with PDL (a kernel starts during the previous one's tail), so their
    sum is not the step. Each kernel (name, start, end) is charged instead with how far it moves
    the stream's end: its end minus the latest end before it (0 when it ends inside an earlier
    one). Returns the charge by kernel name (overlap counted once) and the stream's idle time."""
    exposed: dict[str, float] = {}
    frontier, idle = None, 0.0
    for name, start, end in sorted(spans, key=lambda span: span[1]):
        if frontier is None or start >= frontier:
            idle += 0.0 if frontier is None else start - frontier
            charge = end - start
        else:
            charge = max(0.0, end - frontier)
        exposed[name] = exposed.get(name, 0.0) + charge
        frontier = end if frontier is None else max(frontier, end)
    return exposed, idle


def print_exposed_time(prof, steps: int) -> None:
    """The profiled steps' device time by kernel with overlap counted once (:func:`exposed_time`)."""
    from torch.autograd import DeviceType

    spans = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
    exposed, idle = exposed_time(spans)
    total = sum(exposed.values()) / steps / 1e3
    print(f"exposed device time (how far each kernel moved the stream's end): {total:.3f} ms per step; "
          f"stream idle {idle / steps / 1e3:.3f} ms per step (gaps between steps included)")
    for name, us in sorted(exposed.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {us / steps / 1e3:8.3f} ms {100 * us / steps / 1e3 / total:5.1f}%  {name[:80]}")


LAYER_ANCHOR = "decode_attention"  # a decode step runs one kernel with this in its name a layer
MATMUL_MARKS = ("linear", "gemv", "gemm", "int4", "_mm", "xmma", "cutlass", "nvjet")  # a projection's kernel: ours, cuBLAS's, tinygemm's
PROJECTION_SITES = ("q|k|v", "o_proj", "gate|up", "down_proj", "lm_head", "other matmul")
REDUCE_MARKS = ("splitKreduce",)  # cuBLAS's second kernel of a split-K product: part of the projection before it


def projection_sites(names: list[str], layers: int) -> list[str]:
    """What each kernel of consecutive decode steps (names in launch order) ran: a projection's
    name for a matrix kernel, else the kernel's own name. Decode attention runs once a layer;
    after it the projections come in the model's order - o_proj, gate|up, down_proj, then the
    next layer's q|k|v - and after a step's last layer the lm_head comes before the next step's
    first q|k|v. A matrix kernel beyond that order is "other matmul"; cuBLAS's split-K reduction
    belongs to the projection it finishes."""
    after_anchor = ["o_proj", "gate|up", "down_proj", "q|k|v"]
    after_last = ["o_proj", "gate|up", "down_proj", "lm_head", "q|k|v"]
    order, anchors, sites = ["q|k|v"], 0, []
    for name in names:
        if LAYER_ANCHOR in name:
            order = list(after_last if anchors % layers == layers - 1 else after_anchor)
            anchors += 1
            sites.append(name)
        elif any(mark in name for mark in REDUCE_MARKS) and sites and sites[-1] in PROJECTION_SITES:
            sites.append(sites[-1])
        elif any(mark in name for mark in MATMUL_MARKS):
            sites.append(order.pop(0) if order else "other matmul")
        else:
            sites.append(name)
    return sites


def projection_read_bytes(module: torch.nn.Module) -> int:
    """Bytes a one-row step reads of a projection: its weight with scales, zeros and bias; an int4
    weight laid out more than once (engine/w4a16.py's groups, tinygemm's, the pairs GEMV's) counts once."""
    from engine.memory import storage_bytes
    from engine.w4a16 import W4A16Linear

    skip = {t.untyped_storage().data_ptr() for t in module.other_layouts()} if isinstance(module, W4A16Linear) else set()
    return storage_bytes(t for t in [*module.parameters(), *module.buffers()] if t.untyped_storage().data_ptr() not in skip)


def step_at_copy_bandwidth(projections: list[tuple[float, float]], rest: float) -> float:
    """A step's time if every projection, given as (exposed time, time its bytes take at the copy
    bandwidth), took no longer than its bytes at the copy bandwidth, the rest unchanged: how far
    faster GEMVs alone could take the step."""
    return sum(min(exposed, at_bandwidth) for exposed, at_bandwidth in projections) + rest


def print_projection_sites(prof, steps: int, core) -> None:
    """The profiled decode steps' exposed device time (:func:`exposed_time`) by projection
    (:func:`projection_sites`), with the bytes each reads and the rate that makes, against the
    copy bandwidth: where a launch-bound step's time goes beyond its bytes."""
    from torch.autograd import DeviceType

    from engine.bench.ceilings import copy_bandwidth

    spans = sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA),
                   key=lambda span: span[1])
    model = core.model
    sites = projection_sites([name for name, _, _ in spans], len(model.layers))
    exposed, _ = exposed_time([(site, start, end) for site, (_, start, end) in zip(sites, spans)])
    layer = model.layers[0]
    modules = {"q|k|v": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj, "gate|up": layer.mlp.gate_up_proj,
               "down_proj": layer.mlp.down_proj, "lm_head": model.embed_tokens if model.lm_head is None else model.lm_head}
    bandwidth = copy_bandwidth(core.device)
    total = sum(exposed.values()) / steps
    print(f"by projection (exposed time a step; copy bandwidth {bandwidth / 1e9:.0f} GB/s):")
    bounded = []  # (exposed, at the copy bandwidth) a step, us
    for site in (*modules, "other matmul"):
        if site not in exposed:
            continue
        count = sites.count(site) / steps
        us = exposed[site] / steps
        line = f"  {site:12s} x{count:<4.0f} {us / 1e3:7.3f} ms {100 * us / total:5.1f}%  {us / count:6.2f} us each"
        if site in modules:
            nbytes = projection_read_bytes(modules[site])
            line += (f"  {nbytes / 1e6:8.1f} MB each, {nbytes / (us / count * 1e-6) / 1e9:6.0f} GB/s"
                     f" (at the copy bandwidth: {nbytes / bandwidth * 1e6:6.2f} us)")
        bounded.append((us, count * nbytes / bandwidth * 1e6 if site in modules else us))
        print(line)
    rest = total - sum(exposed.get(site, 0.0) for site in (*modules, "other matmul")) / steps
    print(f"  {'the rest':12s}       {rest / 1e3:7.3f} ms {100 * rest / total:5.1f}%  (attention, norms, activations, sampling, copies)")
    bound = step_at_copy_bandwidth(bounded, rest)
    print(f"every projection at most its bytes at the copy bandwidth, the rest as it is: {bound / 1e3:.3f} ms a step "
          f"({1e6 / bound:.1f} steps/s) against {total / 1e3:.3f} ms")


def profile_chunked_step(model_config: str, batch: int, long: int, budget: int) -> None:
    """Where the time of a chunked-prefill step goes: ``batch`` streams decode while a
    ``long``-token prompt is prefilled ``budget`` tokens a step (as bench's chunked suite);
    profiled near the prompt's end, where its chunks attend to the most context."""
    from engine.config import EngineConfig
    from engine.engine_builder import build_engine
    from engine.sampling import SamplingParams

    steps = 10
    config = EngineConfig(model=model_config, load_format="dummy", gpu_memory_utilization=0.5, max_model_len=long + 256,
                          async_scheduling="off", max_num_seqs=batch + 1, max_num_batched_tokens=budget)
    core = build_engine(config)
    rng = random.Random(0)
    for _ in range(batch):
        core.add_request([rng.randrange(100, 1000) for _ in range(64)], SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True))
    while core.scheduler.waiting or any(len(r.output_token_ids) < 2 for r in core.scheduler.running):
        core.step()
    long_req = core.add_request([rng.randrange(100, 1000) for _ in range(long)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    chunk = budget - batch
    while long_req.num_computed_tokens < long - (2 * steps + 2) * chunk:
        core.step()

    def run_steps() -> None:
        for _ in range(steps):
            core.step()
        torch.cuda.synchronize()

    print_step_profile(core, run_steps, steps, f"{batch} decodes + a {chunk}-token chunk at ~{long_req.num_computed_tokens} context")


def sweep_prefill_tiles(device: torch.device, mm: float) -> None:
    """Every prefill tile shape x split target on chunks after a long context and a fresh prefill;
    prints the fastest per case and the best single shape (how ``PrefillConfig``'s default was chosen)."""
    import itertools

    import triton.testing

    import engine.attention.triton_paged as tp

    cases = {"q32 after 31,968": ([32], [31968]), "q96 after 31,904": ([96], [31904]), "q224 after 31,776": ([224], [31776]),
             "q480 after 31,520": ([480], [31520]), "fresh 8 x 2,048": ([2048] * 8, [0] * 8)}
    shapes = [PrefillConfig(*c) for c in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))]
    targets = (264, 528, 1056)
    relative: dict[tuple[PrefillConfig, int], list[float]] = {}
    default_target = tp.TARGET_PROGRAMS
    for name, (ql, cl) in cases.items():
        q, cache, meta = make_batch(ql, cl, device)
        ref = paged_attention_reference(q, cache, meta, D**-0.5)
        flops, _ = attention_cost(ql, cl)
        rows = []
        for cfg, target in itertools.product(shapes, targets):
            tp.TARGET_PROGRAMS = target
            out = torch.empty_like(q)

            def fn(cfg=cfg):
                meta.scratch.clear()
                return prefill_attention(q, cache, meta, D**-0.5, out, cfg)

            try:
                fn()
            except Exception as e:  # noqa: BLE001 - a shape may not fit shared memory: skip it
                print(f"  {name}: {cfg} skipped ({type(e).__name__})")
                continue
            if ((out.float() - ref.float()).norm() / ref.float().norm()).item() > 2e-2:
                raise SystemExit(f"{name}: {cfg} target {target} is wrong")
            rows.append((triton.testing.do_bench(fn, return_mode="median"), cfg, target))
        tp.TARGET_PROGRAMS = default_target
        rows.sort(key=lambda r: r[0])
        print(f"{name}:")
        for ms, cfg, target in rows[:4]:
            tf = flops / (ms * 1e-3)
            print(f"  {ms:7.3f} ms {tf / 1e12:6.1f} TFLOP/s ({100 * tf / mm:3.0f}% mm)  {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} target {target}")
        for ms, cfg, target in rows:
            relative.setdefault((cfg, target), []).append(ms / rows[0][0])
    ranked = sorted(((sum(v), k) for k, v in relative.items() if len(v) == len(cases)), key=lambda r: r[0])
    print("best single shape (sum over cases of time / the case's best):")
    for score, (cfg, target) in ranked[:5]:
        print(f"  {score:5.2f}  {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} target {target}")


DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "llama-3.1-8b.json"


def gemv_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """The (N, K) of each projection a decode step runs (the first four once a layer)."""
    c = config
    return {"qkv_proj": ((c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim, c.hidden_size),
            "o_proj": (c.hidden_size, c.num_attention_heads * c.head_dim), "gate_up_proj": (2 * c.intermediate_size, c.hidden_size),
            "down_proj": (c.hidden_size, c.intermediate_size), "lm_head": (c.vocab_size, c.hidden_size)}


SPLITS = (2, 4, 5, 7)  # K slices tried for a weight much deeper than wide (down_proj): few rows, few programs


def time_rotating(fn, copies: int, repeat: int = 10) -> float:
    """Seconds per call of ``fn(i)`` over ``copies`` weight copies (more bytes than L2, as in a
    real step where every layer reads new weights), launched from one CUDA graph (as in decode)."""
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e-3 / (repeat * copies)


DECODE_TILE_CASES = [(1, 575), (1, 2047), (1, 8191), (1, 32000), (4, 2047), (16, 2047), (32, 2047), (64, 1023), (256, 799)]
DECODE_TILE_VARIANTS = [(128, 32), (64, 64), (64, 32), (64, 16)]  # (tile, small tile: a short split's one tile)


def sweep_decode_tiles(device: torch.device, bw: float) -> None:
    """Decode attention (split-KV kernel + combine) per context tile and small tile, on
    8B shapes: each case's K/V in copies past the L2 (as in a step, where the weights flush it),
    timed in one CUDA graph; the engine's choice (``DECODE_TILE``, ``DECODE_SMALL_TILE``) last."""
    from engine.attention import triton_paged

    chosen = (triton_paged.DECODE_TILE, triton_paged.DECODE_SMALL_TILE)
    print(f"{'batch':>5} {'context':>7} {'splits':>6} " + " ".join(f"{f'{t}/{a} us':>10}" for t, a in DECODE_TILE_VARIANTS)
          + f"  chosen {chosen[0]}/{chosen[1]}: GB/s")
    for batch, ctx in DECODE_TILE_CASES:
        _, nbytes = attention_cost([1] * batch, [ctx] * batch)
        copies = max(1, -(-100_000_000 // nbytes))
        made = [make_batch([1] * batch, [ctx] * batch, device, seed=i) for i in range(copies)]
        ref = paged_attention_reference(made[0][0], made[0][1], made[0][2], D**-0.5)
        times = {}
        for tile, align in dict.fromkeys(DECODE_TILE_VARIANTS + [chosen]):
            outs = [torch.empty_like(q) for q, _, _ in made]

            def fn(i, tile=tile, align=align, outs=outs):
                q, cache, meta = made[i]
                decode_attention(q, cache, meta.block_tables, meta.seq_lens, D**-0.5, outs[i], tile_n=tile, small_tile=align)

            fn(0)
            err = ((outs[0].float() - ref.float()).norm() / ref.float().norm()).item()
            if err > 2e-2:
                raise SystemExit(f"decode tile {tile}/{align}, batch {batch} x {ctx}: relative error {err:.3g} against the reference")
            times[tile, align] = time_rotating(fn, copies)
        print(f"{batch:>5} {ctx:>7} {triton_paged.decode_splits(batch, HKV):>6} "
              + " ".join(f"{times[v] * 1e6:>10.2f}" for v in DECODE_TILE_VARIANTS)
              + f"  {nbytes / times[chosen] / 1e9:>8,.0f} (copy {bw / 1e9:,.0f})")
        del made


def sweep_gemv(device: torch.device, bw: float, config: ModelConfig, chosen_only: bool = False) -> None:
    """cuBLAS (F.linear) against Triton GEMV tile shapes on ``config``'s projections at decode
    batch sizes (a weight more than twice as deep as wide also split-K: its float32 partials, as
    the next norm sums them); prints the best per (shape, rows) and one step's projection time with
    each. With ``chosen_only``: batch 1 and only the tile ``decode_tile`` picks (the check behind it)."""
    import itertools

    import torch.nn.functional as F

    from engine.kernels.linear import GemvConfig, decode_linear, decode_tile, gemv

    dot = [GemvConfig("dot", n, k, 4, s) for n, k, s in itertools.product((16, 32, 64, 128), (128, 256, 512), (3, 5))]
    dot += [GemvConfig("dot", n, k, 8, s) for n, k, s in itertools.product((64, 128), (128, 256), (3, 5))]
    summ = [GemvConfig("sum", n, k, 4, s) for n, k, s in itertools.product((4, 8, 16), (256, 512, 1024), (1, 3))]
    row_counts = (1,) if chosen_only else (1, 8)
    print(f"{'projection':<14} {'rows':>4} {'cuBLAS us':>10} {'TB/s':>6} {'Triton us':>10} {'TB/s':>6} {'speedup':>8}  best tile (kind n k warps stages)")
    step = {"cublas": {}, "triton": {}}
    for (name, (n, k)), rows in itertools.product(gemv_shapes(config).items(), row_counts):
        nbytes = n * k * 2
        copies = max(2, -(-(256 << 20) // nbytes))
        ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        ref = F.linear(x, ws[0]).float()
        base = time_rotating(lambda i: F.linear(x, ws[i]), copies)
        results = []
        candidates = [(decode_tile(n, k), 1)] if chosen_only else [(c, 1) for c in (dot + summ if rows == 1 else dot)]
        if k > 2 * n and not chosen_only:
            candidates += [(c, s) for c in dot if c.block_n <= 64 and c.num_warps == 4 for s in SPLITS if k % (s * c.block_k) == 0]
        for cfg, split in candidates:
            if not cfg.fits(rows, k):
                continue

            def run(i: int, cfg: GemvConfig = cfg, split: int = split) -> torch.Tensor:
                return gemv(x, ws[i], cfg) if split == 1 else decode_linear(x, ws[i], config=cfg, split_k=split)

            try:
                out = run(0).float()
            except Exception as e:  # noqa: BLE001 - a tile may not fit shared memory: skip it
                print(f"  {name} {cfg} skipped ({type(e).__name__})", file=sys.stderr)
                continue
            err = (((out.sum(0) if split > 1 else out) - ref).norm() / ref.norm()).item()
            if err > 1e-2:
                raise SystemExit(f"gemv {cfg} split-K {split} on {name}: relative error {err:.2e}")
            results.append((time_rotating(run, copies), cfg, split))
        results.sort(key=lambda r: r[0])
        best, cfg, split = results[0]
        reps = 1 if name == "lm_head" else config.num_hidden_layers
        step["cublas"][rows] = step["cublas"].get(rows, 0.0) + reps * base
        step["triton"][rows] = step["triton"].get(rows, 0.0) + reps * min(best, base)
        print(f"{name:<14} {rows:>4} {base * 1e6:>10.1f} {nbytes / base / 1e12:>6.2f} {best * 1e6:>10.1f} {nbytes / best / 1e12:>6.2f} "
              f"{base / best:>7.2f}x  {tile_name(cfg, split)}" + "".join(f" | {t * 1e6:.1f} {tile_name(c, s)}" for t, c, s in results[1:3]))
        del ws
    for rows in row_counts:
        print(f"one decode step's projections at {rows} rows: cuBLAS {step['cublas'][rows] * 1e3:.3f} ms, "
              f"best of cuBLAS/Triton per shape {step['triton'][rows] * 1e3:.3f} ms (copy bandwidth {bw / 1e9:.0f} GB/s)")


def tile_name(cfg, split: int) -> str:
    """A sweep row's tile: kind, block_n, block_k, warps, stages (and its K slices)."""
    return f"{cfg.kind} {cfg.block_n} {cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}" + (f" split-K {split}" if split > 1 else "")


def main(argv: list[str] | None = None) -> int:
    import triton.testing

    p = argparse.ArgumentParser(prog="python -m engine.bench.kernels", description=__doc__)
    p.add_argument("--profile-decode", metavar="CONFIG", help="instead: profile one eager decode step of this model config")
    p.add_argument("--profile-chunked", metavar="CONFIG", help="instead: profile steps of --batch decodes plus a chunk of a "
                   "--long-token prompt, --budget tokens a step, near the prompt's end")
    p.add_argument("--long", type=int, default=32000, help="with --profile-chunked")
    p.add_argument("--budget", type=int, default=64, help="with --profile-chunked: max_num_batched_tokens")
    p.add_argument("--sweep", action="store_true", help="instead: sweep the prefill tile shapes and split targets")
    p.add_argument("--gemv", action="store_true", help="instead: Triton GEMV tile shapes vs cuBLAS on --model's projections")
    p.add_argument("--decode-linear", action="store_true", help="instead: the decode GEMV's chosen tiles vs cuBLAS at batch 1")
    p.add_argument("--decode-tiles", action="store_true", help="instead: decode attention per context tile and batch shape")
    p.add_argument("--model", default=str(DEFAULT_CONFIG), help="with --gemv and --decode-linear: the model config whose projections "
                   "are swept (default: Llama-3.1-8B)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prefill", type=int, default=0, help="with --profile-decode: each profiled step also prefills a prompt this long")
    p.add_argument("--pdl", default="auto", choices=("auto", "on", "off"), help="with --profile-decode: programmatic dependent launch")
    p.add_argument("--quantization", default="none", choices=("none", "fp8", "int4"), help="with --profile-decode: the weights' format")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"), help="with --profile-decode: the KV cache's dtype")
    p.add_argument("--context", type=int, default=512)
    args = p.parse_args(argv)
    if args.profile_decode:
        profile_decode_step(args.profile_decode, args.batch, args.context, args.pdl, args.prefill, args.quantization,
                            args.kv_cache_dtype)
        return 0
    if args.profile_chunked:
        profile_chunked_step(args.profile_chunked, args.batch, args.long, args.budget)
        return 0
    device = torch.device("cuda")
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    mm = 2 * 8192**3 / (triton.testing.do_bench(lambda: a @ a, return_mode="median") * 1e-3)
    x = torch.empty(1 << 28, device=device)
    y = torch.empty_like(x)
    bw = 2 * x.numel() * 4 / (triton.testing.do_bench(lambda: y.copy_(x), return_mode="median") * 1e-3)
    print(f"ceilings: bf16 matmul {mm / 1e12:.0f} TFLOP/s, copy {bw / 1e9:.0f} GB/s (read + write)")
    if args.sweep:
        sweep_prefill_tiles(device, mm)
        return 0
    if args.decode_tiles:
        sweep_decode_tiles(device, bw)
        return 0
    if args.gemv or args.decode_linear:
        sweep_gemv(device, bw, ModelConfig.from_json(args.model), chosen_only=args.decode_linear)
        return 0
    rows = []
    cases = {
        "decode bs1 ctx 576": ([1], [575]),
        "decode bs32 ctx 2048": ([1] * 32, [2047] * 32),
        "decode bs256 ctx 800": ([1] * 256, [799] * 256),
        "question 30 after 32k": ([30], [32000]),
        "chunk 480 after 31.5k": ([480], [31500]),
        "fresh 8 x 2048": ([2048] * 8, [0] * 8),
    }
    for name, (ql, cl) in cases.items():
        q, cache, meta = make_batch(ql, cl, device)
        ref = paged_attention_reference(q, cache, meta, D**-0.5)
        flops, nbytes = attention_cost(ql, cl)
        variants = [None] if meta.num_decodes else PREFILL_VARIANTS
        for cfg in variants:
            out = torch.empty_like(q)
            if cfg is None:
                fn = lambda: decode_attention(q, cache, meta.block_tables, meta.seq_lens, D**-0.5, out)  # noqa: E731
            else:
                def fn(cfg=cfg):
                    meta.scratch.clear()
                    return prefill_attention(q, cache, meta, D**-0.5, out, cfg)
            fn()
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            ms = triton.testing.do_bench(fn, return_mode="median")
            label = name if cfg is None else f"{name} [{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}]"
            rows.append((label, ms, flops / (ms * 1e-3) / 1e12, nbytes / (ms * 1e-3) / 1e9, err))
    print(f"{'kernel':<52} {'ms':>9} {'TFLOP/s':>9} {'% mm':>6} {'GB/s':>8} {'% bw':>6} {'rel err':>9}")
    for label, ms, tf, gbs, err in rows:
        print(f"{label:<52} {ms:>9.3f} {tf:>9.1f} {100 * tf * 1e12 / mm:>5.0f}% {gbs:>8.0f} {100 * gbs * 1e9 / bw:>5.0f}% {err:>9.2e}")
    return 0 if all(r[4] < 2e-2 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
