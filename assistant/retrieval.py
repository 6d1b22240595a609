"""Lexical retrieval over document sections (BM25): picks sections for a question and cites one.

Retrieval mode needs it to choose which sections follow the stable prefix when the documents do
not fit the context; both modes need it to name the section an answer came from (a small model
does not cite reliably, so the citation is decided here, deterministically).

Terms are lower-cased Latin words and numbers (English stop words dropped unless written as an
acronym: "IT" is the IT department, "it" a pronoun; a plural ``s`` folded) and, for Chinese,
overlapping character bigrams: Chinese has no spaces, and bigrams match words without a segmenter
or a dictionary. BM25 is the Okapi formula with a non-negative IDF.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from assistant.docs import Section

K1 = 1.2  # BM25 term-frequency saturation
B = 0.75  # BM25 length normalisation
DOCUMENT_WEIGHT = 0.5  # a section's score adds half its document's (see SectionIndex)
ANSWER_WEIGHT = 0.5  # in a citation, the answer's match counts half as much as the question's
TITLE_WEIGHT = 1.0  # a section adds this times the share of its document's title terms in the query

_TOKEN = re.compile(r"[A-Za-z0-9]+|[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+")
_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
STOP_WORDS = frozenset(
    [
        "a", "an", "and", "are", "as", "at", "be", "by", "can", "do", "does", "for", "from", "get", "how", "i",
        "if", "in", "is", "it", "its", "me", "my", "of", "on", "or", "our", "should", "the", "their", "there",
        "this", "to", "was", "we", "what", "when", "where", "which", "who", "why", "will", "with", "you", "your",
    ]
)


def terms(text: str) -> list[str]:
    """Search terms of ``text``: folded Latin words and numbers, CJK character bigrams."""
    out = []
    for token in _TOKEN.findall(unicodedata.normalize("NFKC", text)):
        if _CJK.match(token):
            out.extend([token] if len(token) == 1 else [token[i : i + 2] for i in range(len(token) - 1)])
            continue
        acronym = len(token) > 1 and token.isupper()
        token = token.lower()
        if acronym or token not in STOP_WORDS:
            out.append(token[:-1] if len(token) > 3 and token.endswith("s") and not token.endswith("ss") else token)
    return out


@dataclass(frozen=True)
class Citation:
    """The handbook section an answer is attributed to."""

    path: str
    heading: str

    def __str__(self) -> str:
        return f"{self.path} — {self.heading}" if self.heading else self.path


@dataclass(frozen=True)
class Hit:
    section: Section
    score: float


class BM25:
    """Okapi BM25 over a fixed list of texts."""

    def __init__(self, texts: Sequence[str]) -> None:
        counts = [Counter(terms(t)) for t in texts]
        self._lengths = [sum(c.values()) for c in counts]
        self._average = sum(self._lengths) / max(len(counts), 1) or 1.0
        self._postings: dict[str, list[tuple[int, int]]] = {}
        for i, c in enumerate(counts):
            for term, tf in c.items():
                self._postings.setdefault(term, []).append((i, tf))

    def scores(self, query: str) -> list[float]:
        """The score of every text for ``query`` (0 where no term matches)."""
        n = len(self._lengths)
        scores = [0.0] * n
        for term, qtf in Counter(terms(query)).items():
            postings = self._postings.get(term, ())
            idf = math.log(1 + (n - len(postings) + 0.5) / (len(postings) + 0.5))
            for i, tf in postings:
                norm = K1 * (1 - B + B * self._lengths[i] / self._average)
                scores[i] += qtf * idf * tf * (K1 + 1) / (tf + norm)
        return scores


class SectionIndex:
    """Ranks sections by their own BM25 match plus, at ``DOCUMENT_WEIGHT``, their document's, plus
    at ``TITLE_WEIGHT`` the share of their document's title terms that the query contains.

    A section is indexed with its document's title. The document's match is a prior: a short
    section that shares few words with the question still wins when its whole document is about
    the question's topic (measured on the bundled handbook: Chinese citations 15/17 -> 16/17). The
    title is a stronger one: "我每年有多少天年假？" names the annual-leave page's title (年假), yet
    shares more bigrams (每年, 年假 inside 每年假期) with the public-holidays page, and "What happens
    in my first week?" names most of "Onboarding: Your First Week" (17/17 and 17/17 with it).
    """

    def __init__(self, sections: Sequence[Section]) -> None:
        self.sections = tuple(sections)
        paths = list(dict.fromkeys(s.path for s in self.sections))
        self._document_of = [paths.index(s.path) for s in self.sections]
        self._sections = BM25([f"{s.title}\n{s.text}" for s in self.sections])
        self._documents = BM25(["\n".join(s.text for s in self.sections if s.path == p) for p in paths])
        titles = {s.path: s.title for s in self.sections}
        self._title_terms = [frozenset(terms(titles[p])) for p in paths]

    def scores(self, text: str) -> list[float]:
        """Every section's score for the query ``text``, on a scale where the best section alone is 1."""
        own = _scaled(self._sections.scores(text))
        documents = _scaled(self._documents.scores(text))
        query = set(terms(text))
        named = [len(t & query) / len(t) if t else 0.0 for t in self._title_terms]
        return [s + DOCUMENT_WEIGHT * documents[d] + TITLE_WEIGHT * named[d] for s, d in zip(own, self._document_of)]

    def search(self, query: str) -> list[Hit]:
        """Sections that match ``query`` at all, best first (ties keep document order)."""
        ranked = sorted(enumerate(self.scores(query)), key=lambda item: -item[1])
        return [Hit(self.sections[i], score) for i, score in ranked if score > 0]

    def cite(self, question: str, answer: str = "") -> Citation | None:
        """The section that best matches the question, with the answer's match as a lesser vote."""
        combined = self.scores(question)
        if answer.strip():
            combined = [q + ANSWER_WEIGHT * a for q, a in zip(combined, self.scores(answer))]
        best = max(range(len(combined)), key=combined.__getitem__, default=None)
        if best is None or combined[best] <= 0:
            return None
        return Citation(self.sections[best].path, self.sections[best].heading)


def _scaled(scores: list[float]) -> list[float]:
    """Scores divided by the largest, so that different queries and indexes weigh on one scale."""
    top = max(scores, default=0.0)
    return [s / top for s in scores] if top > 0 else scores
