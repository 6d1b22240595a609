"""Sampling parameters (validated up front) and the batched sampler.

Order of operations per row, as in vLLM/HF: penalties on the raw logits, then temperature,
then top-k / top-p / min-p filtering, then a draw. Greedy rows (temperature 0) take the argmax.
Seeded requests draw from their own generator, so their output does not depend on what else
is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.kernels.argmax import argmax_rows
from engine.transfer import to_device


class SamplingError(ValueError):
    """A sampling parameter is out of range; raised before anything is scheduled."""


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF-style, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI-style, over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: chosen token; k: chosen + top k
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        """Build from user-supplied fields; unknown names are an error, not silently ignored."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise SamplingError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        params = cls(**d)
        params.validate()
        return params

    def validate(self, vocab_size: int | None = None) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (_num(self.temperature) and 0.0 <= self.temperature <= 100.0, f"temperature must be in [0, 100], got {self.temperature!r}"),
            (_num(self.top_p) and 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (isinstance(self.top_k, int) and self.top_k >= -1, f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}"),
            (_num(self.min_p) and 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p!r}"),
            (_num(self.repetition_penalty) and self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty!r}"),
            (_num(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}"),
            (_num(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}"),
            (self.seed is None or (isinstance(self.seed, int) and -(2**63) <= self.seed < 2**63),
             f"seed must be a 64-bit signed integer (-2**63 to 2**63 - 1), got {self.seed!r}"),
            (all(isinstance(s, str) and s for s in self.stop), f"stop must be a list of non-empty strings, got {self.stop!r}"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20), f"logprobs must be None or 0..20, got {self.logprobs!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise SamplingError(message)
        if vocab_size is not None and any(t >= vocab_size for t in self.stop_token_ids):
            raise SamplingError(f"stop_token_ids must be < vocab size {vocab_size}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


@dataclass
class SampleInput:
    """What the sampler needs of one request."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


class PendingSample:
    """One step's samples: on the device at once (the next step can read them there), on the
    host when :meth:`result` is called. On a GPU the device -> host copies are queued behind the
    sampling kernels into pinned memory, so launching this does not wait for the device."""

    def __init__(
        self, tokens: torch.Tensor, logprob_counts: list[int | None], chosen: torch.Tensor | None,
        top_values: torch.Tensor | None, top_indices: torch.Tensor | None,
    ) -> None:
        self.tokens = tokens  # [N] int64 on the device
        self.logprob_counts = logprob_counts
        self._host = [_to_host(t) if t is not None else None for t in (tokens, chosen, top_values, top_indices)]
        self._ready = None
        if tokens.is_cuda:
            self._ready = torch.cuda.Event()
            self._ready.record()

    def result(self) -> SampleOutput:
        """Wait for the copies (only as long as the device still works on this step)."""
        if self._ready is not None:
            self._ready.synchronize()
        tokens, chosen, top_values, top_indices = (t.tolist() if t is not None else None for t in self._host)
        logprobs: list[dict[int, float] | None] = []
        for i, k in enumerate(self.logprob_counts):
            if k is None:
                logprobs.append(None)
                continue
            entry = {tokens[i]: chosen[i]}
            if k:
                entry.update(zip(top_indices[i][:k], top_values[i][:k]))
            logprobs.append(entry)
        return SampleOutput(tokens, logprobs)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy taken now (in stream order): ``t`` may be a persistent buffer the next step
    overwrites (the decode graphs' token output)."""
    if not t.is_cuda:
        return t.clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class Sampler:
    """Samples one token per row of ``logits`` [N, V] (float32)."""

    def __init__(self, default_generator: torch.Generator) -> None:
        self.default_generator = default_generator

    def __call__(self, logits: torch.Tensor, rows: list[SampleInput]) -> SampleOutput:
        return self.sample(logits, rows).result()

    def sample(self, logits: torch.Tensor, rows: list[SampleInput], greedy_tokens: torch.Tensor | None = None) -> PendingSample:
        """Queue the sampling of every row; nothing here waits for the device (penalty rows
        excepted: they read the request's output tokens from the host). ``greedy_tokens``: each
        row's argmax of ``logits`` when the forward computed it (decode graphs), used when every
        row is greedy and no penalty changes the logits."""
        counts = [r.params.logprobs for r in rows]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(k is not None for k in counts) else None
        penalized = any(r.params.has_penalties for r in rows)
        if penalized:
            logits = logits.clone()
            for i, r in enumerate(rows):
                if r.params.has_penalties:
                    _apply_penalties(logits[i], r)
        if all(r.params.greedy for r in rows):
            tokens = greedy_tokens if greedy_tokens is not None and not penalized else argmax_rows(logits)
        else:
            tokens = self._sample(logits, rows)
        chosen = top_values = top_indices = None
        if raw_logprobs is not None:
            chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0]
            k = max(c or 0 for c in counts)
            if k:
                top_values, top_indices = raw_logprobs.topk(k, dim=-1)
        return PendingSample(tokens, counts, chosen, top_values, top_indices)

    def _sample(self, logits: torch.Tensor, rows: list[SampleInput]) -> torch.Tensor:
        n, vocab = logits.shape
        device = logits.device
        temps = to_device([r.params.temperature or 1.0 for r in rows], logits.dtype, device)
        logits = logits / temps[:, None]
        top_k = [r.params.top_k if r.params.top_k > 0 else vocab for r in rows]
        top_p = [r.params.top_p for r in rows]
        min_p = [r.params.min_p for r in rows]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            logits = _top_k_top_p(logits, to_device(top_k, torch.long, device), to_device(top_p, logits.dtype, device))
        probs = torch.softmax(logits, dim=-1)
        if any(p > 0.0 for p in min_p):
            mp = to_device(min_p, probs.dtype, device)
            probs = probs.masked_fill(probs < mp[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        # Exponential race (equivalent to a categorical draw): argmax(p / E), E ~ Exp(1).
        # Seeded requests draw their row from their own generator (reproducible whatever the
        # batch); all other rows share one draw (one kernel, not one per row).
        noise = torch.empty_like(probs).exponential_(generator=self.default_generator)
        for i, r in enumerate(rows):
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        sampled = argmax_rows(probs / noise)
        if any(r.params.greedy for r in rows):
            greedy = to_device([r.params.greedy for r in rows], torch.bool, device)
            sampled = torch.where(greedy, argmax_rows(logits), sampled)
        return sampled


def _top_k_top_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus with -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    remove = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    cumulative = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    remove |= cumulative >= p[:, None]
    remove[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _apply_penalties(row: torch.Tensor, r: SampleInput) -> None:
    p = r.params
    vocab = row.shape[0]
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(r.prompt_token_ids) | set(r.output_token_ids)), dtype=torch.long, device=row.device)
        if seen.numel():
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
        counts = torch.bincount(torch.tensor(r.output_token_ids, device=row.device), minlength=vocab).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
