"""The shared prompt prefix (system prompt + documents) and per-conversation prompts.

The prefix is tokenized once and its token ids are reused verbatim at the start of every
prompt, so the engine's prefix cache computes its KV once for all sessions. The conversation
that follows is rendered with the model's own chat template and tokenized separately; the
template's end-of-turn special token after the system message keeps the boundary clean.

Two modes, chosen from the context budget (the model's context minus room for the answer and
for the conversation):

- whole-context: all documents are in the prefix; every prompt is prefix + history + the last
  user message, which repeats the best-matching document (BM25, ``assistant.retrieval``) in
  front of the question: a small model reads the figures and form codes next to the question
  far better than 2k tokens back (Qwen2.5-Coder-1.5B named FIN-01 and HR-04 only so). A
  conversation's first question about a document gets the whole document (warmed ahead: the
  same tokens for every such question); a follow-up about a document the conversation does not
  carry yet gets only its best-matching section, since after the conversation nothing is warm and
  a whole document is ~290 tokens to prefill (6.8 s on the 2-core CPU with the 1.5B).
- retrieval: the documents do not fit. The prefix is the system prompt and a table of contents
  (still byte-stable, still cached for everyone); the sections that best match the question
  go into the last user message, in front of the question.

Either way the sections vary per question and come after the shared, cached prefix; the history
keeps each user message as the model saw it, sections included, so every earlier turn is cached. The
last user message ends with the answer's form (:class:`Labels`): short, the figure, the form code
or contact, and "the handbook does not say" + whom to ask when it does not.

History beyond the budget is dropped a whole turn at a time, oldest first; never the prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from assistant.amount_check import Wording, amount_note
from assistant.conversation import Message, oldest_first_cuts
from assistant.docs import DocumentError, DocumentSet, Section
from assistant.image_reading import picture_texts
from assistant.retrieval import SectionIndex
from engine.tokenizer import Tokenizer

WHOLE = "whole-context"
RETRIEVAL = "retrieval"
CONTENTS_SHARE = 4  # the table of contents may take at most 1/4 of the prompt limit


class PromptTooLong(ValueError):
    """The question alone does not fit the context after the prefix and the answer's room."""


@dataclass(frozen=True)
class ContextBudget:
    """How a model's context is shared out.

    max_model_len: the engine's context length; max_tokens: room kept for the answer;
    conversation_tokens: room kept for the question and history before the documents may take
    the rest (whole-context mode needs prefix + conversation_tokens + max_tokens to fit).
    """

    max_model_len: int
    max_tokens: int
    conversation_tokens: int

    @property
    def prompt_limit(self) -> int:
        """The most prompt tokens that still leave ``max_tokens`` to answer."""
        return self.max_model_len - self.max_tokens


@dataclass(frozen=True)
class Labels:
    """The few words the prompt itself says, in the handbook's language (with its punctuation)."""

    contents: str  # heads the table of contents
    sections: str  # heads the retrieved sections
    question: str  # precedes the question after them
    reminder: str  # the answer's form, before the question (shared by every question about a document)
    nudge: str  # the answer's form again in a few words, after the question: what the model reads last
    amount: Wording  # a picture's sum checked against the handbook's limit (assistant/amount_check.py)


LABELS_EN = Labels(
    "The handbook's documents and sections are listed below; the sections that answer a question are given with it.",
    "Handbook sections:",
    "Question: ",
    "Answer in one or two sentences with the exact figure, and the form code or the contact the handbook names.",
    "(Give the exact figure and the form code.)",
    Wording("Checked: the picture's amount, {amount}, is {comparison}.",
            'more than the {limit} of "{clause}": it cannot all be claimed, at most {limit}',
            'not more than the {limit} of "{clause}": it is within the limit'),
)
LABELS_ZH = Labels(
    "手册的文件和章节如下；与问题相关的章节随问题一起给出。",
    "手册相关章节：",
    "问题：",
    "请用一两句话回答，写出手册中的确切数字，以及手册写明的表格编号或联系人。",
    "（写出确切数字和表格编号。）",
    Wording("核对：图片中的金额{amount}{comparison}。", "高于“{clause}”中的{limit}：不能全部报销，最多报销{limit}",
            "不高于“{clause}”中的{limit}：在上限之内"),
)


