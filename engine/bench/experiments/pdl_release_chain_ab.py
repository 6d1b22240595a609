"""One-off A/B (2026-11-30, H200): where a decode GEMV releases the next kernel under PDL.

The PDL trigger right after its wait, or after its K loop, in CUDA graphs of 32 Llama-3.1-8B
layers' projections + norms (attention left out). Random weights. Results:
docs/results/2026-11-30-h200-norm-fold-and-release-chain-ab.txt (its part 2). Run from the
repository root: ``PYTHONPATH=$PWD python engine/bench/experiments/pdl_release_chain_ab.py``.
"""
import torch
from engine.kernels.linear import decode_linear
from engine.kernels.norm import add_rms_norm

dev = torch.device("cuda"); bf = torch.bfloat16; H, I, L = 4096, 14336, 32
torch.manual_seed(0)
W = [dict(qkv=torch.randn(6144, H, device=dev, dtype=bf) * 0.02, o=torch.randn(H, H, device=dev, dtype=bf) * 0.02,
          gu=torch.randn(2 * I, H, device=dev, dtype=bf) * 0.02, down=torch.randn(H, I, device=dev, dtype=bf) * 0.02,
          g1=torch.rand(H, device=dev, dtype=bf) + 0.5, g2=torch.rand(H, device=dev, dtype=bf) + 0.5) for _ in range(L)]
attn = torch.randn(1, H, device=dev, dtype=bf)
h0 = torch.randn(2, 1, H, device=dev, dtype=torch.float32)
r0 = torch.randn(1, H, device=dev, dtype=bf)
eps = 1e-5

def step(late=(), norms=True):
    h, res = h0, r0
    for w in W:
        x, res = add_rms_norm(h, res, w["g1"], eps, pdl=True) if norms else (res, res)
        decode_linear(x, w["qkv"], pdl=True, late_release="qkv" in late)
        o = decode_linear(attn, w["o"], pdl=True, late_release="o" in late)
        x, res = add_rms_norm(o, res, w["g2"], eps, pdl=True) if norms else (res, res)
        act = decode_linear(x, w["gu"], gated=True, pdl=True, late_release="gu" in late)
        h = decode_linear(act, w["down"], pdl=True, split_k=2, late_release="down" in late)
    return h

variants = {
    "early (now)": dict(),
    "late: all": dict(late=("qkv", "o", "gu", "down")),
    "late: gu": dict(late=("gu",)),
    "late: down": dict(late=("down",)),
    "late: qkv,o": dict(late=("qkv", "o")),
    "no norms, early": dict(norms=False),
    "no norms, late all": dict(norms=False, late=("qkv", "o", "gu", "down")),
}
ref = step()
graphs = {}
for v, kw in variants.items():
    out = step(**kw)
    if kw.get("norms", True):
        assert torch.equal(out, ref), v
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g): step(**kw)
    graphs[v] = g
times = {v: [] for v in variants}
for rnd in range(5):
    for v in variants:
        g = graphs[v]
        for _ in range(5): g.replay()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(50): g.replay()
        e.record(); torch.cuda.synchronize()
        times[v].append(s.elapsed_time(e) / 50)
print("variant              replay ms, 5 rounds of 50 replays           min")
for v in variants:
    print(f"{v:20s} " + " ".join(f"{t:.4f}" for t in times[v]) + f"   {min(times[v]):.4f}")
