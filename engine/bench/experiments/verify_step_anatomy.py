"""One-off (2026-12-07): what a verifying step costs on the device, by its rows and its context.

The n-gram spec bench on an H100 (1.5B, batch 1, k=8) spent 1.79 ms of device time a verifying
step of 3.5 tokens against 1.59 ms a one-token step, and the device idled 0.40 ms after each
verifying step, which is read back at once. This script separates the two costs without real
weights or a trace: random weights of a model config, one random prompt of ``--context`` tokens,
greedy decoding. A plain engine answers first; then engines with ``num_speculative_tokens`` k
get an oracle proposer that drafts the plain answer's next k tokens, so that every draft is
accepted and every verifying step has exactly k + 1 rows. Printed for each context and k: the
verifying steps' mean device span (CUDA events; the one-token decode graph's for k = 0), what a
row adds against one row, the device's idle gap after a step read back at once and the host's
turnaround to the next launch, and decode tokens/s. Attention reads a request's context once per
row in a row graph, so the cost a row adds grows with the context; the rest is the projections'.
Each k runs twice: row graphs captured with RoPE and the KV write fused into the attention kernel
(``FUSE_ROW_KV_WRITE``, the default since 2026-12-07 22:48) and as a kernel of their own before it.
Run from the repository root on a GPU: ``PYTHONPATH=$PWD python
engine/bench/experiments/verify_step_anatomy.py [--model engine/configs/qwen2.5-coder-1.5b.json]
[--contexts 64 2160] [--k 1 2 4 8] [--tokens 96]``.
"""
from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from dataclasses import replace

import engine.attention.triton_paged as triton_paged
from engine.bench.report import device_name
from engine.config import EngineConfig
from engine.engine_builder import build_engine
from engine.engine_core import EngineCore
from engine.loaded_model import LoadedModel
from engine.metrics import StepTimes
from engine.sampling import SamplingParams
from engine.speculative import DraftWant


class OracleProposer:
    """Drafts the plain answer's next tokens: every draft is accepted (the guess of a token in
    flight too), so a verifying step has all the rows it asked for."""

    def __init__(self, prompt_len: int, answer: list[int]) -> None:
        self.prompt_len, self.answer = prompt_len, answer

    def propose_batch(self, wants: list[DraftWant]) -> list[list[int]]:
        return [self.answer[len(w.token_ids) - self.prompt_len : len(w.token_ids) - self.prompt_len + w.k] for w in wants]

    def release(self, request_id: str, output_token_ids: Sequence[int] = ()) -> None:
        pass

    @property
    def drafts_ahead(self) -> bool:
        return True


def answer(core: EngineCore, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    """The greedy answer and its decode tokens/s (first token to last)."""
    out = core.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    got: list[int] = []
    while core.has_unfinished_requests():
        for o in core.step():
            got += o.token_ids
    m = out.metrics
    return got, (len(got) - 1) / (m.last_token_time - m.first_token_time)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="engine/configs/qwen2.5-coder-1.5b.json")
    p.add_argument("--contexts", type=int, nargs="+", default=[64, 2160])
    p.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--tokens", type=int, default=96)
    args = p.parse_args()
    base = EngineConfig(model=args.model, load_format="dummy", max_model_len=4096, max_num_seqs=4)
    loaded = LoadedModel.load(base)
    base = replace(base, kv_cache_memory_bytes=2 << 30)
    print(f"# verify_step_anatomy on {device_name(loaded.device)}; {args.model} (random weights), {args.tokens} tokens an answer")
    plain = build_engine(base, loaded)
    spec = {}
    default = triton_paged.FUSE_ROW_KV_WRITE
    for fused in (True, False):  # captured with the switch as it is at capture
        triton_paged.FUSE_ROW_KV_WRITE = fused
        for k in args.k:
            spec[k, fused] = build_engine(replace(base, speculative="ngram", num_speculative_tokens=k, speculative_row_cost=0.0), loaded)
    triton_paged.FUSE_ROW_KV_WRITE = default
    rng = random.Random(0)
    vocab = loaded.model_config.vocab_size
    print(f"{'context':>7} {'k':>2} {'fused':>5} {'steps':>5} {'rows/step':>9} {'device ms/step':>14} {'+ms a row':>9} "
          f"{'idle after read back ms':>23} {'host turnaround ms':>18} {'tok/s':>8} {'identical':>9}")
    for context in args.contexts:
        prompt = [rng.randrange(100, vocab - 100) for _ in range(context)]
        answer(plain, prompt, 4)  # warm: the prompt's blocks cached, every path once
        plain.step_times = StepTimes()
        want, plain_rate = answer(plain, prompt, args.tokens)
        graph = plain.step_times.device_span.get("graph", [0.0, 1])
        one_row = 1e3 * graph[0] / graph[1]
        print(f"{context:>7} {0:>2} {'':>5} {int(graph[1]):>5} {1.0:>9.2f} {one_row:>14.3f} {'':>9} {'':>23} {'':>18} {plain_rate:>8.1f} {'':>9}")
        for (k, fused), core in spec.items():
            core.proposer = OracleProposer(len(prompt), want)
            answer(core, prompt, 4)
            core.step_times = StepTimes()
            got, rate = answer(core, prompt, args.tokens)
            t = core.step_times
            seconds, steps = t.device_span.get("graph", [0.0, 1])
            rows = t.by_mode.get("graph", [0, 1, 0])
            ms = 1e3 * seconds / steps
            n = max(t.read_back_launches, 1)
            print(f"{context:>7} {k:>2} {'yes' if fused else 'no':>5} {int(steps):>5} {rows[2] / rows[1]:>9.2f} {ms:>14.3f} {(ms - one_row) / k:>9.3f} "
                  f"{1e3 * t.read_back_idle / n:>23.3f} {1e3 * t.read_back_turnaround / n:>18.3f} {rate:>8.1f} {str(got == want):>9}")


if __name__ == "__main__":
    main()
