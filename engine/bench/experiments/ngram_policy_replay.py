"""One-off (2026-12-06): n-gram drafting policies replayed on real greedy answers, on the CPU.

Greedy output does not depend on speculation, so how many steps a proposer would save is a
property of the answers: this script has the real Qwen2.5-Coder-1.5B answer the spec bench's
questions with the handbook in front (greedy, one engine, no speculation), then replays each
answer step by step for each policy: at a step the proposer sees the prompt and the tokens so far
and drafts up to k tokens (``engine.speculative.NgramProposer``, the engine's own code, with the
earlier answers in its ``AnswerCache`` as in the engine), the step appends the drafts the answer
agrees with plus one. Printed per policy: steps against plain decoding, the share of steps that
verify drafts, tokens a verifying step, and a time estimate with the costs measured on the H200
(2026-12-04, 1.5B, batch 1: an async plain step 1.41 ms, a step read back at once - every
verifying step - 1.64 ms). An "oracle" row takes, among
every earlier occurrence of the longest matching n-gram, the one whose continuation the answer
follows longest: what any choice of match could reach.
Run from the repository root: ``python engine/bench/experiments/ngram_policy_replay.py QWEN1.5B.gguf QUESTIONS [MAX_TOKENS]``.
"""
import sys
from pathlib import Path

from engine.config import EngineConfig
from engine.bench.speculative import run_group
from engine.engine_builder import build_engine
from engine.speculative import AnswerCache, NgramIndex, NgramProposer

ASYNC_MS, SYNC_MS = 1.41, 1.64  # H200, 1.5B, batch 1 (docs/performance.md, 2026-12-04)
model, questions_file = sys.argv[1], Path(sys.argv[2])
max_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 64
core = build_engine(EngineConfig(model=model, max_model_len=4096, max_num_seqs=32))
documents = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(Path("assistant/handbook/en").glob("*.md")))
questions = [q.strip() for q in questions_file.read_text(encoding="utf-8").splitlines() if q.strip()]
prompts = [core.tokenizer.apply_chat_template([{"role": "user", "content": f"{documents}\n\nQuestion: {q}"}]) for q in questions]
answers = run_group(core, prompts, max_tokens)[0]
print(f"{len(answers)} answers, {sum(map(len, answers))} tokens, prompt {len(prompts[0])} tokens", flush=True)


def oracle_drafts(tokens: list[int], future: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Among all earlier occurrences of the longest n-gram ending ``tokens``, the continuation
    that agrees with ``future`` longest."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        key, best = tokens[-n:], []
        for end in range(n, len(tokens)):
            if tokens[end - n : end] == key:
                cand = tokens[end : end + k]
                agree = next((i for i, (a, b) in enumerate(zip(cand, future)) if a != b), min(len(cand), len(future)))
                if agree > len(best) or not best:
                    best = cand[: max(agree, 1)]
        if best:
            return best
    return []


def replay(k: int, min_n: int, max_n: int, oracle: bool = False) -> tuple[int, int, int]:
    """(steps, verifying steps, tokens) over every answer, in order, with earlier answers in the
    proposer's answer cache. A step with drafts is read back at once (it verifies them)."""
    proposer = NgramProposer(k, min_n, max_n, answers=AnswerCache(1 << 15, min_n, max_n))
    steps = verifying = tokens = 0
    for prompt, answer in zip(prompts, answers):
        index = NgramIndex(min_n, max_n)
        t = 1  # the first token comes from the prefill step
        while t < len(answer):
            known = prompt + answer[:t]
            drafts = oracle_drafts(known, answer[t:], k, min_n, max_n) if oracle else proposer.propose(known, None, index)
            steps += 1
            if drafts:
                agree = next((i for i, (a, b) in enumerate(zip(drafts, answer[t:])) if a != b), min(len(drafts), len(answer) - t))
                verifying += 1
                t += agree + 1
            else:
                t += 1
        tokens += len(answer) - 1
        proposer.answers.add(answer)
    return steps, verifying, tokens


plain_steps = sum(len(a) - 1 for a in answers)
print(f"{'policy':34s} {'steps':>6s} {'x fewer':>7s} {'verifying':>9s} {'tok/verify':>10s} {'est. speed-up':>13s}")
for oracle in (False, True):
    for k in (4, 6, 8, 12):
        for min_n, max_n in ((1, 4), (2, 4), (3, 4), (2, 6), (2, 8), (1, 8)):
            if oracle and (k, max_n) not in ((4, 4), (8, 8)):
                continue
            steps, verifying, tokens = replay(k, min_n, max_n, oracle)
            per_verify = (tokens - (steps - verifying)) / max(verifying, 1)
            est = plain_steps * ASYNC_MS / (verifying * SYNC_MS + (steps - verifying) * ASYNC_MS)
            name = f"{'oracle ' if oracle else ''}k={k} n={min_n}..{max_n}"
            print(f"{name:34s} {steps:6d} {plain_steps / steps:7.2f} {verifying / steps:9.1%} {per_verify:10.2f} {est:13.2f}", flush=True)
