"""Text mode: ask the handbook from the terminal.

    python -m assistant.cli -q "How do I apply for annual leave?"
    python -m assistant.cli                      # interactive, multi-turn
    python -m assistant.cli --docs DIR --model PATH --timings
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from assistant.config import HANDBOOK_DIR, AssistantConfig, EngineOptions


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m assistant.cli", description="Ask the company handbook (text mode).")
    p.add_argument("-q", "--question", help="ask one question, print the streamed answer, exit")
    p.add_argument("--docs", type=Path, default=HANDBOOK_DIR, help="documents folder (default: the bundled handbook)")
    p.add_argument("--model", type=Path, help="HF model directory or llama .gguf file (default: embedded SmolLM2-135M)")
    p.add_argument("--lang", choices=("auto", "en", "zh"), default="auto", help="handbook language (default: from the question)")
    p.add_argument("--max-tokens", type=int, default=160, help="longest answer in tokens (default 160)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (default)")
    p.add_argument("--timings", action="store_true", help="print TTFT, tokens/s and cached prompt tokens per answer")
    return p.parse_args(argv)


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def check_args(args: argparse.Namespace) -> str | None:
    if not args.docs.is_dir():
        return f"--docs {args.docs}: no such directory"
    if args.model is not None and not args.model.exists():
        return f"--model {args.model}: no such file or directory"
    if args.max_tokens < 1:
        return f"--max-tokens must be >= 1, got {args.max_tokens}"
    if args.temperature < 0:
        return f"--temperature must be >= 0, got {args.temperature}"
    return None


async def ask(answerer, question: str, history: list[dict[str, str]], timings: bool) -> str:
    text = ""
    async for delta in answerer.answer(question, history):
        print(delta.text, end="", flush=True)
        text += delta.text
        if delta.finished:
            print(flush=True)
            if timings:
                ttft = f"{delta.ttft_s * 1000:.0f} ms" if delta.ttft_s is not None else "n/a"
                rate = f"{delta.decode_tokens_per_s:.1f} tok/s" if delta.decode_tokens_per_s else "n/a"
                print(
                    f"[ttft {ttft} · {rate} · {delta.generated_tokens} tokens · prompt {delta.prompt_tokens} tokens, "
                    f"{delta.cached_tokens} cached]",
                    file=sys.stderr, flush=True,
                )
    return text


async def run(args: argparse.Namespace) -> int:
    from assistant.answerer import Answerer
    from assistant.docs import DocumentError
    from assistant.models import ModelNotAvailable
    from engine import ConfigError

    config = AssistantConfig(
        docs_dir=args.docs, language=args.lang, max_tokens=args.max_tokens, temperature=args.temperature,
        engine=EngineOptions(model=args.model, device=args.device),
    )
    print("Loading the model and the handbook...", file=sys.stderr, flush=True)
    try:
        answerer = Answerer.create(config)
    except (DocumentError, FileNotFoundError, ConfigError) as e:
        return fail(str(e))
    except ModelNotAvailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        if args.question is not None:
            if not args.question.strip():
                return fail("the question is empty")
            await ask(answerer, args.question, [], args.timings)
            return 0
        history: list[dict[str, str]] = []
        print("Ask a question about the handbook (empty line or Ctrl-D to quit).", file=sys.stderr)
        while True:
            try:
                question = await asyncio.to_thread(input, "> ")
            except EOFError:
                print(file=sys.stderr)
                return 0
            if not question.strip():
                return 0
            answer = await ask(answerer, question, history, args.timings)
            history += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    finally:
        answerer.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    error = check_args(args)
    if error:
        return fail(error)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(run(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
