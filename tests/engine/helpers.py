"""Test helpers: requests built directly, a model-free engine loop, waits on an async engine, and
transformers' own model of a GGUF file."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import Iterator
from pathlib import Path

from engine.block_manager import BlockManager
from engine.execution_path import ExecutionPath
from engine.request import Request, RequestStatus
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, StepBoundPolicy

_seq = itertools.count()


def make_request(rid: str, prompt_len: int, max_tokens: int = 4, priority: int = 0, start_token: int = 1) -> Request:
    prompt = [(start_token + i) % 1000 for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), priority=priority, arrival_seq=next(_seq))


class SimulatedEngine:
    """Scheduler + block manager driven like the real engine, with a fake model that emits
    token 7 for every completed chunk. Checks invariants after every step."""

    def __init__(self, num_blocks: int = 64, block_size: int = 4, step_bound: StepBoundPolicy | None = None, **sched) -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=sched.pop("prefix", True))
        self.scheduler = Scheduler(SchedulerConfig(**sched), self.bm, step_bound)
        self.finished: list[Request] = []
        self.steps = 0

    def add(self, req: Request) -> Request:
        self.scheduler.add_request(req)
        return req

    def step(self):
        out = self.scheduler.schedule()
        self.finished += out.out_of_capacity
        assert out.num_batched_tokens <= self.scheduler.config.max_num_batched_tokens or not self.scheduler.config.enable_chunked_prefill
        assert len(self.scheduler.running) <= self.scheduler.config.max_num_seqs
        for c in out.chunks:
            req = c.request
            assert req.status is RequestStatus.RUNNING
            assert len(req.block_ids) * self.bm.block_size >= req.num_computed_tokens + c.num_tokens
            done = c.completes_prompt
            req.num_computed_tokens += c.num_tokens
            self.bm.cache_full_blocks(req)
            if done:
                req.append_output(7)
                if len(req.output_token_ids) >= req.sampling_params.max_tokens:
                    self.scheduler.finish_request(req, RequestStatus.FINISHED_LENGTH)
                    self.finished.append(req)
        self.steps += 1
        assert all(c >= 0 for c in self.bm.ref_cnt)
        return out

    def abort(self, req: Request) -> None:
        self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)

    def run(self, max_steps: int = 10_000) -> None:
        while self.scheduler.has_work:
            self.step()
            assert self.steps < max_steps, "requests starved"

    def assert_idle_and_clean(self) -> None:
        assert not self.scheduler.has_work
        assert self.bm.num_free_blocks == self.bm.num_usable_blocks
        assert all(c == 0 for c in self.bm.ref_cnt)


def record_paths(runner) -> list[ExecutionPath]:
    """The path of every step ``runner`` prepares from now on, in order (wraps its ``prepare``)."""
    paths: list[ExecutionPath] = []
    prepare = runner.prepare

    def spy(*args, **kwargs):
        inputs = prepare(*args, **kwargs)
        paths.append(inputs.path)
        return inputs

    runner.prepare = spy
    return paths


async def wait_idle(engine, timeout: float = 30.0):
    """Wait until an AsyncEngine has nothing running or waiting and every KV block is free."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s = engine.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_blocks_free == s.kv_blocks_total:
            return s
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine not idle: {engine.stats()}")


def generate_staggered(core, prompts: list[list[int]], params: SamplingParams, steps_between: int) -> list[list[int]]:
    """Token ids of each prompt when they arrive ``steps_between`` engine steps apart (later
    prompts prefill while earlier ones decode), in prompt order."""
    reqs, out = [], {}

    def step() -> None:
        for d in core.step():
            out.setdefault(d.request_id, []).extend(d.token_ids)

    for p in prompts:
        reqs.append(core.add_request(p, params))
        for _ in range(steps_between):
            step()
    while core.has_unfinished_requests():
        step()
    return [out[r.request_id] for r in reqs]


@contextlib.contextmanager
def gguf_files_read_once() -> Iterator[None]:
    """While the block runs, ``gguf.GGUFReader`` parses each file once and hands that same reader
    to every later reader of the file (the reader is only read from). transformers'
    ``from_pretrained(gguf_file=...)`` reads a file twice, for its config and for its tensors, and
    gguf's reader turns every vocabulary entry into numpy views in Python: seconds a read."""
    import gguf

    parse = gguf.GGUFReader
    readers: dict[tuple[str, str], gguf.GGUFReader] = {}

    def reader(path: os.PathLike[str] | str, mode: str = "r") -> gguf.GGUFReader:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = parse(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = parse


def hf_model_from_gguf(path: Path):
    """transformers' model of a GGUF file in float32, by its own loader (``gguf_file=``: its
    dequantization and names, independent of the engine's loader), the file parsed once."""
    import torch
    from transformers import AutoModelForCausalLM

    with gguf_files_read_once():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval().requires_grad_(False)
