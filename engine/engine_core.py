"""The engine loop: add requests, step (schedule -> run -> sample -> detokenize), abort.

Single-threaded and synchronous; :class:`engine.LLM` drives it to completion and
:class:`engine.AsyncEngine` runs it on a background thread. Built from its parts by
:func:`engine.engine_builder.build_engine`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.device_speculation import DeviceSpeculation, DeviceSpeculationStats, DeviceStep, StepYield, takes_device_path
from engine.execution_path import ExecutionPath
from engine.kv_cache import KVCache
from engine.loaded_model import LoadedModel
from engine.memory import MemoryLedger
from engine.metrics import EngineStats, StepTimes
from engine.model_runner import DeviceTokens, ModelRunner, StepInputs
from engine.outputs import RequestOutput
from engine.prefix_cache import PrefixCacheStats
from engine.request import Request, RequestStatus
from engine.sampling import PendingSample, SampleInput, Sampler, SamplingParams
from engine.scheduler import ScheduledChunk, Scheduler
from engine.speculative import DraftWant, Proposer, SpecDecodeStats, accepted_tokens, best_k
from engine.transfer import to_device

log = logging.getLogger(__name__)


@dataclass
class InflightStep:
    """A launched step whose samples the host has not read yet."""

    requests: list[Request]  # every request with a chunk in the step
    sampled: list[ScheduledChunk]  # the chunks it samples for, in sample-row order (a verifying decode: 1 + drafts rows)
    sample: PendingSample | None
    device_tokens: DeviceTokens | None  # the samples, on the device, for the next step's decodes
    path: ExecutionPath = ExecutionPath.EAGER  # how the forward ran (decided by ModelRunner.prepare)
    span: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # CUDA events around the step
    chained: bool = False  # launched while the step before it was in flight (async scheduling)
    after_read_back: bool = False  # launched onto an idle device because the step before it was read back at once
    num_tokens: int = 0  # tokens the step computed


class RequestError(ValueError):
    """A request is invalid; raised by ``add_request`` before anything is scheduled."""


class EngineCore:
    def __init__(
        self, config: EngineConfig, loaded: LoadedModel, memory: MemoryLedger, max_model_len: int, kv_cache: KVCache,
        block_manager: BlockManager, scheduler: Scheduler, runner: ModelRunner, proposer: Proposer | None = None,
        device_speculation: DeviceSpeculation | None = None,
    ) -> None:
        """The step loop over parts already set up (:func:`engine.engine_builder.build_engine`);
        ``proposer`` gives decoding requests their drafts before each step (speculative decoding);
        ``device_speculation`` runs the steps while every running request decodes greedily, with
        drafts and verification decided on the device (engine/device_speculation.py)."""
        self.config = config
        self.device, self.dtype = loaded.device, loaded.dtype
        self.model, self.model_config, self.tokenizer = loaded.model, loaded.model_config, loaded.tokenizer
        self.memory = memory
        self.max_model_len = max_model_len
        self.kv_cache = kv_cache
        self.block_manager = block_manager
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.seed))
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._generators: dict[str, torch.Generator] = {}
        # async scheduling: the step launched on the device whose samples the host has not read yet
        self.async_scheduling = config.async_scheduling == "on" or (config.async_scheduling == "auto" and self.device.type == "cuda")
        # speculative decoding: drafts proposed before each step (EngineConfig.speculative)
        self.proposer = proposer
        self.draft_cost = config.speculative_draft_cost if config.speculative == "draft" else 0.0
        self.row_cost = config.row_cost(self.device.type)
        self._inflight: InflightStep | None = None
        self.device_speculation = device_speculation
        self._device_inflight: tuple[DeviceStep, InflightStep] | None = None  # a device speculation step launched, not read
        self._device_yield = StepYield.prior(config.num_speculative_tokens)  # tokens per request and device step
        self._device_resting = False  # left because its steps did not pay: back once a host-verified draft stands
        self.reset_counters()
        self.warm_up_steps = 0  # steps the start-up warm-up ran (EngineConfig.warm_up)

    def reset_counters(self) -> None:
        """Request ids, step counts and timings, token totals and prefix-cache statistics from zero
        (the cached prefixes stay). Only while no request is in flight, e.g. after a warm-up."""
        self._ids = itertools.count()
        self._last_step_end: torch.cuda.Event | None = None  # for the device's idle time between steps
        self._read_back_at: float | None = None  # when a step was read back at once while requests remained
        self.num_steps = 0
        self.step_times = StepTimes()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.scheduler.num_preemptions = 0
        self.spec_stats = SpecDecodeStats()
        self.device_stats = DeviceSpeculationStats()
        self.block_manager.prefix_cache.stats = PrefixCacheStats()

    def warm_up(self) -> None:
        """Run throwaway requests through the real step loop - a short prompt, a long one, the
        long one again with a few more tokens (a prefix-cache hit: a short chunk after a cached
        context, whose attention splits and merges), and a prompt arriving while another request
        decodes (a mixed step) - then forget them: no cached prefixes, counters and step timings
        back to zero, request ids from the start. Called once by the builder, before serving."""
        start = time.perf_counter()
        vocab = self.model_config.vocab_size
        pool = self.block_manager.num_usable_blocks * self.config.block_size
        longest = max(1, min(600, self.max_model_len - 24, pool // 2 - 24))
        long_prompt = [1 + i % (vocab - 1) for i in range(longest)]
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        for prompt in (long_prompt[:16], long_prompt, long_prompt + [2] * 20):
            self.add_request(prompt, params)
            while self.has_unfinished_requests():
                self.step()
        # A mixed step: one request decoding while another's prompt is prefilled in the same step.
        # Every shape here is seen once, so no mixed-step graph is captured for it (the second
        # sighting captures: EngineConfig.mixed_cuda_graph_max_graphs).
        self.add_request([3] * min(12, longest), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        self.step()
        self.add_request([4 + i % (vocab - 4) for i in range(min(40, longest))], params)
        while self.has_unfinished_requests():
            self.step()
        self.warm_up_steps = self.num_steps
        log.info("warm-up: %d steps in %.2f s", self.num_steps, time.perf_counter() - start)
        self.block_manager.reset_prefix_cache()
        self.reset_counters()

    # ---- requests -------------------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str | None) -> None:
        """Raise :class:`RequestError` for anything that would fail later; schedules nothing."""
        if request_id is not None and request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if len(prompt_token_ids) == 0:
            raise RequestError("the prompt is empty: at least one token is needed")
        vocab = self.model_config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise RequestError(f"prompt token ids must be integers in [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(prompt_token_ids)} tokens but the context is {self.max_model_len}: "
                "at least one position must be left to generate"
            )
        needed = self.block_manager.blocks_needed(len(prompt_token_ids) + 1)
        if needed > self.block_manager.num_usable_blocks:
            raise RequestError(
                f"the prompt needs {needed} KV blocks but the cache has {self.block_manager.num_usable_blocks}"
            )
        try:
            params.validate(vocab)
        except ValueError as e:
            raise RequestError(str(e)) from e

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        extra_keys: tuple = (),
        arrival_time: float | None = None,
    ) -> Request:
        params = params or SamplingParams()
        prompt = list(prompt_token_ids)
        self.validate_request(prompt, params, request_id)
        seq = next(self._ids)
        rid = request_id if request_id is not None else f"req-{seq}"
        req = Request(rid, prompt, params, priority=priority, arrival_seq=seq, extra_keys=extra_keys)
        req.metrics.arrival_time = arrival_time if arrival_time is not None else time.perf_counter()
        req.metrics.num_prompt_tokens = len(prompt)
        if self.tokenizer is not None:
            self._detok[rid] = IncrementalDetokenizer(self.tokenizer.backend, params)
        if params.seed is not None:
            self._generators[rid] = torch.Generator(device=self.device).manual_seed(params.seed)
        self.requests[rid] = req
        self.scheduler.add_request(req)
        self._device_resting = False  # another batch: device speculation gets a fresh chance
        return req

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free all its KV blocks; False if it is unknown or already done."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work or self._inflight is not None or self._device_inflight is not None

    # ---- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step; return the tokens the host has learned since the last call.

        With async scheduling (``EngineConfig.async_scheduling``) the step launched here runs on
        the device while the host reads back and processes the *previous* step's samples
        (detokenize, stop checks, outputs), so the device does not idle during host work. Its
        decodes take their input tokens from the previous step's samples on the device. A request
        that stops on a token learned late has computed one token too many, which is dropped.
        Without it (and always on the CPU by default) the step is launched and read back at once.
        """
        if self.device_speculation is not None:
            device_outputs = self._device_step()
            if device_outputs is not None:
                return device_outputs
        t0 = time.perf_counter()
        outputs = self._propose_drafts() if self.proposer is not None else []
        sched = self.scheduler.schedule()
        outputs += [self._finish_out_of_capacity(req) for req in sched.out_of_capacity]
        if self._inflight is not None and any(c.completes_prompt and c.request.sampling_params.has_penalties for c in sched.chunks):
            # Penalties read the request's output tokens on the host: learn them first.
            outputs += self._read_back()
            sched.chunks = [c for c in sched.chunks if not c.request.status.finished]
        if not sched.chunks:
            if self._inflight is not None:
                outputs += self._finalize(self._take_inflight())
            return outputs
        t1 = time.perf_counter()
        inputs = self.runner.prepare(sched.chunks, self._inflight.device_tokens if self._inflight else None)
        t2 = time.perf_counter()
        launched = self._launch(inputs)
        t3 = time.perf_counter()
        previous, self._inflight = self._inflight, launched
        if previous is not None:
            outputs += self._finalize(previous)
        if not self.async_scheduling or any(c.drafts for c in inputs.chunks):
            # a verifying step is read back at once: until its drafts are accepted or rejected, its
            # requests' computed tokens count drafts, and no next step may be scheduled on them
            outputs += self._read_back()
        self.step_times.record(
            t0, t1, t2, t3, time.perf_counter(), inputs.path, len(inputs.chunks), inputs.num_tokens
        )
        return outputs

    # ---- device speculation (engine/device_speculation.py) -----------------------------------------
    def _device_step(self) -> list[RequestOutput] | None:
        """A step of device speculation, or None when this step goes the host's way. Entering it
        takes the samples of a host step in flight on the device (``_samples_ahead``) and reads
        that step while the first device step runs, or else reads it back first; while in it,
        each step launches the next device step, then reads the one before (its tokens are
        learned a step late). A request that finished or was aborted is dropped (its slot padding,
        ``_device_drop``) while the others stay. It is left when a request arrives, every request
        has finished, the next step's KV blocks or context are not there, or (with
        ``speculative_device_rests``) its steps stop paying (``StepYield``; then it rests until a
        draft verified the host's way stands): the step in flight is read back, and the requests
        go on as decoding requests of the scheduler (their last token's KV not yet computed, as
        after any decode)."""
        t0 = time.perf_counter()
        if self._device_inflight is None:
            ahead = self._samples_ahead()
            if not self._device_can_run(pending=ahead is not None):
                return None
            outputs = []
            if ahead is None and self._inflight is not None:
                outputs = self._read_back()
                if not self._device_can_run():  # the tokens just read finished a request
                    return outputs
            requests = list(self.scheduler.running)
            self._device_allocate(requests, pending=ahead is not None)
            last = None
            if ahead is not None:  # indices staged through pinned memory: a pageable copy would wait for the step in flight
                last = ahead.tokens.index_select(0, to_device([ahead.row_of[r.request_id] for r in requests], torch.int64, self.device))
            self.device_speculation.enter(requests, last)
            self.device_stats.entries += 1
            self.device_stats.entries_ahead += ahead is not None
            self._device_yield = StepYield.prior(self.device_speculation.k)
            t1 = time.perf_counter()
            self._device_inflight = self._device_launch(requests)
            t2 = time.perf_counter()
            if ahead is not None:  # the host step's samples, read while the device step runs behind it
                outputs = self._finalize(self._take_inflight())
            self._record_device_step(t0, t1, t2, time.perf_counter())
            return outputs
        step = self._device_inflight[0]
        requests = [None if r is not None and r.status.finished else r for r in step.requests]  # finished: dropped
        while requests and requests[-1] is None:
            requests.pop()
        pays = not self.config.speculative_device_rests or self._device_yield.pays(self.device_speculation.k, self.row_cost)
        if not pays or not self._device_can_run(requests):
            self._device_resting = not pays
            if pays:
                self.device_stats.leaves_other += 1
            else:
                self.device_stats.leaves_for_yield += 1
            outputs = self._device_finalize(self._take_device())
            self._read_back_at = time.perf_counter() if self.has_unfinished_requests() else None
            return outputs
        self._device_drop(step, requests)
        self._device_allocate(requests)
        t1 = time.perf_counter()
        previous, self._device_inflight = self._device_inflight, self._device_launch(requests)
        t2 = time.perf_counter()
        outputs = self._device_finalize(previous)
        self._record_device_step(t0, t1, t2, time.perf_counter())
        return outputs

    def _device_drop(self, step: DeviceStep, requests: list[Request | None]) -> None:
        """The requests of ``step`` that finished or were aborted (not in ``requests``, the next
        step's) leave device speculation alone: their slots become padding, and the others stay
        on the device without a read back."""
        slots = [slot for slot, req in enumerate(step.requests)
                 if req is not None and (slot >= len(requests) or requests[slot] is None)]
        if slots:
            self.device_speculation.drop(slots, step.bucket)
            self.device_stats.drops += len(slots)

    def _device_can_run(self, current: list[Request | None] | None = None, pending: bool = False) -> bool:
        """Whether the next step can be a device speculation step: ``current`` (the requests in
        it, dropped slots None; None when entering) are all the scheduler runs, none finished,
        none waits; each decodes greedily (``takes_device_path``) with room for three more steps in its context,
        and the KV blocks for those are free (``_device_allocate``); ``pending``: each has one
        token more than the host knows, sampled by the step in flight. Not entered while it rests
        (``_device_step``), nor for a request that decoded in a batch too large to speculate
        (``may_draft``, as the host's way: the tail of a large batch, where on an H100 a group of 32
        entering at most 8 at a time finished 0.91x as fast, 2026-12-08)."""
        spec = self.device_speculation
        running = self.scheduler.running
        if (current is None and self._device_resting) or self.scheduler.waiting or not running or len(running) > spec.max_requests:
            return False
        if current is not None:
            live = [r for r in current if r is not None]
            if not live or len(live) != len(running) or any(r.status.finished for r in live):
                return False
        rows = spec.k + 1
        need = 0
        entering = current is None
        for req in running:
            known = len(req.all_token_ids) + pending
            if (req.status.finished or req.is_prefilling or (entering and not (takes_device_path(req.sampling_params) and req.may_draft))
                    or known + 3 * rows > self.max_model_len):
                return False
            need += max(0, self.block_manager.blocks_needed(known - 1 + 3 * rows) - len(req.block_ids))
        return need <= self.block_manager.num_free_blocks

    def _samples_ahead(self) -> DeviceTokens | None:
        """The samples of the host step in flight, on the device, when device speculation can
        enter on them without reading that step back first: it sampled one token (no drafts) for
        every running request. Entering after a prompt's last chunk then costs no idle device."""
        step = self._inflight
        if step is None or step.device_tokens is None or any(c.drafts for c in step.sampled):
            return None
        row_of = step.device_tokens.row_of
        if all(r.request_id in row_of and r.num_pending_tokens == 1 for r in self.scheduler.running):
            return step.device_tokens
        return None

    def _device_allocate(self, requests: list[Request | None], pending: bool = False) -> None:
        """KV blocks for each request's next three steps, and their tables on the device. The step
        launched now also computes the next step's slots from these tables, and the host learns
        the tokens one step late: the step before this one (in flight) and this one may each add
        k + 1 tokens to those known here, and the next step's rows reach k positions past them.
        ``pending``: each request's last token is still in flight (``_samples_ahead``), one past
        those known."""
        rows = self.device_speculation.k + 1
        for slot, req in enumerate(requests):
            if req is None:  # a dropped slot
                continue
            req.num_computed_tokens = len(req.all_token_ids) - 1 + pending
            if not self.block_manager.allocate_slots(req, 3 * rows):
                raise AssertionError("_device_can_run counted the free blocks")  # never: checked just before
            self.device_speculation.update_table(slot, req.block_ids)

    def _device_launch(self, requests: list[Request | None]) -> tuple[DeviceStep, InflightStep]:
        """Queue a device speculation step (timed by CUDA events as a graph step)."""
        behind = self._device_inflight is not None or self._inflight is not None  # launched behind a step in flight
        after_read_back, span = self._begin_span(not behind)
        step = self.device_speculation.launch(requests)
        if span is not None:
            span[1].record()
        self.num_steps += 1
        self.device_stats.steps += 1
        return step, InflightStep([r for r in requests if r is not None], [], None, None, ExecutionPath.GRAPH, span, behind,
                                  after_read_back, self.device_speculation.rows(step.bucket))

    def _record_device_step(self, t0: float, t1: float, t2: float, t3: float) -> None:
        """Host phases of the device step just launched: deciding and allocating (t0..t1; on entry
        with the read back of a host step in flight), the launch (t1..t2), reading back the
        device step before it (t2..t3)."""
        timing = self._device_inflight[1]
        self.step_times.record(t0, t1, t1, t2, t3, ExecutionPath.GRAPH, len(timing.requests), timing.num_tokens)

    def _take_device(self) -> tuple[DeviceStep, InflightStep]:
        step, self._device_inflight = self._device_inflight, None
        return step

    def _device_finalize(self, launched: tuple[DeviceStep, InflightStep]) -> list[RequestOutput]:
        """Read a device step back (waiting for it) and append each request's tokens; a request
        finished meanwhile drops its own."""
        step, timing = launched
        results = self.device_speculation.read(step)
        now = time.perf_counter()
        if timing.span is not None:
            self._account_device_span(timing)
        outputs = []
        gained = [len(result.tokens) for req, result in zip(step.requests, results) if req is not None and not req.status.finished]
        if gained:
            self._device_yield.record(sum(gained) / len(gained))
        for req, result in zip(step.requests, results):
            if req is None or req.status.finished:
                continue
            if result.num_drafts:
                self.spec_stats.record(result.num_drafts, result.num_accepted)
                self.device_stats.verifications += 1
            for token in result.tokens:
                outputs.append(self._append_token(req, token, None, now))
                if req.status.finished:
                    break
            if not req.status.finished:
                req.num_computed_tokens = len(req.all_token_ids) - 1
                self.block_manager.cache_full_blocks(req)
        return outputs

    def _propose_drafts(self) -> list[RequestOutput]:
        """Give each decoding request its draft tokens for the next step: as many as pay at its
        measured acceptance (``best_k``), none while more than ``speculative_max_batch`` decode,
        none for requests whose sampling reads their outputs (penalties), and never past their
        ``max_tokens`` or the context. With async scheduling a request's last token may still be
        in flight: a proposer that drafts ahead is asked for one token more on the tokens known,
        the first its guess of that token (``Request.draft_guess``), and the step stays async;
        any other proposer has the step in flight read back first (its outputs are returned). A
        batch too large to speculate stays async."""
        outputs: list[RequestOutput] = []
        wants, resting = self._draft_wants()
        if wants and self._inflight is not None and not self.proposer.drafts_ahead:
            outputs = self._read_back()
            wants, resting = self._draft_wants()  # the tokens just learned: some requests stopped, all moved on
        for req in resting:
            req.acceptance.rest()
        if wants:
            asks = [DraftWant(w.request_id, w.token_ids, w.k + 1) if req.num_pending_tokens else w for req, w in wants]
            for (req, _), proposal in zip(wants, self.proposer.propose_batch(asks)):
                if not req.num_pending_tokens:
                    req.draft_token_ids = proposal
                elif len(proposal) > 1:  # a guess of the token in flight, then drafts to follow it
                    req.draft_guess, req.draft_token_ids = proposal[0], proposal[1:]
        return outputs

    def _draft_wants(self) -> tuple[list[tuple[Request, DraftWant]], list[Request]]:
        """The decoding requests that draft this step and how many tokens each (their drafts and
        guess reset to none first), and those whose estimate keeps them from drafting (they rest).
        With async scheduling a request that has decoded in a batch too large to speculate never
        drafts: it would only in that batch's tail, where drafts cost more than they saved (H100,
        the 1.5B, 2026-12-06: a group of 32 questions drafting once at most 8 decode finished
        0.84x as fast, a group of 8 drafting throughout 1.32x; the tail's steps are bound by the
        host's work, and a verifying step forfeits the overlap). Without it (the CPU: every step
        waited for, each bound by its dot products) the tail drafts as any small batch does."""
        decoding = [r for r in self.scheduler.running if not r.is_prefilling and not r.status.finished]
        if len(decoding) > self.config.speculative_max_batch:  # too many to speculate: no per-request work
            for req in decoding:
                req.draft_token_ids, req.draft_guess = [], None
                req.may_draft = not self.async_scheduling
            return [], []
        wants: list[tuple[Request, DraftWant]] = []
        resting: list[Request] = []
        for req in decoding:
            req.draft_token_ids, req.draft_guess = [], None
            if not req.may_draft:
                continue
            room = min(req.sampling_params.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
            pays = best_k(req.acceptance.rate, self.row_cost, self.config.num_speculative_tokens, self.draft_cost)
            k = min(room, pays)
            if k > 0 and not req.sampling_params.has_penalties:
                wants.append((req, DraftWant(req.request_id, req.all_token_ids, k)))
            if pays == 0:
                resting.append(req)
        return wants, resting

    def _launch(self, inputs: StepInputs) -> InflightStep:
        """Queue the forward and the sampling of one step; account its tokens as computed and
        its samples as pending."""
        after_read_back, span = self._begin_span(self._inflight is None)
        out = self.runner.execute(inputs)
        rows = [
            SampleInput(c.request.sampling_params, c.request.prompt_token_ids, c.request.output_token_ids, self._generators.get(c.request.request_id))
            for c in inputs.sampled_chunks
        ]
        sample = self.sampler.sample(out.logits, rows, greedy_tokens=out.argmax) if rows else None
        if span is not None:
            span[1].record()
        self.num_steps += 1
        for c in inputs.chunks:
            req = c.request
            self.prompt_tokens_total += max(0, min(c.start + c.num_tokens, req.num_prompt_tokens) - c.start)
            req.num_computed_tokens += c.num_tokens
        sampled: list[ScheduledChunk] = []
        for c in inputs.sampled_chunks:  # a verifying decode's chunk fills consecutive rows
            if not sampled or sampled[-1] is not c:
                sampled.append(c)
                c.request.num_pending_tokens += 1
        # the next step's decodes read their input from the last row of each (async scheduling: no drafts)
        rows = {c.request.request_id: i for i, c in enumerate(inputs.sampled_chunks)}
        device_tokens = DeviceTokens(sample.tokens, rows) if sample else None
        return InflightStep([c.request for c in inputs.chunks], sampled, sample, device_tokens, inputs.path, span,
                            self._inflight is not None, after_read_back, inputs.num_tokens)

    def _begin_span(self, idle: bool) -> tuple[bool, tuple[torch.cuda.Event, torch.cuda.Event] | None]:
        """Before a launch: whether it comes after a step read back at once (``idle``: nothing in
        flight; then the host's turnaround since that read back is accounted), and on CUDA the
        step's span events, the first recorded now (timing events only: recording never waits)."""
        after_read_back = idle and self._read_back_at is not None
        if after_read_back:
            self.step_times.record_turnaround(time.perf_counter() - self._read_back_at)
        self._read_back_at = None
        span = None
        if self.device.type == "cuda":
            span = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            span[0].record()
        return after_read_back, span

    def _take_inflight(self) -> InflightStep:
        step, self._inflight = self._inflight, None
        return step

    def _read_back(self) -> list[RequestOutput]:
        """Finalize the step in flight now, before the next is launched (it waits for the device),
        and note when, if requests remain: the device idles from that step's end until the host
        launches the next one (``StepTimes.read_back_turnaround``)."""
        outputs = self._finalize(self._take_inflight())
        self._read_back_at = time.perf_counter() if self.has_unfinished_requests() else None
        return outputs

    def _finalize(self, step: InflightStep) -> list[RequestOutput]:
        """Read a launched step's samples back (waiting for the device if it is still busy) and
        turn them into outputs; requests finished meanwhile drop theirs."""
        result = step.sample.result() if step.sample is not None else None
        now = time.perf_counter()
        if step.span is not None:
            self._account_device_span(step)
        learned: list[tuple[Request, list[int], list]] = []  # per sampled request: its new tokens and their logprobs
        row = 0
        for c in step.sampled:
            rows = 1 + len(c.drafts)
            tokens = result.token_ids[row : row + rows]
            if c.drafts and not c.request.status.finished:
                if c.request.draft_guess is not None:  # the step before was read back first: its token is known
                    first = c.request.num_computed_tokens - c.num_tokens  # the step's first input: the guessed token
                    self.spec_stats.record_guess(c.request.all_token_ids[first] == c.request.draft_guess)
                tokens = accepted_tokens(c.drafts, tokens)
                # the KV of rejected drafts was written but is not the request's: compute over it
                c.request.num_computed_tokens -= len(c.drafts) - (len(tokens) - 1)
                self.spec_stats.record(len(c.drafts), len(tokens) - 1)
                c.request.acceptance.update(len(c.drafts), len(tokens) - 1)
                self._device_resting = self._device_resting and len(tokens) == 1  # a draft stood: quoting again
            learned.append((c.request, tokens, result.logprobs[row : row + len(tokens)]))
            row += rows
        for req in step.requests:  # before any finishes: its full blocks stay findable after it
            if not req.status.finished:
                self.block_manager.cache_full_blocks(req)
        outputs = []
        for req, tokens, logprobs in learned:
            if req.status.finished:  # aborted, or stopped by a token learned after this step launched
                continue
            req.num_pending_tokens -= 1
            for token, lp in zip(tokens, logprobs):
                outputs.append(self._append_token(req, token, lp, now))
                if req.status.finished:  # a stop among accepted drafts: the rest are dropped
                    break
        return outputs

    def _account_device_span(self, step: InflightStep) -> None:
        """Record a finished step's device span and the device's idle gap before it: when it was
        launched behind the step before it (async scheduling), time the host failed to hide; when
        it was launched after the step before it was read back at once, the host's turnaround
        (kept apart: ``StepTimes.read_back_idle``). Gaps after the engine ran out of work are not
        counted. Steps finalize in launch order: the previous end is done."""
        start, end = step.span
        end.synchronize()  # the samples were the step's last work: this returns at once
        idle = read_back_idle = 0.0
        if self._last_step_end is not None and (step.chained or step.after_read_back):
            gap = max(0.0, self._last_step_end.elapsed_time(start) / 1e3)
            idle, read_back_idle = (gap, 0.0) if step.chained else (0.0, gap)
        self.step_times.record_device(step.path, start.elapsed_time(end) / 1e3, idle, len(step.requests), step.num_tokens,
                                      read_back_idle)
        self._last_step_end = end

    def _append_token(self, req: Request, token: int, logprobs: dict[int, float] | None, now: float) -> RequestOutput:
        req.append_output(token)
        m = req.metrics
        m.token_times.append(now)
        m.num_generated_tokens = len(req.output_token_ids)
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        self.generation_tokens_total += 1
        params = req.sampling_params
        status, stop_reason = None, None
        detok = self._detok.get(req.request_id)
        stop_str = detok.add_token(token) if detok is not None else None
        if stop_str is not None:
            status, stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
        elif not params.ignore_eos and token in self.eos_token_ids:
            status, stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif token in params.stop_token_ids:
            status, stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif len(req.output_token_ids) >= params.max_tokens or len(req.all_token_ids) >= self.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        text = detok.take_delta(finished=status is not None) if detok is not None else ""
        if status is not None:
            req.stop_reason = stop_reason
            self._finish(req, status)
        return RequestOutput(
            request_id=req.request_id,
            text=text,
            token_ids=[token],
            finished=status is not None,
            finish_reason=status.value if status is not None else None,
            stop_reason=stop_reason,
            logprobs=[logprobs] if logprobs is not None else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_generated_tokens=len(req.output_token_ids),
            # the first output too, so a caller can split its time to first token (queue, prefill)
            metrics=req.metrics if status is not None or len(req.output_token_ids) == 1 else None,
        )

    def _finish_out_of_capacity(self, req: Request) -> RequestOutput:
        """The scheduler stopped a request the KV pool cannot hold: report it as 'length'."""
        log.warning("request %s needs more KV blocks than the pool has; stopped at %d tokens", req.request_id, req.num_tokens)
        detok = self._detok.get(req.request_id)
        req.stop_reason = "kv_cache_full"
        self._finish(req, RequestStatus.FINISHED_LENGTH)
        return RequestOutput(
            request_id=req.request_id, text=detok.take_delta(finished=True) if detok else "", token_ids=[],
            finished=True, finish_reason="length", stop_reason="kv_cache_full",
            num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=max(req.num_cached_tokens, 0),
            num_generated_tokens=len(req.output_token_ids), metrics=req.metrics,
        )

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self.scheduler.finish_request(req, status)
        req.num_pending_tokens = 0  # a token of a step in flight, if any, is dropped
        req.metrics.finished_time = time.perf_counter()
        self.requests.pop(req.request_id, None)
        self._detok.pop(req.request_id, None)
        self._generators.pop(req.request_id, None)
        if self.proposer is not None:
            self.proposer.release(req.request_id, req.output_token_ids)

    # ---- observability ---------------------------------------------------------------------------
    def memory_ledger(self) -> MemoryLedger:
        """The ledger now, with what the mixed-step graphs captured while serving have reserved
        since (it comes out of the headroom left after the KV budget)."""
        mixed = self.runner.mixed
        if mixed is not None and mixed.pool_bytes:
            self.memory.record("cuda_graphs (mixed steps, captured while serving)", mixed.pool_bytes)
        return self.memory

    def memory_rows(self) -> list[tuple[str, int]]:
        """Device memory by owner now (:meth:`memory_ledger`'s rows)."""
        return self.memory_ledger().rows()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=bm.num_usable_blocks,
            kv_blocks_free=bm.num_free_blocks,
            kv_usage=bm.usage,
            prefix_cache_queries=bm.prefix_cache.stats.queries,
            prefix_cache_hits=bm.prefix_cache.stats.hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens_total,
            generation_tokens=self.generation_tokens_total,
            num_steps=self.num_steps,
            step_host={mode: tuple(totals) for mode, totals in self.step_times.by_mode.items()},
            step_device={mode: tuple(totals) for mode, totals in self.step_times.device_span.items()},
            device_idle_s=self.step_times.device_idle,
            read_back_launches=self.step_times.read_back_launches,
            read_back_turnaround_s=self.step_times.read_back_turnaround,
            read_back_idle_s=self.step_times.read_back_idle,
            spec_drafts=self.spec_stats.num_drafts,
            spec_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_accepted_per_pos=tuple(self.spec_stats.accepted_per_pos),
        )
