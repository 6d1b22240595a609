"""One-off (2026-11-30 ~11:30 UTC, H200): how long each mixed-step graph capture (its warm-up
forward + the capture, synchronized on both sides) takes, during ``engine.bench chunked --no-hf``
on the 8B shape with random weights. Results: docs/results/2026-11-30-h200-mixed-capture-time.log
(before the mixed step in the start-up warm-up) and ...-mixed-capture-time-warm-up.log (after).
Run from the repository root: ``PYTHONPATH=$PWD python engine/bench/experiments/mixed_capture_time.py``.
"""
import time

import torch

import engine.bench.cli as bench
import engine.cuda_graph as cg

real = cg.MixedGraphRunner._capture
times = []


def timed(self, db, c):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = real(self, db, c)
    torch.cuda.synchronize()
    times.append((db, c, time.perf_counter() - t))
    return out


cg.MixedGraphRunner._capture = timed
bench.main(["chunked", "--no-hf", "--model", "engine/configs/llama-3.1-8b.json", "--load-format", "dummy"])
print("mixed-graph captures (decode rows, chunk, seconds):", [(d, c, round(s, 3)) for d, c, s in times])
