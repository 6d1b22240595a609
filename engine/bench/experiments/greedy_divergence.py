"""Where greedy answers of speculating engines part from the plain engine's, and how close the
plain engine's top two tokens were there.

Greedy speculation must give the plain engine's tokens, but a verifying step computes its rows
with the multi-row kernels where a plain step computes one row with the one-row kernels: in bf16
their sums differ in the last bits, and where the top two logits are that close the argmax can
flip (after which the answers go apart). A flip at a near-tie is numerics; a parting where the
plain engine's choice led by a clear margin is a bug. For each question: plain's tokens with its
top-2 log-probs, each other engine's tokens, and at the first difference the position, plain's
two candidates and their log-prob gap, and the engine's token. Device speculation runs three
ways: as configured, never leaving mid-answer for its yield (row cost 0), and on CUDA with the
tensor-op ``verify_and_draft`` in its graphs instead of the Triton kernel.

    python engine/bench/experiments/greedy_divergence.py --model Q.gguf --documents D... --questions Q.txt
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from functools import partial
from pathlib import Path

from engine import device_speculation
from engine.config import EngineConfig
from engine.engine_builder import build_engine
from engine.engine_core import EngineCore
from engine.loaded_model import LoadedModel
from engine.sampling import SamplingParams


def answer(core: EngineCore, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[dict[int, float]]]:
    """One greedy answer alone: its tokens and (with ``params.logprobs``) their log-probs."""
    req = core.add_request(prompt, params)
    tokens: list[int] = []
    logprobs: list[dict[int, float]] = []
    while core.has_unfinished_requests():
        for out in core.step():
            if out.request_id == req.request_id:
                tokens += out.token_ids
                logprobs += out.logprobs or []
    return tokens, logprobs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--documents", type=Path, nargs="+", required=True)
    p.add_argument("--questions", type=Path, required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--ngram-sizes", type=int, nargs=2, default=[1, 8])
    args = p.parse_args()
    base = EngineConfig(model=args.model, max_model_len=4096, max_num_seqs=4)
    loaded = LoadedModel.load(base)
    if loaded.device.type == "cuda":
        base = replace(base, kv_cache_memory_bytes=4 << 30)
    spec = replace(base, speculative="ngram", speculative_device="off", num_speculative_tokens=args.k, speculative_ngram_sizes=tuple(args.ngram_sizes),
                   speculative_row_cost=0.05)
    device = replace(spec, speculative_device="on")
    engines = {"plain": build_engine(base, loaded), "ngram": build_engine(spec, loaded),
               "ngram_device": build_engine(device, loaded),
               # row cost 0: every step pays, so device speculation never leaves mid-answer for its yield
               "ngram_device_no_rest": build_engine(replace(device, speculative_row_cost=0.0), loaded)}
    if loaded.device.type == "cuda":  # the step graphs captured with the tensor-op verify_and_draft, not the kernel
        original = device_speculation.verify_and_draft
        device_speculation.verify_and_draft = partial(original, triton=False)
        engines["ngram_device_tensor_ops"] = build_engine(device, loaded)
        device_speculation.verify_and_draft = original
    documents = "\n\n".join(path.read_text(encoding="utf-8") for path in args.documents)
    questions = [q.strip() for q in args.questions.read_text(encoding="utf-8").splitlines() if q.strip()]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    top2 = replace(greedy, logprobs=2)
    parted = {kind: 0 for kind in engines if kind != "plain"}
    gaps: dict[str, list[float]] = {kind: [] for kind in parted}
    for n, q in enumerate(questions, 1):
        prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": f"{documents}\n\nQuestion: {q}"}])
        want, lps = answer(engines["plain"], prompt, top2)
        again, _ = answer(engines["plain"], prompt, greedy)
        line = [f"q{n:02d}: plain {len(want)} tokens, same without logprobs: {again == want}"]
        for kind in parted:
            got, _ = answer(engines[kind], prompt, greedy)
            if got == want:
                line.append(f"{kind} same")
                continue
            parted[kind] += 1
            i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            if i < len(lps) and len(lps[i]) >= 2:
                (t1, l1), (t2, l2) = sorted(lps[i].items(), key=lambda kv: -kv[1])[:2]
                gaps[kind].append(l1 - l2)
                line.append(f"{kind} parts at {i}: plain {t1} ({l1:.4f}) / runner-up {t2} ({l2:.4f}), gap {l1 - l2:.4f}; "
                            f"{kind} took {got[i] if i < len(got) else 'end'}{' (the runner-up)' if i < len(got) and got[i] == t2 else ''}")
            else:
                line.append(f"{kind} parts at {i} (length)")
        print("; ".join(line), flush=True)
    for kind in parted:
        print(f"{kind}: {parted[kind]}/{len(questions)} parted; plain's top-2 gap there: "
              f"{', '.join(f'{g:.4f}' for g in sorted(gaps[kind])) or '-'}")


if __name__ == "__main__":
    main()
