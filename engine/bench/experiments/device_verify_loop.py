"""One-off (2026-12-07): batch-1 n-gram speculation with verifying steps that need nothing from
the host, against the plain engine and the engine's own speculation, same run, same questions.

The engine reads every verifying step back before it launches the next (the accepted count
decides the next step's positions and input, and the host looks up the next drafts): on an H100
with the 1.5B that idled the device 0.28 ms a verifying step, and the spec bench's k=8 ran 1.45x
the plain engine where the issue asks 1.6x. Here a CUDA graph holds a whole verifying iteration:
the row step of 1 + k tokens (the engine's row-graph forward), the argmax, the drafts accepted
(engine/device_ngram.py ``verify_and_draft``, one Triton kernel: the drafts accepted, the
accepted tokens appended to a token history kept on the device, the next drafts looked up there
by the rule of the host's n-gram index over the request's own tokens, and the next step's rows). Each iteration is launched before the host reads
the one before it, so the device never waits for the host.

Not the engine: one request at a time, greedy only, every iteration k + 1 rows whatever the
drafts (a request without a match verifies padding and gets one token), KV blocks for the whole
answer taken up front. The prompt is prefilled and its first token sampled by an engine without
async scheduling, whose request the loop then continues (aborted after, which frees its
blocks). Printed: decode tokens/s as the spec bench counts it (output tokens after the first over
the time from the first to the last), for the plain engine (baseline), the engine's n-gram
speculation and this loop, with the loop's iterations, tokens an iteration and whether its
answers are token for token the plain engine's.
Run from the repository root on a GPU: ``PYTHONPATH=$PWD python
engine/bench/experiments/device_verify_loop.py --model QWEN1.5B.gguf --documents
assistant/handbook/en/*.md --questions docs/results/2026-12-04-spec-questions-en32.txt
[--max-tokens 64] [--k 8] [--ngram-sizes 1 8]``.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import torch

from engine.attention.backend import AttentionMetadata
from engine.bench.report import device_name
from engine.bench.speculative import run_group
from engine.config import EngineConfig
from engine.device_ngram import verify_and_draft
from engine.engine_builder import build_engine
from engine.engine_core import EngineCore
from engine.kernels.argmax import argmax_rows
from engine.kernels.linear import TILE_ROWS
from engine.loaded_model import LoadedModel
from engine.sampling import SamplingParams


class DeviceVerifyLoop:
    """One request's verifying iterations, each a CUDA graph replay (eager on the CPU) whose
    inputs are the device's own state: token history, length, drafts, block table."""

    def __init__(self, core: EngineCore, k: int, min_n: int, max_n: int) -> None:
        runner, device = core.runner, core.device
        self.core, self.k, self.min_n, self.max_n = core, k, min_n, max_n
        rows, width = k + 1, core.max_model_len
        self.block_size = runner.block_size
        self.history = torch.zeros(1, width, dtype=torch.int64, device=device)
        self.lengths = torch.ones(1, dtype=torch.int64, device=device)
        self.drafts = torch.zeros(1, k, dtype=torch.int64, device=device)
        self.num_drafts = torch.zeros(1, dtype=torch.int64, device=device)
        self.tables = torch.zeros(rows, -(-width // self.block_size), dtype=torch.int32, device=device)
        self.slots = torch.zeros(rows, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.samples = torch.zeros(1, rows, dtype=torch.int64, device=device)
        self.out = torch.zeros(1, rows + 2, dtype=torch.int64, device=device)  # the samples, how many stand, the drafts
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.meta = AttentionMetadata(
            slot_mapping=self.slots, query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device=device),
            seq_lens=self.seq_lens, block_tables=self.tables, query_lens_host=[1] * rows, seq_lens_host=[0] * rows,
            num_decodes=rows, max_seq_len=0, rows_are_tokens=True, row_group=rows)
        self.gemv = replace(runner.gemv, max_rows=TILE_ROWS) if runner.gemv.max_rows else runner.gemv
        self.graph: torch.cuda.CUDAGraph | None = None
        self.cuda = device.type == "cuda"
        self.pinned = [torch.zeros(rows + 2, dtype=torch.int64, pin_memory=self.cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)] if self.cuda else []

    def _iteration(self) -> None:
        """Verify the drafts, append what stands, look up the next drafts and lay out the next
        step's rows: all on the device (``verify_and_draft``: one Triton kernel on CUDA)."""
        runner = self.core.runner
        meta = self.meta
        if not self.cuda:  # the CPU's attention reads the lengths on the host (CudaGraphRunner._step_eager too)
            lens = self.seq_lens.tolist()
            meta = replace(meta, seq_lens_host=lens, max_seq_len=max(lens), scratch={})
        hidden = runner.model(self.input_ids, self.positions, runner.backend, meta, runner.kv_layers, self.gemv)
        argmax_rows(runner.model.compute_logits(hidden, self.gemv), out=self.samples.view(-1))
        self._verify_and_draft(self.samples)

    def _verify_and_draft(self, samples: torch.Tensor | None) -> None:
        verify_and_draft(self.history, self.lengths, self.drafts, self.num_drafts, samples, self.out if samples is not None else None,
                         self.tables[:: self.k + 1], self.input_ids, self.positions, self.slots, self.seq_lens,
                         min_n=self.min_n, max_n=self.max_n, page=self.block_size)

    def start(self, tokens: list[int], block_ids: list[int]) -> None:
        """Take over a request whose last token is sampled but not yet computed."""
        self.history[0, : len(tokens)] = torch.tensor(tokens, device=self.history.device)
        self.lengths.fill_(len(tokens))
        self.tables.zero_()
        self.tables[:, : len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32, device=self.tables.device)
        self._verify_and_draft(None)

    def capture(self) -> None:
        """Compile and capture the iteration on the state :meth:`start` set (it advances it)."""
        if not self.cuda:
            return
        with torch.inference_mode():
            for _ in range(2):
                self._iteration()
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self._iteration()
        torch.cuda.synchronize()

    def _launch(self, parity: int) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            with torch.inference_mode():
                self._iteration()
        self.pinned[parity].copy_(self.out[0], non_blocking=self.cuda)
        if self.cuda:
            self.events[parity].record()

    def answer(self, max_new: int, eos: set[int]) -> tuple[list[int], int, float]:
        """Run iterations, each launched before the one before it is read, until ``max_new``
        tokens or an end-of-sequence token: the tokens, the iterations read and when the last
        token was read (before waiting for the iteration launched after it)."""
        tokens: list[int] = []
        parity, iterations = 0, 0
        self._launch(parity)
        while True:
            self._launch(1 - parity)  # the next iteration first: the device never waits for the host
            if self.cuda:
                self.events[parity].synchronize()
            values = self.pinned[parity].tolist()
            iterations += 1
            for token in values[: values[self.k + 1]]:
                tokens.append(token)
                if token in eos or len(tokens) >= max_new:
                    last = time.perf_counter()
                    if self.cuda:
                        self.events[1 - parity].synchronize()
                    return tokens, iterations, last
            parity = 1 - parity


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--documents", type=Path, nargs="+", required=True)
    p.add_argument("--questions", type=Path, required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--ngram-sizes", type=int, nargs=2, default=[1, 8])
    p.add_argument("--row-cost", type=float, default=0.05, help="the engine speculation's speculative_row_cost")
    p.add_argument("--limit", type=int, default=0, help="only the first questions (0: all)")
    args = p.parse_args()
    base = EngineConfig(model=str(args.model), load_format=args.load_format, max_model_len=4096, max_num_seqs=1)
    loaded = LoadedModel.load(base)
    if loaded.device.type == "cuda":
        base = replace(base, kv_cache_memory_bytes=4 << 30)
    plain = build_engine(base, loaded)
    spec = build_engine(replace(base, speculative="ngram", num_speculative_tokens=args.k,
                                speculative_ngram_sizes=tuple(args.ngram_sizes), speculative_row_cost=args.row_cost), loaded)
    host = build_engine(replace(base, async_scheduling="off"), loaded)  # prefills for the loop
    documents = "\n\n".join(path.read_text(encoding="utf-8") for path in args.documents)
    questions = [q.strip() for q in args.questions.read_text(encoding="utf-8").splitlines() if q.strip()]
    questions = questions[: args.limit] if args.limit else questions
    prompts = [loaded.tokenizer.apply_chat_template([{"role": "user", "content": f"{documents}\n\nQuestion: {q}"}]) for q in questions]
    loop = DeviceVerifyLoop(host, args.k, *args.ngram_sizes)
    eos = host.eos_token_ids
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    def prefill(prompt: list[int]):
        req = host.add_request(prompt, params)
        while not req.output_token_ids and not req.status.finished:
            host.step()
        return req

    def loop_answer(prompt: list[int]) -> tuple[list[int], int, float, int]:
        req = prefill(prompt)
        tokens, iterations, last = list(req.output_token_ids), 0, req.metrics.first_token_time
        if not req.status.finished:
            need = len(prompt) + args.max_tokens + 2 * (args.k + 1) - req.num_computed_tokens
            if not host.block_manager.allocate_slots(req, need):
                raise RuntimeError("no KV blocks for the answer")
            loop.start(req.all_token_ids, req.block_ids)
            more, iterations, last = loop.answer(args.max_tokens - 1, eos)
            tokens += more
            host.abort_request(req.request_id)
        return tokens, len(tokens) - 1, last - req.metrics.first_token_time, iterations

    for core in (plain, spec):  # the documents into each prefix cache, every path once
        run_group(core, prompts[:1], 8)
    req = prefill(prompts[0])  # and the loop's graph, captured on a first answer's state
    host.block_manager.allocate_slots(req, len(prompts[0]) + 64 - req.num_computed_tokens)
    loop.start(req.all_token_ids, req.block_ids)
    loop.capture()
    host.abort_request(req.request_id)

    print(f"# device_verify_loop on {device_name(loaded.device)}; {Path(args.model).name}, k={args.k}, n-grams "
          f"{args.ngram_sizes[0]}..{args.ngram_sizes[1]}, {len(questions)} questions, {args.max_tokens} tokens at most, batch 1", flush=True)
    totals = {name: [0, 0.0] for name in ("plain", "engine n-gram", "device loop")}
    answers: dict[str, list[list[int]]] = {name: [] for name in totals}
    iterations = 0
    for prompt in prompts:
        for name, core in (("plain", plain), ("engine n-gram", spec)):
            got, tokens, seconds = run_group(core, [prompt], args.max_tokens)
            answers[name].append(got[0])
            totals[name][0] += tokens
            totals[name][1] += seconds
        got_loop, tokens, seconds, n = loop_answer(prompt)
        answers["device loop"].append(got_loop)
        totals["device loop"][0] += tokens
        totals["device loop"][1] += seconds
        iterations += n
    base_rate = totals["plain"][0] / totals["plain"][1]
    for name, (tokens, seconds) in totals.items():
        same = sum(a == b for a, b in zip(answers[name], answers["plain"]))
        print(f"{name:>14}: {tokens / seconds:9.2f} tok/s  {tokens / seconds / base_rate:5.2f}x plain  "
              f"{tokens} decode tokens in {seconds:.3f} s  identical to plain {same}/{len(prompts)}")
    loop_tokens = sum(len(a) - 1 for a in answers["device loop"])
    print(f"device loop: {iterations} iterations read, {loop_tokens / max(iterations, 1):.2f} tokens an iteration, "
          f"{1e3 * totals['device loop'][1] / max(iterations, 1):.3f} ms an iteration (host clock)")


if __name__ == "__main__":
    main()
