"""What the engine hands back: one delta per request per step, and the offline result."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.metrics import RequestMetrics


@dataclass
class RequestOutput:
    """New text and tokens of one request since its previous output."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    logprobs: list[dict[int, float]] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    metrics: RequestMetrics | None = None


@dataclass
class CompletionOutput:
    """A whole finished request (offline API)."""

    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None

    def add(self, delta: RequestOutput) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        if delta.logprobs:
            self.logprobs += delta.logprobs
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason
            self.num_cached_tokens = delta.num_cached_tokens
            self.metrics = delta.metrics
