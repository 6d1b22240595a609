"""Documents load into a stable prefix that every conversation's prompt starts with."""

from __future__ import annotations

import pytest

from assistant.config import HANDBOOK_DIR, SYSTEM_PROMPT
from assistant.docs import DocumentError, DocumentSet, detect_language, load_library, normalize
from assistant.prompt import PromptBuilder


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
    assert text.endswith("How do I apply for annual leave?<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def smollm_tokenizer(llm_gguf_path):
    from engine.tokenizer import Tokenizer

    return Tokenizer.load(llm_gguf_path)
