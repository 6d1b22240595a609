"""Batch-1 decode (the engine.bench latency suite) and the TTFT of a 30-token question after a cached 2,000-token prefix, int4 + native, on a GGUF: ``python engine/bench/experiments/qwen_cpu_decode_ttft.py MODEL.gguf`` (no OMP_WAIT_POLICY, as the server runs: ``passive`` decodes 10-15% slower, docs/performance.md) (the prefix suite of ``engine.bench`` without its uncached runs, which take over 10 minutes on 2 cores)."""
import random, statistics, sys, time
import torch
from engine.bench.ceilings import copy_bandwidth
from engine.bench.latency import bench_latency
from engine.bench.report import format_table
from engine.bench.workload import Sizes, random_prompt, run_to_completion
from engine.config import EngineConfig
from engine.engine_builder import build_engine
from engine.loaded_model import LoadedModel
from engine.sampling import SamplingParams
path = sys.argv[1]
config = EngineConfig(model=path, quantization="int4", max_model_len=4096, max_num_seqs=32, max_num_batched_tokens=512)
t = time.time(); loaded = LoadedModel.load(config); print(f"load {time.time()-t:.0f} s", flush=True)
core = build_engine(config, loaded)
sizes = Sizes.for_device(torch.device("cpu")); rng = random.Random(0)
bw = copy_bandwidth(torch.device("cpu")); results = {}
rows = bench_latency(core, None, sizes, rng, bw, results)
print(format_table(rows), flush=True)
print({k: round(v, 3) if isinstance(v, float) else v for k, v in results.items()}, f"copy bw {bw/1e9:.2f} GB/s", f"native bytes/step {core.runner.native.weight_bytes_per_step/1e6:.0f} MB", flush=True)
vocab = core.model_config.vocab_size
prefix = random_prompt(rng, 2000, vocab)
def ttft(question):
    req = core.add_request(prefix + question, SamplingParams(max_tokens=1, ignore_eos=True))
    run_to_completion(core)
    return req.metrics.ttft, req.num_cached_tokens if hasattr(req, "num_cached_tokens") else None
core.block_manager.reset_prefix_cache()
t = time.time(); print("uncached (prefix prefill, 512-token PyTorch chunks then native)", ttft(random_prompt(rng, 30, vocab)), f"{time.time()-t:.0f} s", flush=True)
runs = [ttft(random_prompt(rng, 30, vocab)) for _ in range(5)]
print("cached-prefix TTFT, 30-token question, s:", runs, "p50 ms", statistics.median(r[0] for r in runs) * 1e3, flush=True)
