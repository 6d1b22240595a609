"""Correctness before speed: the engine's log-probs against HF transformers' float32 forward."""

from __future__ import annotations

import random
import sys

import torch

from engine.bench.report import Row
from engine.bench.workload import random_prompt
from engine.engine_core import EngineCore
from engine.memory import tensor_bytes
from engine.request import Request, RequestStatus
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledChunk


HF_BASELINE_MEMORY = "HF baseline's weights (bench only, float32 at its check)"


def prompt_logits(core: EngineCore, token_ids: list[int]) -> torch.Tensor:
    """Logits at every prompt position, computed by the engine's model over its paged cache (one
    eager prefill, outside the scheduler; the request's blocks are freed after)."""
    req = Request("logits-probe", list(token_ids), SamplingParams(max_tokens=1))
    assert core.block_manager.allocate_slots(req, len(token_ids))
    req.status = RequestStatus.RUNNING
    try:
        inputs = core.runner.prepare([ScheduledChunk(req, len(token_ids))])
        with torch.inference_mode():
            hidden = core.model(inputs.input_ids, inputs.positions, core.runner.backend, inputs.meta, core.runner.kv_layers)
            return core.model.compute_logits(hidden)
    finally:
        core.block_manager.free(req)


def check_against_hf(core: EngineCore, hf: torch.nn.Module, rng: random.Random, results: dict) -> Row:
    """Correctness before speed: the log-probs the engine gives its own greedy tokens (prefill,
    then decode steps: CUDA graphs on the GPU) against a float32 forward of HF over the same
    sequence. In bf16 the bound is twice HF's own bf16 error against that float32 reference."""
    prompt = random_prompt(rng, 61, core.model_config.vocab_size)
    req = core.add_request(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0))
    ours = []
    while core.has_unfinished_requests():
        for out in core.step():
            ours += [lp[t] for lp, t in zip(out.logprobs or [], out.token_ids)]
    tokens = req.output_token_ids
    x = torch.tensor([prompt + tokens], device=core.device)
    rows = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens), device=core.device)
    picked = torch.tensor(tokens, device=core.device)

    def chosen_logprobs() -> list[float]:
        with torch.inference_mode():
            logits = hf(x).logits[0, rows].float()
        return torch.log_softmax(logits, -1)[torch.arange(len(tokens), device=core.device), picked].tolist()

    low = chosen_logprobs()
    dtype = next(hf.parameters()).dtype
    if dtype != torch.float32:
        hf.float()
        exact = chosen_logprobs()
    else:
        exact = low
    # The baseline shares the device with the engine in this process: its float32 weights are an
    # owner of the peak, not "other".
    core.memory.record(HF_BASELINE_MEMORY, tensor_bytes(hf))
    if dtype != torch.float32:
        hf.to(dtype)
        torch.cuda.empty_cache() if core.device.type == "cuda" else None
    err = max(abs(a - b) for a, b in zip(ours, exact))
    hf_err = max(abs(a - b) for a, b in zip(low, exact))
    tolerance = max(2 * hf_err, 1e-3)
    print(f"check: per-token |ours - fp32| {[round(abs(a - b), 4) for a, b in zip(ours, exact)]}", file=sys.stderr)
    print(f"check: per-token |HF {dtype} - fp32| {[round(abs(a - b), 4) for a, b in zip(low, exact)]}", file=sys.stderr)
    results.update(check_max_abs_logprob_diff=err, check_hf_same_dtype_diff=hf_err)
    if err > tolerance:
        raise SystemExit(f"correctness check failed: max |logprob diff| vs float32 = {err:.4f} > {tolerance:.4f}")
    return Row(f"correctness: max |logprob - fp32 ref| over {len(tokens)} tokens", err, "nats",
               "bound: 2 x HF's own error at this dtype", tolerance, False, is_check=True)
