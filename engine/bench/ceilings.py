"""What the figures are measured against: the device's copy bandwidth and matmul rate, the bytes
a decode step must read, and the roofline and no-overlap bounds of a throughput run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.bench.timing import timed
from engine.config import ModelConfig
from engine.engine_core import EngineCore
from engine.fp8 import Fp8Linear
from engine.memory import storage_bytes
from engine.quantization import Int4Linear
from engine.w4a16 import W4A16Linear


def copy_bandwidth(device: torch.device, rounds: int = 5) -> float:
    """Bytes read + written per second by a large device-to-device copy (rotating buffers).

    On CUDA the best of ``rounds`` rounds of 10 back-to-back copies, timed with events: one
    round's median drifted 4-5% between processes on one GPU, and a ceiling must not be the
    figure that moves (the best round is the bandwidth the card can give)."""
    n = (1 << 30 if device.type == "cuda" else 1 << 28) // 4
    bufs = [torch.randn(n, device=device) for _ in range(3)]
    out = torch.empty_like(bufs[0])
    i = [0]

    def run():
        out.copy_(bufs[i[0] % 3])
        i[0] += 1

    if device.type != "cuda":
        return 2 * n * 4 / timed(run, device, 10)
    run()
    best = float("inf")
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            run()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / 10)
    return 2 * n * 4 / best


def matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a large square matmul in ``dtype``: the compute ceiling."""
    n = 8192 if device.type == "cuda" else 1024
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / timed(lambda: a @ b, device, 10)


def fp8_matmul_flops(device: torch.device, n: int = 8192) -> float:
    """FLOP/s of a large e4m3 matmul as Fp8Linear runs it (``torch._scaled_mm``, row-wise scales,
    bf16 out): the compute ceiling of FP8 weights' projections on a GPU with FP8 tensor cores."""
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    sa, sb = torch.ones(n, 1, device=device), torch.ones(1, n, device=device)
    return 2 * n**3 / timed(lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), device, 10)


def projection_rate(core: EngineCore, dense_flops: float) -> float:
    """The matmul rate a run's layer projections are priced at: FP8 weights on a GPU multiply on
    FP8 tensor cores (measured now); everything else at the dense dtype's rate."""
    fp8 = any(isinstance(m, Fp8Linear) for m in core.model.modules())
    return fp8_matmul_flops(core.device) if fp8 and core.device.type == "cuda" else dense_flops


def compute_seconds(mc: ModelConfig, flops: float, tokens: float, dense_flops: float, projection_flops: float) -> float:
    """Seconds for ``flops`` FLOPs of which ``tokens`` tokens' layer projections (2 per projection
    weight a token) run at ``projection_flops`` and the rest at ``dense_flops``."""
    if projection_flops == dense_flops:
        return flops / dense_flops
    projections = 2.0 * mc.num_projection_parameters * tokens
    return (flops - projections) / dense_flops + projections / projection_flops


def decode_step_bytes(core: EngineCore, context: int) -> int:
    """Bytes one batch-1 decode step must read: the weights a one-row step multiplies by (the
    native step's GGUF blocks, or int4 blocks, FP8 or W4A16 weights where the model has them; the embedding table is only indexed unless
    it is the head)
    plus the request's KV."""
    mc = core.model_config
    elem = torch.empty((), dtype=core.dtype).element_size()
    kv = core.kv_cache.spec.bytes_per_token * context  # as stored: e4m3 and its scales with an FP8 cache
    if core.runner.native is not None:  # the native step reads its own block copy of the weights
        return core.runner.native.weight_bytes_per_step + kv
    model = core.model
    int4 = [m for m in model.modules() if isinstance(m, Int4Linear)]
    if int4 or any(isinstance(m, (Fp8Linear, W4A16Linear)) for m in model.modules()):
        # the stored weights (int4 blocks, e4m3 or nibbles with their scales) as they are; not read by a one-row step: int4's
        # dense copies, the RoPE table, and the embedding unless it is the head (an int4 model's
        # head is an int4 copy of its own)
        layouts = [t for m in model.modules() if isinstance(m, W4A16Linear)
                   for t in m.other_layouts()]  # the same groups laid out again; a step reads one (as many bytes)
        skip = [*(m.weight for m in int4 if m.weight is not None), *layouts, model.rope.cos_sin,
                *((model.embed_tokens.weight,) if int4 or model.lm_head is not None else ())]
        ptrs = {t.untyped_storage().data_ptr() for t in skip}
        read = [t for t in [*model.parameters(), *model.buffers()] if not t.is_mkldnn]  # prepacked: dense copies too
        return storage_bytes(t for t in read if t.untyped_storage().data_ptr() not in ptrs) + kv
    weights = mc.num_parameters * elem
    if not mc.tie_word_embeddings:
        weights -= mc.vocab_size * mc.hidden_size * elem
    return weights + kv


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


def throughput_bounds(mc: ModelConfig, lengths: list[tuple[int, int]], steps: int, weight_bytes: int, kv_bytes_per_token: int,
                      flops: float, bw: float, projection_flops: float | None = None) -> ThroughputBounds:
    """Bounds for requests of (prompt, output) ``lengths`` served in ``steps`` steps: FLOPs 2 per
    parameter per token plus causal attention (prefill) and attention over the context (each
    output token but the last is decoded), the layer projections' at ``projection_flops`` (FP8
    tensor cores for FP8 weights; default ``flops``); bytes the weights once a step plus each
    decoded token's read of its request's K/V as stored (prefill's own K/V traffic left out: small
    beside the decode's)."""
    attn = 4 * mc.num_hidden_layers * mc.num_attention_heads * mc.head_dim  # FLOPs per (query, key) pair
    total_flops, kv_reads, tokens = 0.0, 0, 0
    for prompt, out in lengths:
        decoded = max(0, out - 1)  # the first output token comes from the prefill
        reads = decoded * prompt + decoded * (decoded + 1) // 2  # contexts prompt+1 .. prompt+decoded
        total_flops += 2 * mc.num_parameters * (prompt + decoded) + attn * (prompt * (prompt + 1) // 2 + reads)
        kv_reads += reads
        tokens += prompt + decoded
    total_bytes = float(steps) * weight_bytes + float(kv_reads) * kv_bytes_per_token
    compute_s = compute_seconds(mc, total_flops, tokens, flops, projection_flops or flops)
    return ThroughputBounds(total_flops, total_bytes, compute_s, total_bytes / bw)
