"""n-gram speculative decoding whose verifying steps stay asynchronous: the drafts, their
verification and the next step's inputs are decided on the device.

The host-driven path (engine/speculative.py) must read a verifying step back before it launches the
next: how many drafts stood decides the next step's positions and input token, and the host looks
up the next drafts in the tokens it has just learned. The device idles meanwhile (0.28 ms a
verifying step on an H100 with the 1.5B at batch 1, docs/performance.md). Here each request's
tokens are also kept on the device, and one step is a CUDA graph (eager on the CPU) that runs the
row step of ``k + 1`` tokens a request, the argmax, and then ``verify_and_draft``
(engine/device_ngram.py: one Triton kernel on CUDA) - the drafts accepted (temperature 0: a draft
stands while it is the argmax), the kept tokens appended to the device's history, the next drafts
looked up there (the most recent earlier occurrence of the longest n-gram ending the request's
tokens: the host index's rule, over the request's own tokens) and the next step's rows. So the
next step can be launched before the host reads this one, as async scheduling does for plain
decode steps; the host learns each step's tokens one step late.

Every step has ``k + 1`` rows a request, with drafts or not (a request without a match verifies
padding and gets one token), and a bucket of requests (``buckets``; a padding request's rows
write only the null block). Only greedy requests without penalties or logprobs take this path,
and only while nothing else is scheduled: :class:`engine.engine_core.EngineCore` enters it when
every running request decodes and none waits (on the samples of the host step in flight, taken
on the device, when that step sampled every request's last token) and none has decoded in a
batch too large to speculate, and leaves it (the step in flight read back, the requests handed
back to the scheduler) when a request arrives, every request has finished or been aborted, or
its next KV blocks are not free; a request that finishes or is aborted while others go on is
dropped (``drop``: its slot becomes a padding request, no read back). With
``speculative_device_rests`` it also leaves when its steps stop paying (:class:`StepYield`): an
answer that quotes nothing verifies padding rows for one token a step, where a plain step costs
less; the host's way then drafts only where its lookups find matches, and a draft it verifies
that stands brings the requests back. Off by default: on a GPU a device step of 5 rows costs
little more than one of 1, and leaving and coming back cost read backs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from engine.attention.backend import AttentionMetadata
from engine.block_manager import NULL_BLOCK
from engine.device_ngram import verify_and_draft
from engine.kernels.argmax import argmax_rows
from engine.kernels.linear import TILE_ROWS
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.sampling import SamplingParams
from engine.speculative import PRIOR
from engine.transfer import to_device


@dataclass
class DeviceStep:
    """A launched device verifying step: its requests (the first ``len(requests)`` of the
    bucket), the pinned buffer its outputs are copied into and the event after that copy."""

    requests: list[Request | None]  # None: a slot dropped while the others stayed (padding)
    bucket: int
    parity: int
    copied: torch.cuda.Event | None


@dataclass(frozen=True)
class DeviceResult:
    """One request's outcome of a device step: the tokens it appends (the drafts that stood and
    the argmax after them), and how many drafts it verified and accepted."""

    tokens: list[int]
    num_drafts: int
    num_accepted: int


@dataclass
class StepYield:
    """The tokens a request gains per device step, a running mean with older steps weighted down
    by ``decay``. It starts where drafts accepted at :data:`engine.speculative.PRIOR` would put it
    (answers that quote their prompt are the common case). A step of ``k + 1`` rows a request costs
    about ``1 + row_cost * k`` one-token steps (the host's model, ``best_k``): below that the drafts
    do not pay for their rows."""

    mean: float
    decay: float = 0.7

    @classmethod
    def prior(cls, k: int) -> StepYield:
        return cls(sum(PRIOR**i for i in range(k + 1)))

    def record(self, tokens: float) -> None:
        """One step's tokens per request."""
        self.mean = self.mean * self.decay + tokens * (1 - self.decay)

    def pays(self, k: int, row_cost: float) -> bool:
        return self.mean >= 1 + row_cost * k


@dataclass
class DeviceSpeculationStats:
    """Totals since start of the ways in and out of device speculation: its steps, and of them
    the request verifications with drafts; entries, and of them those taken on the samples of a
    host step in flight (no read back first); leaves because its steps stopped paying (it rests
    then, and the host's verifying steps, each read back at once, stand in until a draft stands),
    and other leaves (a request arriving; every request finished or aborted; no KV blocks or
    context for the next steps). Each leave reads the device step in flight back before the next
    launch. ``drops``: requests that finished or were aborted while the others stayed (no read
    back: their slots became padding)."""

    steps: int = 0
    verifications: int = 0
    entries: int = 0
    entries_ahead: int = 0
    drops: int = 0
    leaves_for_yield: int = 0
    leaves_other: int = 0


def takes_device_path(params: SamplingParams) -> bool:
    """Whether a request's sampling leaves its tokens to the device's argmax: temperature 0, no
    penalties (they read the outputs on the host), no logprobs (the device path returns none)."""
    return params.temperature == 0 and not params.has_penalties and params.logprobs is None


class DeviceSpeculation:
    """The device's state of up to ``max_requests`` speculating requests and a step per bucket of
    them (module docstring). ``k`` drafts a request and step; n-grams of ``min_n`` to ``max_n``."""

    def __init__(self, runner: ModelRunner, k: int, min_n: int, max_n: int, max_requests: int, max_model_len: int,
                 capture: bool) -> None:
        """``capture``: a CUDA graph per bucket (else each step runs eagerly: the CPU, tests)."""
        device = runner.device
        self.runner, self.k, self.min_n, self.max_n = runner, k, min_n, max_n
        self.page = runner.block_size
        rows, blocks = max_requests * (k + 1), -(-max_model_len // self.page)
        self.history = torch.zeros(max_requests, max_model_len, dtype=torch.int64, device=device)
        self.lengths = torch.ones(max_requests, dtype=torch.int64, device=device)
        self.drafts = torch.zeros(max_requests, k, dtype=torch.int64, device=device)
        self.num_drafts = torch.zeros(max_requests, dtype=torch.int64, device=device)
        self.samples = torch.zeros(max_requests, k + 1, dtype=torch.int64, device=device)
        self.out = torch.zeros(max_requests, k + 3, dtype=torch.int64, device=device)  # samples, accepted + 1, drafts
        self.row_tables = torch.zeros(rows, blocks, dtype=torch.int32, device=device)  # a row's: its request's
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slots = torch.zeros(rows, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.query_start = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.buckets = sorted({b for b in (1, 2, 4, 8, 16, 32) if b < max_requests} | {max_requests})
        self.gemv = replace(runner.gemv, max_rows=TILE_ROWS) if runner.gemv.max_rows else runner.gemv
        self.cuda = device.type == "cuda"
        self.host_lengths = runner.backend.name != "triton"  # the reference attention reads the lengths on the host
        self.pinned = [torch.zeros(max_requests, k + 3, dtype=torch.int64, pin_memory=self.cuda) for _ in range(2)]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._parity = 0
        self._block_counts: list[int] = [0] * max_requests  # blocks of each slot's table on the device
        if capture:
            self._capture()

    @property
    def max_requests(self) -> int:
        return self.history.shape[0]

    def bucket(self, num_requests: int) -> int:
        """The smallest bucket that holds ``num_requests``."""
        return next(b for b in self.buckets if b >= num_requests)

    def rows(self, bucket: int) -> int:
        return bucket * (self.k + 1)

    def _meta(self, bucket: int) -> AttentionMetadata:
        rows = self.rows(bucket)
        meta = AttentionMetadata(
            slot_mapping=self.slots[:rows], query_start_loc=self.query_start[: rows + 1], seq_lens=self.seq_lens[:rows],
            block_tables=self.row_tables[:rows], query_lens_host=[1] * rows, seq_lens_host=[0] * rows, num_decodes=rows,
            max_seq_len=0, rows_are_tokens=True, row_group=self.k + 1)
        if self.host_lengths:  # as CudaGraphRunner._step_eager
            lens = self.seq_lens[:rows].tolist()
            meta = replace(meta, seq_lens_host=lens, max_seq_len=max(lens))
        return meta

    def _step(self, bucket: int, meta: AttentionMetadata) -> None:
        """What a step's graph holds: forward, argmax, verification and the next step's inputs."""
        runner, rows = self.runner, self.rows(bucket)
        hidden = runner.model(self.input_ids[:rows], self.positions[:rows], runner.backend, meta, runner.kv_layers, self.gemv)
        argmax_rows(runner.model.compute_logits(hidden, self.gemv), out=self.samples[:bucket].view(-1))
        self._verify_and_draft(bucket, self.samples[:bucket])

    def request_tables(self, bucket: int) -> torch.Tensor:
        """Each request's block table [bucket, blocks]: its first row's (a strided view)."""
        return self.row_tables[: self.rows(bucket) : self.k + 1]

    def _verify_and_draft(self, bucket: int, samples: torch.Tensor | None) -> None:
        rows = self.rows(bucket)
        verify_and_draft(self.history[:bucket], self.lengths[:bucket], self.drafts[:bucket], self.num_drafts[:bucket], samples,
                         self.out[:bucket] if samples is not None else None, self.request_tables(bucket), self.input_ids[:rows],
                         self.positions[:rows], self.slots[:rows], self.seq_lens[:rows], min_n=self.min_n, max_n=self.max_n,
                         page=self.page)

    def _capture(self) -> None:
        """A graph per bucket, largest first (the others reuse its pool), captured on padding
        requests (one token each, every write to the null block)."""
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            meta = self._meta(bucket)
            with torch.inference_mode():
                for _ in range(2):  # compile the Triton kernels, settle cuBLAS's choices
                    self._reset_padding(0)
                    self._verify_and_draft(bucket, None)
                    self._step(bucket, meta)
                torch.cuda.synchronize()
                self._reset_padding(0)
                self._verify_and_draft(bucket, None)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    self._step(bucket, meta)
            self.graphs[bucket] = graph
        torch.cuda.synchronize()

    def _reset_padding(self, first: int, stop: int | None = None) -> None:
        """Slots ``first`` to ``stop`` (the last by default) as padding requests: one token, an
        empty table (the null block)."""
        stop = self.max_requests if stop is None else stop
        self.history[first:stop, 0] = 0
        self.lengths[first:stop] = 1
        self.row_tables[first * (self.k + 1) : stop * (self.k + 1)] = NULL_BLOCK
        self._block_counts[first:stop] = [0] * (stop - first)

    def enter(self, requests: list[Request], last: torch.Tensor | None = None) -> None:
        """Take over ``requests`` (each decoding, its last token sampled, not yet computed): their
        tokens and block tables to the device, the first drafts and rows looked up there.
        ``last``: each request's last token, sampled on the device by a step the host has not
        read yet (one a request, in order), after the tokens the host knows."""
        n = len(requests)
        bucket = self.bucket(n)
        width = max(len(r.all_token_ids) for r in requests)
        tokens = np.zeros((n, width), dtype=np.int64)
        for i, req in enumerate(requests):
            tokens[i, : len(req.all_token_ids)] = req.all_token_ids
        self.history[:n, :width] = to_device(tokens, torch.int64, self.history.device).view(n, width)
        self.lengths[:n] = to_device([len(r.all_token_ids) for r in requests], torch.int64, self.lengths.device)
        if last is not None:
            slots = torch.arange(n, device=self.history.device)
            self.history[slots, self.lengths[:n]] = last.to(torch.int64)
            self.lengths[:n] += 1
        self._reset_padding(n)
        self._block_counts[:n] = [0] * n
        for i, req in enumerate(requests):
            self.update_table(i, req.block_ids)
        self._verify_and_draft(bucket, None)

    def update_table(self, slot: int, block_ids: list[int]) -> None:
        """The request in ``slot`` holds these blocks now (its table grows only): copy the new ones."""
        have = self._block_counts[slot]
        if len(block_ids) == have:
            return
        new = to_device(block_ids[have:], torch.int32, self.row_tables.device)
        rows = slice(slot * (self.k + 1), (slot + 1) * (self.k + 1))
        self.row_tables[rows, have : len(block_ids)] = new[None, :]
        self._block_counts[slot] = len(block_ids)

    def drop(self, slots: list[int], bucket: int) -> None:
        """The requests in ``slots`` finished or were aborted while the others go on: from the
        next launch each slot is a padding request. The step in flight has laid out the next
        step's rows for them in their blocks, so every row of the ``bucket`` is laid out again,
        once, queued behind that step (the others' rows come out the same: the same tokens)."""
        for slot in slots:
            self._reset_padding(slot, slot + 1)
        self._verify_and_draft(bucket, None)

    def launch(self, requests: list[Request | None]) -> DeviceStep:
        """Queue one step for the requests ``enter`` took (in its order; None for a dropped slot)
        and the copy of its outputs to the host; returns at once."""
        bucket = self.bucket(len(requests))
        self._parity ^= 1
        if len(requests) < bucket:  # padding requests restart at one token: their rows stay in the null block's first positions
            self.lengths[len(requests) : bucket] = 1
        if self.graphs:
            self.graphs[bucket].replay()
        else:
            with torch.inference_mode():
                self._step(bucket, self._meta(bucket))
        self.pinned[self._parity][:bucket].copy_(self.out[:bucket], non_blocking=self.cuda)
        copied = None
        if self.cuda:
            copied = torch.cuda.Event()
            copied.record()
        return DeviceStep(list(requests), bucket, self._parity, copied)

    def read(self, step: DeviceStep) -> list[DeviceResult]:
        """A launched step's outcome per request (waits for it)."""
        if step.copied is not None:
            step.copied.synchronize()
        k = self.k
        results = []
        for values in self.pinned[step.parity][: len(step.requests)].tolist():
            kept = values[k + 1]
            results.append(DeviceResult(values[:kept], values[k + 2], kept - 1))
        return results
