"""One-off (2026-12-07): the FP8-cache attention kernels as the device's Triton compiles them,
without a GPU.

Why: GPU time is scarce, and register counts from this machine's Triton (3.9) did not match the
device's (3.6). Triton ships its own ptxas and nvdisasm, so any Triton version compiles a kernel
for sm_90 on a CPU-only machine, here with the specialization a launch makes (16-byte-aligned
pointers, strides that are multiples of 16 known as such, an int argument of 1 made a constant).
The counts are close to the device's, not equal: the decode step kernel before the 12-07 change
got 255 registers and a 24-byte stack here, 244 and no spill in the H100's own compile (some
detail of a real launch differs, not found), so they compare versions of the code under one
compile. This prints registers, local-memory stack, SASS size and the instruction mix of the
largest loop (the context tiles) of the decode step's kernel (``split_kv_decode_attention``: RoPE
and the KV write fused, a short slice preloaded, PDL off) or, with ``--kernel prefill``, of the
prefill kernel in PREFILL_FP8's query tiles; the 8B shape (4 query heads a KV head, head dim 128,
pages of 16; engine.bench.kernels.LAUNCH_STRIDES), per context tile, stage and warp variant.

``--kernels PATH...`` compiles copies of engine/attention/_triton_kernels.py (e.g. ``git show
REV:engine/attention/_triton_kernels.py > old.py``) side by side. For the device's compiler:
``pip install --no-deps --target /tmp/t36 triton==3.6.0`` and run with ``PYTHONPATH=/tmp/t36:$PWD``.
Static counts only: they show what a change did to the code, not its time
(fp8_kv_fused_decode_ab.py and prefill_tiles_by_cache.py time the kernels on a GPU).

Run from the repository root: ``PYTHONPATH=$PWD python engine/bench/experiments/fp8_attention_sass.py``.
"""
import argparse
import collections
import importlib.util
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton

from engine.bench.kernels import compile_as_launched

POINTERS = {"Q": "*bf16", "K_CACHE": "*fp8e4nv", "V_CACHE": "*fp8e4nv", "K_SCALE": "*fp32", "V_SCALE": "*fp32", "BLOCK_TABLES": "*i32",
            "SEQ_LENS": "*i32", "OUT": "*bf16", "O_PART": "*fp32", "LSE_PART": "*fp32", "K_NEW": "*bf16", "V_NEW": "*bf16", "POS": "*i64",
            "COS_SIN": "*fp32", "SLOT": "*i64", "QUERY_START": "*i32", "TILE_REQ": "*i32", "TILE_START": "*i32", "scale": "fp32"}
# the step's kernels: decode (RoPE and the KV write fused, a short slice preloaded, PDL off, 4 warps)
# and prefill in PREFILL_FP8's tiles (engine/attention/triton_paged.py: 64 x 128, 4 warps)
KERNELS = {"decode": ("split_kv_decode_attention", {"GROUP": 4, "GROUP_PAD": 16, "D": 128, "D_PAD": 128, "PAGE": 16, "USE_PDL": False,
                                                   "FUSED_ROPE": True, "HALF": 64, "SMALL_TILE": 32, "KV_PRELOAD": True, "KV_LINE": 0,
                                                   "KV_LINES": 1}, "TILE_N"),
           "prefill": ("prefill_kernel", {"GROUP": 4, "D": 128, "D_PAD": 128, "PAGE": 16}, "BLOCK_N")}
INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def load_kernels(path: Path):
    """engine/attention/_triton_kernels.py, or a copy of it, as a module."""
    spec = importlib.util.spec_from_file_location("engine.attention._triton_kernels", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def compile_step(kernels, kernel: str, tile: int, stages: int, maxnreg: int = 0, warps: int = 4, block_m: int = 64,
                 fp8: bool = True) -> bytes:
    """The step's ``kernel`` ("decode" or "prefill", context tiles of ``tile`` tokens; prefill
    ``block_m`` query rows a tile) over an FP8 cache (``fp8``) or a bf16 one, for sm_90,
    specialized as the step's launches are; its cubin."""
    name, constexprs, tile_name = KERNELS[kernel]
    fn = getattr(kernels, name)
    params = {p.name for p in fn.params}  # an older copy of the kernels may lack a newer constexpr (ROW_GROUP)
    constexprs = {k: v for k, v in {**constexprs, **({"BLOCK_M": block_m} if kernel == "prefill" else {}), tile_name: tile,
                                    "FP8": fp8}.items() if k in params}
    types = POINTERS if fp8 else {**POINTERS, "K_CACHE": "*bf16", "V_CACHE": "*bf16"}
    options = {"num_warps": warps, "num_stages": stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    return compile_as_launched(fn, types, constexprs, **options).asm["cubin"]


def describe(cubin: bytes) -> tuple[str, str]:
    """Registers, stack and SASS counts of a cubin; the opcode mix of its largest loop."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([str(tools / "cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([str(tools / "nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout.splitlines()
    labels = {line.strip()[:-1]: i for i, line in enumerate(sass) if re.match(r"\s*\.L_x_\d+:", line)}
    loop = (0, 0)  # the largest span from a label to a branch back to it
    for i, line in enumerate(sass):
        target = re.search(r"BRA\s.*?(\.L_x_\d+)", line)
        if target and labels.get(target.group(1), i) < i:
            start = labels[target.group(1)]
            loop = max(loop, (start, i + 1), key=lambda s: s[1] - s[0])
    ops = [m.group(1) for line in sass if (m := INSTRUCTION.match(line))]
    body = collections.Counter(m.group(1) for line in sass[loop[0]:loop[1]] if (m := INSTRUCTION.match(line)))
    moves = sum(1 for line in sass[loop[0]:loop[1]] if re.search(r"\s(MOV|IMAD\.MOV)[.\s]", line))
    regs, stack = re.search(r"REG:(\d+)", usage).group(1), re.search(r"STACK:(\d+)", usage).group(1)
    return (f"regs {regs}, stack {stack} B, SASS {len(ops)} instructions, largest loop {sum(body.values())} "
            f"({moves} of them register moves: MOV, IMAD.MOV)",
            ", ".join(f"{op} {n}" for op, n in body.most_common(14)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", type=Path, nargs="+", default=[Path("engine/attention/_triton_kernels.py")])
    p.add_argument("--kernel", choices=sorted(KERNELS), default="decode")
    p.add_argument("--variants", nargs="+", default=["128:2", "128:3", "64:2", "64:3", "128:2:168"],
                   help="TILE:STAGES[:MAXNREG[:WARPS]] (MAXNREG 0: no cap; WARPS default 4; the engine's: 128:2 for both kernels)")
    p.add_argument("--block-m", type=int, default=64, help="prefill: query rows a tile (PREFILL_FP8's: 64)")
    p.add_argument("--cache-dtype", choices=("fp8", "bf16"), default="fp8", help="bf16: the same kernel over a bf16 cache, for scale")
    p.add_argument("--row-group", type=int, default=1,
                   help="decode: ROW_GROUP, rows of one request a verifying step's row graph may hold (default 1: a one-token step)")
    args = p.parse_args()
    name, constexprs, tile_name = KERNELS["decode"]
    KERNELS["decode"] = (name, {**constexprs, "ROW_GROUP": args.row_group}, tile_name)
    print(f"Triton {triton.__version__}, sm_90, {args.kernel} step kernel over a {args.cache_dtype} cache" + (f", {args.block_m} query rows a tile" if args.kernel == "prefill" else "")
          + (f", ROW_GROUP {args.row_group}" if args.kernel == "decode" else ""))
    for path in args.kernels:
        kernels = load_kernels(path)
        for variant in args.variants:
            tile, stages, maxnreg, warps = ([int(x) for x in variant.split(":")] + [0, 0])[:4]
            summary, mix = describe(compile_step(kernels, args.kernel, tile, stages, maxnreg, warps or 4, args.block_m,
                                                 args.cache_dtype == "fp8"))
            print(f"{path}  tile {tile}, {stages} stages, {warps or 4} warps{f', maxnreg {maxnreg}' if maxnreg else ''}: {summary}\n"
                  f"    loop: {mix}", flush=True)


if __name__ == "__main__":
    main()