@dataclass(frozen=True)
class PromptPrefix:
    system_text: str
    token_ids: tuple[int, ...]
    rendered: str
    docs_version: str


@dataclass(frozen=True)
class Prompt:
    """One request's prompt and how it was made."""

    token_ids: list[int]
    sections: tuple[Section, ...]  # the sections sent with the question (retrieval: best first; whole: the best document)
    dropped_turns: int  # oldest history turns left out to fit the context
    content: str = ""  # the last user message as sent (the conversation keeps it: Conversation.add)


class PromptBuilder:
    """Builds token ids of ``prefix + history + question`` for one tokenizer and document set.

    Without a ``budget`` the documents are always whole and history is never trimmed.
    """

    def __init__(
        self, tokenizer: Tokenizer, system_prompt: str, docs: DocumentSet, *, budget: ContextBudget | None = None, language: str = "en"
    ) -> None:
        self.tokenizer = tokenizer
        self.docs = docs
        self.budget = budget
        self.labels = LABELS_ZH if language == "zh" else LABELS_EN
        self.index = SectionIndex(docs.sections)
        # every line of the handbook: a picture's sum is checked against its rule wherever it is written
        self.lines = tuple(line for s in docs.sections for line in s.text.splitlines())
        whole = self._prefix(f"{system_prompt}\n\n{docs.render()}")
        if budget is None or len(whole.token_ids) + budget.conversation_tokens <= budget.prompt_limit:
            self.mode, self.prefix, self.section_budget = WHOLE, whole, 0
            return
        self.mode = RETRIEVAL
        contents = self._contents(docs.table_of_contents(), budget.prompt_limit // CONTENTS_SHARE)
        self.prefix = self._prefix(f"{system_prompt}\n\n{self.labels.contents}\n{contents}")
        self.section_budget = budget.prompt_limit - budget.conversation_tokens - len(self.prefix.token_ids)
        if self.section_budget <= 0:
            raise DocumentError(
                f"the context ({budget.max_model_len} tokens) cannot hold the system prompt and contents "
                f"({len(self.prefix.token_ids)} tokens), {budget.conversation_tokens} tokens of conversation "
                f"and a {budget.max_tokens}-token answer"
            )
        excerpts = [self._excerpt(s) for s in self.index.sections]
        counts = tokenizer.hf(excerpts, add_special_tokens=False)["input_ids"] if excerpts else []
        self._excerpt_tokens = {s: len(ids) for s, ids in zip(self.index.sections, counts)}

    def _prefix(self, system_text: str) -> PromptPrefix:
        rendered = self.tokenizer.render_chat([{"role": "system", "content": system_text}], add_generation_prompt=False)
        ids = tuple(self.tokenizer.hf(rendered, add_special_tokens=False)["input_ids"])
        return PromptPrefix(system_text, ids, rendered, self.docs.version)

    def _contents(self, lines: list[str], limit: int) -> str:
        """The table of contents, cut (deterministically) to about ``limit`` tokens."""
        lengths = self.tokenizer.hf(lines, add_special_tokens=False)["input_ids"]
        kept, used = [], 0
        for line, ids in zip(lines, lengths):
            if used + len(ids) + 1 > limit:
                kept.append(f"- … ({len(lines) - len(kept)} more documents)")
                break
            kept.append(line)
            used += len(ids) + 1
        return "\n".join(kept)

    @staticmethod
    def _excerpt(section: Section) -> str:
        return f"[{section.prompt_label}]\n{section.text}"

    def summary(self) -> str:
        """One line saying which mode is in use and what the prefix holds (for logs and the CLI)."""
        line = f"{self.mode} mode · {len(self.docs.documents)} documents · prefix {len(self.prefix.token_ids)} tokens"
        if self.mode == RETRIEVAL:
            line += f" · up to {self.section_budget} tokens of sections per question"
        return f"{line} · version {self.docs.version}"

    def select(self, question: str) -> tuple[Section, ...]:
        """Retrieval mode: the best-matching sections that fit the section budget, best first."""
        chosen, used = [], 0
        for hit in self.index.search(question):
            cost = self._excerpt_tokens[hit.section] + 2
            if used + cost <= self.section_budget:
                chosen.append(hit.section)
                used += cost
        return tuple(chosen)

    def best_section(self, question: str) -> tuple[Section, ...]:
        """Whole-context mode: the best-matching section (none if nothing matches)."""
        return tuple(hit.section for hit in self.index.search(question)[:1])

    def document_of(self, best: tuple[Section, ...]) -> tuple[Section, ...]:
        """Whole-context mode: every section of the document holding ``best`` (a :meth:`best_section`)."""
        return tuple(s for s in self.docs.sections if s.path == best[0].path) if best else ()

    def warm_prompts(self) -> list[list[int]]:
        """Whole-context mode: per document, the prompt of a question about it with the question left
        empty. Its full KV blocks up to the document's end are what every question about that
        document shares after the prefix (:meth:`prompt` repeats the document there), so
        computing them once ahead moves that prefill out of the first question's TTFT. Retrieval
        mode picks sections per question: nothing to warm ([])."""
        if self.mode != WHOLE:
            return []
        paths = dict.fromkeys(s.path for s in self.docs.sections)
        return [self._ids([], self._user_content("", [s for s in self.docs.sections if s.path == p])) for p in paths]

    def _user_content(self, question: str, sections: Sequence[Section]) -> str:
        """The last user message: the sections given with the question, the answer's form, the
        question, the answer's form again in a few words.

        The question comes late so that everything before it is the same for every question about
        a document: warmed once (:meth:`warm_prompts`), a question then prefills only its own words
        and the short nudge."""
        if not sections:
            return f"{self.labels.reminder}\n\n{self.labels.question}{question}\n{self.labels.nudge}"
        excerpts = "\n\n".join(self._excerpt(s) for s in sections)
        pictures = picture_texts(question)
        note = amount_note(pictures, question, self.lines, self.labels.amount) if pictures else ""
        return (f"{self.labels.sections}\n\n{excerpts}\n\n{self.labels.reminder}\n\n{self.labels.question}{question}\n"
                f"{note + chr(10) if note else ''}{self.labels.nudge}")

    def _follow_up(self, question: str) -> str:
        """The last user message when the conversation already carries the question's document: the question and the nudge."""
        return f"{self.labels.question}{question}\n{self.labels.nudge}"

    def _ids(self, history: list[Message], content: str) -> list[int]:
        messages = [{"role": "system", "content": self.prefix.system_text}, *history, {"role": "user", "content": content}]
        full = self.tokenizer.render_chat(messages, add_generation_prompt=True)
        if not full.startswith(self.prefix.rendered):
            raise ValueError("the chat template does not render the system message as a stable prefix")
        rest = full[len(self.prefix.rendered) :]
        return list(self.prefix.token_ids) + list(self.tokenizer.hf(rest, add_special_tokens=False)["input_ids"])

    def prompt(self, history: list[Message], question: str) -> Prompt:
        """The prompt for the next answer: prefix, as many recent turns as fit, (sections +) question.

        Whole-context mode: a document that a kept earlier turn already carries in front of its
        question is not repeated; the follow-up is then only the question and the nudge (its KV is
        all that is left to compute: the earlier turn, answer included, is in the prefix cache). A
        follow-up about another document gets that document's best-matching section only."""
        best = self.best_section(question) if self.mode == WHOLE else ()
        sections = self.select(question) if self.mode == RETRIEVAL else self.document_of(best)
        for kept, dropped in oldest_first_cuts(history):
            repeated = self.mode == WHOLE and bool(sections) and any(
                m["role"] == "user" and self._excerpt(sections[0]) in m["content"] for m in kept)
            given = () if repeated else best if self.mode == WHOLE and kept else sections
            content = self._follow_up(question) if repeated else self._user_content(question, given)
            ids = self._ids(kept, content)
            if self.budget is None or len(ids) <= self.budget.prompt_limit:
                return Prompt(ids, given, dropped, content)
        raise PromptTooLong(
            f"the question needs {len(ids) - len(self.prefix.token_ids)} tokens after the {len(self.prefix.token_ids)}-token "
            f"prefix; at most {self.budget.prompt_limit - len(self.prefix.token_ids)} fit"
        )

    def build(self, history: list[Message], question: str) -> list[int]:
        """Token ids for the next answer: the cached prefix, earlier turns, then the question."""
        return self.prompt(history, question).token_ids
