"""Word errors of a transcript: the edit distance in words to the reference text.

Both texts are lower-cased, hyphens split words and other punctuation is dropped, so "HR-01."
and "hr 01" agree. Used by the ASR tests and the voice benchmark.
"""

from __future__ import annotations

import re


def words(text: str) -> list[str]:
    return re.sub(r"[^\w' ]+", " ", text.lower().replace("-", " ")).split()


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """(edit distance in words, reference length in words)."""
    ref, hyp = words(reference), words(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1], len(ref)


def word_error_rate(reference: str, hypothesis: str) -> float:
    errors, n = word_errors(reference, hypothesis)
    return errors / max(1, n)
