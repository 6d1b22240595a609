"""The documents panel: what the assistant answers from, in which mode, and changing it.

:class:`DocumentLibrary` works on the :class:`~assistant.answerer.Answerer` the page is mounted
beside. It lists the loaded documents per handbook language with the prompt mode
(whole-context or retrieval), points the assistant at another folder, reloads, and adds uploaded
files. Uploads go into a folder the app owns (``--documents-dir``): on the first upload it becomes
a copy of the documents being served, the upload is added (into ``en/`` or ``zh/`` by the file's
script when the handbook is split by language), and the assistant switches to it. A file that
cannot be read is refused with the reason and the assistant keeps its documents.

Only folders under the allowed roots (``--documents-root``; always the app's own folder and the
folder the server started with) can be served: a folder is checked after resolving symlinks, and
so is every document in it, so a link inside a root that points outside is refused. Only
document files are read or copied, and a folder is walked only up to :data:`MAX_WALK_ENTRIES`
entries and :data:`MAX_DOCUMENT_BYTES` of documents, so pointing at a huge tree is refused fast.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path

from assistant.answerer import Answerer
from assistant.docs import LANGUAGES, RICH_SUFFIXES, TEXT_SUFFIXES, DocumentError, DocumentSet, detect_language

DOCUMENT_SUFFIXES = tuple(sorted(TEXT_SUFFIXES | set(RICH_SUFFIXES)))
MARKER = ".web-documents"  # marks a folder this app created and may rewrite
MAX_WALK_ENTRIES = 10_000  # files and folders looked at in one documents folder
MAX_DOCUMENT_BYTES = 256 << 20  # documents in one folder, in all


class DocumentLibrary:
    """The page's handle on the assistant's documents; one lock serialises changes."""

    def __init__(self, answerer: Answerer, own_dir: Path, roots: Iterable[Path]) -> None:
        """``roots``: the folders (with everything under them) the page may switch to; the own
        folder and the folder served now are always allowed."""
        self.answerer = answerer
        self.own_dir = own_dir.expanduser().resolve()
        self.roots = tuple(dict.fromkeys(Path(r).expanduser().resolve() for r in (*roots, self.own_dir, self.folder)))
        self._lock = threading.Lock()

    @property
    def folder(self) -> Path:
        """The folder the assistant answers from now."""
        return Path(self.answerer.config.docs_dir).resolve()

    def markdown(self) -> str:
        """What is loaded: the folder, per language the mode and prefix, and every document."""
        owned = " (the app's own folder: uploads go here)" if self.folder == self.own_dir else ""
        lines = [f"**Folder:** `{self.folder}`{owned}", "",
                 "| handbook | mode | documents | prefix tokens | version |", "|---|---|---:|---:|---|"]  # fmt: skip
        builders = self.answerer.builders
        for lang, b in builders.items():
            lines.append(f"| {lang} | {b.mode} | {len(b.docs.documents)} | {len(b.prefix.token_ids)} | `{b.docs.version}` |")
        lines += ["", "| handbook | file | title | sections |", "|---|---|---|---:|"]
        for lang, builder in builders.items():
            lines += [f"| {lang} | `{d.path}` | {d.title} | {len(d.sections)} |" for d in builder.docs.documents]
        return "\n".join(lines)

    def reload(self) -> str:
        """Re-read the folder now; says whether anything changed."""
        with self._lock:
            changed = self.answerer.reload()
        return "Reloaded: the documents changed." if changed else "Reloaded: no changes."

    def use_folder(self, folder: Path) -> str:
        """Answer from ``folder`` from now on; on any problem the assistant keeps its documents."""
        folder = self._allowed(folder.expanduser().resolve(), folder)
        if not folder.is_dir():
            raise DocumentError(f"not a folder: {folder}")
        self.documents_in(folder)
        with self._lock:
            self._switch(folder)
        return f"Now answering from {folder}."

    def documents_in(self, folder: Path) -> list[Path]:
        """The document files under ``folder`` (relative paths), checked: DocumentError if the walk
        passes its bounds or a document (or a link) resolves outside the allowed roots."""
        found, entries, size = [], 0, 0
        for top, dirs, files in os.walk(folder):
            entries += len(dirs) + len(files)
            if entries > MAX_WALK_ENTRIES:
                raise DocumentError(f"{folder} holds more than {MAX_WALK_ENTRIES} files and folders; choose a folder of documents only")
            for name in sorted(dirs):
                if (Path(top) / name).is_symlink():
                    self._allowed((Path(top) / name).resolve(), Path(top) / name)
            for name in files:
                path = Path(top) / name
                if path.suffix.lower() not in DOCUMENT_SUFFIXES:
                    continue
                self._allowed(path.resolve(), path)
                size += path.stat().st_size
                if size > MAX_DOCUMENT_BYTES:
                    raise DocumentError(f"the documents in {folder} exceed {MAX_DOCUMENT_BYTES >> 20} MiB")
                found.append(path.relative_to(folder))
        return sorted(found)

    def _allowed(self, resolved: Path, asked: Path) -> Path:
        """``resolved`` if it lies under an allowed root, else DocumentError naming what was asked."""
        if not any(resolved.is_relative_to(root) for root in self.roots):
            raise DocumentError(f"{asked} is not under an allowed documents folder "
                                f"({', '.join(map(str, self.roots))}; the server's --documents-root sets them)")  # fmt: skip
        return resolved

    def add_file(self, upload: Path, name: str) -> str:
        """Add an uploaded document (``name`` as the user named it) and reload."""
        name = Path(name).name
        if Path(name).suffix.lower() not in DOCUMENT_SUFFIXES:
            raise DocumentError(f"{name} is not a document this assistant reads ({', '.join(DOCUMENT_SUFFIXES)})")
        language = _check_readable(upload, name)
        with self._lock:
            self._adopt_current()
            split = any((self.own_dir / lang).is_dir() for lang in LANGUAGES)
            target = (self.own_dir / language if split else self.own_dir) / name
            target.parent.mkdir(exist_ok=True)
            backup = target.read_bytes() if target.exists() else None
            shutil.copyfile(upload, target)
            try:
                self._switch(self.own_dir)
            except DocumentError:
                if backup is None:
                    target.unlink()
                else:
                    target.write_bytes(backup)
                raise
        where = target.relative_to(self.own_dir).as_posix()
        return f"Added {where}" + (" (replacing the earlier file)" if backup is not None else "") + "."

    def _switch(self, folder: Path) -> None:
        self.answerer.use_folder(folder)

    def _adopt_current(self) -> None:
        """Make the own folder a copy of the documents served now (unless it is what is served)."""
        if self.folder == self.own_dir:
            return
        if self.own_dir.exists() and any(self.own_dir.iterdir()) and not (self.own_dir / MARKER).exists():
            raise DocumentError(f"{self.own_dir} was not made by this app and is not empty; start with another --documents-dir")
        documents = self.documents_in(self.folder)
        shutil.rmtree(self.own_dir, ignore_errors=True)
        for rel in documents:
            (self.own_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.folder / rel, self.own_dir / rel)
        self.own_dir.mkdir(parents=True, exist_ok=True)
        (self.own_dir / MARKER).write_text("documents managed by the web UI (python -m web); rewritten on upload\n")


def _check_readable(upload: Path, name: str) -> str:
    """Load the file alone, as the assistant would; its language ("en"/"zh"), or DocumentError."""
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copyfile(upload, Path(tmp) / name)
        try:
            docs = DocumentSet.load(Path(tmp))
        except (DocumentError, OSError) as exc:
            raise DocumentError(str(exc).replace(f"{tmp}/", "").replace(tmp, name)) from exc
    return detect_language(docs.documents[0].text)
