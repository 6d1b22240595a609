"""A question's TTFT after the cached handbook prefix on the CPU, four variants on one engine,
round by round so the machine's drift hits each alike: the int4 model's dense copies plain
(``F.linear`` lays the weight out for oneDNN on every call) or prepacked in oneDNN's layout once,
and the chunk's attention through the gathering reference or through views of the cached blocks.
Both layouts of the same weights are made once (``quantize_from_gguf(prepack=...)``) and swapped
in per run; the views are switched off by planning no chunk for them (a patch of this script only).

Run from the repository root: ``OMP_WAIT_POLICY=passive PYTHONPATH=$PWD python
engine/bench/experiments/question_ttft_ab.py MODEL.gguf [ROUNDS [T [PREFIX]]]``.
"""
import random
import statistics
import sys
import time

import torch

import engine.attention.torch_ref as torch_ref
from engine.bench.workload import random_prompt, run_to_completion
from engine.config import EngineConfig
from engine.engine_builder import build_engine
from engine.gguf_blocks import BlockCache
from engine.loaded_model import LoadedModel
from engine.quantization import gguf_tensors, quantize_from_gguf
from engine.sampling import SamplingParams

path = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 30
prefix_len = int(sys.argv[4]) if len(sys.argv) > 4 else 5000
config = EngineConfig(model=path, quantization="int4", max_model_len=8192, max_num_seqs=8, max_num_batched_tokens=512)
loaded = LoadedModel.load(config)
core = build_engine(config, loaded)
blocks = BlockCache(gguf_tensors(path))
rng, vocab = random.Random(0), core.model_config.vocab_size
prefix = random_prompt(rng, prefix_len, vocab)
core.add_request(prefix, SamplingParams(max_tokens=1, ignore_eos=True))
run_to_completion(core)  # the prefix, cached
planned = torch_ref.chunk_view_plan
layouts = {}  # prepack -> the layers' projections laid out that way, made once (switching allocates nothing)
for prepack in (False, True):
    quantize_from_gguf(loaded.model, blocks, prepack=prepack)
    layouts[prepack] = [(owner, attr, getattr(owner, attr)) for layer in loaded.model.layers
                        for owner, attr in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                                            (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj"))]  # fmt: skip


def ttft(prepack: bool, views: bool) -> float:
    for owner, attr, module in layouts[prepack]:
        setattr(owner, attr, module)
    torch_ref.chunk_view_plan = planned if views else (lambda meta, page: {})
    req = core.add_request(prefix + random_prompt(rng, tokens, vocab), SamplingParams(max_tokens=1, ignore_eos=True))
    run_to_completion(core)
    assert req.num_cached_tokens == prefix_len // 16 * 16, req.num_cached_tokens
    return req.metrics.ttft


variants = {(p, v): [] for p in (False, True) for v in (False, True)}
print(f"# {path.rsplit('/', 1)[-1]}, {torch.get_num_threads()} threads, T={tokens} after {prefix_len} cached, {rounds} rounds", flush=True)
for r in range(rounds + 1):
    this_round = {key: ttft(*key) for key in variants}
    if r:  # round 0 warms each variant
        for key, seconds in this_round.items():
            variants[key].append(seconds)
    print(f"round {r}: " + ", ".join(f"{'prepacked' if p else 'plain'}+{'views' if v else 'gather'} "
                                     f"{seconds * 1e3:.0f}" for (p, v), seconds in this_round.items()), flush=True)
print(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
for (p, v), times in variants.items():
    print(f"{'prepacked' if p else 'plain':9s} + {'views' if v else 'gather':6s}: TTFT p50 {statistics.median(times) * 1e3:5.0f} ms, "
          f"min {min(times) * 1e3:5.0f}, runs {[round(t * 1e3) for t in times]}")
