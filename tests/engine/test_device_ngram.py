"""n-gram drafts and greedy verification on the device (engine/device_ngram.py): the same drafts
as the host's n-gram index, the same accepted tokens as the host's verification rule, and an
append that leaves each request's history as the host would have it. On the CPU; the functions
are plain tensor operations, the same on a GPU."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.device_ngram import accept_greedy, append_accepted, ngram_drafts
from engine.speculative import NgramIndex, accepted_tokens


def host_drafts(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The host proposer's lookup (NgramProposer.propose without answers)."""
    return NgramIndex(min_n, max_n).lookup(tokens, k) if len(tokens) > min_n else []


def padded(rows: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    history = torch.full((len(rows), width), 7, dtype=torch.int64)  # 7: garbage past each length
    for b, row in enumerate(rows):
        history[b, : len(row)] = torch.tensor(row)
    return history, torch.tensor([len(r) for r in rows])


def test_drafts_follow_the_longest_most_recent_match():
    history, lengths = padded([[1, 2, 3, 4, 5, 9, 2, 3], [7, 2, 3, 8, 8, 2, 3, 6, 6, 7, 2, 3], [1, 2, 3, 4, 5, 6], [1, 2, 3, 1, 2]], 16)
    drafts, num = ngram_drafts(history, lengths, k=3, min_n=2, max_n=3)
    assert num.tolist() == [3, 3, 0, 3]
    assert drafts[0].tolist() == [4, 5, 9]
    assert drafts[1].tolist() == [8, 8, 2]  # the 3-gram "7 2 3" beats the more recent 2-gram "2 3"
    assert drafts[3].tolist() == [3, 1, 2]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=30), min_size=1, max_size=4),
       st.integers(1, 8), st.integers(1, 3), st.integers(0, 5))
def test_drafts_are_the_host_indexs(rows, k, min_n, extra):
    """Whatever the tokens (a small vocabulary: many repeats), each request's drafts are exactly
    what the host's NgramIndex proposes for its tokens."""
    max_n = min_n + extra
    history, lengths = padded(rows, 32)
    drafts, num = ngram_drafts(history, lengths, k, min_n, max_n)
    for b, row in enumerate(rows):
        want = host_drafts(row, k, min_n, max_n)
        assert num[b].item() == len(want), (row, want)
        assert drafts[b, : len(want)].tolist() == want


@given(st.lists(st.integers(0, 3), min_size=4, max_size=4), st.lists(st.integers(0, 3), min_size=5, max_size=5), st.integers(0, 4))
def test_accepted_drafts_are_the_host_rules(drafts, samples, num_drafts):
    """The drafts accepted are those of engine.speculative.accepted_tokens over the request's
    first num_drafts drafts (a request with fewer drafts has its rows' extra samples ignored)."""
    accepted = accept_greedy(torch.tensor([drafts]), torch.tensor([num_drafts]), torch.tensor([samples]))
    want = accepted_tokens(drafts[:num_drafts], samples[: num_drafts + 1])
    assert accepted.tolist() == [len(want) - 1]


def test_append_puts_the_accepted_tokens_after_each_history():
    history, lengths = padded([[1, 2], [5]], 10)
    samples = torch.tensor([[3, 4, 9], [6, 8, 8]])
    append_accepted(history, lengths, samples, torch.tensor([1, 0]))
    assert lengths.tolist() == [4, 2]
    assert history[0, :4].tolist() == [1, 2, 3, 4]
    assert history[1, :2].tolist() == [5, 6]
    # then the next lookup sees them: "2 3 4" is new, but "5 6" continues nothing yet
    drafts, num = ngram_drafts(history, lengths, k=2, min_n=1, max_n=2)
    assert num.tolist() == [0, 0]
