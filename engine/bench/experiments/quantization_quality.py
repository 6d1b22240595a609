"""What the GPU's quantized weights cost in answers, on real weights, without a GPU: the model
loaded dense (float32) on the CPU, then its layer projections rounded as ``--quantization fp8``
does (e4m3 per output channel, each forward's activations rounded per token too: W8A8, the
arithmetic of the GPU's FP8 matmuls; its batch-1 GEMV rounds only the weights, so this is the
stricter case) or as ``--quantization int4`` on CUDA does (engine/w4a16.py: a GGUF's own 4-bit
groups of 32 with the wider-typed projections left dense, or every projection rounded again into
groups of 128 with an fp16 scale and minimum; the products here in float32, where the kernel
rounds x to fp16). For each prompt (handbook documents and a question, the chat template), one
forward of each model over the whole prompt: how often their next-token argmax agrees, and how far
the FP8 model's log-prob of the dense model's argmax moves. The same for the model in bf16 (the
GPU's unquantized dtype) puts the FP8 figures in scale.

Variants with the lm_head rounded too (``EngineConfig.lm_head_quantization``) show what the head's
share of a step's bytes costs: in e4m3 per row, or in int4 groups of 128.

Run from the repository root: ``PYTHONPATH=$PWD python engine/bench/experiments/quantization_quality.py
MODEL.gguf QUESTIONS.txt DOC.md... [--only WORD ...]`` (``--only``: the variants whose name has one
of the words, e.g. ``--only head``).
"""
import argparse
from pathlib import Path

import torch

from engine import EngineConfig, build_engine
from engine.bench.correctness import prompt_logits
from engine.fp8 import quantize_lm_head_fp8, quantize_model_fp8
from engine.loaded_model import LoadedModel
from engine.gguf_blocks import BlockCache
from engine.quantization import gguf_tensors
from engine.w4a16 import quantize_lm_head_int4, quantize_model_int4, quantize_model_int4_from_gguf


def prompt_logprobs(core, ids: list[int]) -> torch.Tensor:
    """Log-probs [len(ids), vocab] after every prompt position."""
    return torch.log_softmax(prompt_logits(core, ids), dim=-1)


def compare(core, prompts: list[list[int]], dense: list[torch.Tensor], name: str) -> None:
    """Print ``core``'s argmax agreement and log-prob deltas against the float32 ``dense`` ones."""
    agree = total = 0
    deltas = []
    for p, ref in zip(prompts, dense):
        got = prompt_logprobs(core, p).float()
        top = ref.argmax(-1)
        agree += int((got.argmax(-1) == top).sum())
        total += len(p)
        deltas.append((got.gather(1, top[:, None]) - ref.gather(1, top[:, None])).abs().squeeze(1))
    d = torch.cat(deltas)
    print(f"{name} against float32, {len(prompts)} prompts, {total} positions: next-token argmax agreement {agree / total:.4f}; "
          f"|log-prob delta| of float32's argmax mean {d.mean():.4f}, p99 {d.quantile(0.99):.3f}, max {d.max():.3f} nats", flush=True)


def main(model: str, questions: str, documents: list[str], only: list[str]) -> None:
    """One model in memory at a time (the float32 1.5B is 6 GB): the reference log-probs are kept,
    each variant is loaded, compared and freed."""
    config = EngineConfig(model=model, device="cpu", dtype="float32", max_model_len=4096)
    loaded = LoadedModel.load(config)
    text = "\n\n".join(Path(d).read_text(encoding="utf-8") for d in documents)
    prompts = [loaded.tokenizer.apply_chat_template([{"role": "user", "content": f"{text}\n\nQuestion: {q}"}])
               for q in Path(questions).read_text(encoding="utf-8").splitlines() if q.strip()]
    dense = [prompt_logprobs(build_engine(config, loaded), p) for p in prompts]
    del loaded
    print(f"{Path(model).name}: float32 reference over {len(prompts)} prompts", flush=True)

    def from_gguf(m) -> None:
        quantize_model_int4_from_gguf(m, BlockCache(gguf_tensors(model)))

    def both(*steps):
        return lambda m: [step(m) for step in steps]

    variants = (("bf16", None),
                ("int4 W4A16 from the GGUF's own 4-bit groups of 32, wider types bf16", from_gguf),
                ("int4 W4A16 from the GGUF's own groups, lm_head int4 groups of 128", both(from_gguf, quantize_lm_head_int4)),
                ("int4 W4A16 from the GGUF's own groups, lm_head e4m3", both(from_gguf, quantize_lm_head_fp8)),
                ("int4 W4A16, groups of 128", quantize_model_int4), ("FP8 (W8A8)", quantize_model_fp8),
                ("FP8 (W8A8), lm_head e4m3 too", both(quantize_model_fp8, quantize_lm_head_fp8)))
    for name, quantize in variants:
        if only and not any(word in name for word in only):
            continue
        if quantize is None:  # the GPU's unquantized dtype, for scale
            bf16_config = EngineConfig(model=model, device="cpu", dtype="bfloat16", max_model_len=4096)
            compare(build_engine(bf16_config, LoadedModel.load(bf16_config)), prompts, dense, name)
            continue
        variant = LoadedModel.load(config)
        quantize(variant.model)
        compare(build_engine(config, variant), prompts, dense, name)
        del variant


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("questions")
    p.add_argument("documents", nargs="+")
    p.add_argument("--only", nargs="+", default=[], help="run only the variants whose name has one of these words (bf16, head, FP8...)")
    args = p.parse_args()
    main(args.model, args.questions, args.documents, args.only)
