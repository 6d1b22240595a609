"""The turn-completion rule that confirms a speculative endpoint early (pure functions)."""

from __future__ import annotations

import pytest

from speech.turn_completion import is_complete


@pytest.mark.parametrize("text", [
    "How do I apply for annual leave?",
    " How many days of annual leave do I get per year? ",
    "I lost my laptop.",
    "Thanks!",
    "Tell me about the probation period.",
    "What is the deadline for submitting an expense claim?\"",
])  # fmt: skip
def test_finished_english_sentences_are_complete(text: str) -> None:
    assert is_complete(text, "en")


@pytest.mark.parametrize("text", [
    "",
    "How do I apply for",  # no punctuation: Whisper heard no end
    "How do I apply for.",  # dangling preposition
    "I need to take some leave and.",  # dangling conjunction
    "Tell me about the.",  # dangling article
    "How many days of annual leave.",  # opens as a question, closed with a period
    "What is the minimum length of a password,",
    "So I was wondering...",  # trailing off
    "So I was wondering…",
    "?",
])  # fmt: skip
def test_fragments_are_incomplete_in_english(text: str) -> None:
    assert not is_complete(text, "en")


@pytest.mark.parametrize(("text", "complete"), [
    ("我怎么申请年假？", True),
    ("年假有多少天。", True),
    ("谢谢！", True),
    ("我想问一下年假和", False),  # no final punctuation
    ("我想问一下年假和。", False),  # dangling conjunction
    ("因为我的电脑的。", False),  # dangling particle
    ("我想问一下，", False),
    ("我想问一下……", False),
])  # fmt: skip
def test_chinese_rule(text: str, complete: bool) -> None:
    assert is_complete(text, "zh") is complete


def test_other_languages_follow_the_script() -> None:
    assert is_complete("我怎么申请年假？", "auto") and not is_complete("年假和。", "auto")
    assert is_complete("Wie beantrage ich Urlaub?", "de") and not is_complete("How do I apply for.", "auto")
