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

How many drafts pay depends on the step: a draft costs one more row, and on a CPU, whose decode
step is bound by its integer dot products rather than by reading the weights, a row costs a good
share of a step (a 5-row native step took ~2.7x a 1-row one: ``row_cost`` ~0.43). So each request
keeps an estimate of how often its drafts are accepted (:class:`Acceptance`), and each step
proposes the number of drafts (:func:`best_k`, possibly none) that maximizes the tokens expected per
unit of step cost: an answer that quotes its prompt gets several, one that does not soon gets none.

Drafts come from a :class:`Proposer`: :class:`NgramProposer` here, or a smaller model of the same
tokenizer that decodes ahead greedily (engine/draft_model.py). An n-gram that the request's own
tokens do not continue may still be continued by a recent request's answer
(:class:`AnswerCache`): questions about one handbook get answers worded alike ("submit form HR-01
in PeopleHub", "the handbook does not say; ask ..."), and a draft never changes an output, only
how many steps it takes. A model's draft costs a step of the
draft model as well, which :func:`best_k` weighs (``draft_cost``).

With async scheduling the step before a verifying one may still be in flight, its token not yet
on the host. A proposer that :attr:`Proposer.drafts_ahead` (n-gram lookup) is then asked for one
token more than the drafts, on the tokens known: the first is its guess of the token in flight,
the rest are the drafts, and the verifying step is launched behind the step in flight (its first
input read from that step's sample on the device) instead of waiting for it. A wrong guess only
costs the drafts: each draft is still checked against the target's sample after the real tokens
before it, so verification stays exact whatever the drafts were.

Each step counts proposed and accepted drafts (:class:`SpecDecodeStats`, on ``/metrics`` under
vLLM's ``vllm:spec_decode_*`` names).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class DraftWant:
    """One request's ask for drafts before a step: its tokens so far as the host knows them
    (prompt and verified output) and how many tokens to propose (``k`` >= 1: the drafts that pay,
    plus one for the guess of a token still in flight when drafting ahead)."""

    request_id: str
    token_ids: list[int]
    k: int


class Proposer(Protocol):
    """Proposes draft tokens for the decoding requests of one step."""

    def propose_batch(self, wants: list[DraftWant]) -> list[list[int]]:
        """Up to ``want.k`` draft tokens for each want, in order (possibly none)."""
        ...

    def release(self, request_id: str, output_token_ids: Sequence[int] = ()) -> None:
        """Forget a finished request (its draft state, if the proposer keeps any); its output
        tokens may seed later requests' drafts."""
        ...

    @property
    def drafts_ahead(self) -> bool:
        """Whether it drafts ahead of the step in flight (async scheduling): asked on the tokens
        the host knows, which lack that step's token, for one token more, the first being its
        guess of that token (see ``EngineCore._propose_drafts``). Worth it when a guess is free
        (a lookup); a proposer whose every token costs a step of its own (a draft model) has the
        step read back instead."""
        ...


@dataclass
class NgramIndex:
    """Where each n-gram (``min_n`` <= n <= ``max_n``) of a growing token sequence last ended,
    updated as tokens are appended: a lookup costs a few dict reads instead of a scan of the whole
    context (with the scan, a 1,141-token question's steps spent 0.51 ms of host time scheduling
    and drafting against 0.08 ms without speculation, on a 2-core CPU: host time that a step read
    back at once exposes).
    Only n-grams that end before the last token are indexed: the last n tokens are the key.
    An index may continue a ``base``: the frozen index of the sequence's first tokens, shared with
    other sequences that start alike (:class:`SharedPrefixes`); it is looked up after this index's
    own n-grams, which end later, and is never extended."""

    min_n: int
    max_n: int
    ends: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending at or before this position are in ``ends`` (or the base's)
    base: NgramIndex | None = None

    @classmethod
    def over(cls, base: NgramIndex) -> NgramIndex:
        """An empty index that continues ``base`` (its sequence's first tokens, already indexed)."""
        return cls(base.min_n, base.max_n, indexed=base.indexed, base=base)

    def extend(self, tokens: list[int]) -> None:
        """Index the n-grams of ``tokens`` (the sequence seen so far, grown since the last call)
        that end before its last token."""
        last = len(tokens) - 1  # n-grams ending here at the latest
        for n in range(self.min_n, self.max_n + 1):
            first = max(self.indexed + 1, n)
            if first <= last:  # zip builds the n-grams in C: 2,200 tokens in 2.7 ms on a 2-core CPU, once a request
                grams = zip(*(tokens[first - n + j : last - n + j + 1] for j in range(n)))
                self.ends.setdefault(n, {}).update(zip(grams, range(first, last + 1)))  # later ends overwrite
        self.indexed = max(self.indexed, last)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest
        n-gram ending ``tokens``; [] without one."""
        self.extend(tokens)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            key = tuple(tokens[-n:])
            end = self.ends.get(n, {}).get(key)
            if end is None and self.base is not None:
                end = self.base.ends.get(n, {}).get(key)
            if end is not None:
                return tokens[end : end + k]
        return []


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many first tokens ``a`` and ``b`` share (slices compared in C, 256 tokens at a time)."""
    n, step = 0, 256
    limit = min(len(a), len(b))
    while n + step <= limit and a[n : n + step] == b[n : n + step]:
        n += step
    while n < limit and a[n] == b[n]:
        n += 1
    return n


@dataclass
class SharedPrefixes:
    """Frozen n-gram indexes of long prompt prefixes that requests share (the documents in front of
    every question), so that a new request indexes only the tokens after one. A request that
    starts with a kept prefix gets an index over that prefix's; otherwise the tokens it shares with
    the last new request, at least ``min_tokens`` and cut to a multiple of ``align`` (so that the
    next question, which shares the documents but not the words after them, starts with it too),
    become a kept prefix. The ``capacity`` most recently used prefixes are kept.
    Indexing a whole handbook prompt is most of the proposer's host time a request, spent in its
    first decode step, which a batch-1 answer waits for: on the spec bench's 32 questions
    (2,161-2,170-token prompts, 30-token answers, 2-core CPU) the proposer's time a question fell
    from 1.36 to 0.36 ms with n-grams of 1 to 8 tokens (2 to 4: 0.50 to 0.16 ms)."""

    min_n: int
    max_n: int
    min_tokens: int = 256
    align: int = 64
    capacity: int = 4
    entries: list[tuple[list[int], NgramIndex]] = field(default_factory=list)  # most recently used first
    previous: list[int] = field(default_factory=list)  # the last new request's tokens

    def index_for(self, tokens: list[int]) -> NgramIndex:
        """A new (empty) index for a request's ``tokens``, over a kept prefix's index where they
        start with one."""
        for i, (prefix, base) in enumerate(self.entries):
            if tokens[: len(prefix)] == prefix:
                self.entries.insert(0, self.entries.pop(i))
                return NgramIndex.over(base)
        shared = common_prefix_length(tokens, self.previous) // self.align * self.align
        self.previous = list(tokens)
        if shared < self.min_tokens:
            return NgramIndex(self.min_n, self.max_n)
        base = NgramIndex(self.min_n, self.max_n)
        base.extend(tokens[:shared])
        self.entries.insert(0, (tokens[:shared], base))
        del self.entries[self.capacity :]
        return NgramIndex.over(base)


@dataclass
class AnswerCache:
    """The outputs of the last requests (``capacity`` tokens at most, oldest dropped first), indexed
    by their n-grams (``min_n`` <= n <= ``max_n``): drafts for a request whose own tokens do not
    continue its last n-gram. Each n-gram maps to the answer and position where it last ended; an
    entry left by a dropped answer is ignored, and the index is rebuilt from the answers kept once
    dropped answers held more than ``capacity`` tokens (so it stays within a few times
    ``capacity`` entries)."""

    capacity: int
    min_n: int = 2
    max_n: int = 4
    answers: dict[int, list[int]] = field(default_factory=dict)  # serial -> tokens, oldest first
    ends: dict[tuple[int, ...], tuple[int, int]] = field(default_factory=dict)  # n-gram -> (serial, end)
    num_tokens: int = 0
    dropped_since_rebuild: int = 0
    next_serial: int = 0

    def __post_init__(self) -> None:
        if self.capacity < 1 or not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"AnswerCache needs capacity >= 1 and 1 <= min_n <= max_n, got capacity={self.capacity}, "
                             f"min_n={self.min_n}, max_n={self.max_n}")

    def add(self, tokens: Sequence[int]) -> None:
        """Keep one answer (its last ``capacity`` tokens), dropping the oldest answers beyond ``capacity``."""
        answer = list(tokens[-self.capacity :])
        if len(answer) <= self.min_n:  # no n-gram with a token after it
            return
        serial, self.next_serial = self.next_serial, self.next_serial + 1
        self.answers[serial] = answer
        self.num_tokens += len(answer)
        self._index(serial, answer)
        while self.num_tokens > self.capacity:
            dropped = self.answers.pop(next(iter(self.answers)))
            self.num_tokens -= len(dropped)
            self.dropped_since_rebuild += len(dropped)
        if self.dropped_since_rebuild > self.capacity:
            self.ends.clear()
            for kept, answer in self.answers.items():
                self._index(kept, answer)
            self.dropped_since_rebuild = 0

    def _index(self, serial: int, answer: list[int]) -> None:
        """Each n-gram of ``answer`` that has a token after it (later ends overwrite)."""
        for n in range(self.min_n, self.max_n + 1):
            grams = zip(*(answer[j : len(answer) - n + j] for j in range(n)))
            self.ends.update(zip(grams, ((serial, end) for end in range(n, len(answer)))))

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest n-gram ending ``tokens`` where it last ended
        in a kept answer; [] without one."""
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            hit = self.ends.get(tuple(tokens[-n:]))
            if hit is not None and hit[0] in self.answers:
                return self.answers[hit[0]][hit[1] : hit[1] + k]
        return []

    def clear(self) -> None:
        """Forget every answer."""
        self.answers.clear()
        self.ends.clear()
        self.num_tokens = self.dropped_since_rebuild = 0


@dataclass(frozen=True)
class NgramProposer:
    """Proposes up to ``k`` tokens by matching the request's last ``max_n`` .. ``min_n`` tokens
    against its earlier tokens (prompt and output), the most recent match of the longest n-gram,
    and failing that against recent requests' answers (``answers``, when given; a released
    request's output joins them). Each request's n-grams are indexed as its tokens grow
    (:class:`NgramIndex`), over the shared index of a long prompt prefix it starts with
    (:class:`SharedPrefixes`), until it is released."""

    k: int
    min_n: int = 2
    max_n: int = 4
    answers: AnswerCache | None = field(default=None, compare=False, repr=False)
    indexes: dict[str, NgramIndex] = field(default_factory=dict, compare=False, repr=False)
    prefixes: SharedPrefixes = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.k < 1 or not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"NgramProposer needs k >= 1 and 1 <= min_n <= max_n, got k={self.k}, "
                             f"min_n={self.min_n}, max_n={self.max_n}")
        if self.answers is not None and (self.answers.min_n, self.answers.max_n) != (self.min_n, self.max_n):
            raise ValueError(f"NgramProposer's answers must index its own n-grams ({self.min_n}..{self.max_n}), "
                             f"got {self.answers.min_n}..{self.answers.max_n}")
        object.__setattr__(self, "prefixes", SharedPrefixes(self.min_n, self.max_n))  # frozen: set once, here

    def propose(self, tokens: list[int], limit: int | None = None, index: NgramIndex | None = None) -> list[int]:
        """Up to ``min(k, limit)`` draft tokens to follow ``tokens``, or [] without a match;
        ``index``: the sequence's index so far (default: one built for this call)."""
        k = self.k if limit is None else min(self.k, limit)
        if k < 1 or len(tokens) <= self.min_n:
            return []
        drafts = (index or NgramIndex(self.min_n, self.max_n)).lookup(tokens, k)
        if not drafts and self.answers is not None:
            drafts = self.answers.lookup(tokens, k)
        return drafts

    def _index(self, want: DraftWant) -> NgramIndex:
        """The request's index, anew if its tokens are not the ones indexed (fewer than them)."""
        index = self.indexes.get(want.request_id)
        if index is None or len(want.token_ids) < index.indexed:
            index = self.indexes[want.request_id] = self.prefixes.index_for(want.token_ids)
        return index

    def propose_batch(self, wants: list[DraftWant]) -> list[list[int]]:
        """Each want's proposal on its own: a lookup in its own tokens."""
        return [self.propose(w.token_ids, w.k, self._index(w)) for w in wants]

    def release(self, request_id: str, output_token_ids: Sequence[int] = ()) -> None:
        """Forget the request's index; keep its output among the answers (when kept)."""
        self.indexes.pop(request_id, None)
        if self.answers is not None and output_token_ids:
            self.answers.add(output_token_ids)

    @property
    def drafts_ahead(self) -> bool:
        """Yes: a lookup costs a few dict reads, so a guess of the token in flight costs nothing.
        On the H200 with the 1.5B at batch 1, a step read back at once took 2.5 ms of host time
        against 1.4 ms async (2026-12-04)."""
        return True


def best_k(acceptance: float, row_cost: float, k_max: int, draft_cost: float = 0.0) -> int:
    """The number of drafts (0..``k_max``) that maximizes expected tokens per step cost: with each
    draft accepted with probability ``acceptance`` given the ones before it, k drafts yield
    1 + a + a^2 + ... + a^k tokens for a step costing 1 + ``row_cost`` * k one-row steps, plus
    ``draft_cost`` (one draft-model step, as a share of a target step) for each draft a model
    proposes (0 for n-gram lookup)."""
    best, best_rate = 0, 1.0
    expected = 1.0
    for k in range(1, k_max + 1):
        expected += acceptance**k
        rate = expected / (1 + (row_cost + draft_cost) * k)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


PRIOR = 0.8  # a new request's acceptance estimate (Acceptance)


@dataclass
class Acceptance:
    """A request's running estimate of the chance that a draft is accepted given the ones before it
    were: accepted drafts over drafts decided (each rejected draft ends its step's decisions),
    older steps weighted down by ``decay``. Starts at 0.8 (:data:`PRIOR`), as if from a few drafts:
    answers that quote their prompt are the common case. A step without drafts (:meth:`rest`)
    moves it slowly back there, so a request that stopped drafting tries again now and then (an
    answer may start quoting later)."""

    accepted: float = 5 * PRIOR
    decided: float = 5.0
    decay: float = 0.7
    rest_weight: float = 0.1

    @property
    def rate(self) -> float:
        return self.accepted / self.decided

    def update(self, num_drafts: int, num_accepted: int) -> None:
        """One verification: ``num_accepted`` of ``num_drafts`` accepted."""
        self.accepted = self.accepted * self.decay + num_accepted
        self.decided = self.decided * self.decay + min(num_drafts, num_accepted + 1)

    def rest(self) -> None:
        """A step in which the estimate kept the request from drafting: a small pull back to :data:`PRIOR`."""
        self.accepted = self.accepted * self.decay + self.rest_weight * PRIOR
        self.decided = self.decided * self.decay + self.rest_weight


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
    num_drafts_ahead: int = 0  # verifications drafted ahead of the step in flight, on a guess of its token
    num_guesses_right: int = 0  # of those, the ones whose guess was the token sampled

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verification: ``num_drafts`` proposed, the first ``num_accepted`` of them accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafts:
            self.accepted_per_pos += [0] * (num_drafts - len(self.accepted_per_pos))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    def record_guess(self, right: bool) -> None:
        """One request's verification drafted ahead of the step in flight: whether the token it
        guessed that step samples was the one sampled (when not, its drafts rarely stand)."""
        self.num_drafts_ahead += 1
        self.num_guesses_right += right

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted drafts per proposed draft (None before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verifying step appends on average: accepted drafts + the one sampled after them."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None
