"""Where greedy answers of speculating engines part from the plain engine's, and how close the
plain engine's top two tokens were there.

Greedy speculation must give the plain engine's tokens, but a verifying step computes its rows
with the multi-row kernels where a plain step computes one row with the one-row kernels: in bf16
their sums differ in the last bits, and where the top two logits are that close the argmax can
flip (after which the answers go apart). A flip at a near-tie is numerics; a parting where the
plain engine's choice led by a clear margin is a bug. Each question is answered alone by each
engine; at each answer's first difference from plain's, the token and plain's top-2 log-prob gap
(``engine.bench.speculative.parting_gaps``, as the spec bench shows them). Device speculation runs
three ways: as configured, never leaving mid-answer for its yield (row cost 0), and on CUDA with
the tensor-op ``verify_and_draft`` in its graphs instead of the Triton kernel.

    python engine/bench/experiments/greedy_divergence.py --model Q.gguf --documents D... --questions Q.txt
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from functools import partial
from pathlib import Path

from engine import device_speculation
from engine.bench.speculative import NEAR_TIE, parting_gaps, run_group
from engine.config import EngineConfig
from engine.engine_builder import build_engine
from engine.loaded_model import LoadedModel


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
    spec = replace(base, speculative="ngram", speculative_device="off", num_speculative_tokens=args.k,
                   speculative_ngram_sizes=tuple(args.ngram_sizes), speculative_row_cost=0.05)
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
    gaps: dict[str, list[float | None]] = {kind: [] for kind in engines if kind != "plain"}
    for n, q in enumerate(questions, 1):
        prompt = [loaded.tokenizer.apply_chat_template([{"role": "user", "content": f"{documents}\n\nQuestion: {q}"}])]
        [want], _, _ = run_group(engines["plain"], prompt, args.max_tokens)
        line = [f"q{n:02d}: plain {len(want)} tokens"]
        for kind in gaps:
            [got], _, _ = run_group(engines[kind], prompt, args.max_tokens)
            parted = parting_gaps(engines["plain"], prompt, [want], [got], args.max_tokens)
            for _, at, gap in parted:
                gaps[kind].append(gap)
                line.append(f"{kind} parts at {at}, plain's top-2 gap {'-' if gap is None else f'{gap:.4f}'}")
            if not parted:
                line.append(f"{kind} same")
        print("; ".join(line), flush=True)
    for kind, found in gaps.items():
        wide = sum(g is None or g > NEAR_TIE for g in found)
        print(f"{kind}: {len(found)}/{len(questions)} parted, {wide} at more than a near-tie ({NEAR_TIE}); plain's top-2 gaps: "
              f"{', '.join('-' if g is None else f'{g:.4f}' for g in found) or '-'}")


if __name__ == "__main__":
    main()
