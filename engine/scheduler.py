"""Continuous batching with one token budget per step, priorities and preemption by recompute.

Each step hands out ``max_num_batched_tokens`` tokens; a decode with draft tokens
(speculative decoding, engine/speculative.py) takes one more token for each draft the budget
still holds. Requests are visited by priority class
(lower value first); within a class, running decodes get their one token first, then running
requests still prefilling get chunks, then waiting requests are admitted (FCFS) with what is
left. So decodes and prefill chunks share a step, and a long prompt never stalls running streams
of its class (chunked prefill). When KV blocks or seats (``max_num_seqs``) run out, the
lowest-priority, latest-arriving running request is preempted: its blocks are freed and it goes
back to waiting to be recomputed (its full blocks usually survive in the prefix cache). A waiting
request may preempt running ones only of a strictly lower class; a running one may preempt any
request behind it in scheduling order, itself included.

A step bound (:class:`StepBound`, asked for once per step from the ``step_bound`` callable given
at construction) caps the tokens handed to classes after a given one: while an urgent request is
on its way, or waits for its first token, a long prefill chunk of background work does not make
the step it runs in (or the step in flight when it arrives) long.

With ``beside_decodes_max_chunk`` (a GPU server whose mixed-step CUDA graphs were captured at
start-up) a step that has decodes takes one prefill chunk of at most that many tokens, the most
urgent first, so that it replays a graph; with nothing decoding, prompts share steps as above.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.request import Request, RequestStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None  # cap on one request's chunk per step
    max_model_len: int = 8192
    # Token counts the runner replays as CUDA graphs (ascending; empty: none). A step of T tokens
    # runs as the bucket above T, its padding rows computing nothing useful; with chunked
    # prefill a large step is trimmed down to a bucket instead (see Scheduler._fit_to_bucket).
    step_token_buckets: tuple[int, ...] = ()
    # While requests decode, a step holds at most one prefill chunk, of at most this many tokens
    # (0: no such limit): the shapes of the mixed-step CUDA graphs captured at start-up
    # (EngineConfig.mixed_cuda_graph_start_chunk), so such a step replays one graph instead of
    # running its attention eagerly. A second question then waits a step (~15-25 ms on the H200).
    beside_decodes_max_chunk: int = 0


@dataclass
class TokenBudget:
    """The tokens a step may still hand out; helpers take from it and preemption gives back."""

    remaining: int

    def take(self, n: int) -> None:
        self.remaining -= n

    def give_back(self, n: int) -> None:
        self.remaining += n


@dataclass(frozen=True)
class StepBound:
    """Requests of a priority class after ``priority`` (a larger value) get at most ``tokens`` of a
    step between them; the classes up to ``priority`` keep the whole budget."""

    priority: int
    tokens: int

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ValueError(f"StepBound.tokens={self.tokens}: must be >= 1")


# Asked once per step: the bound for this step, or None for none.
StepBoundPolicy = Callable[[], StepBound | None]


# Below this many tokens a step is bound by reading the weights, so padding it to the next bucket
# is nearly free and trimming would only delay a prompt's first token by a step.
FIT_BUCKET_MIN_TOKENS = 1024


@dataclass
class ScheduledChunk:
    """``num_tokens`` of a request in one step; a decode may also verify ``drafts`` (speculative
    decoding: its last token, then the drafts, counted in ``num_tokens``)."""

    request: Request
    num_tokens: int
    drafts: list[int] = field(default_factory=list)

    @property
    def start(self) -> int:
        """Position of the chunk's first token (the request's computed tokens so far)."""
        return self.request.num_computed_tokens

    @property
    def completes_prompt(self) -> bool:
        """True when the chunk reaches the request's last known token, so it yields a sample
        (a verifying decode: one after its last token and one after each draft)."""
        return self.request.num_computed_tokens + self.num_tokens - len(self.drafts) == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests that alone need more KV blocks than the whole pool: finished ("length").
    out_of_capacity: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, step_bound: StepBoundPolicy | None = None) -> None:
        self.config = config
        self.block_manager = block_manager
        self.step_bound = step_bound
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []  # sorted by Request.sort_key
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        bisect.insort(self.waiting, req, key=lambda r: r.sort_key)

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """Remove a request wherever it is and free its blocks (finish or abort)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.block_manager.free(req)
        req.status = status

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        scheduled: dict[int, ScheduledChunk] = {}
        budget = TokenBudget(self.config.max_num_batched_tokens)
        bound = self.step_bound() if self.step_bound is not None else None
        admission_open = True
        oversize_used = False
        classes = sorted({r.priority for r in self.running} | {r.priority for r in self.waiting})
        # beside decodes, one prefill chunk of at most this many tokens (0: any number, any size)
        beside = self.config.beside_decodes_max_chunk if any(not r.is_prefilling for r in self.running) else 0
        prefill_chunks = 0
        for cls in classes:
            if bound is not None and cls > bound.priority and budget.remaining > bound.tokens:
                budget.remaining = bound.tokens  # what the classes from here on share
            members = [r for r in self.running if r.priority == cls]
            decodes = [r for r in members if not r.is_prefilling]
            prefills = [r for r in members if r.is_prefilling]
            for req in decodes + prefills:
                if req.status is not RequestStatus.RUNNING or budget.remaining <= 0 or self._awaits_last_token(req):
                    continue
                n = self._chunk_size(req, budget.remaining)
                drafts = req.draft_token_ids[: budget.remaining - n] if not req.is_prefilling else []
                n += len(drafts)
                if beside and req.is_prefilling:
                    if prefill_chunks:
                        continue
                    n, prefill_chunks = min(n, beside), 1
                while not self.block_manager.allocate_slots(req, n):
                    victim = self.running[-1]
                    if victim is req and len(self.running) == 1:
                        # Nothing else holds blocks: the pool is too small for this request.
                        self.finish_request(req, RequestStatus.FINISHED_LENGTH)
                        out.out_of_capacity.append(req)
                        break
                    self._preempt(victim, scheduled, budget, out)
                    if victim is req:
                        break
                if req.status is RequestStatus.RUNNING:
                    scheduled[id(req)] = ScheduledChunk(req, n, drafts)
                    budget.take(n)
            if not admission_open:
                continue
            for req in [r for r in self.waiting if r.priority == cls]:
                if req in out.preempted:  # not re-admitted in the step that preempted it
                    admission_open = False
                    break
                if budget.remaining <= 0 or (beside and prefill_chunks):
                    break
                admitted, oversize = self._try_admit(req, scheduled, budget, out, oversize_used, beside or None)
                oversize_used |= oversize
                prefill_chunks += admitted and beside > 0
                if not admitted:
                    admission_open = False  # FCFS: nobody behind it jumps the queue this step
                    break
        now = time.perf_counter()
        for chunk in scheduled.values():
            if chunk.request.metrics.first_scheduled_time is None:
                chunk.request.metrics.first_scheduled_time = now
        out.chunks = list(scheduled.values())
        self._fit_to_bucket(out.chunks)
        return out

    def _fit_to_bucket(self, chunks: list[ScheduledChunk]) -> None:
        """Shorten the last prefill chunks so a large step's token count is exactly a graph
        bucket: the trimmed tokens run next step instead of padding rows running now (up to 25%
        of a compute-bound step's matmuls). All or nothing; every chunk keeps at least one token."""
        buckets = self.config.step_token_buckets
        total = sum(c.num_tokens for c in chunks)
        if not buckets or not self.config.enable_chunked_prefill or total < FIT_BUCKET_MIN_TOKENS or total > buckets[-1]:
            return
        below = bisect.bisect_right(buckets, total) - 1
        if below < 0 or buckets[below] == total:
            return
        excess = total - buckets[below]
        cuts = []
        for c in reversed(chunks):  # the latest admitted prompts give up tokens first
            if excess == 0:
                break
            cut = min(excess, c.num_tokens - 1)
            if cut:
                cuts.append((c, cut))
                excess -= cut
        if excess:
            return  # not enough prefill tokens to trim: run padded
        for c, cut in cuts:
            c.num_tokens -= cut

    def _chunk_size(self, req: Request, budget: int) -> int:
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if self.config.long_prefill_token_threshold:
            n = min(n, self.config.long_prefill_token_threshold)
        return n

    def _awaits_last_token(self, req: Request) -> bool:
        """Its last token is pending (async scheduling): it finishes when that token arrives,
        so another decode would be wasted."""
        return req.num_pending_tokens > 0 and (
            req.num_output_tokens >= req.sampling_params.max_tokens or req.num_tokens >= self.config.max_model_len
        )

    def _try_admit(
        self, req: Request, scheduled: dict[int, ScheduledChunk], budget: TokenBudget, out: SchedulerOutput, oversize_used: bool,
        max_chunk: int | None = None,
    ) -> tuple[bool, bool]:
        """Admit one waiting request (possibly preempting lower classes), its first chunk at most
        ``max_chunk`` tokens when given (chunked prefill only). Returns (admitted, used the one
        oversize slot that non-chunked prefill gets per step)."""
        while len(self.running) >= self.config.max_num_seqs:
            if not self._preempt_lower(req, scheduled, budget, out):
                return False, False
        cached = self.block_manager.find_cached_prefix(req) if req.num_computed_tokens == 0 else []
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = len(cached) * self.block_manager.block_size
            req.metrics.num_cached_tokens = req.num_cached_tokens
        remaining = req.num_tokens - req.num_computed_tokens - len(cached) * self.block_manager.block_size
        oversize = False
        if self.config.enable_chunked_prefill:
            n = min(remaining, budget.remaining)
            if self.config.long_prefill_token_threshold:
                n = min(n, self.config.long_prefill_token_threshold)
            if max_chunk:
                n = min(n, max_chunk)
            # A first chunk that fits the free blocks beats waiting for the whole chunk's worth.
            n = max(1, min(n, self.block_manager.free_token_capacity(req, cached)))
        elif remaining <= budget.remaining:
            n = remaining
        elif not oversize_used:
            n, oversize = remaining, True  # without chunking a long prompt runs whole, once per step
        else:
            return False, False
        while not self.block_manager.allocate_slots(req, n, cached):
            if self._preempt_lower(req, scheduled, budget, out):
                continue
            if not self.running:  # nobody else holds blocks: the pool can never hold this request
                self.finish_request(req, RequestStatus.FINISHED_LENGTH)
                out.out_of_capacity.append(req)
            return False, False
        self.waiting.remove(req)
        req.num_computed_tokens += len(cached) * self.block_manager.block_size
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=lambda r: r.sort_key)
        scheduled[id(req)] = ScheduledChunk(req, n)
        budget.take(n)
        return True, oversize

    def _preempt_lower(self, req: Request, scheduled: dict[int, ScheduledChunk], budget: TokenBudget, out: SchedulerOutput) -> bool:
        """Preempt the last running request if it is of a strictly lower class than ``req``."""
        if not self.running or self.running[-1].priority <= req.priority:
            return False
        self._preempt(self.running[-1], scheduled, budget, out)
        return True

    def _preempt(self, victim: Request, scheduled: dict[int, ScheduledChunk], budget: TokenBudget, out: SchedulerOutput) -> None:
        chunk = scheduled.pop(id(victim), None)
        if chunk is not None:
            budget.give_back(chunk.num_tokens)
        self.running.remove(victim)
        self.block_manager.free(victim)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.metrics.num_preemptions += 1
        self.num_preemptions += 1
        victim.status = RequestStatus.PREEMPTED
        bisect.insort(self.waiting, victim, key=lambda r: r.sort_key)
        out.preempted.append(victim)
