"""One-off (2026-12-02, 2-core AMD EPYC with AVX-512 BF16 and VNNI): a T-token question after a
cached 2,000-token prefix through the native step (one T-token call, int8 dots) against the PyTorch
path (the int4 model's dense bf16 matmuls above 8 rows, as on CPUs with hardware bf16 matmuls),
alternating, on one engine (``core.runner.native.max_tokens`` set per run; at the time the run was
made, the module constant ``NATIVE_MAX_TOKENS`` that the runner then read was patched instead).

Run from the repository root: ``OMP_WAIT_POLICY=passive PYTHONPATH=$PWD python
engine/bench/experiments/native_vs_dense_question.py MODEL.gguf [ROUNDS [T,T,...]]`` (T: question
tokens, default 30).
Results: docs/results/2026-12-02-cpu-question-native-vs-dense.txt.
"""
import random
import statistics
import sys
import time

from engine.bench.workload import random_prompt, run_to_completion
from engine.config import EngineConfig
from engine.engine_builder import build_engine
from engine.loaded_model import LoadedModel
from engine.native_decode import NATIVE_MAX_TOKENS
from engine.sampling import SamplingParams

path, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5
config = EngineConfig(model=path, quantization="int4", max_model_len=4096, max_num_seqs=32, max_num_batched_tokens=512)
start = time.time()
core = build_engine(config, LoadedModel.load(config))
print(f"# {path.rsplit('/', 1)[-1]}: loaded in {time.time() - start:.0f} s", flush=True)
rng, vocab = random.Random(0), core.model_config.vocab_size
prefix = random_prompt(rng, 2000, vocab)


def ttft(question: list[int]) -> float:
    req = core.add_request(prefix + question, SamplingParams(max_tokens=1, ignore_eos=True))
    run_to_completion(core)
    assert req.num_cached_tokens == 2000, req.num_cached_tokens
    return req.metrics.ttft


core.add_request(prefix, SamplingParams(max_tokens=1, ignore_eos=True))
run_to_completion(core)  # the prefix, cached
ways = {"native step (one C call)": NATIVE_MAX_TOKENS, "PyTorch path (dense bf16 matmuls)": 8}
for tokens in (int(t) for t in sys.argv[3].split(",")) if len(sys.argv) > 3 else (30,):
    times: dict[str, list[float]] = {w: [] for w in ways}
    for _ in range(rounds):
        for way, limit in ways.items():
            core.runner.native.max_tokens = limit
            times[way].append(ttft(random_prompt(rng, tokens, vocab)))
    for way, t in times.items():
        print(f"T={tokens} {way}: TTFT p50 {statistics.median(t) * 1e3:.0f} ms, min {min(t) * 1e3:.0f} ms, "
              f"runs {[round(x * 1e3) for x in t]}", flush=True)
