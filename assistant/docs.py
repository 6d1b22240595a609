"""Company documents: load a folder, normalise the text, fix one stable order, split into sections.

The documents become the start of every prompt, so their text must be byte-identical across
sessions and restarts: files are read in sorted path order, Unicode-normalised (NFC), with LF
line endings, no trailing spaces, and at most one blank line in a row. A folder with ``en/``
and ``zh/`` subfolders holds one handbook per language.

Markdown and plain text are always read; PDF (``pypdf``) and DOCX (``python-docx``) when those
libraries are installed (``pip install 'handbook-voice-assistant[documents]'``). Each document is
cut into sections at its ``##`` headings: the unit of retrieval and of citations. A set keeps a
cheap stamp of its files (path, size, mtime) so a caller can notice edits and reload.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import re
import unicodedata
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

log = logging.getLogger(__name__)

TEXT_SUFFIXES = {".md", ".markdown", ".txt"}
RICH_SUFFIXES = {".pdf": "pypdf", ".docx": "docx"}  # suffix -> the module that reads it
EXTRA_HINT = "pip install 'handbook-voice-assistant[documents]'"
LANGUAGES = ("en", "zh")
MAX_SECTION_CHARS = 2000  # longer sections are cut at paragraph breaks, so each can be retrieved alone

FileStamp = tuple[str, int, int]  # relative path, size in bytes, mtime in ns


class DocumentError(ValueError):
    """A documents folder cannot be used; the message says why."""


@dataclass(frozen=True)
class Section:
    """One ``##`` section of a document (or a part of a long one): what retrieval ranks and cites."""

    path: str  # the document's path, relative to the documents folder
    title: str  # the document's title
    heading: str  # the ``##`` heading; "" for the text before the first one
    text: str

    @property
    def label(self) -> str:
        """``path — heading`` (or just the path): how citations name the section."""
        return f"{self.path} — {self.heading}" if self.heading else self.path

    @property
    def prompt_label(self) -> str:
        """``title — heading`` (or just the title): how prompts name the section. Not the file
        name: asked for a form code, a small model quoted "04-business-travel.md" as one."""
        return f"{self.title} — {self.heading}" if self.heading else self.title


@dataclass(frozen=True)
class Document:
    path: str  # relative to the documents folder, POSIX style
    title: str
    text: str

    @cached_property
    def sections(self) -> tuple[Section, ...]:
        """The document cut at its ``##`` headings; a title-only preamble is no section."""
        sections = []
        for part in re.split(r"(?m)^(?=## )", self.text):
            body = part.strip()
            heading = re.match(r"## +(.+)", body)
            if not body or (heading is None and re.fullmatch(r"# [^\n]*", body)):
                continue
            name = heading[1].strip() if heading else ""
            for i, piece in enumerate(_pieces(body, MAX_SECTION_CHARS)):
                label = name if i == 0 else f"{name} ({i + 1})".strip()
                sections.append(Section(self.path, self.title, label, piece))
        return tuple(sections)


def _pieces(text: str, limit: int) -> list[str]:
    """``text`` cut at paragraph breaks (or, for one huge paragraph, hard) into parts of <= limit chars."""
    paragraphs = [p[i : i + limit] for p in text.split("\n\n") for i in range(0, len(p), limit)]
    pieces = [paragraphs[0]]
    for paragraph in paragraphs[1:]:
        if len(pieces[-1]) + 2 + len(paragraph) <= limit:
            pieces[-1] += "\n\n" + paragraph
        else:
            pieces.append(paragraph)
    return pieces


