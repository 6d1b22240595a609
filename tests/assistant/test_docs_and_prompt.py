"""Documents load into a stable prefix that every conversation's prompt starts with."""

from __future__ import annotations

import os

import pytest

from assistant import docs as docs_module
from assistant.config import HANDBOOK_DIR, SYSTEM_PROMPT
from assistant.docs import MAX_SECTION_CHARS, DocumentError, DocumentSet, Section, detect_language, load_library, normalize
from assistant.prompt import LABELS_EN, PromptBuilder


def test_bundled_handbook_has_both_languages_with_the_same_topics():
    lib = load_library(HANDBOOK_DIR)
    assert set(lib) == {"en", "zh"}
    assert [d.path for d in lib["en"].documents] == [d.path for d in lib["zh"].documents]
    assert len(lib["en"].documents) >= 10
    assert "HR-01" in lib["en"].render() and "HR-01" in lib["zh"].render()


def test_normalisation_makes_the_text_byte_stable(tmp_path):
    (tmp_path / "b.md").write_text("# B\r\nline   \r\n\r\n\r\n\r\nend", encoding="utf-8")
    (tmp_path / "a.txt").write_text("# A\nalpha\n", encoding="utf-8")
    docs = DocumentSet.load(tmp_path)
    assert [d.path for d in docs.documents] == ["a.txt", "b.md"]
    assert docs.documents[1].text == "# B\nline\n\nend\n"
    assert normalize("e\u0301") == "\u00e9\n"  # NFC
    v1 = docs.version
    (tmp_path / "a.txt").write_text("# A\nalpha changed\n", encoding="utf-8")
    assert DocumentSet.load(tmp_path).version != v1


def test_bad_folders_are_clear_errors(tmp_path):
    with pytest.raises(DocumentError, match="not found"):
        DocumentSet.load(tmp_path / "missing")
    with pytest.raises(DocumentError, match="no documents"):
        DocumentSet.load(tmp_path)
    (tmp_path / "x.md").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(DocumentError, match="not UTF-8"):
        DocumentSet.load(tmp_path)


def test_documents_are_cut_into_sections_at_level_two_headings(tmp_path):
    long_body = "\n\n".join(f"Paragraph {i}. " + "word " * 60 for i in range(12))
    (tmp_path / "a.md").write_text(f"# Leave\n\n## Entitlement\n20 days.\n\n### Details\nPro rata.\n\n## Rules\n{long_body}\n")
    (tmp_path / "b.txt").write_text("Plain notes without headings.\n", encoding="utf-8")
    docs = DocumentSet.load(tmp_path)
    sections = docs.sections
    assert sections[0] == Section("a.md", "Leave", "Entitlement", "## Entitlement\n20 days.\n\n### Details\nPro rata.")
    rules = [s for s in sections if s.heading.startswith("Rules")]
    assert len(rules) > 1 and all(len(s.text) <= MAX_SECTION_CHARS for s in rules)  # a long section is cut up
    assert [s.heading for s in rules[:2]] == ["Rules", "Rules (2)"] and "Paragraph 11." in rules[-1].text
    assert sections[-1] == Section("b.txt", "b", "", "Plain notes without headings.")  # no title-only preamble section
    assert sections[-1].label == "b.txt" and sections[0].label == "a.md — Entitlement"
    parts = "; ".join(s.heading for s in rules)
    assert docs.table_of_contents() == [f"- Leave — Entitlement; {parts}", "- b"]


def test_edits_are_noticed_cheaply_and_only_content_changes_the_version(tmp_path):
    path = tmp_path / "a.md"
    path.write_text("# A\nalpha\n", encoding="utf-8")
    docs = DocumentSet.load(tmp_path)
    assert not docs.changed_on_disk()
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched, same content
    assert docs.changed_on_disk() and DocumentSet.load(tmp_path).version == docs.version
    (tmp_path / "b.md").write_text("# B\nbeta\n", encoding="utf-8")  # a new file
    assert DocumentSet.load(tmp_path).version != docs.version


def write_pdf(path, lines: list[str]) -> None:
    """A minimal one-page PDF (Helvetica text), written by hand so the test needs no PDF writer."""
    text = " ".join(f"({line}) Tj 0 -16 Td" for line in lines)
    stream = f"BT /F1 12 Tf 72 720 Td {text} ET".encode()
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R /Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    path.write_bytes(bytes(out))


def test_pdf_documents_are_read_when_pypdf_is_installed(tmp_path):
    pytest.importorskip("pypdf")
    write_pdf(tmp_path / "leave.pdf", ["Annual leave", "Employees get 20 days of annual leave."])
    (tmp_path / "broken.pdf").write_bytes(b"%PDF-1.4 nothing else")
    with pytest.raises(DocumentError, match="broken.pdf is not a readable PDF"):
        DocumentSet.load(tmp_path)
    (tmp_path / "broken.pdf").unlink()
    doc = DocumentSet.load(tmp_path).documents[0]
    assert doc.path == "leave.pdf" and "Employees get 20 days of annual leave." in doc.text


