"""Company documents: load a folder, normalise the text, and fix one stable order.

The documents become the start of every prompt, so their text must be byte-identical across
sessions and restarts: files are read in sorted path order, Unicode-normalised (NFC), with LF
line endings, no trailing spaces, and at most one blank line in a row. A folder with ``en/``
and ``zh/`` subfolders holds one handbook per language.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

TEXT_SUFFIXES = {".md", ".markdown", ".txt"}
LANGUAGES = ("en", "zh")


class DocumentError(ValueError):
    """A documents folder cannot be used; the message says why."""


@dataclass(frozen=True)
class Document:
    path: str  # relative to the documents folder, POSIX style
    title: str
    text: str


def normalize(text: str) -> str:
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n"))
    lines = [line.rstrip() for line in text.split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def _title(rel: str, text: str) -> str:
    m = re.search(r"^#\s+(.+)$", text, flags=re.M)
    return m[1].strip() if m else Path(rel).stem


@dataclass(frozen=True)
class DocumentSet:
    """Documents of one language, in a fixed order, with a content version."""

    root: Path
    documents: tuple[Document, ...]

    @classmethod
    def load(cls, root: Path) -> "DocumentSet":
        root = Path(root)
        if not root.is_dir():
            raise DocumentError(f"documents folder not found: {root}")
        docs = []
        for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES):
            rel = path.relative_to(root).as_posix()
            try:
                text = normalize(path.read_text(encoding="utf-8"))
            except UnicodeDecodeError as e:
                raise DocumentError(f"{path} is not UTF-8 text ({e.reason})") from e
            if text.strip():
                docs.append(Document(rel, _title(rel, text), text))
        if not docs:
            raise DocumentError(f"no documents (*.md, *.txt) in {root}")
        return cls(root, tuple(docs))

    @property
    def version(self) -> str:
        """Short content hash: changes exactly when the prompt prefix would change."""
        h = hashlib.sha256()
        for d in self.documents:
            h.update(d.path.encode() + b"\0" + d.text.encode() + b"\0")
        return h.hexdigest()[:12]

    def render(self) -> str:
        """All documents as one text block, each under its source path."""
        return "\n".join(f"[{d.path}]\n{d.text}" for d in self.documents)


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
