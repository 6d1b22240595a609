"""One-off (2026-12-06): the engine bench with int4 steps of many rows kept on the Triton W4A16
kernel (``engine.w4a16.DEQUANTIZE_MIN_ROWS`` set past any step), to set beside a run with the
default (the weight written out in bf16, then cuBLAS) on the same machine.
Run from the repository root on a GPU: ``PYTHONPATH=$PWD python engine/bench/experiments/int4_prefill_triton_only.py
prefill --no-hf --model engine/configs/llama-3.1-8b.json --load-format dummy --quantization int4`` (any ``engine.bench`` arguments).
"""
import sys

import engine.w4a16 as w4a16
from engine.bench.cli import main

w4a16.DEQUANTIZE_MIN_ROWS = 1 << 30
sys.exit(main(sys.argv[1:]))