def test_docx_documents_are_read_as_markdown_when_python_docx_is_installed(tmp_path):
    docx = pytest.importorskip("docx")
    document = docx.Document()
    document.add_heading("Expenses", level=0)
    document.add_heading("Rules", level=1)
    document.add_paragraph("Submit claims within 30 days.")
    document.add_paragraph("Receipts over 10 pounds", style="List Bullet")
    table = document.add_table(rows=1, cols=2)
    table.rows[0].cells[0].text, table.rows[0].cells[1].text = "Form", "FIN-01"
    document.save(tmp_path / "expenses.docx")
    doc = DocumentSet.load(tmp_path).documents[0]
    assert doc.title == "Expenses"
    assert doc.text == "# Expenses\n\n## Rules\n\nSubmit claims within 30 days.\n\n- Receipts over 10 pounds\n\nForm | FIN-01\n"
    assert [s.label for s in doc.sections] == ["expenses.docx — Rules"]


def test_pdf_and_docx_files_without_their_library_are_skipped_with_the_install_hint(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(docs_module.RICH_SUFFIXES, ".pdf", "no_such_pdf_library")
    write_pdf(tmp_path / "leave.pdf", ["Annual leave"])
    with pytest.raises(DocumentError, match=r"1 PDF/DOCX files need: pip install 'handbook-voice-assistant\[documents\]'"):
        DocumentSet.load(tmp_path)
    (tmp_path / "notes.md").write_text("# Notes\nhello\n", encoding="utf-8")
    assert [d.path for d in DocumentSet.load(tmp_path).documents] == ["notes.md"]
    assert "skipped 1 PDF/DOCX files" in caplog.text


def test_language_detection():
    assert detect_language("年假怎么申请？") == "zh"
    assert detect_language("How do I apply for annual leave?") == "en"


def test_every_prompt_starts_with_the_same_prefix_tokens(smollm_tokenizer):
    builder = PromptBuilder(smollm_tokenizer, SYSTEM_PROMPT, load_library(HANDBOOK_DIR)["en"])
    prefix = list(builder.prefix.token_ids)
    a = builder.build([], "How do I apply for annual leave?")
    b = builder.build([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"}], "And sick leave?")
    assert a[: len(prefix)] == prefix and b[: len(prefix)] == prefix
    assert len(prefix) > 1500  # the whole handbook is in it
    # the prompt is exactly what the chat template renders
    text = smollm_tokenizer.decode(a, skip_special_tokens=False)
    # after the prefix: the best-matching document again, the answer's form, the question, a short nudge (all before the question is shared)
    rest = text[len(builder.prefix.rendered) :]
    assert rest.index("[Annual Leave — Entitlement]") < rest.index("[Annual Leave — How to apply]")
    assert "Submit a Leave Request form (HR-01)" in rest and "[Sick Leave" not in rest
    # documents and excerpts are named by their titles, not their file names (no ".md" to quote as a form code)
    assert ".md" not in text
    assert rest.endswith(
        f"{LABELS_EN.reminder}\n\nQuestion: How do I apply for annual leave?\n{LABELS_EN.nudge}<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def smollm_tokenizer(llm_gguf_path):
    from engine.tokenizer import Tokenizer

    return Tokenizer.load(llm_gguf_path)


def test_an_unreadable_file_is_a_document_error_naming_it(tmp_path):
    (tmp_path / "ok.md").write_text("# Ok\ntext\n", encoding="utf-8")
    # A file whose read fails with an OSError even for root: /proc/self/mem at offset 0 (EIO).
    (tmp_path / "secret.md").symlink_to("/proc/self/mem")
    with pytest.raises(DocumentError, match="cannot read .*secret.md"):
        DocumentSet.load(tmp_path)


def test_a_follow_up_about_another_document_carries_only_its_best_section(smollm_tokenizer):
    """A conversation's first question gets its whole document (warmed for every such question); a
    follow-up about a document not yet in the conversation gets its best section only: nothing after
    the conversation is warm, and the whole document would be hundreds of tokens to prefill."""
    builder = PromptBuilder(smollm_tokenizer, SYSTEM_PROMPT, load_library(HANDBOOK_DIR)["en"])
    question = "What is the minimum length of a password?"
    alone = builder.prompt([], question)
    assert len(alone.sections) > 2 and "[IT Accounts and Passwords — Locked out]" in alone.content
    first = builder.prompt([], "How do I apply for annual leave?")
    history = [{"role": "user", "content": first.content}, {"role": "assistant", "content": "With form HR-01."}]
    follow = builder.prompt(history, question)
    assert [s.prompt_label for s in follow.sections] == ["IT Accounts and Passwords — Password rules"]
    assert "Use at least 14 characters." in follow.content and "Locked out" not in follow.content
    assert follow.content.endswith(f"Question: {question}\n{LABELS_EN.nudge}")
    with_whole = len(builder._ids(history, builder._user_content(question, alone.sections)))
    assert len(follow.token_ids) < with_whole - 100
