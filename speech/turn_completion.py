"""Turn completion: does a transcript read as a finished utterance? (pure functions)

A speculative endpoint (a short pause) may be confirmed at once, without waiting for the VAD
hangover, when the words so far end like a finished sentence. Whisper punctuates what it hears,
so the rule reads its punctuation:

- the text ends in sentence-final punctuation (``. ? !`` or ``。？！``), not a comma, colon or an
  ellipsis (a speaker trailing off);
- the last word is not one that needs a continuation (a conjunction, preposition, article,
  auxiliary: "and", "of", "the", "to", ...; 和, 的, 因为, ...);
- English: an utterance that opens like a question (how, what, do, can, ...) ends in "?"; Whisper
  often closes a fragment such as "How many days of annual leave" with a period, rarely with "?".

Anything else is incomplete: the pipeline then waits for the hangover, as fixed endpointing does.
The language is the transcript's ("en", "zh", ...); other languages use the English rule when the
text has no Han characters and the Chinese one when it has.
"""

from __future__ import annotations

import re

FINAL_PUNCTUATION = ".?!。？！"
TRAILING_OFF = ("...", "…", "。。")
EN_DANGLING = frozenset(
    """a an the and or but nor so because if unless although though than that which who whose whom when where
    while whether as of to for with without in on at from by about into onto over under between after before
    during through per via like my your our their his her its this these those some any every each no is are am
    was were be been do does did can could will would should shall may might must have has had i we you they he
    she it there how what why please um uh er""".split()
)
EN_QUESTION_OPENERS = frozenset(
    """how what when where why who whom whose which can could do does did is are am was were will would should
    shall may might have has had""".split()
)
ZH_DANGLING = ("和", "与", "及", "或", "或者", "还是", "但", "但是", "而", "而且", "并且", "因为", "所以", "如果", "虽然",
               "的", "地", "得", "在", "把", "被", "对", "从", "向", "给", "跟", "比", "就", "是", "要", "呃", "嗯", "那个")  # fmt: skip
_WORD = re.compile(r"[A-Za-z']+")
_HAN = re.compile(r"[\u4e00-\u9fff]")


def is_complete(text: str, language: str) -> bool:
    """True if ``text`` (a transcript in ``language``) reads as a finished utterance."""
    text = text.strip().strip("\"'”’」』)）")
    if not text or text[-1] not in FINAL_PUNCTUATION or text.endswith(TRAILING_OFF):
        return False
    body = text.rstrip(FINAL_PUNCTUATION).rstrip()
    if not body:
        return False
    chinese = language.startswith("zh") or (not language.startswith("en") and _HAN.search(body) is not None)
    return _zh_complete(body) if chinese else _en_complete(body, text[-1])


def _en_complete(body: str, mark: str) -> bool:
    words = [w.lower() for w in _WORD.findall(body)]
    if not words or words[-1] in EN_DANGLING or body[-1] in ",;:-":
        return False
    return mark in "?？" or words[0] not in EN_QUESTION_OPENERS


def _zh_complete(body: str) -> bool:
    return body[-1] not in "，,、；;：:" and not body.endswith(ZH_DANGLING)


__all__ = ["is_complete"]
