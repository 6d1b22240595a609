"""Cut a stream of LLM text deltas into pieces a TTS can speak, as early as sounds natural.

Two stages, both streaming: ``MarkdownStripper`` removes markup (emphasis, inline code, headings,
bullets, quotes, code fences, links -> their text), then ``Chunker`` cuts the clean text at
sentence ends, line breaks and (once a piece is ``min_chars`` long) clause punctuation, English
or Chinese (。！？，；：、). It never cuts inside a number ("3.5", "1,250", "10:30") or after an
abbreviation ("e.g.", "Dr.", "U.S.") or a list number ("1."); a piece longer than ``max_chars``
(``first_max_chars`` for an answer's first piece, so that first audio comes early) is cut at its
last space. Each stage decides only once it has seen enough of the text, so the pieces do not
depend on how the text was split into deltas, and joined they give the clean text.
"""

from __future__ import annotations

import re

from speech.config import ChunkerConfig

_CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")
_SPEAKABLE = re.compile(r"[^\W_]")  # a letter, digit or CJK character
_LINE_MARKER = re.compile(r"[ \t]*(?:#{1,6}[ \t]+|[-*+][ \t]+|>[ \t]*)")
_LINE_MARKER_PREFIX = re.compile(r"[ \t]*(?:#{1,6}|[-*+]|>|`{1,2})?")  # could still become one
_FENCE = re.compile(r"[ \t]*```[^\n]*(?:\n|$)")
_LINK = re.compile(r"!?\[([^\]\n]*)\]\(([^)\n]*)\)")
_LINK_PREFIX = re.compile(r"!?(?:\[[^\]\n]*(?:\](?:\([^)\n]*)?)?)?")
_MAX_LINK = 500  # longer "[...](..." runs are taken as plain text

SENTENCE_END = ".!?…"
CJK_SENTENCE_END = "。！？"
CLAUSE = ",;:"
CJK_CLAUSE = "，；：、"
CLOSERS = "\"')]}”’」』）》"
ABBREVIATIONS = frozenset(
    """mr. mrs. ms. dr. prof. sr. jr. st. mt. vs. e.g. i.e. cf. approx. no. nos. fig. dept.
    jan. feb. mar. apr. jun. jul. aug. sep. sept. oct. nov. dec. p. pp. vol. ca. inc. ltd. co.
    corp. est. min. max. avg. ref. tel.""".split()
)
_ACRONYM = re.compile(r"(?:[A-Za-z]\.){2,}|[A-Z]\.")  # "U.S.", "e.g.", an initial "J."
_LIST_NUMBER = re.compile(r"\d+\.")


def weight(text: str, config: ChunkerConfig) -> int:
    """Length in Latin-character equivalents (a CJK character counts ``config.cjk_weight``)."""
    return len(text) + (config.cjk_weight - 1) * len(_CJK.findall(text))


class MarkdownStripper:
    """Streaming markdown removal: ``push(delta)`` returns the clean text that is certain so far."""

    def __init__(self) -> None:
        self._pending = ""
        self._line_start = True
        self._previous = ""  # the last raw character consumed

    def push(self, delta: str) -> str:
        self._pending += delta
        return self._drain(final=False)

    def flush(self) -> str:
        return self._drain(final=True)

    def _drain(self, final: bool) -> str:
        out: list[str] = []
        text = self._pending
        i = 0
        while i < len(text):
            if self._line_start:
                rest = text[i:]
                fence = _FENCE.match(rest)
                if fence and (fence.group().endswith("\n") or final):
                    i += fence.end()  # the whole fence line goes
                    continue
                partial = _LINE_MARKER_PREFIX.fullmatch(rest)
                marker = _LINE_MARKER.match(rest)
                if not final and (partial or fence or (marker and marker.end() == len(rest))):
                    break  # a line marker may still be forming
                self._line_start = False
                if marker:
                    i += marker.end()
                    self._previous = " "
                continue
            ch = text[i]
            nxt = text[i + 1] if i + 1 < len(text) else None
            if nxt is None and not final and ch in "_~!":
                break  # these depend on the next character
            if ch == "[" or (ch == "!" and nxt == "["):
                link = _LINK.match(text, i)
                if link:
                    text = text[:i] + link.group(1) + text[link.end() :]
                    self._previous = ch
                    continue
                if not final and _LINK_PREFIX.fullmatch(text, i) and len(text) - i < _MAX_LINK:
                    break  # the link may still close
            if ch == "\n":
                self._line_start = True
                out.append(ch)
            elif ch in "*`":
                pass
            elif ch == "~" and nxt == "~":
                i += 1
            elif ch == "_" and not (self._previous.isalnum() and nxt is not None and nxt.isalnum()):
                pass  # emphasis underscore; "snake_case" keeps its underscore
            else:
                out.append(ch)
            self._previous = ch
            i += 1
        self._pending = text[i:]
        return "".join(out)


def strip_markdown(text: str) -> str:
    """The text without markdown markup (what the chunker's pieces join up to)."""
    stripper = MarkdownStripper()
    return stripper.push(text) + stripper.flush()


