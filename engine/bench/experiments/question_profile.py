"""Where a question's time to first token goes on the CPU: a T-token question after a cached
prefix as long as the handbook's (5,000 tokens by default), the int4 model's PyTorch path (dense
bf16 matmuls for a step of more than 16 rows), three timed runs, then one under torch's profiler
with the operators that took the most time. Also times a plain bf16 matmul of the step's shape
(T x hidden by hidden x 2 intermediate, the gate|up projection) for the CPU's matmul rate.

Run from the repository root: ``OMP_WAIT_POLICY=passive PYTHONPATH=$PWD python
engine/bench/experiments/question_profile.py MODEL.gguf [T [PREFIX]]``.
"""
import random
import statistics
import sys
import time

import torch

from engine.bench.workload import random_prompt, run_to_completion
from engine.config import EngineConfig
from engine.engine_builder import build_engine
from engine.loaded_model import LoadedModel
from engine.sampling import SamplingParams

path = sys.argv[1]
tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 30
prefix_len = int(sys.argv[3]) if len(sys.argv) > 3 else 5000
config = EngineConfig(model=path, quantization="int4", max_model_len=8192, max_num_seqs=8, max_num_batched_tokens=512)
core = build_engine(config, LoadedModel.load(config))
rng, vocab = random.Random(0), core.model_config.vocab_size
prefix = random_prompt(rng, prefix_len, vocab)
core.add_request(prefix, SamplingParams(max_tokens=1, ignore_eos=True))
run_to_completion(core)  # the prefix, cached


def ttft() -> float:
    req = core.add_request(prefix + random_prompt(rng, tokens, vocab), SamplingParams(max_tokens=1, ignore_eos=True))
    run_to_completion(core)
    assert req.num_cached_tokens == prefix_len // 16 * 16, req.num_cached_tokens  # whole KV blocks of the prefix
    return req.metrics.ttft


times = [ttft() for _ in range(4)][1:]
print(f"T={tokens} after {prefix_len} cached: TTFT p50 {statistics.median(times) * 1e3:.0f} ms, runs {[round(t * 1e3) for t in times]}")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    ttft()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
cfg = core.model_config
x = torch.randn(tokens, cfg.hidden_size, dtype=torch.bfloat16)
w = torch.randn(2 * cfg.intermediate_size, cfg.hidden_size, dtype=torch.bfloat16)
torch.nn.functional.linear(x, w)
start = time.perf_counter()
for _ in range(10):
    torch.nn.functional.linear(x, w)
seconds = (time.perf_counter() - start) / 10
rate = 2 * tokens * cfg.hidden_size * 2 * cfg.intermediate_size / seconds
q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
layer_params = cfg.num_hidden_layers * cfg.hidden_size * (q + 2 * kv + q + 3 * cfg.intermediate_size)
print(f"bf16 matmul {tokens} x {cfg.hidden_size} @ {cfg.hidden_size} x {2 * cfg.intermediate_size}: {seconds * 1e3:.1f} ms, "
      f"{rate / 1e9:.0f} GFLOP/s; the layers' {layer_params / 1e9:.2f}B parameters x {tokens} tokens at that rate: "
      f"{2 * layer_params * tokens / rate * 1e3:.0f} ms")
