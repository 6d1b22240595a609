"""The chunker: unit cases and properties over generated text and arbitrary delta splits."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speech.chunker import Chunker, chunk_text, strip_markdown, weight
from speech.config import ChunkerConfig, ConfigError


def stream(text: str, sizes: list[int], config: ChunkerConfig | None = None) -> list[str]:
    """Push ``text`` in deltas of the given sizes (cycled), then flush."""
    chunker, pieces, i, k = Chunker(config), [], 0, 0
    while i < len(text):
        n = sizes[k % len(sizes)] if sizes else len(text)
        pieces += chunker.push(text[i : i + n])
        i, k = i + n, k + 1
    return pieces + chunker.flush()


# -- unit cases -------------------------------------------------------------------------------


def test_sentences_are_cut_at_their_end() -> None:
    assert chunk_text("Annual leave is 25 days. You can carry over 5 days! Ask HR? Yes.") == [
        "Annual leave is 25 days. ",
        "You can carry over 5 days! ",
        "Ask HR? ",
        "Yes.",
    ]


def test_a_piece_is_released_as_soon_as_the_next_sentence_begins() -> None:
    chunker = Chunker()
    assert chunker.push("Annual leave is 25 days.") == []
    assert chunker.push(" ") == []  # "." may still be an abbreviation or a decimal point
    assert chunker.push("You") == ["Annual leave is 25 days. "]
    assert chunker.flush() == ["You"]


def test_the_first_piece_of_an_answer_is_short_so_that_first_audio_comes_early() -> None:
    text = (
        "You get twenty-five days of annual leave per calendar year and apply for them in the HR "
        "portal at least two weeks before the first day of your leave."
    )
    config = ChunkerConfig(min_chars=16, max_chars=160, first_max_chars=42)
    pieces = chunk_text(text, config)
    assert pieces[0] == "You get twenty-five days of annual leave "  # cut at its last space
    assert "".join(pieces) == text and len(pieces) == 2  # the rest is one piece up to max_chars
    assert chunk_text(text, ChunkerConfig(first_max_chars=160)) == [text]
    assert ChunkerConfig(min_chars=30, first_max_chars=40).first_limit == 60  # never below 2 * min
    chunker = Chunker(config)  # after a flush the next answer's first piece is short again
    assert chunker.push(text + " ")[0] == pieces[0]
    chunker.flush()
    assert chunker.push(text + " ")[0] == pieces[0]


def test_clauses_are_cut_only_once_long_enough() -> None:
    text = "Yes, you can, but only if your manager agrees, in writing."
    assert chunk_text(text, ChunkerConfig(min_chars=16)) == [
        "Yes, you can, but only if your manager agrees, ",
        "in writing.",
    ]
    assert chunk_text(text, ChunkerConfig(min_chars=4)) == [
        "Yes, ",
        "you can, ",
        "but only if your manager agrees, ",
        "in writing.",
    ]


def test_numbers_are_never_cut() -> None:
    text = "It costs $9.99, i.e. about 1,250 yen at 10:30 on 2024-03-01, up 3.5% on last year."
    pieces = chunk_text(text, ChunkerConfig(min_chars=4, max_chars=40))
    joined = "".join(pieces)
    assert joined == text
    for number in ("$9.99", "1,250", "10:30", "2024-03-01", "3.5%"):
        assert any(number in p for p in pieces), number


@pytest.mark.parametrize(
    "text",
    [
        "Ask Dr. Smith about it. Then wait.",
        "Bring a document, e.g. a passport. Then wait.",
        "Offices in the U.S. Office hours vary. Then wait.",
        "That is No. 5 on the list. Then wait.",
        "See J. Smith first. Then wait.",
    ],
)
def test_abbreviations_do_not_end_a_sentence(text: str) -> None:
    pieces = chunk_text(text, ChunkerConfig(min_chars=100, max_chars=200))
    assert pieces == [text[: text.index("Then")], "Then wait."]


def test_a_lowercase_word_after_a_period_continues_the_sentence() -> None:
    assert chunk_text("Submit form HR-01 etc. before you go. Done.") == [
        "Submit form HR-01 etc. before you go. ",
        "Done.",
    ]


def test_numbered_and_bulleted_lists() -> None:
    text = "Steps:\n1. Open PeopleHub.\n2. Choose Leave.\n- Submit it.\n"
    assert chunk_text(text) == [
        "Steps:\n",
        "1. Open PeopleHub.\n",
        "2. Choose Leave.\n",
        "Submit it.\n",
    ]


def test_chinese_punctuation() -> None:
    text = "年假怎么申请？请登录人事系统，选择请假类型，然后提交。我们有3.5天的额外假期！"
    pieces = chunk_text(text, ChunkerConfig(min_chars=12))
    assert pieces == ["年假怎么申请？", "请登录人事系统，", "选择请假类型，", "然后提交。", "我们有3.5天的额外假期！"]
    short = chunk_text("好的，可以。", ChunkerConfig(min_chars=12))
    assert short == ["好的，可以。"]  # "好的，" is shorter than min_chars


def test_closing_quotes_stay_with_their_sentence() -> None:
    assert chunk_text("他说：“可以。”然后走了。", ChunkerConfig(min_chars=100, max_chars=200)) == [
        "他说：“可以。”",
        "然后走了。",
    ]
    assert chunk_text('He said "yes." Then left.') == ['He said "yes." ', "Then left."]


def test_long_text_without_punctuation_is_cut_at_a_space() -> None:
    config = ChunkerConfig(min_chars=10, max_chars=40)
    text = " ".join(["word"] * 30)
    pieces = chunk_text(text, config)
    assert "".join(pieces) == text and len(pieces) > 1
    assert all(len(p.rstrip()) <= 40 for p in pieces)
    assert all(p.endswith(" ") for p in pieces[:-1])


def test_long_chinese_without_punctuation_is_cut_between_characters() -> None:
    config = ChunkerConfig(min_chars=10, max_chars=30, cjk_weight=3)
    pieces = chunk_text("年" * 25, config)
    assert [len(p) for p in pieces] == [10, 10, 5]


def test_a_single_overlong_token_is_not_cut() -> None:
    url = "https://example.com/" + "a" * 100
    assert chunk_text(f"See {url} for more", ChunkerConfig(min_chars=5, max_chars=20)) == [
        "See ",
        f"{url} ",
        "for more",
    ]


def test_markdown_is_stripped() -> None:
    text = (
        "## Annual leave\n\n"
        "You get **25 days** of *paid* leave (see the [HR portal](https://hr.example.com)).\n"
        "- Use `PeopleHub` and the leave_type field.\n"
        "> Note: ~~old rule~~ new rule.\n"
        "```text\ncode line\n```\n"
        "![chart](x.png) done"
    )
    assert strip_markdown(text) == (
        "Annual leave\n\n"
        "You get 25 days of paid leave (see the HR portal).\n"
        "Use PeopleHub and the leave_type field.\n"
        "Note: old rule new rule.\n"
        "code line\n"
        "chart done"
    )


def test_markup_only_or_blank_text_gives_no_pieces() -> None:
    assert chunk_text("**  **\n\n") == []
    assert chunk_text("") == []


def test_bad_chunker_settings_are_rejected() -> None:
    with pytest.raises(ConfigError, match="max_chars=10: must be >= 2 \\* min_chars"):
        ChunkerConfig(min_chars=8, max_chars=10)


# -- properties ---------------------------------------------------------------------------------

WORDS = ["leave", "Annual", "days", "HR", "portal", "you", "apply", "年假", "申请", "请假", "系统"]
NUMBERS = ["3.5", "1,250", "$9.99", "10:30", "2024-03-01", "50%", "25", "0.75"]
ABBREVIATIONS = ["e.g.", "i.e.", "Dr.", "U.S.", "Mr.", "approx.", "No."]
PUNCTUATION = [".", ",", "?", "!", ";", ":", "。", "，", "！", "？", "；", "、", "...", "…", "”"]
MARKUP = ["**", "*", "`", "\n# ", "\n- ", "\n> ", "[link](http://x.y/z)", "~~", "_", "\n```\n", "\n1. "]
SEPARATORS = [" ", " ", " ", "", "\n", "\n\n", "  "]

token = st.sampled_from(WORDS + NUMBERS + ABBREVIATIONS + PUNCTUATION + MARKUP)
texts = st.lists(st.tuples(token, st.sampled_from(SEPARATORS)), max_size=60).map(
    lambda parts: "".join(t + s for t, s in parts)
)
splits = st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=8)
configs = st.builds(
    lambda lo, extra, first: ChunkerConfig(min_chars=lo, max_chars=2 * lo + extra, first_max_chars=first),
    st.integers(min_value=1, max_value=30),
    st.integers(min_value=20, max_value=100),
    st.integers(min_value=20, max_value=200),  # first_max_chars, as low as max_chars can be
)


@settings(max_examples=300, deadline=None)
@given(text=texts, sizes=splits, config=configs)
def test_pieces_join_to_the_text_minus_markup_whatever_the_deltas(text, sizes, config) -> None:
    pieces = stream(text, sizes, config)
    clean = strip_markdown(text)
    assert "".join(pieces) == (clean if clean.strip() else "")
    assert pieces == chunk_text(text, config)  # the deltas do not change the pieces
    assert all(re.search(r"[^\W_]", p) for p in pieces[:-1])  # every piece has something to say


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(
        st.tuples(
            st.sampled_from(WORDS + NUMBERS + ABBREVIATIONS + PUNCTUATION),
            st.sampled_from(WORDS),
        ),
        max_size=40,
    ),
    sizes=splits,
    config=configs,
)
def test_no_piece_breaks_a_number_or_an_abbreviation(parts, sizes, config) -> None:
    """Each generated token is followed by a word, so there is always a better place to cut."""
    text, protected = "", []
    for tok, word in parts:
        if tok in NUMBERS:
            protected.append((len(text), len(text) + len(tok)))  # no cut inside
        if tok in ABBREVIATIONS:
            protected.append((len(text), len(text) + len(tok) + 1))  # nor right after
        text += f"{tok} {word} "
    pieces = stream(text, sizes, config)
    assert "".join(pieces) == (text if text.strip() else "")
    cuts = [sum(len(p) for p in pieces[: i + 1]) for i in range(len(pieces) - 1)]
    for cut in cuts:
        assert not any(start < cut <= end for start, end in protected), (text, pieces)


@settings(max_examples=300, deadline=None)
@given(text=texts, config=configs)
def test_pieces_respect_max_chars_unless_nothing_can_be_cut(text, config) -> None:
    """A piece is longer than its limit (max_chars; the lower first_limit for the first piece)
    only if it has no place within the limit to cut at (between words or CJK characters, with
    something speakable before it)."""
    for index, piece in enumerate(chunk_text(text, config)):
        limit = config.first_limit if index == 0 else config.max_chars
        body = piece.rstrip()
        if weight(body, config) <= limit:
            continue
        for p in range(1, len(body)):
            if weight(body[:p], config) > limit:
                break
            between_words = body[p - 1].isspace() and not body[p].isspace()
            between_cjk = bool(re.match(r"[\u3400-\u9fff]{2}", body[p - 1 : p + 1]))
            assert not ((between_words or between_cjk) and re.search(r"[^\W_]", body[:p])), (
                text,
                piece,
            )
