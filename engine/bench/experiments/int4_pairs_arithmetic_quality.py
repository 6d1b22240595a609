"""One-off (2026-12-06): what the int4 pairs GEMV's arithmetic costs in answers, on the real
Qwen2.5-Coder-1.5B weights, on the CPU (the GPU kernel's rounding emulated in torch).

The pairs GEMV (engine/kernels/_int4_pairs_triton.py) reads x as bf16 and sums each word's 8
products (q - 8) * x in bf16 (two lanes of four-product FMA chains, each step rounded once to bf16),
then in float32. This script loads the model as the GPU's int4 path does from a GGUF (the file's
own 4-bit groups: engine/w4a16.py ``quantize_model_int4_from_gguf``; its Q6_K projections stay
dense), then scores one teacher-forced text (the handbook's pages, their first tokens) four ways:
A: the int4 weights dequantized exactly, float32 activations; B: as A with each projection's input
rounded to bf16 (what every bf16 kernel reads); C: the pairs arithmetic emulated on top of B;
D: tinygemm's, for scale (engine/w4a16.py ``tinygemm_operands``: bf16 scale and zero = min + 8 *
scale, each weight (q - 8) * scale + zero rounded to bf16, products summed in float32). It prints,
against A, each variant's next-token agreement and log-prob differences of A's choice.
Run from the repository root: ``PYTHONPATH=$PWD python engine/bench/experiments/int4_pairs_arithmetic_quality.py [GGUF] [TOKENS]``
(default: the assistant's embedded 1.5B from the model cache, 160 tokens; a few minutes on 2 cores).
"""
import sys
import time
from pathlib import Path

import torch

from engine import build_engine
from engine.bench.correctness import prompt_logits
from engine.gguf_blocks import BlockCache
from engine.llm import make_config
from engine.loaded_model import LoadedModel
from engine.quantization import gguf_tensors
from engine.w4a16 import W4A16Linear, int4_linear_ref, quantize_model_int4_from_gguf, tinygemm_operands, unpack_groups

path = sys.argv[1] if len(sys.argv) > 1 else str(Path.home() / ".cache/handbook-assistant/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
tokens_wanted = int(sys.argv[2]) if len(sys.argv) > 2 else 160
torch.set_num_threads(2)


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def pairs_linear(x: torch.Tensor, m: W4A16Linear) -> torch.Tensor:
    """x [T, K] @ W^T as the pairs GEMV computes it: x in bf16, each word's two 4-product chains of
    (q - 8) * x rounded to bf16 after every step (an FMA rounds once; the products of a 4-bit value
    and a bf16 value are exact in float32), the chains' sums added in float32, then
    scale * that + (min + 8 * scale) * sum(x) per group, in float32."""
    centred = unpack_groups(m.qweight, m.group).float() - 8.0  # [N, K]
    n, k = centred.shape
    xs = bf16(x)
    out = torch.empty(x.shape[0], n)
    for t in range(x.shape[0]):
        prod = (centred * xs[t]).reshape(n, k // 8, 4, 2)  # [N, words, pair p, lane h]: input 8i + 2p + h
        acc = bf16(prod[:, :, 0])
        for p in range(1, 4):
            acc = bf16(acc + prod[:, :, p])
        words = acc.sum(dim=2)  # the two lanes, float32
        by_group = words.reshape(n, k // m.group, m.group // 8).sum(dim=2)
        x_groups = xs[t].reshape(k // m.group, m.group).sum(dim=1)
        scales, mins = m.scales.float(), m.mins.float()
        out[t] = (scales * by_group + (mins + 8 * scales) * x_groups).sum(dim=1)
    return out if m.bias is None else out + m.bias.float()


def tinygemm_linear(x: torch.Tensor, m: W4A16Linear) -> torch.Tensor:
    """x [T, K] @ W^T as tinygemm computes it (module doc): bf16 x, bf16 weights from bf16 scales and zeros, float32 sums."""
    _, scales_zeros = tinygemm_operands(m.qweight, m.scales, m.mins, m.group)
    scale, zero = scales_zeros[..., 0].float().t(), scales_zeros[..., 1].float().t()  # [N, groups]
    centred = unpack_groups(m.qweight, m.group).float() - 8.0
    n, k = centred.shape
    w = bf16((centred.reshape(n, -1, m.group) * scale[:, :, None] + zero[:, :, None]).reshape(n, k))
    y = bf16(x) @ w.t()
    return y if m.bias is None else y + m.bias.float()


config = make_config(path, device="cpu", dtype="float32", num_kv_blocks=64)
loaded = LoadedModel.load(config)
replaced, kept = quantize_model_int4_from_gguf(loaded.model, BlockCache(gguf_tensors(path)))
core = build_engine(config, loaded)
page = (Path(__file__).resolve().parents[3] / "assistant/handbook/en").glob("*.md")
text = "\n\n".join(p.read_text() for p in sorted(page))
tokens = core.tokenizer.encode(text)[:tokens_wanted]
print(f"{path}: {replaced} projections int4 (the file's groups of 32), {kept} dense; {len(tokens)} tokens of the handbook", flush=True)

modes = {"A": "exact", "B": "x in bf16", "C": "pairs arithmetic", "D": "tinygemm arithmetic"}
original = W4A16Linear.forward
logits = {}
for name, mode in modes.items():
    def forward(self, x, *, mode=mode, **kw):
        rows = x.reshape(-1, x.shape[-1]).float()
        if mode == "pairs arithmetic":
            y = pairs_linear(rows, self)
        elif mode == "tinygemm arithmetic":
            y = tinygemm_linear(rows, self)
        else:
            y = int4_linear_ref(bf16(rows) if mode == "x in bf16" else rows, self.qweight, self.scales, self.mins, self.group,
                                self.bias, torch.float32)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    W4A16Linear.forward = forward
    t0 = time.perf_counter()
    logits[name] = torch.log_softmax(prompt_logits(core, tokens).float(), dim=-1)
    W4A16Linear.forward = original
    print(f"{name} ({mode}): scored in {time.perf_counter() - t0:.0f} s", flush=True)

ref = logits["A"]
choice = ref.argmax(dim=-1)
for name in ("B", "C", "D"):
    other = logits[name]
    agree = (other.argmax(dim=-1) == choice).float().mean().item()
    delta = (other.gather(1, choice[:, None]) - ref.gather(1, choice[:, None])).abs().squeeze(1)
    kl = (ref.exp() * (ref - other)).sum(dim=-1)
    print(f"{name} ({modes[name]}) against A: next-token agreement {agree:.4f} over {len(choice)} positions; "
          f"|log-prob delta| of A's choice mean {delta.mean():.5f}, max {delta.max():.5f}; KL mean {kl.mean():.2e}, max {kl.max():.2e}",
          flush=True)
other = logits["C"]
agree = (other.argmax(dim=-1) == logits["B"].argmax(dim=-1)).float().mean().item()
print(f"C against B (the pairs arithmetic alone): next-token agreement {agree:.4f}", flush=True)