def normalize(text: str) -> str:
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n"))
    lines = [line.rstrip() for line in text.split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def _title(rel: str, text: str) -> str:
    m = re.search(r"^#\s+(.+)$", text, flags=re.MULTILINE)
    return m[1].strip() if m else Path(rel).stem


def _pdf_text(path: Path) -> str:
    from pypdf import PdfReader
    from pypdf.errors import PyPdfError

    try:
        return "\n\n".join(page.extract_text() or "" for page in PdfReader(path).pages)
    except (PyPdfError, ValueError, KeyError) as e:
        raise DocumentError(f"{path} is not a readable PDF ({e})") from e


def _docx_text(path: Path) -> str:
    """Word paragraphs as Markdown: Title -> ``#``, Heading n -> ``#`` * (n + 1), lists -> ``-``, tables -> rows."""
    import docx
    from docx.opc.exceptions import PackageNotFoundError
    from docx.table import Table

    try:
        document = docx.Document(str(path))
    except (PackageNotFoundError, ValueError, KeyError) as e:
        raise DocumentError(f"{path} is not a readable DOCX file ({e})") from e
    blocks = []
    for block in document.iter_inner_content():
        if isinstance(block, Table):
            blocks.extend(" | ".join(cell.text.strip() for cell in row.cells) for row in block.rows)
            continue
        text, style = block.text.strip(), block.style.name if block.style is not None else ""
        level = re.fullmatch(r"Heading (\d)", style)
        if not text:
            continue
        if style == "Title":
            text = f"# {text}"
        elif level:
            text = "#" * min(int(level[1]) + 1, 6) + " " + text
        elif "List" in style:
            text = f"- {text}"
        blocks.append(text)
    return "\n\n".join(blocks)


def _read(path: Path) -> str:
    """The text of one document; any problem reading it is a DocumentError naming the file."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".pdf":
            return _pdf_text(path)
        if suffix == ".docx":
            return _docx_text(path)
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DocumentError(f"{path} is not UTF-8 text ({e.reason})") from e
    except OSError as e:  # e.g. no read permission
        raise DocumentError(f"cannot read {path}: {e.strerror or e}") from e


def _candidates(root: Path) -> list[Path]:
    """Every file of a kind we know, readable now or not, in sorted path order."""
    known = TEXT_SUFFIXES | set(RICH_SUFFIXES)
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in known)


def scan(root: Path) -> tuple[FileStamp, ...]:
    """The (path, size, mtime) of every document file under ``root``: cheap, changes on any edit."""
    stamps = []
    for path in _candidates(root):
        try:
            stat = path.stat()
        except FileNotFoundError:  # deleted while we looked: the next scan will not list it
            continue
        stamps.append((path.relative_to(root).as_posix(), stat.st_size, stat.st_mtime_ns))
    return tuple(stamps)


@dataclass(frozen=True)
class DocumentSet:
    """Documents of one language, in a fixed order, with a content version."""

    root: Path
    documents: tuple[Document, ...]
    stamp: tuple[FileStamp, ...] = ()  # scan(root) taken before reading, see changed_on_disk

    @classmethod
    def load(cls, root: Path) -> DocumentSet:
        root = Path(root)
        if not root.is_dir():
            raise DocumentError(f"documents folder not found: {root}")
        stamp = scan(root)
        readable = TEXT_SUFFIXES | {s for s, module in RICH_SUFFIXES.items() if importlib.util.find_spec(module)}
        docs, skipped = [], []
        for path in _candidates(root):
            rel = path.relative_to(root).as_posix()
            if path.suffix.lower() not in readable:
                skipped.append(rel)
                continue
            text = normalize(_read(path))
            if text.strip():
                docs.append(Document(rel, _title(rel, text), text))
        if skipped:
            log.warning("skipped %d PDF/DOCX files in %s (%s); to read them: %s", len(skipped), root, ", ".join(skipped[:3]), EXTRA_HINT)
        if not docs:
            hint = f"; {len(skipped)} PDF/DOCX files need: {EXTRA_HINT}" if skipped else ""
            raise DocumentError(f"no documents (*.md, *.txt, *.pdf, *.docx) in {root}{hint}")
        return cls(root, tuple(docs), stamp)

    @property
    def version(self) -> str:
        """Short content hash: changes exactly when the prompt prefix would change."""
        h = hashlib.sha256()
        for d in self.documents:
            h.update(d.path.encode() + b"\0" + d.text.encode() + b"\0")
        return h.hexdigest()[:12]

    @property
    def sections(self) -> tuple[Section, ...]:
        """Every document's sections, in document order."""
        return tuple(s for d in self.documents for s in d.sections)

    def changed_on_disk(self) -> bool:
        """True when a file under the folder was added, removed or edited since this set was loaded."""
        return scan(self.root) != self.stamp

    def render(self) -> str:
        """All documents as one text block, each under its title (see :attr:`Section.prompt_label`)."""
        return "\n".join(f"[{d.title}]\n{d.text}" for d in self.documents)

    def table_of_contents(self) -> list[str]:
        """One line per document: its title and section headings (the stable part in retrieval mode)."""
        lines = []
        for d in self.documents:
            headings = "; ".join(dict.fromkeys(s.heading for s in d.sections if s.heading))
            lines.append(f"- {d.title}" + (f" — {headings}" if headings else ""))
        return lines


def load_library(root: Path) -> dict[str, DocumentSet]:
    """Per-language document sets: ``root/en``, ``root/zh`` when present, else ``root`` as one set."""
    root = Path(root)
    if not root.is_dir():
        raise DocumentError(f"documents folder not found: {root}")
    per_language = {lang: root / lang for lang in LANGUAGES if (root / lang).is_dir()}
    if not per_language:
        return {"any": DocumentSet.load(root)}
    return {lang: DocumentSet.load(path) for lang, path in per_language.items()}


def detect_language(text: str) -> str:
    """'zh' if the text contains CJK ideographs, else 'en'."""
    return "zh" if re.search(r"[\u3400-\u9fff]", text) else "en"
