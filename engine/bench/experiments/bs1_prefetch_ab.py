"""One-off (2026-12-03, H200): the batch-1 GEMVs' L2 prefetch before the PDL wait
(GemvPolicy.prefetch_bytes) on the Qwen2.5-1.5B shape (random weights), with and without
gate|up's late release, the batch-1 graph recaptured per variant in one process, three rounds
interleaved; every variant's greedy tokens checked equal to the first's. ``--late``: which
projections release late; ``--splits``: decode attention's context splits (module constant
TARGET_PROGRAMS patched); ``--policy``: o_proj split-K and down_proj on cuBLAS; ``--sum`` (2026-12-04): q|k|v and o_proj on
the CUDA-core "sum" GEMV (GemvPolicy.sum_tiles); ``--down`` (2026-12-05): down_proj as a GEMV split K
2-14 ways with 16-64-row tiles (decode_tile patched) against cuBLAS: every split past 2 slower
(docs/results/2026-12-05-h200-qwen1.5b-dummy-bs1-down-split-ab.txt); ``--kv`` (2026-12-05): decode
attention's first cached K/V rows asked into L2 before its PDL wait (DECODE_KV_PREFETCH), or a short
slice's tile loaded into registers then (DECODE_KV_PRELOAD), or both, or neither, and one GEMV's L2
prefetch budget raised (GemvPolicy.prefetch_by_projection) (the prefetch alone
kept: docs/results/2026-12-05-h200-qwen1.5b-dummy-bs1-combine-in-o-proj-kv-prefetch-ab.txt, whose
form ``--combine`` also A/B'd o_proj merging the attention's splits itself, since dropped). (A form
``--norm`` A/B'd the norms run by the o/down GEMVs' last program, GemvPolicy.fused_norm, since
dropped: docs/results/2026-12-03-h200-qwen1.5b-dummy-bs1-fused-norm-ab.txt; the ``--splits`` form's
output has those variants too. Forms ``--ahead`` and ``--gate-up`` (2026-12-04) A/B'd GEMVs asking L2
for a later weight after their K loop - GemvPolicy.prefetch_ahead, then .prefetch_gate_up_bytes -
since dropped: docs/results/2026-12-04-h200-*-bs1-prefetch-ahead-ab.txt and *-gate-up-ahead-*.txt.) Run from the repository
root: ``PYTHONPATH=$PWD python engine/bench/experiments/bs1_prefetch_ab.py [model config] [--late | --policy | --splits | --sum | --down | --kv]``.
"""
import random
import sys
from dataclasses import replace

import torch

import engine.attention.triton_paged as tp
from engine import EngineConfig, build_engine
from engine.bench.ceilings import copy_bandwidth, decode_step_bytes
from engine.bench.timing import replay_ms
from engine.bench.workload import random_prompt, run_to_completion
from engine.cuda_graph import CudaGraphRunner
from engine.kernels import linear
from engine.kernels.linear import GemvConfig
from engine.sampling import SamplingParams

model = next((a for a in sys.argv[1:] if not a.startswith("--")), "engine/configs/qwen2.5-coder-1.5b.json")
config = EngineConfig(model=model, load_format="dummy", gpu_memory_utilization=0.5, max_num_seqs=8, max_model_len=4096,
                      cuda_graph_batch_sizes=(1, 2, 4, 8))
core = build_engine(config)
path = core.runner.gemv
prompt = random_prompt(random.Random(0), 512, core.model_config.vocab_size)
ceiling = copy_bandwidth(core.device) / decode_step_bytes(core, 512 + 64)
print("path:", path, f"\nceiling {ceiling:.1f} tok/s", flush=True)


def decode(n):
    req = core.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    run_to_completion(core)
    return req.metrics.tpot, list(req.output_token_ids)


decode(8)
default_tile = linear.decode_tile
runner, graphs = core.runner, core.runner.graphs
variants = {}
if "--late" in sys.argv:  # second form: which projections release late, with and without a 2 MiB prefetch
    for late in (("gate_up",), ("gate_up", "lm_head"), ("gate_up", "down"), ("gate_up", "o"), ("gate_up", "qkv"),
                 ("gate_up", "o", "down"), ("qkv", "o", "gate_up", "down", "lm_head")):
        for mib in (0, 1, 2):
            variants[f"prefetch {mib} MiB, late {'+'.join(late)}"] = replace(path, prefetch_bytes=mib << 20, late_release=late)
