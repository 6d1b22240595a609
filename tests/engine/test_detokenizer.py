"""Streaming detokenization is UTF-8 safe and honours stop strings split across tokens."""

from __future__ import annotations

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling import SamplingParams

TEXTS = [
    "年假怎么申请？请在 PeopleHub 提交请假申请表（HR-01）。",
    "Great news 🎉👍🏽 — leave approved! 😀",
    "混合 mixed 文本 with émojis 🚀 and 中文标点：，。！",
]


def stream(tokenizer, ids, params):
    detok = IncrementalDetokenizer(tokenizer.backend, params)
    pieces, stop = [], None
    for t in ids:
        stop = detok.add_token(t)
        pieces.append(detok.take_delta(finished=stop is not None))
        if stop:
            break
    pieces.append(detok.take_delta(finished=True))
    return pieces, stop


def test_streaming_chinese_and_emoji_equals_the_full_decode(smollm):
    tok = smollm.tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        pieces, _ = stream(tok, ids, SamplingParams())
        assert "".join(pieces) == tok.decode(ids) == text
        assert all("\ufffd" not in p for p in pieces)  # never half a character
        assert sum(1 for p in pieces if p) > 3  # it really streamed


def test_stop_string_split_across_tokens_is_honoured_and_excluded(smollm):
    tok = smollm.tokenizer
    text = "Submit form HR-01 in PeopleHub. END_OF_ANSWER and more text"
    ids = tok.encode(text)
    stop = "END_OF_ANSWER"
    # the stop string really spans several tokens
    assert not any(stop in tok.decode([i]) for i in ids)
    pieces, found = stream(tok, ids, SamplingParams(stop=[stop]))
    assert found == stop
    assert "".join(pieces) == "Submit form HR-01 in PeopleHub. "
    # never emitted a prefix of the stop string before knowing
    assert "END" not in "".join(pieces)


def test_include_stop_string_and_earliest_match(smollm):
    tok = smollm.tokenizer
    ids = tok.encode("alpha beta gamma delta")
    pieces, found = stream(tok, ids, SamplingParams(stop=["delta", "beta"], include_stop_str_in_output=True))
    assert found == "beta" and "".join(pieces) == "alpha beta"


def test_chinese_stop_string(smollm):
    tok = smollm.tokenizer
    ids = tok.encode("请提交申请表。谢谢！以后的内容")
    pieces, found = stream(tok, ids, SamplingParams(stop=["谢谢"]))
    assert found == "谢谢" and "".join(pieces) == "请提交申请表。"
