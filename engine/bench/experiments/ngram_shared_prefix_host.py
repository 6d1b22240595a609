"""One-off (2026-12-07): host time the n-gram proposer spends a question, with and without the
shared index of the documents' prefix (engine.speculative.SharedPrefixes), on the spec bench's
prompts.

The time is the proposer's alone (``NgramProposer.propose_batch``, as the engine calls it once a
step at batch 1), which a verifying step's launch waits for: each question's prompt (the handbook
documents, then the question, in the model's chat template), then an answer of ``--answer-tokens``
tokens quoted from the documents, two tokens a step. The baseline is the same proposer with no
prefix ever shared (every request indexes its whole prompt, as before SharedPrefixes). Run from the
repository root: ``python engine/bench/experiments/ngram_shared_prefix_host.py QWEN.gguf
docs/results/2026-12-04-spec-questions-en32.txt --ngram-sizes 1 8``.
"""
import argparse
import time
from pathlib import Path

from engine.speculative import DraftWant, NgramProposer
from engine.tokenizer import Tokenizer

p = argparse.ArgumentParser()
p.add_argument("model", help="a GGUF whose tokenizer makes the prompts")
p.add_argument("questions", type=Path)
p.add_argument("--documents", type=Path, nargs="+", default=sorted(Path("assistant/handbook/en").glob("*.md")))
p.add_argument("--ngram-sizes", type=int, nargs=2, default=[2, 4])
p.add_argument("--k", type=int, default=8)
p.add_argument("--answer-tokens", type=int, default=30)
p.add_argument("--rounds", type=int, default=5)
args = p.parse_args()

tokenizer = Tokenizer.load(args.model)
documents = "\n\n".join(path.read_text(encoding="utf-8") for path in args.documents)
questions = [q.strip() for q in args.questions.read_text(encoding="utf-8").splitlines() if q.strip()]
prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"{documents}\n\nQuestion: {q}"}]) for q in questions]
quote = tokenizer.encode(documents)


def per_question_ms(shared: bool) -> list[float]:
    """The proposer's host time for each question, in order, one proposer for all (as one engine)."""
    proposer = NgramProposer(args.k, *args.ngram_sizes)
    if not shared:
        proposer.prefixes.min_tokens = 1 << 30
    times = []
    for q, prompt in enumerate(prompts):
        answer = quote[100 * q : 100 * q + args.answer_tokens]
        start = time.perf_counter()
        for end in range(1, len(answer) + 1, 2):
            proposer.propose_batch([DraftWant(str(q), prompt + answer[:end], args.k)])
        times.append((time.perf_counter() - start) * 1e3)
        proposer.release(str(q), answer)
    return times


print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, n-grams {args.ngram_sizes[0]}.."
      f"{args.ngram_sizes[1]}, k={args.k}, answers of {args.answer_tokens} tokens, two a step; best of {args.rounds} rounds")
for label, shared in (("whole prompt indexed a request (baseline)", False), ("documents' prefix indexed once (SharedPrefixes)", True)):
    rounds = [per_question_ms(shared) for _ in range(args.rounds)]
    first = min(r[0] for r in rounds)
    rest = min(sum(r[1:]) / (len(r) - 1) for r in rounds)
    print(f"  {label:48s} first question {first:6.2f} ms, each later question {rest:6.2f} ms")