elif "--splits" in sys.argv:  # fourth form: decode attention's context splits at batch 1 (TARGET_PROGRAMS)
    for target in (264, 32, 16, 8, 2):
        variants[f"attention programs {target}"] = (target, path)
elif "--sum" in sys.argv:  # fifth form: the CUDA-core GEMV for the small projections
    for tiles in ((), ("qkv",), ("o",), ("qkv", "o")):
        variants[f"sum tiles {'+'.join(tiles) or 'none'}"] = replace(path, sum_tiles=tiles)
elif "--kv" in sys.argv:  # seventh form (2026-12-05): decode attention's cached K/V asked into L2 / loaded before its PDL wait
    for prefetch, preload in ((True, False), (False, False), (False, True), (True, True)):
        variants[f"attention KV prefetch {'on' if prefetch else 'off'}, preload {'on' if preload else 'off'}"] = ((prefetch, preload), path)
    for name, mib in (("qkv", 2), ("o", 2), ("gate_up", 2), ("gate_up", 4)):  # one GEMV's L2 budget raised (prefetch_by_projection)
        variants[f"attention KV prefetch on, preload off, {name} prefetch {mib} MiB"] = ((True, False), replace(
            path, prefetch_by_projection=((name, mib << 20),)))
elif "--down" in sys.argv:  # sixth form (2026-12-05): down_proj as a GEMV split K 5-14 ways (more programs than 96)
    variants["down on cuBLAS"] = (None, replace(path, gemv_down=False))
    for block_n, stages in ((32, 5), (16, 5), (64, 4)):
        for split in (2, 5, 7, 10, 14):
            variants[f"down GEMV {block_n}x128 s{stages} split-K {split}"] = (
                GemvConfig("dot", block_n, 128, 4, stages), replace(path, gemv_down=True, down_split_k=split))
elif "--policy" in sys.argv:  # third form, after the fused norms were dropped: o_proj split-K and down_proj on cuBLAS
    variants = {"as configured": path, "down on cuBLAS": replace(path, gemv_down=False),
                "o split-K 2": replace(path, o_split_k=2), "down on cuBLAS, o split-K 2": replace(path, gemv_down=False, o_split_k=2)}
else:  # first form (docs/results/2026-12-03-h200-qwen1.5b-dummy-bs1-prefetch-ab.txt)
    for mib in (0, 2, 8, 32, 128):
        variants[f"prefetch {mib} MiB, late {'+'.join(path.late_release)}"] = replace(path, prefetch_bytes=mib << 20)
        variants[f"prefetch {mib} MiB, late none"] = replace(path, prefetch_bytes=mib << 20, late_release=())
first = None
for rnd in range(3):
    for name, variant in variants.items():
        if isinstance(variant, tuple) and "--down" in sys.argv:
            down_tile, variant = variant
            linear.decode_tile = (lambda n, k, tile=down_tile: tile if tile and k > 4 * n else default_tile(n, k))
        elif isinstance(variant, tuple) and "--kv" in sys.argv:
            (tp.DECODE_KV_PREFETCH, tp.DECODE_KV_PRELOAD), variant = variant
        elif isinstance(variant, tuple):
            tp.TARGET_PROGRAMS, variant = variant
        other = CudaGraphRunner(core.model, runner.backend, runner.kv_layers, [1], graphs.block_tables.shape[1], len(graphs.tokens),
                                core.device, variant)
        try:
            runner.graphs = other
            core.block_manager.reset_prefix_cache()
            tpot, tokens = decode(128)
            ms = replay_ms(other.graphs[1])
        finally:
            runner.graphs = graphs
        del other
        torch.cuda.synchronize()
        first = first or tokens
        same = "same tokens" if tokens == first else "TOKENS DIFFER"
        print(f"round {rnd} {name:52s} tpot {tpot * 1e3:.4f} ms ({1 / tpot:.1f} tok/s, {1 / tpot / ceiling:.3f} of ceiling), "
              f"replay {ms:.4f} ms, {same}", flush=True)
