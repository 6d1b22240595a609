"""The amount on a user's picture (a receipt) checked against the handbook's money limits.

Comparing numbers is where a small model fails: Qwen2.5-Coder-1.5B, given a GBP 214.00 London
hotel receipt and the line "Hotels up to £150 per night, or up to £200 per night in London.",
answered that it was within the limit. So the assistant compares them itself and states the
result beside the question ("the picture's amount, GBP 214.00, is more than the £200 of ..."); the
model still picks the rule that applies and writes the answer.

- The picture's amount is the largest sum of money its text states (a receipt's total).
- The rule line is the line of the given handbook sections that caps a sum of money ("up to",
  "不超过") and shares
  the most words with the picture and the question (English words of 4+ letters, a plural's "s"
  dropped; Chinese: pairs of characters). Ties and no shared word: no check.
- Each clause of that line that caps one sum ("Hotels up to £150 per night" / "or up to £200 per
  night in London") is one comparison.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

# A sum of money as the handbook and receipts write it: £150, GBP 187.40, 187.40 英镑, 150英镑
MONEY = re.compile(r"(?:£|GBP\s?)(\d[\d,]*(?:\.\d+)?)|(\d[\d,]*(?:\.\d+)?)\s?(?:英镑|GBP\b)")
CLAUSE_BREAK = re.compile(r"[,;，；。]")
# a clause that caps a sum ("up to £150"), not a threshold for something else ("a receipt for every item over £10")
CAP = re.compile(r"\bup to\b|\bat most\b|\bmaximum\b|\blimit\b|不超过|最高|上限|至多", re.IGNORECASE)
WORD = re.compile(r"[A-Za-z]{4,}")
CJK_RUN = re.compile(r"[\u4e00-\u9fff]+")


@dataclass(frozen=True)
class Limit:
    """One clause of a handbook line and the sum it states."""

    clause: str
    amount: float
    written: str  # the sum as the handbook writes it ("£150", "150英镑")


def sums(text: str) -> list[tuple[float, str]]:
    """Every sum of money in ``text``: (value, as written)."""
    return [(float((m.group(1) or m.group(2)).replace(",", "")), m.group(0).strip()) for m in MONEY.finditer(text)]


def terms(text: str) -> set[str]:
    """Words to match a rule line by: English words of 4+ letters (lower case, a final "s" dropped)
    and every pair of adjacent Chinese characters."""
    words = {w.lower().removesuffix("s") for w in WORD.findall(text)}
    pairs = {run[i : i + 2] for run in CJK_RUN.findall(text) for i in range(len(run) - 1)}
    return words | pairs


def rule_line(lines: Sequence[str], context: str) -> str | None:
    """The line that states a sum and shares the most :func:`terms` with ``context`` (None on a
    tie at the top or when none shares a term)."""
    wanted = terms(context)
    scored = sorted(((len(terms(MONEY.sub(" ", line)) & wanted), line) for line in lines if limits(line)), reverse=True)
    if not scored or scored[0][0] == 0 or (len(scored) > 1 and scored[1][0] == scored[0][0]):
        return None
    return scored[0][1]


def limits(line: str) -> list[Limit]:
    """The clauses of ``line`` that cap exactly one sum."""
    out = []
    for clause in CLAUSE_BREAK.split(line):
        found = sums(clause)
        if len(found) == 1 and CAP.search(clause):
            out.append(Limit(clause.strip(" -*.\t"), found[0][0], found[0][1]))
    return out


@dataclass(frozen=True)
class Wording:
    """How a check is said in one language: ``{amount}`` and the joined ``{comparisons}``."""

    sentence: str
    over: str  # with {limit} (as written) and {clause}
    within: str
    joiner: str


def amount_note(pictures: Sequence[str], question: str, handbook_lines: Sequence[str], wording: Wording) -> str:
    """The check to state beside the question, or "" when there is nothing to check (no sum in
    the pictures, or no clear rule line)."""
    found = [s for text in pictures for s in sums(text)]
    line = rule_line(handbook_lines, " ".join([*pictures, question])) if found else None
    checks = limits(line) if line else []
    if not checks:
        return ""
    value, written = max(found)
    parts = [(wording.over if value > limit.amount else wording.within).format(limit=limit.written, clause=limit.clause) for limit in checks]
    return wording.sentence.format(amount=written, comparisons=wording.joiner.join(parts))


__all__ = ["Limit", "Wording", "amount_note", "limits", "rule_line", "sums", "terms"]
