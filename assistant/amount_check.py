"""The amount on a user's picture (a receipt) checked against the handbook's money limits.

Comparing numbers is where a small model fails: Qwen2.5-Coder-1.5B, given a GBP 214.00 London
hotel receipt and the line "Hotels up to £150 per night, or up to £200 per night in London.",
answered that it was within the limit. So the assistant compares them itself and states the
result and what follows from it beside the question ("the picture's amount, GBP 187.40, is more
than the £150 of "Hotels up to £150 per night": it cannot all be claimed, at most £150"); the
model writes the answer.

- Only when the question asks about money (claiming, a limit, how much) and a picture states a
  sum: its amount is the largest sum of money its text states (a receipt's total).
- The rule line is the line of the whole handbook (of the question's language) that caps a sum
  of money ("up to", "不超过") and shares the most words with the picture and the question, each
  word weighted by how rare it is in the handbook (English words of 4+ letters, a plural's "s"
  dropped; Chinese: pairs of characters), so "meal" outweighs "claim". Ties and no shared word:
  no check.
- A line may cap several sums, a rule and its exceptions ("Hotels up to £150 per night, or up to
  £200 per night in London"). The clause checked is the last one whose own words (those no other
  clause of the line has: "london") the picture shows, else the first: a Manchester receipt is
  checked against £150, a London one against £200.
"""

from __future__ import annotations

import math
import re
from collections import Counter
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


MONEY_TERMS = frozenset({"claim", "claimed", "limit", "much", "cover", "covered", "reimburse", "reimbursed", "reimbursement", "spend",
                         "allowance", "报销", "上限", "限额", "少钱"})
"""Terms (as :func:`terms` makes them) that make a question one about money (whether or how much
can be claimed, a limit; not "within how many days") and that say nothing of which rule it is about."""


def rule_line(lines: Sequence[str], question: str, picture: str = "") -> str | None:
    """The line that caps a sum and best matches the question and the picture: the :func:`terms`
    it shares, each weighted by its rarity among ``lines`` (BM25's IDF), the question's twice (the
    user's words say what is asked; a receipt's print has noise: "Card payment approved"); words
    that only say the question is about money ("claim", "limit") do not count. None on a tie at
    the top or when none shares a term."""
    asked = terms(question) - MONEY_TERMS
    shown = terms(picture) - MONEY_TERMS - asked
    line_terms = [terms(MONEY.sub(" ", line)) for line in lines]
    df = Counter(t for ts in line_terms for t in ts)
    n = len(lines)

    def idf(shared: set[str]) -> float:
        return sum(math.log(1 + (n - df[t] + 0.5) / (df[t] + 0.5)) for t in shared)

    scored = sorted(((round(2 * idf(ts & asked) + idf(ts & shown), 9), line) for line, ts in zip(lines, line_terms) if limits(line)),
                    reverse=True)
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


def applicable(checks: Sequence[Limit], picture: str) -> Limit:
    """The clause that applies to ``picture``: the last whose own terms (no other clause of the
    line has them) the picture shows, else the first (the rule before its exceptions)."""
    shown = terms(picture)
    chosen = checks[0]
    for i, limit in enumerate(checks[1:], 1):
        others = set().union(*(terms(MONEY.sub(" ", c.clause)) for j, c in enumerate(checks) if j != i))
        if (terms(MONEY.sub(" ", limit.clause)) - others) & shown:
            chosen = limit
    return chosen


@dataclass(frozen=True)
class Wording:
    """How a check is said in one language: ``{amount}``, then ``over`` or ``within`` with
    ``{limit}`` (as the handbook writes it) and ``{clause}``."""

    sentence: str
    over: str
    within: str


def amount_note(pictures: Sequence[str], question: str, handbook_lines: Sequence[str], wording: Wording) -> str:
    """The check to state beside the question, or "" when there is nothing to check (a question
    not about money, no sum in the pictures, or no clear rule line)."""
    found = [s for text in pictures for s in sums(text)]
    line = rule_line(handbook_lines, question, " ".join(pictures)) if found and terms(question) & MONEY_TERMS else None
    checks = limits(line) if line else []
    if not checks:
        return ""
    value, written = max(found)
    limit = applicable(checks, " ".join(pictures))
    comparison = (wording.over if value > limit.amount else wording.within).format(limit=limit.written, clause=limit.clause)
    return wording.sentence.format(amount=written, comparison=comparison)


__all__ = ["Limit", "Wording", "amount_note", "applicable", "limits", "rule_line", "sums", "terms"]
