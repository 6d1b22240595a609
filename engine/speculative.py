"""Speculative decoding with n-gram prompt lookup: propose the tokens that followed the last few
tokens where they occurred before, verify them all in one target step.

A handbook answer quotes the handbook, and the handbook is in the prompt: when an answer's last
tokens also occur in the prompt, the tokens after them there are a good guess for what comes
next. A decode step then feeds the request's last token plus ``k`` proposed ("draft") tokens, and
the model's logits at each of those ``k + 1`` positions say which drafts it agrees with. A decode
step on a small batch is bound by reading the weights, so a ``k + 1``-token step costs much less
than ``k + 1`` one-token steps.

Verification (:func:`accepted_tokens`): a sample is drawn at every position from the target's own
distribution, exactly as a one-token step would draw it (same temperature, top-k/p); drafts are
accepted while each equals the sample drawn at its position, and the first sample that differs
(or the one after the last draft) is kept as well. For a draft that is a single proposed token
(an n-gram proposal is one token, not a distribution) this is exact rejection sampling: the draft
is accepted with probability p(draft), and when it is not, the kept sample is drawn from p with
the draft excluded, renormalized. So the output has the target's distribution at any temperature,
and at temperature 0 it is the same token sequence as without speculation.

Each step counts proposed and accepted drafts (:class:`SpecDecodeStats`, on ``/metrics`` under
vLLM's ``vllm:spec_decode_*`` names).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class NgramProposer:
    """Proposes up to ``k`` tokens by matching the request's last ``max_n`` .. ``min_n`` tokens
    against its earlier tokens (prompt and output), the most recent match of the longest n-gram."""

    k: int
    min_n: int = 2
    max_n: int = 4

    def __post_init__(self) -> None:
        if self.k < 1 or not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"NgramProposer needs k >= 1 and 1 <= min_n <= max_n, got k={self.k}, "
                             f"min_n={self.min_n}, max_n={self.max_n}")

    def propose(self, tokens: list[int], limit: int | None = None) -> list[int]:
        """Up to ``min(k, limit)`` draft tokens to follow ``tokens``, or [] without a match."""
        k = self.k if limit is None else min(self.k, limit)
        if k < 1 or len(tokens) <= self.min_n:
            return []
        ids = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            # every window of n tokens that ends before the last token, compared with the suffix
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # the token after the most recent earlier occurrence
                return ids[start : start + k].tolist()
        return []


def accepted_tokens(drafts: list[int], samples: list[int]) -> list[int]:
    """The tokens a verified step appends: ``samples`` (one per position: after the last known
    token, then after each draft) up to and including the first one that differs from its draft;
    all ``len(drafts) + 1`` when every draft was accepted. See the module docstring."""
    if len(samples) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} samples, got {len(samples)}")
    out = []
    for draft, sample in zip(drafts, samples):
        out.append(sample)
        if sample != draft:
            return out
    out.append(samples[-1])
    return out


@dataclass
class SpecDecodeStats:
    """Totals since start: steps that verified drafts, drafts proposed, drafts accepted, and
    accepted drafts by their position (0: the first draft of a step)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verification: ``num_drafts`` proposed, the first ``num_accepted`` of them accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafts:
            self.accepted_per_pos += [0] * (num_drafts - len(self.accepted_per_pos))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted drafts per proposed draft (None before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verifying step appends on average: accepted drafts + the one sampled after them."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None
