"""One-off (2026-12-06): the throughput bench with the attention tiles before 2026-12-06 (decode
context tile 64, one prefill shape for every cache), to set beside a run with today's defaults
(decode tile 128, PREFILL_FP8 for an FP8 cache) on the same machine.
Run from the repository root on a GPU: ``PYTHONPATH=$PWD python engine/bench/experiments/attention_tiles_throughput_ab.py
throughput --no-hf --model engine/configs/llama-3.1-8b.json --load-format dummy --formats none fp8+fp8-kv`` (any
``engine.bench`` arguments).
"""
import sys

import engine.attention.triton_paged as paged
from engine.bench.cli import main

paged.DECODE_TILE = 64
paged.PREFILL_FP8 = paged.PREFILL
sys.exit(main(sys.argv[1:]))
