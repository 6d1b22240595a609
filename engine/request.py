"""A request as the scheduler sees it: tokens, progress, KV blocks, priority and timings."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.metrics import RequestMetrics
from engine.prefix_cache import BlockHash
from engine.sampling import SamplingParams
from engine.speculative import Acceptance


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    """Lower ``priority`` values are served first (0 = interactive voice turn)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    arrival_seq: int = 0
    extra_keys: tuple = ()
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until looked up
    num_preemptions: int = 0
    # Sampled by a step still in flight, not yet read back (async scheduling): they count as
    # tokens for scheduling, but are in neither token list until the host has them.
    num_pending_tokens: int = 0
    stop_reason: int | str | None = None
    # Tokens proposed to follow its last one (speculative decoding), verified by its next step.
    draft_token_ids: list[int] = field(default_factory=list)
    # Drafted ahead of a step in flight (async scheduling): the token the drafts guessed that step
    # samples, their first input; the drafts follow it.
    draft_guess: int | None = None
    # False once it has decoded in a batch too large to speculate (speculative_max_batch) with
    # async scheduling: it would draft only in that batch's tail, where drafting cost more than it saved.
    may_draft: bool = True
    acceptance: Acceptance = field(default_factory=Acceptance)  # how often its drafts are accepted
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    # prompt + output, kept as one list: the runner slices it every step (no re-concatenation)
    all_token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def num_tokens(self) -> int:
        """Known tokens plus the pending ones (the next decode's input may still be on the device)."""
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        """Output tokens, known or pending."""
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: priority class, then arrival (FCFS within a class)."""
        return (self.priority, self.arrival_seq)

    @property
    def is_prefilling(self) -> bool:
        return self.num_tokens - self.num_computed_tokens > 1