class Chunker:
    """Streaming text -> speakable pieces: ``push(delta)`` returns the pieces completed so far."""

    def __init__(self, config: ChunkerConfig | None = None) -> None:
        self.config = config or ChunkerConfig()
        self._stripper = MarkdownStripper()
        self._buffer = ""
        self._line_start = True  # the buffer begins at the start of a line
        self._limit = self.config.first_limit  # max_chars once the first piece is out

    def push(self, delta: str) -> list[str]:
        self._buffer += self._stripper.push(delta)
        return self._cut(final=False)

    def flush(self) -> list[str]:
        """The remaining pieces at the end of the stream (the chunker is then empty)."""
        self._buffer += self._stripper.flush()
        pieces = self._cut(final=True)
        if self._buffer.strip():
            pieces.append(self._buffer)
        self._buffer = ""
        self._line_start = True
        self._limit = self.config.first_limit
        return pieces

    def _cut(self, final: bool) -> list[str]:
        pieces = []
        while (cut := self._next_cut(final)) is not None:
            piece, self._buffer = self._buffer[:cut], self._buffer[cut:]
            self._line_start = "\n" in piece[len(piece.rstrip()) :]
            self._limit = self.config.max_chars
            pieces.append(piece)
        return pieces

    def _next_cut(self, final: bool) -> int | None:
        """Where the next piece ends, or None if that is not decided yet."""
        buf, config, limit = self._buffer, self.config, self._limit
        over = weight(buf, config) > limit
        so_far = 0
        for i, ch in enumerate(buf):
            so_far += config.cjk_weight if _CJK.match(ch) else 1
            if so_far > limit:
                break
            cut = self._boundary(buf, i, final)
            if cut is _WAIT:
                return None
            if (
                cut is not None
                and _SPEAKABLE.search(buf[:cut])
                and weight(buf[:cut].rstrip(), config) <= limit
            ):
                return cut
        return self._forced_cut(buf) if over else None

    def _boundary(self, buf: str, i: int, final: bool) -> int | None | object:
        """The cut after a boundary at ``buf[i]``; None if there is none; _WAIT if undecided."""
        ch = buf[i]
        if ch == "\n":
            return _after_space(buf, i, final)
        if ch in CJK_SENTENCE_END or ch in CJK_CLAUSE:
            if ch in CJK_CLAUSE and weight(buf[: i + 1], self.config) < self.config.min_chars:
                return None
            if i + 1 == len(buf) and not final:
                return _WAIT
            if ch in CJK_CLAUSE and buf[i - 1 : i].isdigit() and buf[i + 1 : i + 2].isdigit():
                return None
            j = i + 1
            while j < len(buf) and buf[j] in CLOSERS:
                j += 1
            return _after_space(buf, j - 1, final)
        if ch in SENTENCE_END:
            j = i + 1
            while j < len(buf) and (buf[j] in SENTENCE_END or buf[j] in CLOSERS):
                j += 1
            if j == len(buf):
                return None if final else _WAIT
            if not buf[j].isspace() or j != i + 1 and buf[i + 1] in SENTENCE_END:
                return None  # "3.5", "example.com"; a run like "..." is judged at its end
            cut = _after_space(buf, j - 1, final)
            if cut is _WAIT or cut is None:
                return cut
            if cut == len(buf):
                return cut  # final: end of text
            if ch == "." and (buf[cut].islower() or self._no_break_after(buf, i)):
                return None
            if ch == "…" and buf[cut].islower():
                return None
            return cut
        if ch in CLAUSE:
            if weight(buf[: i + 1], self.config) < self.config.min_chars:
                return None
            if i + 1 == len(buf):
                return None if final else _WAIT
            if not buf[i + 1].isspace():
                return None  # "1,250", "10:30"
            return _after_space(buf, i, final)
        return None

    def _no_break_after(self, buf: str, i: int) -> bool:
        """True if the "." at ``buf[i]`` ends an abbreviation or a list number, not a sentence."""
        start = i
        while start > 0 and not buf[start - 1].isspace():
            start -= 1
        token = buf[start : i + 1].lstrip("\"'([{“‘")
        if token.lower() in ABBREVIATIONS or _ACRONYM.fullmatch(token):
            return True
        if _LIST_NUMBER.fullmatch(token):
            line_start = buf.rfind("\n", 0, start) + 1
            return buf[line_start:start].strip() == "" and (line_start > 0 or self._line_start)
        return False

    def _forced_cut(self, buf: str) -> int | None:
        """The last place within the length limit between words (or CJK characters), preferably not
        right after an abbreviation; None if there is none yet."""
        best = fallback = None
        so_far = weight(buf[:1], self.config)
        for p in range(1, len(buf)):
            if so_far > self._limit:
                break
            so_far += weight(buf[p], self.config)
            between_words = buf[p - 1].isspace() and not buf[p].isspace()
            between_cjk = bool(_CJK.match(buf[p - 1]) and _CJK.match(buf[p]))
            if (between_words or between_cjk) and _SPEAKABLE.search(buf[:p]):
                fallback = p
                end = len(buf[:p].rstrip())
                if not (buf[end - 1] == "." and self._no_break_after(buf, end - 1)):
                    best = p
        if best is None and fallback is None:  # a token longer than the limit: cut after it
            return next(
                (
                    p
                    for p in range(1, len(buf))
                    if buf[p - 1].isspace() and not buf[p].isspace() and _SPEAKABLE.search(buf[:p])
                ),
                None,
            )
        return best if best is not None else fallback


_WAIT = object()


def _after_space(buf: str, i: int, final: bool) -> int | object:
    """The index after ``buf[i]`` and the whitespace that follows it (waits for a non-space)."""
    j = i + 1
    while j < len(buf) and buf[j].isspace():
        j += 1
    if j == len(buf) and not final:
        return _WAIT
    return j


def chunk_text(text: str, config: ChunkerConfig | None = None) -> list[str]:
    """All pieces of a complete text (the same pieces as streaming it in any deltas)."""
    chunker = Chunker(config)
    return chunker.push(text) + chunker.flush()
