"""Answer accuracy on the handbook: ``python -m assistant.eval``.

Asks every question of ``eval_facts.json`` (17 facts of the bundled handbook and 8 questions it
does not answer, each in English and Chinese) through the real assistant (text mode, the embedded
model or ``--model``) and grades the answers (:func:`grade`):

- a fact is right when the answer contains every expected fact (numbers as whole numbers, "4" is
  not found in "14"; names such as form codes case-insensitively), states no number that neither
  the fact's handbook document nor the contacts state (a list of guesses fails on its first
  invented number; a numbered list's item numbers are not numbers), does not offer the expected
  number as one of alternatives ("10 or 20 days"), and does not refuse;
- a refusal is right when the answer says plainly that the handbook does not say, names the
  contact the handbook gives for the topic, and states no number beyond the contacts'.

With ``--images with`` (or ``only``), the picture questions of :mod:`assistant.eval_images` too:
a receipt, a form or an error screenshot rendered from the handbook's facts, read by the image
stage (its character error rate printed per picture), its text put before the question as in a
turn with an image, the answer graded as a fact (numbers the picture shows count as stated).

Several engine variants (``--quantization``) run one after the other on the same questions, so
what an optimization costs in answers is measured next to what it buys in speed. A variant names
the layers' weights (``int4``, ``fp8``, ``none``, ``auto``) and may add the output head's own
format: ``fp8+fp8-head`` (engine.EngineConfig.lm_head_quantization).

With ``--gate-only``, no model: only whether the refusal gate (:mod:`assistant.refusal`) refuses
each question, per language the questions the handbook does not answer that it refuses (and of
them those whose refusal :func:`grade` passes: it names the topic's contact) and the facts it
refuses wrongly. A refused question never reaches the model, so those refusals are what the full
run scores for them. ``--facts
assistant/eval_colloquial.json`` asks the colloquial questions written to test it.
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

from assistant.config import HANDBOOK_DIR
from assistant.eval_images import PICTURES

FACTS_FILE = Path(__file__).resolve().parent / "eval_facts.json"
CONTACTS_FILE = "12-who-to-contact.md"  # the handbook's contacts: any answer may quote their numbers


FACT_NUMBER = re.compile(r"\d+(?:[.,]\d+)?")
# A number standing alone: not part of a longer number, a time (9:00) or a code such as HR-01
# or A4 (CJK characters around it are fine: 第4天).
ANSWER_NUMBER = re.compile(r"(?<![A-Za-z0-9.,:\-])\d+(?:[.,]\d+)?(?![A-Za-z0-9:\-]|[.,]\d)")
# The number of a numbered list's item ("1. ", "2) ", "3、" at the start of a line): an ordinal of
# the answer's layout, not a quantity it states.
LIST_MARKER = re.compile(r"(?m)^[ \t]*\d+[.)、]\s*")
# Numbers offered as alternatives: "10 or 20 days", "5, 10, 15", "5天、10天或20天". A number in such
# a run is a guess among several, not an answer (a word or two CJK characters of unit may follow each).
_ALT_NUMBER = r"(?<![A-Za-z0-9.,:\-])[£$€¥]?\d+(?:[.,]\d+)?(?![A-Za-z0-9:\-]|[.,]\d)(?:\s*(?:[A-Za-z]{1,8}|[\u4e00-\u9fff]{1,2}))?"
_COMMA = r"\s*[,，、]\s*"
_OR = r"\s*[,，]?\s*(?:or|或者|或|/)\s*"
ALTERNATIVES = re.compile(rf"{_ALT_NUMBER}(?:(?:{_COMMA}{_ALT_NUMBER})*{_OR}{_ALT_NUMBER}|(?:{_COMMA}{_ALT_NUMBER}){{2,}})")
# Saying plainly that the handbook does not answer the question (not "if the handbook does not say").
REFUSAL = {
    "en": re.compile(
        r"(?<!if the )handbook (?:does not|doesn't|did not|didn't) (?:say|state|mention|cover|specify|include|contain|provide|answer|have|give)"
        r"|not (?:in|covered (?:in|by)|mentioned in|stated in|specified in|addressed in|included in) the handbook"
        r"|handbook (?:has|contains|gives|provides|says) (?:no|nothing)",
        re.IGNORECASE,
    ),
    "zh": re.compile(r"(?<!如果)手册[^。！？\n]{0,10}(?:没有|未|并未|不包括|不包含|不涉及)"),
}


# Saying yes to a question whose right answer is no ("Is this London hotel within the limit?" of a
# GBP 214 room under a GBP 200 limit): opening with yes, or putting the amount within the limit.
AFFIRMS = {
    "en": re.compile(r"^\W*yes\b|(?<!not )(?<!n't )\b(?:is|are|falls|stays|it's) (?:well )?within\b|\bcan claim (?:the|this|it) whole\b",
                     re.IGNORECASE),
    "zh": re.compile(r"^\W*(?:是|可以|能)|(?<![不没])(?:可以|能)全部报销|(?<!不)在(?:[^。！？，,]{0,6})(?:上限|限额)(?:之内|以内|内)"),
}


def affirms(answer: str, lang: str) -> bool:
    """Whether ``answer`` says yes (see ``AFFIRMS``): a picture question whose verdict is "no" then fails."""
    return AFFIRMS[lang].search(answer.strip()) is not None


def contains_fact(answer: str, fact: str) -> bool:
    """Whether ``fact`` appears in ``answer``: a number as a whole number, text case-insensitively."""
    if FACT_NUMBER.fullmatch(fact):
        return re.search(rf"(?<![\d.,]){re.escape(fact)}(?![\d]|[.,]\d)", answer) is not None
    return fact.lower() in answer.lower()


def names(answer: str, name: str) -> bool:
    """Whether ``answer`` names ``name`` as a whole word (case-insensitively): "HR" is not in "HR-01" or "through"."""
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(name)}(?![A-Za-z0-9\-])", answer, re.IGNORECASE) is not None


def stated_numbers(text: str) -> set[str]:
    """The distinct stand-alone numbers ``text`` states (list items' numbers are layout, not numbers)."""
    return set(ANSWER_NUMBER.findall(LIST_MARKER.sub("", text)))


def alternatives(answer: str) -> list[str]:
    """The runs of numbers ``answer`` offers as alternatives ("10 or 20", "5, 10, 15")."""
    return [m.group(0) for m in ALTERNATIVES.finditer(LIST_MARKER.sub("", answer))]


def refuses(answer: str, lang: str) -> bool:
    """Whether ``answer`` says plainly that the handbook does not answer the question."""
    return REFUSAL[lang].search(answer) is not None


def source_text(item: dict, lang: str, handbook: Path = HANDBOOK_DIR) -> str:
    """The handbook text whose numbers an answer to ``item`` in ``lang`` may state: the item's
    document and the contacts document."""
    files = dict.fromkeys([item["file"], CONTACTS_FILE])
    return "\n".join((handbook / lang / f).read_text(encoding="utf-8") for f in files)


def grade(answer: str, item: dict, lang: str, source: str) -> bool:
    """Whether ``answer`` answers ``item`` asked in ``lang``; ``source`` is :func:`source_text`.

    A fact: every expected fact is present, the answer does not refuse, no expected number is one
    of several offered as alternatives, and every other number it states is one its handbook
    document or the contacts state (quoting the handbook's other figures is fine, inventing one is
    not: a list of guesses fails on its first invented number), and when the item has ``verdict`` "no"
    (a picture's amount over the limit), the answer does not say yes. A question the handbook does not answer: the
    answer says the handbook does not say, names the contact to ask, and states no number beyond
    those of the contacts (no invented answer).
    """
    question = item[f"question_{lang}"]
    invented = stated_numbers(answer) - stated_numbers(source) - stated_numbers(question)
    if item.get("refusal"):
        return refuses(answer, lang) and any(names(answer, c) for c in item["contact_any"]) and not invented
    expected = item["answer_contains"]
    hedged = any(contains_fact(run, f) for run in alternatives(answer) for f in expected if FACT_NUMBER.fullmatch(f))
    wrong_verdict = item.get("verdict") == "no" and affirms(answer, lang)
    return (all(contains_fact(answer, f) for f in expected) and not refuses(answer, lang) and not hedged and not invented
            and not wrong_verdict)  # fmt: skip


@dataclass
class Graded:
    variant: str
    lang: str
    kind: str  # "fact" (the handbook answers it) or "refusal" (it does not)
    question: str
    expected: list[str]  # a fact's expected facts, all needed; a refusal's contact names, one needed
    answer: str
    correct: bool
    generated_tokens: int
    ttft_s: float | None
    decode_tokens_per_s: float | None
    seconds: float
    ocr_cer: float | None = None  # a picture question: the character error rate of the text read from it
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of them, found in the prefix cache (the shared prefix; with warming, the document too)


def load_facts(path: Path = FACTS_FILE) -> list[dict]:
    """The questions of ``path``: facts (``answer_contains``) and refusals (``refusal`` + ``contact_any``)."""
    items = json.loads(path.read_text(encoding="utf-8"))
    for item in items:
        shape = {"refusal", "contact_any"} if item.get("refusal") else {"answer_contains"}
        if not {"question_en", "question_zh", "file"} | shape <= item.keys():
            raise ValueError(
                f"{path}: every question needs question_en, question_zh, file and either answer_contains or "
                f"refusal: true with contact_any; got {sorted(item)}"
            )
    return items


def kind_of(item: dict) -> str:
    return "refusal" if item.get("refusal") else "fact"


VARIANT_WEIGHTS = ("auto", "int4", "none", "fp8")
VARIANT_HEADS = ("fp8-head", "int4-head")


def parse_variant(text: str) -> tuple[str, str]:
    """``"int4+fp8-head"`` -> ("int4", "fp8"): the layers' quantization and the head's (``"none"``
    when not named); ValueError naming the choices otherwise (argparse shows it)."""
    weights, _, head = text.partition("+")
    if weights not in VARIANT_WEIGHTS or head not in ("", *VARIANT_HEADS):
        raise ValueError(f"unknown variant {text!r}: one of {', '.join(VARIANT_WEIGHTS)}, optionally with "
                         f"+{' or +'.join(VARIANT_HEADS)} (e.g. fp8+fp8-head)")
    return weights, head.removesuffix("-head") or "none"


def variant_argument(text: str) -> str:
    """argparse type for a variant: checked by :func:`parse_variant`, kept as written (its label)."""
    try:
        parse_variant(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return text


async def grade_variant(variant: str, items: list[dict], langs: list[str], max_tokens: int, model: Path | None,
                        progress: bool, pictures: tuple = (), warm: bool = False) -> list[Graded]:  # fmt: skip
    """Every question (and picture question) in every language through one Answerer built for
    ``variant`` (:func:`parse_variant`)."""
    from assistant.answerer import Answerer
    from assistant.config import AssistantConfig, EngineOptions
    from assistant.eval_images import character_error_rate, render
    from assistant.image_reading import ImageReading, image_prompt

    weights, head = parse_variant(variant)
    engine = EngineOptions(model=model, quantization=weights, lm_head_quantization=head)
    answerer = Answerer.create(AssistantConfig(max_tokens=max_tokens, engine=engine))
    out: list[Graded] = []
    try:
        if warm:
            start = time.perf_counter()
            count = await answerer.warm_documents()
            if progress:
                print(f"[{variant}] warmed {count} document prompts in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        for lang in langs:
            for i, item in enumerate(items):
                question = item[f"question_{lang}"]
                start = time.perf_counter()
                text, final = "", None
                async for delta in answerer.answer(question):
                    text += delta.text
                    final = delta if delta.finished else final
                expected = item["contact_any"] if item.get("refusal") else item["answer_contains"]
                graded = Graded(
                    variant, lang, kind_of(item), question, expected, text, grade(text, item, lang, source_text(item, lang)),
                    final.generated_tokens if final else 0, final.ttft_s if final else None,
                    final.decode_tokens_per_s if final else None, time.perf_counter() - start,
                )
                if final is not None:
                    graded.prompt_tokens, graded.cached_tokens = final.prompt_tokens, final.cached_tokens
                out.append(graded)
                if progress:
                    mark = "ok  " if graded.correct else "MISS"
                    print(f"[{variant} {lang} {i + 1}/{len(items)}] {mark} {question} -> {text.strip()[:90]!r}", file=sys.stderr, flush=True)
            reading = ImageReading()
            for picture in (p for p in pictures if p.lang == lang):
                read = reading.read(render(picture))
                cer = character_error_rate(picture.reference, read.text)
                item = {f"question_{lang}": picture.question, "answer_contains": list(picture.answer_contains), "file": picture.file,
                        "verdict": picture.verdict}  # fmt: skip
                start = time.perf_counter()
                text, final = "", None
                async for delta in answerer.answer(image_prompt([read], picture.question), gate=False):
                    text += delta.text
                    final = delta if delta.finished else final
                source = source_text(item, lang) + "\n" + picture.reference  # the picture's own numbers are stated too
                graded = Graded(
                    variant, lang, "image", picture.question, list(picture.answer_contains), text, grade(text, item, lang, source),
                    final.generated_tokens if final else 0, final.ttft_s if final else None,
                    final.decode_tokens_per_s if final else None, time.perf_counter() - start, round(cer, 4),
                )  # fmt: skip
                out.append(graded)
                if progress:
                    mark = "ok  " if graded.correct else "MISS"
                    print(f"[{variant} {lang} image {picture.name}: OCR CER {100 * cer:.1f}% in {read.read_ms:.0f} ms] {mark} "
                          f"{picture.question} -> {text.strip()[:90]!r}", file=sys.stderr, flush=True)  # fmt: skip
    finally:
        answerer.shutdown()
    return out


def summarize(graded: list[Graded]) -> list[dict]:
    """Per variant and language: facts right, refusals right, answer length, TTFT and decode rate."""
    rows = []
    for variant in dict.fromkeys(g.variant for g in graded):
        for lang in dict.fromkeys(g.lang for g in graded):
            part = [g for g in graded if g.variant == variant and g.lang == lang]
            if not part:
                continue
            facts = [g for g in part if g.kind == "fact"]
            refusals = [g for g in part if g.kind == "refusal"]
            images = [g for g in part if g.kind == "image"]
            rates = [g.decode_tokens_per_s for g in part if g.decode_tokens_per_s]
            ttfts = [g.ttft_s for g in part if g.ttft_s is not None]
            rows.append({
                "variant": variant, "lang": lang, "correct": sum(g.correct for g in facts), "questions": len(facts),
                "accuracy": sum(g.correct for g in facts) / len(facts) if facts else None,
                "refusals_correct": sum(g.correct for g in refusals), "refusals": len(refusals),
                "images_correct": sum(g.correct for g in images), "images": len(images),
                "ocr_cer_mean": statistics.mean(g.ocr_cer for g in images) if images else None,  # type: ignore[misc]
                "answer_tokens_mean": statistics.mean(g.generated_tokens for g in part),
                "ttft_ms_p50": 1e3 * statistics.median(ttfts) if ttfts else None,
                "decode_tok_s_p50": statistics.median(rates) if rates else None,
            })
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| variant | lang | facts correct | accuracy | refusals correct | answer tokens (mean) | TTFT p50 (ms) | decode tok/s p50 |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        accuracy = f"{100 * r['accuracy']:.0f}%" if r["accuracy"] is not None else "n/a"
        ttft = f"{r['ttft_ms_p50']:.0f}" if r["ttft_ms_p50"] is not None else "n/a"
        rate = f"{r['decode_tok_s_p50']:.1f}" if r["decode_tok_s_p50"] is not None else "n/a"
        lines.append(f"| {r['variant']} | {r['lang']} | {r['correct']}/{r['questions']} | {accuracy} | "
                     f"{r['refusals_correct']}/{r['refusals']} | {r['answer_tokens_mean']:.0f} | {ttft} | {rate} |")
    if any(r["images"] for r in rows):
        lines += ["", "| variant | lang | picture questions correct | OCR character error rate (mean) |", "|---|---|---|---|"]
        lines += [f"| {r['variant']} | {r['lang']} | {r['images_correct']}/{r['images']} | {100 * r['ocr_cer_mean']:.1f}% |"
                  for r in rows if r["images"]]  # fmt: skip
    return "\n".join(lines)


@dataclass
class GateVerdict:
    lang: str
    kind: str  # "fact" or "refusal"
    question: str
    refused: bool
    graded: bool  # whether the gate's decision is right; for a refused unanswerable question, whether its refusal passes grade()
    uncovered_share: float
    unknown: tuple[str, ...]
    text: str  # the refusal, or ""


def gate_verdicts(items: list[dict], langs: list[str], handbook: Path = HANDBOOK_DIR) -> list[GateVerdict]:
    """What the refusal gate, with the assistant's default settings, decides for every question in every language."""
    from assistant.config import RefusalConfig
    from assistant.docs import load_library
    from assistant.refusal import RefusalGate
    from assistant.retrieval import SectionIndex

    library = load_library(handbook)
    out = []
    for lang in langs:
        docs = library[lang]
        gate = RefusalGate(docs, SectionIndex(docs.sections), RefusalConfig())
        for item in items:
            question = item[f"question_{lang}"]
            evidence, refusal = gate.evidence(question), gate.refusal(question)
            if item.get("refusal"):
                right = refusal is not None and grade(refusal.text, item, lang, source_text(item, lang, handbook))
            else:
                right = refusal is None
            out.append(GateVerdict(lang, kind_of(item), question, refusal is not None, right, evidence.uncovered_share,
                                   evidence.unknown, refusal.text if refusal else ""))  # fmt: skip
    return out


def format_gate_table(verdicts: list[GateVerdict]) -> str:
    """Per language: unanswerable questions refused, of them graded right (the contact too), and facts refused wrongly."""
    lines = ["| lang | refusals caught | graded right (names the topic's contact) | false refusals (facts) |", "|---|---|---|---|"]
    for lang in dict.fromkeys(v.lang for v in verdicts):
        refusals = [v for v in verdicts if v.lang == lang and v.kind == "refusal"]
        facts = [v for v in verdicts if v.lang == lang and v.kind == "fact"]
        lines.append(f"| {lang} | {sum(v.refused for v in refusals)}/{len(refusals)} | {sum(v.graded for v in refusals)}/"
                     f"{len(refusals)} | {sum(v.refused for v in facts)}/{len(facts)} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m assistant.eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quantization", nargs="+", default=["int4", "none"], type=variant_argument, metavar="VARIANT",
                   help="engine variants to compare, in order: auto, int4, none or fp8, each optionally with +fp8-head or "
                        "+int4-head, the output head's own format (default: int4 none)")
    p.add_argument("--lang", nargs="+", default=["en", "zh"], choices=("en", "zh"))
    p.add_argument("--max-tokens", type=int, default=96, help="longest answer in tokens (default 96)")
    p.add_argument("--model", type=Path, help="the model to ask (default: the assistant's default LLM)")
    p.add_argument("--limit", type=int, help="only the first N questions")
    p.add_argument("--facts", type=Path, default=FACTS_FILE,
                   help="a JSON list of {question_en, question_zh, file, answer_contains} or {..., refusal: true, contact_any}")
    p.add_argument("--images", choices=("off", "with", "only"), default="off",
                   help="the picture questions (assistant/eval_images.py): off (default), with the text questions, or only them")
    p.add_argument("--warm-documents", action="store_true",
                   help="before the questions, compute each document's part of a question's prompt (Answerer.warm_documents)")
    p.add_argument("--gate-only", action="store_true",
                   help="no model: print whether the refusal gate refuses each question, and the refusals caught and false refusals")
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
    if a.gate_only:
        verdicts = gate_verdicts(facts, a.lang)
        for v in verdicts:
            print(f"{'ok   ' if v.graded else 'WRONG'} {v.lang} {v.kind:7} {'refused' if v.refused else 'asked  '} "
                  f"uncovered {v.uncovered_share:.2f} unknown {list(v.unknown)} {v.question} {v.text}")  # fmt: skip
        print(format_gate_table(verdicts))
        return 0
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    graded: list[Graded] = []
    pictures = () if a.images == "off" else PICTURES
    if a.images == "only":
        facts = []
    from engine.memory import release_device_memory

    for variant in a.quantization:
        graded += asyncio.run(grade_variant(variant, facts, a.lang, a.max_tokens, a.model, a.progress, pictures, a.warm_documents))
        release_device_memory()  # the next variant's engine sizes its KV cache from what is free
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
