"""The prefill suite: a batch of prompts against the matmul ceiling and HF's forward."""

from __future__ import annotations

import random

import torch

from engine.bench.ceilings import compute_seconds
from engine.bench.report import Row
from engine.bench.timing import timed
from engine.bench.workload import Sizes, random_prompt, run_to_completion
from engine.engine_core import EngineCore
from engine.sampling import SamplingParams


def bench_prefill(core: EngineCore, hf: torch.nn.Module | None, sizes: Sizes, rng: random.Random, flops: float,
                  results: dict, projection_flops: float | None = None) -> list[Row]:
    """Prompts prefilled in one batch against the matmul ceiling and HF's forward."""
    vocab = core.model_config.vocab_size
    prompts = [random_prompt(rng, sizes.prefill_len, vocab) for _ in range(sizes.prefill_batch)]
    saved = core.scheduler.config.max_num_batched_tokens
    core.scheduler.config.max_num_batched_tokens = sizes.prefill_batch * sizes.prefill_len

    def once():
        core.block_manager.reset_prefix_cache()
        for p in prompts:
            core.add_request(p, SamplingParams(max_tokens=1, ignore_eos=True))
        run_to_completion(core)

    seconds = timed(once, core.device, 3)
    core.scheduler.config.max_num_batched_tokens = saved
    tokens = sizes.prefill_batch * sizes.prefill_len
    ours = tokens / seconds
    mc = core.model_config
    ceiling = 1 / compute_seconds(mc, 2.0 * mc.num_parameters, 1, flops, projection_flops or flops)  # tokens a second
    rows = [Row(f"prefill {sizes.prefill_batch} x {sizes.prefill_len}", ours, "tok/s", "matmul ceiling (2 FLOP/param/token)", ceiling)]
    results.update(prefill_tok_s=ours)
    if hf is not None:
        x = torch.tensor(prompts, device=core.device)
        with torch.inference_mode():
            hf_seconds = timed(lambda: hf(x, logits_to_keep=1), core.device, 3)
        rows.append(Row(f"prefill {sizes.prefill_batch} x {sizes.prefill_len} vs HF forward", ours, "tok/s", "HF forward same batch", tokens / hf_seconds))
        results.update(hf_prefill_tok_s=tokens / hf_seconds)
    return rows
