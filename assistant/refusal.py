"""The refusal gate: decides, before the model is asked, that the handbook does not answer a question.

A small model asked a question its documents do not answer invents an answer (Qwen2.5 1.5B gave
"the handbook does not say" to 1 of 8 such questions in English and 3 of 8 in Chinese), and a
firmer instruction to refuse cost it the facts. So the decision is taken here, from retrieval
evidence, and for a refused question the model is not called at all.

The evidence is the question's content words. Question words ("how many", "minimum", "多少",
"怎么", numbers with their unit), conversation ("hello", "thanks", "谢谢") and common function
words and verbs ("not", "use"): :data:`FUNCTION_WORDS_EN`, :data:`FUNCTION_WORDS_ZH`, are not
content: they ask for a figure or keep a conversation going, they do not name a topic; a turn
made only of them ("Hello?") is left to the model. A question is refused when

- some of its content words appear nowhere in the handbook of its language, and
- the words that its best-matching document (BM25, :class:`~assistant.retrieval.SectionIndex`)
  lacks, those and any others, carry at least ``RefusalConfig.uncovered_share`` of its weight,
  each word weighing its inverse section frequency (BM25's IDF).

"bereavement leave" is refused: ``leave`` is in most sections and weighs little next to the
unknown "bereavement". "How many weeks of paid leave does a partner get when a baby is born?"
is answered: "baby" and "born" are unknown, but the parental-leave page holds the rare
"partner" and the rest (0.52 of the weight outside it, under the default 0.55). A question all
of whose words the handbook has is never refused, however they are spread over its pages.
"Unknown" is relative to the handbook: to a one-page folder most words are, and a follow-up such
as "Where do I submit it?" is refused there (``RefusalConfig.enabled`` turns the gate off).

- English (and Latin words in any question): :func:`assistant.retrieval.terms`, compared by a
  crude stem (``submitting`` ~ ``submit``); one-letter words ("What's" -> ``s``) are not content.
- Chinese has no spaces: a run of it is cut, left to right, into the longest substrings (two
  characters or more) that the handbook holds; what lies between them, function words cut out,
  is unknown where two characters or more remain together ("丧假"). A lone character is usually
  a measure word or a particle and is not judged.

The refusal names a contact from the handbook itself: its contacts document is the one most of
whose sections give an e-mail address (the bundled "Who to Contact"). The contact is the section
of it that best matches the question, with the title and heading of the question's best-matching
section when that section's document holds two or more of the question's words (the VPN question
is about working from home: its best section is the home office allowance, on the equipment page,
so the IT Helpdesk). A Chinese unit counts as words by its length, two characters a word: "家办公"
(of 居家办公, "home office") is two words, as "home" and "office" are in English. With no match, the document's first
section (the bundled Human Resources, for "leave, pay, contracts and PeopleHub questions", the
broadest it lists). That section is also the refusal's citation: where to look the contact up.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from assistant.config import RefusalConfig
from assistant.docs import DocumentSet, Section, detect_language
from assistant.retrieval import Citation, SectionIndex, terms

EMAIL = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")
_CJK_RUN = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+")
_SUFFIX = re.compile(r"(?:ing|ed|es|s)$")
MIN_UNKNOWN_CJK = 2  # uncovered Chinese characters in a row that count as an unknown word
MIN_TOPIC_WORDS = 2  # words of a question its best document must hold for the refusal to name that topic's contact
CJK_CHARS_PER_WORD = 2  # most Chinese words are two characters: a held substring of n counts as ceil(n / 2) words

# Words that ask for a figure, a time or a step, or that converse ("hello", "thanks", "again"), rather
# than name a topic (after retrieval's stop words). A turn made only of them is left to the model.
FUNCTION_WORDS_EN = frozenset(
    "about after allowed also am any anything before could deadline did during each far fill get got had has have "
    "into just long length limit many may maximum might minimum most much must need next now often out over per "
    "quick quickly shall soon than then there these those up what whom would "
    "one two three four five six seven eight nine ten once twice "
    "hello hi hey thank thanks bye goodbye please sorry ok okay yes no again repeat mean say said "
    "use used using make want know like go not only yet here very still already some all more less other own same so too".split()
)
FUNCTION_WORDS_ZH = (
    "什么时候", "多长时间", "为什么", "怎么样", "怎么办", "怎么", "怎样", "什么", "哪里", "哪儿", "哪个", "哪些", "哪张",
    "哪", "多长", "多久", "多大", "是否", "吗", "呢", "吧", "啊", "可以", "能否", "能", "需要", "应该",
    "该", "要", "我们", "我的", "我", "您", "你", "的", "了", "是", "有", "在", "把", "被", "到", "从", "第几", "后", "时",
    "内", "最多", "至少", "上限", "截止", "开始", "一下",
    "你好", "您好", "谢谢", "再见", "好的", "请", "再说一遍", "再说", "重复", "一遍",
)
# How many (of a unit), or a number of a unit: "几天", "多少个", "两周", "一次" (the unit is part of the question).
_COUNT_ZH = r"(?:几|多少|[一二两三四五六七八九十百\d]+)(?:小时|分钟|[天周月年个位次张])?"
_FUNCTION_ZH = re.compile("|".join([_COUNT_ZH, *map(re.escape, sorted(FUNCTION_WORDS_ZH, key=len, reverse=True))]))

REFUSAL_EN = "The handbook does not say. Please ask {name}: {email}."
REFUSAL_ZH = "手册中没有写这一点。请咨询{name}：{email}。"
REFUSAL_NO_CONTACT = {"en": "The handbook does not say.", "zh": "手册中没有写这一点。"}


@dataclass(frozen=True)
class Evidence:
    """What the gate saw in a question: its content units, those the handbook lacks, their weight."""

    units: tuple[str, ...]  # the question's content units (English stems, Chinese substrings and runs)
    unknown: tuple[str, ...]  # of them, those found nowhere in the handbook
    covered: tuple[str, ...]  # of them, those the question's best-matching document holds
    uncovered_share: float  # the share of the units' IDF weight that the best-matching document lacks (0: no units)
    best: Section | None  # the question's best-matching section (None: no match)


@dataclass(frozen=True)
class Refusal:
    """The answer given instead of the model's: the text, and the contact's section as its citation."""

    text: str
    citation: Citation | None


class RefusalGate:
    """Per handbook (one language's documents): says which questions it does not answer, and the refusal."""

    def __init__(self, docs: DocumentSet, index: SectionIndex, config: RefusalConfig) -> None:
        self.config = config
        self.index = index
        self._texts = [f"{s.title}\n{s.text}" for s in docs.sections]
        self._text = "\n".join(self._texts)
        self._term_sets = [frozenset(_stem(t) for t in terms(text)) for text in self._texts]
        self._handbook = (self._text, frozenset().union(*self._term_sets))  # as _contains looks a unit up
        self._documents = {d.path: _document(f"{d.title}\n{d.text}") for d in docs.documents}
        self.contacts = _contact_sections(docs)
        self._contact_index = SectionIndex(self.contacts)

    def evidence(self, question: str) -> Evidence:
        """The question's content units, those the handbook lacks, and the share of the question's
        weight that its best-matching document lacks (see the module's doc)."""
        units: list[str] = []
        latin = [t for t in terms(_CJK_RUN.sub(" ", question)) if len(t) > 1 and t not in FUNCTION_WORDS_EN]
        units += [_stem(t) for t in latin]
        for run in _CJK_RUN.findall(question):
            units += self._cover(run)
        units = list(dict.fromkeys(units))
        unknown = [u for u in units if not _contains(self._handbook, u)]
        hits = self.index.search(question)[:1]
        best = hits[0].section if hits else None
        document = self._documents.get(best.path) if best is not None else None
        covered = [u for u in units if document is not None and _contains(document, u)]
        weights = {u: self._idf(u) for u in units}
        total = sum(weights.values())
        outside = total - sum(weights[u] for u in covered)
        return Evidence(tuple(units), tuple(unknown), tuple(covered), outside / total if total else 0.0, best)

    def refusal(self, question: str) -> Refusal | None:
        """The refusal to give instead of asking the model, or None when the model should answer
        (or the gate is off): the question has words the handbook lacks, and with the words its
        best-matching document lacks they carry at least the configured share of its weight."""
        if not self.config.enabled:
            return None
        evidence = self.evidence(question)
        if not evidence.unknown or evidence.uncovered_share < self.config.uncovered_share:
            return None
        lang = detect_language(question)
        contact = self.contact_for(question, evidence)
        if contact is None:
            return Refusal(REFUSAL_NO_CONTACT[lang], None)
        email = EMAIL.search(contact.text)
        template = REFUSAL_ZH if lang == "zh" else REFUSAL_EN
        text = template.format(name=contact.heading, email=email.group(0) if email else "")
        return Refusal(text, Citation(contact.path, contact.heading))

    def contact_for(self, question: str, evidence: Evidence) -> Section | None:
        """The contact section to name (None: the handbook has none): the one best matching the
        question, with the title and heading of its best-matching section when that section's
        document holds ``MIN_TOPIC_WORDS`` of its words (one shared word, "office", is no topic);
        else, or with no match, the contacts document's first."""
        if not self.contacts:
            return None
        topic = evidence.best if sum(map(_words, evidence.covered)) >= MIN_TOPIC_WORDS else None
        topic = topic if topic is not None and topic.path != self.contacts[0].path else None
        scores = self._contact_index.scores(question + (f"\n{topic.title}\n{topic.heading}" if topic else ""))
        return self.contacts[max(range(len(scores)), key=scores.__getitem__)]  # no match (all equal): the first

    def _cover(self, run: str) -> list[str]:
        """A run of Chinese as the longest handbook substrings, left to right, and the gaps between
        them; function words are cut out of the gaps, and substrings made only of them are dropped.
        A gap piece counts from ``MIN_UNKNOWN_CJK`` characters."""
        units, gap = [], ""
        for i, j in self._longest(run):
            if j - i < 2:
                gap += run[i]
                continue
            units += _pieces(gap)
            gap = ""
            units += [] if not _FUNCTION_ZH.sub("", run[i:j]) else [run[i:j]]
        return units + _pieces(gap)

    def _longest(self, run: str) -> list[tuple[int, int]]:
        """``run`` cut into spans: each the longest substring from its start that the handbook holds, or one character."""
        spans, i = [], 0
        while i < len(run):
            j = i + 1
            while j < len(run) and run[i : j + 1] in self._text:
                j += 1
            j = j if j - i >= 2 else i + 1
            spans.append((i, j))
            i = j
        return spans

    def _idf(self, unit: str) -> float:
        """BM25's IDF of a unit (a stem or a Chinese substring) over the handbook's sections."""
        if _CJK_RUN.fullmatch(unit):
            df = sum(unit in t for t in self._texts)
        else:
            df = sum(unit in t for t in self._term_sets)
        n = len(self._texts)
        return math.log(1 + (n - df + 0.5) / (df + 0.5))


def _words(unit: str) -> int:
    """How many words a content unit counts as: an English stem one, a Chinese substring one per two characters."""
    return -(-len(unit) // CJK_CHARS_PER_WORD) if _CJK_RUN.fullmatch(unit) else 1


def _pieces(gap: str) -> list[str]:
    """The parts of an uncovered gap left between its function words, of ``MIN_UNKNOWN_CJK`` characters or more."""
    return [p for p in _FUNCTION_ZH.split(gap) if len(p) >= MIN_UNKNOWN_CJK]


def _document(text: str) -> tuple[str, frozenset[str]]:
    """A document as the gate looks it up: its text (for Chinese substrings) and its stems."""
    return text, frozenset(_stem(t) for t in terms(text))


def _contains(document: tuple[str, frozenset[str]], unit: str) -> bool:
    """Whether a document, or the whole handbook (its text, its stems), holds a unit."""
    text, stems = document
    return unit in text if _CJK_RUN.fullmatch(unit) else unit in stems


def _stem(term: str) -> str:
    """A crude English stem, enough to match inflections: submitting ~ submit, approved ~ approve."""
    suffix = _SUFFIX.search(term)
    stem = term[: suffix.start()] if suffix and suffix.start() >= 3 else term
    stem = stem[:-1] if len(stem) > 3 and stem[-1] == stem[-2] else stem  # submitt -> submit
    return stem[:-1] if len(stem) > 3 and stem.endswith("e") else stem


def _contact_sections(docs: DocumentSet) -> tuple[Section, ...]:
    """The sections with an e-mail address of the document most of whose sections give one (none: ())."""
    best: tuple[Section, ...] = ()
    for d in docs.documents:
        with_email = tuple(s for s in d.sections if EMAIL.search(s.text))
        if len(with_email) * 2 > len(d.sections) and len(with_email) > len(best):
            best = with_email
    return best
