"""One-off (2026-12-07): the FP8 decode kernel as the device's Triton compiles it, without a GPU.

Why: GPU time is scarce, and register counts from this machine's Triton (3.9) did not match the
device's (3.6). Triton ships its own ptxas and nvdisasm, so any Triton version compiles a kernel
for sm_90 on a CPU-only machine; with the device's version and the same argument specialization
as its launches (16-byte-aligned pointers and strides, an int argument of 1 made a constant), the
registers, local-memory stack, shared memory and SASS are the device's. This prints them for the
decode step's kernel (``split_kv_decode_attention``: RoPE and the KV write fused, a short slice
preloaded, PDL off; the 8B shape's 4 query heads a KV head, head dim 128, pages of 16) and the
instruction mix of its largest loop (the context tiles), per tile and pipeline-stage variant.

``--kernels PATH`` compiles another copy of engine/attention/_triton_kernels.py (e.g. ``git show
REV:engine/attention/_triton_kernels.py > old.py``) to set beside the current one. For the
device's compiler: ``pip install --no-deps --target /tmp/t36 triton==3.6.0`` and run with
``PYTHONPATH=/tmp/t36:$PWD``. Static counts only: they show what a change did to the code, not
its time (fp8_kv_fused_decode_ab.py times it on a GPU).

Run from the repository root: ``PYTHONPATH=$PWD python engine/bench/experiments/decode_kernel_sass.py``.
"""
import argparse
import collections
import importlib.util
import inspect
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# the 8B step's strides that are multiples of 16 (q [b, 32, 128], cache [blocks, 16, 8, 128],
# q|k|v rows of 6,144, RoPE rows of 128, the scales' [blocks, 16, 8]); stride_ss (8) is not
DIVISIBLE_BY_16 = {"stride_qt", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_out_t", "stride_out_h", "stride_ot",
                   "stride_oh", "stride_os", "stride_knt", "stride_knh", "stride_vnt", "stride_vnh", "stride_cs", "stride_sb"}
POINTERS = {"Q": "*bf16", "K_CACHE": "*fp8e4nv", "V_CACHE": "*fp8e4nv", "K_SCALE": "*fp32", "V_SCALE": "*fp32", "BLOCK_TABLES": "*i32",
            "SEQ_LENS": "*i32", "OUT": "*bf16", "O_PART": "*fp32", "LSE_PART": "*fp32", "K_NEW": "*bf16", "V_NEW": "*bf16", "POS": "*i64",
            "COS_SIN": "*fp32", "SLOT": "*i64", "scale": "fp32"}
INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def load_kernels(path: Path):
    """engine/attention/_triton_kernels.py, or a copy of it, as a module."""
    spec = importlib.util.spec_from_file_location("engine.attention._triton_kernels", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def compile_decode(kernels, tile: int, stages: int, maxnreg: int) -> bytes:
    """The FP8 decode step's kernel for sm_90, specialized as the step's launches are; its cubin."""
    fn = kernels.split_kv_decode_attention
    names = list(inspect.signature(fn.fn).parameters)
    constexprs = {"GROUP": 4, "GROUP_PAD": 16, "D": 128, "D_PAD": 128, "PAGE": 16, "TILE_N": tile, "USE_PDL": False,
                  "FUSED_ROPE": True, "HALF": 64, "SMALL_TILE": 32, "KV_PRELOAD": True, "FP8": True, "KV_LINE": 0, "KV_LINES": 1,
                  "stride_sh": 1}
    signature = {n: "constexpr" if n in constexprs else POINTERS.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in constexprs and (signature[n].startswith("*") or n in DIVISIBLE_BY_16)}
    options = {"num_warps": 4, "num_stages": stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"]


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
    p.add_argument("--variants", nargs="+", default=["128:2", "128:3", "64:2", "64:3", "128:2:168"],
                   help="TILE:STAGES[:MAXNREG] (the engine's step: 128:2)")
    args = p.parse_args()
    print(f"Triton {triton.__version__}, sm_90, FP8 decode step kernel (4 warps)")
    for path in args.kernels:
        kernels = load_kernels(path)
        for variant in args.variants:
            tile, stages, maxnreg = ([int(x) for x in variant.split(":")] + [0])[:3]
            summary, mix = describe(compile_decode(kernels, tile, stages, maxnreg))
            print(f"{path}  tile {tile}, {stages} stages{f', maxnreg {maxnreg}' if maxnreg else ''}: {summary}\n    loop: {mix}", flush=True)


if __name__ == "__main__":
    main()
