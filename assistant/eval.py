"""Answer accuracy on the handbook: ``python -m assistant.eval``.

Asks every question of ``eval_facts.json`` (17 facts of the bundled handbook, each in English and
Chinese) through the real assistant (text mode, the embedded model) and counts an answer correct
when it contains every expected fact: numbers as whole numbers ("4" is not found in "14"),
names such as form codes case-insensitively. An answer that names more than
:data:`MAX_OTHER_NUMBERS` numbers besides the expected ones is wrong: a list of numbers can
contain the right one by accident. Several engine variants (``--quantization``) run
one after the other on the same questions, so what an optimization costs in answers is measured
next to what it buys in speed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import platform
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

FACTS_FILE = Path(__file__).resolve().parent / "eval_facts.json"


FACT_NUMBER = re.compile(r"\d+(?:[.,]\d+)?")
# A number standing alone: not part of a longer number, a time (9:00) or a code such as HR-01
# or A4 (CJK characters around it are fine: 第4天).
ANSWER_NUMBER = re.compile(r"(?<![A-Za-z0-9.,:\-])\d+(?:[.,]\d+)?(?![A-Za-z0-9:\-]|[.,]\d)")
MAX_OTHER_NUMBERS = 3


def contains_fact(answer: str, fact: str) -> bool:
    """Whether ``fact`` appears in ``answer``: a number as a whole number, text case-insensitively."""
    if FACT_NUMBER.fullmatch(fact):
        return re.search(rf"(?<![\d.,]){re.escape(fact)}(?![\d]|[.,]\d)", answer) is not None
    return fact.lower() in answer.lower()


def other_numbers(answer: str, facts: list[str]) -> set[str]:
    """The distinct stand-alone numbers of ``answer`` that are not expected facts."""
    return set(ANSWER_NUMBER.findall(answer)) - set(facts)


def is_correct(answer: str, facts: list[str]) -> bool:
    """Every fact present, and not hidden in a list of more than MAX_OTHER_NUMBERS other numbers."""
    return all(contains_fact(answer, f) for f in facts) and len(other_numbers(answer, facts)) <= MAX_OTHER_NUMBERS


@dataclass
class Graded:
    variant: str
    lang: str
    question: str
    expected: list[str]
    answer: str
    correct: bool
    generated_tokens: int
    ttft_s: float | None
    decode_tokens_per_s: float | None
    seconds: float


def load_facts(path: Path = FACTS_FILE) -> list[dict]:
    facts = json.loads(path.read_text(encoding="utf-8"))
    for f in facts:
        if not {"question_en", "question_zh", "answer_contains"} <= f.keys():
            raise ValueError(f"{path}: every fact needs question_en, question_zh and answer_contains; got {sorted(f)}")
    return facts


async def grade_variant(variant: str, facts: list[dict], langs: list[str], max_tokens: int, progress: bool) -> list[Graded]:
    """Every question in every language through one Answerer built with ``quantization=variant``."""
    from assistant.answerer import Answerer
    from assistant.config import AssistantConfig, EngineOptions

    answerer = Answerer.create(AssistantConfig(max_tokens=max_tokens, engine=EngineOptions(quantization=variant)))
    out: list[Graded] = []
    try:
        for lang in langs:
            for i, fact in enumerate(facts):
                question = fact[f"question_{lang}"]
                start = time.perf_counter()
                text, final = "", None
                async for delta in answerer.answer(question):
                    text += delta.text
                    final = delta if delta.finished else final
                graded = Graded(
                    variant, lang, question, fact["answer_contains"], text, is_correct(text, fact["answer_contains"]),
                    final.generated_tokens if final else 0, final.ttft_s if final else None,
                    final.decode_tokens_per_s if final else None, time.perf_counter() - start,
                )
                out.append(graded)
                if progress:
                    mark = "ok  " if graded.correct else "MISS"
                    print(f"[{variant} {lang} {i + 1}/{len(facts)}] {mark} {question} -> {text.strip()[:90]!r}", file=sys.stderr, flush=True)
    finally:
        answerer.shutdown()
    return out


def summarize(graded: list[Graded]) -> list[dict]:
    rows = []
    for variant in dict.fromkeys(g.variant for g in graded):
        for lang in dict.fromkeys(g.lang for g in graded):
            part = [g for g in graded if g.variant == variant and g.lang == lang]
            if not part:
                continue
            rates = [g.decode_tokens_per_s for g in part if g.decode_tokens_per_s]
            ttfts = [g.ttft_s for g in part if g.ttft_s is not None]
            rows.append({
                "variant": variant, "lang": lang, "correct": sum(g.correct for g in part), "questions": len(part),
                "accuracy": sum(g.correct for g in part) / len(part),
                "answer_tokens_mean": statistics.mean(g.generated_tokens for g in part),
                "ttft_ms_p50": 1e3 * statistics.median(ttfts) if ttfts else None,
                "decode_tok_s_p50": statistics.median(rates) if rates else None,
            })
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| variant | lang | correct | accuracy | answer tokens (mean) | TTFT p50 (ms) | decode tok/s p50 |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ttft = f"{r['ttft_ms_p50']:.0f}" if r["ttft_ms_p50"] is not None else "n/a"
        rate = f"{r['decode_tok_s_p50']:.1f}" if r["decode_tok_s_p50"] is not None else "n/a"
        lines.append(f"| {r['variant']} | {r['lang']} | {r['correct']}/{r['questions']} | {100 * r['accuracy']:.0f}% | "
                     f"{r['answer_tokens_mean']:.0f} | {ttft} | {rate} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m assistant.eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quantization", nargs="+", default=["int4", "none"], choices=("auto", "int4", "none"),
                   help="engine variants to compare, in order (default: int4 none)")
    p.add_argument("--lang", nargs="+", default=["en", "zh"], choices=("en", "zh"))
    p.add_argument("--max-tokens", type=int, default=96, help="longest answer in tokens (default 96)")
    p.add_argument("--limit", type=int, help="only the first N facts")
    p.add_argument("--facts", type=Path, default=FACTS_FILE, help="a JSON list of {question_en, question_zh, answer_contains}")
    p.add_argument("--json", type=Path, help="write every answer and the summary here")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    a = p.parse_args(argv)
    if a.max_tokens < 1 or (a.limit is not None and a.limit < 1):
        p.error("--max-tokens and --limit must be >= 1")
    try:
        facts = load_facts(a.facts)[: a.limit]
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    graded: list[Graded] = []
    for variant in a.quantization:
        graded += asyncio.run(grade_variant(variant, facts, a.lang, a.max_tokens, a.progress))
    rows = summarize(graded)
    print(format_table(rows))
    if a.json:
        import torch

        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({
            "date": started, "command": "python -m assistant.eval " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
            "versions": {"python": platform.python_version(), "torch": torch.__version__},
            "summary": rows, "answers": [asdict(g) for g in graded],
        }, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
