"""GPU memory profiling: how much is left for the KV cache after weights and peak activations."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata, select_backend
from engine.config import EngineConfig
from engine.kv_cache import KVCache, KVCacheSpec
from engine.memory import MemoryLedger
from engine.model import LlamaForCausalLM


@torch.inference_mode()
def profile_peak_activations(model: LlamaForCausalLM, config: EngineConfig, device: torch.device, spec: KVCacheSpec,
                             max_model_len: int) -> int:
    """Run one prefill of ``max_num_batched_tokens`` tokens and return the activation peak (bytes)."""
    tokens = min(config.max_num_batched_tokens, max_model_len)
    blocks = -(-tokens // spec.block_size) + 1
    scratch = KVCache(spec, blocks, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(spec.block_size, spec.block_size + tokens, device=device),
        query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(1, blocks, dtype=torch.int32, device=device)[None],
        query_lens_host=[tokens],
        seq_lens_host=[tokens],
        num_decodes=0,
        max_seq_len=tokens,
    )
    ids = torch.randint(0, model.config.vocab_size, (tokens,), device=device)
    positions = torch.arange(tokens, device=device)
    backend = select_backend(config.attention_backend, device)
    hidden = model(ids, positions, backend, meta, scratch.layers())
    model.compute_logits(hidden[-config.max_num_seqs :])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del scratch, hidden
    torch.cuda.empty_cache()
    return peak


@dataclass(frozen=True)
class KVBudget:
    """The bytes left for the KV cache and how they were worked out (for a start-up error that
    names the numbers when they are too few)."""

    nbytes: int
    explanation: str


def kv_budget_after_profile(model: LlamaForCausalLM, config: EngineConfig, device: torch.device, memory: MemoryLedger,
                            spec: KVCacheSpec, max_model_len: int) -> KVBudget:
    """``gpu_memory_utilization`` x total memory, minus what is in use (these weights, other
    models in the process, other processes) and the activation peak (recorded in ``memory``)."""
    activations = profile_peak_activations(model, config, device, spec, max_model_len)
    memory.record("activations (profiled peak)", activations)
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    budget = int(config.gpu_memory_utilization * total) - used - activations
    gib = 2**30
    return KVBudget(max(budget, 0), (
        f"gpu_memory_utilization {config.gpu_memory_utilization:g} x {total / gib:.2f} GiB = "
        f"{config.gpu_memory_utilization * total / gib:.2f} GiB, minus {used / gib:.2f} GiB in use (weights, other "
        f"models, other processes) and a {activations / gib:.2f} GiB activation peak"))
