"""Greedy Whisper decoding of many rows at once, one fixed-shape step at a time.

Every row advances one position per step. Its first positions are forced (the prompt
``<|startoftranscript|> [<|lang|> <|transcribe|>] <|notimestamps|>`` and the prefix's text tokens),
the rest are the argmax of the suppressed log-probabilities, until ``<|endoftext|>`` or the row's
last position. As CTranslate2 does for faster-whisper: the no-speech probability is the softmax of
``<|nospeech|>`` at the ``<|startoftranscript|>`` position; "auto" rows take the language with the
highest logit there (a row may take its ``leader``'s, so every window of a clip speaks the clip's
first window's language); ``suppress`` applies at every scored position and ``suppress_begin`` at
a row's first sampled one; the score sums the log-probabilities of the prefix, the text and
``<|endoftext|>``; at most ``max_new`` positions (prefix included) follow the prompt.

The step (:meth:`GreedyDecoder._step`) reads and writes only the preallocated buffers of
:class:`_Rows`, so on CUDA it is captured per batch-size bucket in CUDA graphs and replayed; on
the CPU (and with graphs off) the very same function runs eagerly. Finished rows keep stepping,
masked, until every row is done. Each bucket has two graphs: one step, and ``steps_per_graph``
steps back to back. A batch replays the long one while at least that many steps remain, then
single steps, and checks after each replay whether any row is alive: one host round trip (and one
GIL hand-off, which costs milliseconds when the server's other threads hold the GIL) every
``steps_per_graph`` tokens instead of every token, at the price of at most ``steps_per_graph - 1``
masked steps once every row has ended.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from speech.asr.whisper_model import KVCache, Whisper

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes captured for ``max_batch`` rows: the :data:`BUCKETS` below it, and itself."""
    return sorted({b for b in BUCKETS if b < max_batch} | {max_batch})


@dataclass(frozen=True)
class DecodeRules:
    """What the step needs to know of the vocabulary, for every row of a batch."""

    eot: int
    no_speech: int
    lang_ids: list[int]
    suppress: list[int]
    suppress_begin: list[int]
    prompt_length: int  # forced positions before the first text token (prefix excluded)
    max_new: int = 224  # positions after the prompt, prefix included (CTranslate2: half of 448)
    allow_eot: bool = True  # False: exactly max_new tokens after the prefix (random-weight timing runs)


@dataclass(frozen=True)
class RowPrompt:
    """One row to decode: its forced tokens, whether it detects its language, and from which row."""

    forced: list[int]
    auto_language: bool = False
    leader: int | None = None  # the row (in the same call) whose detected language this one takes


@dataclass(frozen=True)
class RowResult:
    """One decoded row: text tokens (prefix included), summed log-probability, no-speech probability."""

    tokens: list[int]
    sum_logprob: float
    no_speech_prob: float
    language_token: int | None


class _Rows:
    """The static buffers of the first ``batch`` rows (views of the decoder's full-size buffers)."""

    def __init__(self, full: _Rows | None, batch: int, cache: KVCache, positions: int, device: torch.device):
        if full is None:
            def new(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
                return torch.zeros(*shape, dtype=dtype, device=device)

            self.tokens, self.forced, self.n_forced = new(batch), new(batch, positions + 1), new(batch)
            self.stop_at, self.leader, self.end = new(batch), new(batch), new(batch)
            self.auto, self.alive = new(batch, dtype=torch.bool), new(batch, dtype=torch.bool)
            self.sum_logprob, self.no_speech = new(batch, dtype=torch.float32), new(batch, dtype=torch.float32)
            self.out = new(batch, positions + 1)
            self.step = new(())
        else:
            for name in ("tokens", "forced", "n_forced", "stop_at", "leader", "end", "auto", "alive",
                         "sum_logprob", "no_speech", "out"):  # fmt: skip
                setattr(self, name, getattr(full, name)[:batch])
            self.step = full.step
        self.batch = batch
        self.cache = cache.rows(batch)


class GreedyDecoder:
    """Decodes batches of up to ``max_batch`` rows of one model; CUDA graphs per bucket when asked."""

    def __init__(self, model: Whisper, rules: DecodeRules, max_batch: int, cuda_graphs: bool = True,
                 stream: torch.cuda.Stream | None = None, steps_per_graph: int = 8) -> None:  # fmt: skip
        if steps_per_graph < 1:
            raise ValueError(f"steps_per_graph={steps_per_graph}: use 1 or more")
        self.model = model
        self.steps_per_graph = steps_per_graph
        self.rules = rules
        self.max_batch = max_batch
        weight = model.decoder.ln.weight
        self.device = weight.device
        self.positions = model.dims.n_text_ctx
        vocab = model.dims.n_vocab
        self.cache = model.new_cache(max_batch, self.positions)
        self.full = _Rows(None, max_batch, self.cache, self.positions, self.device)
        self.lang_ids = torch.tensor(rules.lang_ids or [rules.eot], device=self.device)
        self.suppress = torch.zeros(vocab, dtype=torch.bool, device=self.device)
        self.suppress[rules.suppress + ([] if rules.allow_eot else [rules.eot])] = True
        self.suppress_begin = torch.zeros(vocab, dtype=torch.bool, device=self.device)
        self.suppress_begin[rules.suppress_begin] = True
        self.stream = stream
        self.use_graphs = cuda_graphs and self.device.type == "cuda"
        self.buckets = batch_buckets(max_batch)
        self._rows = {b: _Rows(self.full, b, self.cache, self.positions, self.device) for b in self.buckets}
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (bucket, steps) -> graph
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.steps_run = 0  # steps the last batch ran (for timing: a step is one token of every row)
        on_cuda = self.device.type == "cuda"
        self._flags = torch.zeros(2, dtype=torch.bool, pin_memory=on_cuda)
        self._events = [torch.cuda.Event(), torch.cuda.Event()] if on_cuda else []

    # ---- the step: eager and captured alike ---------------------------------------------------------
    def _step(self, rows: _Rows) -> None:
        rules, step = self.rules, rows.step
        logits = self.model.decode_step(rows.tokens, step, rows.cache)
        position = step + 1  # the position whose token this step chooses
        first = step == 0
        # At <|startoftranscript|>: the no-speech probability and the language, from the raw logits.
        no_speech = (logits[:, rules.no_speech] - logits.logsumexp(-1)).exp()
        rows.no_speech.copy_(torch.where(first, no_speech, rows.no_speech))
        language = self.lang_ids.index_select(0, logits.index_select(1, self.lang_ids).argmax(-1))
        language = language.index_select(0, rows.leader)
        rows.forced[:, 1].copy_(torch.where(first & rows.auto, language, rows.forced[:, 1]))

        sampled = position >= rows.n_forced
        begin = position == rows.n_forced
        logits = logits.masked_fill(self.suppress, float("-inf"))
        logits = logits.masked_fill(begin[:, None] & self.suppress_begin, float("-inf"))
        logprobs = logits.log_softmax(-1)
        forced = rows.forced.gather(1, position.view(1, 1).expand(rows.batch, 1))[:, 0]
        token = torch.where(sampled, logprobs.argmax(-1), forced)
        scored = rows.alive & (position >= rules.prompt_length)
        rows.sum_logprob.add_(torch.where(scored, logprobs.gather(1, token[:, None])[:, 0], 0.0))
        eot = rows.alive & sampled & (token == rules.eot)
        last = rows.alive & (position >= rows.stop_at)
        rows.end.copy_(torch.where(eot, position, torch.where(last, position + 1, rows.end)))
        rows.alive.copy_(rows.alive & ~eot & ~last)
        rows.out.index_copy_(1, position.view(1), token[:, None])
        rows.tokens.copy_(token)
        step.add_(1)

    def _run_steps(self, rows: _Rows, steps: int) -> None:
        """Advance every row ``steps`` steps: one graph replay when captured, else eagerly."""
        graph = self._graphs.get((rows.batch, steps))
        if graph is not None:
            graph.replay()
            return
        with torch.inference_mode():
            for _ in range(steps):
                self._step(rows)

    def capture(self) -> None:
        """Capture every bucket's one-step and ``steps_per_graph``-step graphs (no-op unless CUDA
        graphs are on)."""
        if not self.use_graphs:
            return
        side = self.stream or torch.cuda.Stream()
        with torch.inference_mode():
            for batch in self.buckets:
                rows = self._rows[batch]
                for steps in sorted({1, self.steps_per_graph}):
                    if (batch, steps) in self._graphs:
                        continue
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        for _ in range(2):  # warm up kernels and workspaces outside the capture
                            self._step(rows)
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    # thread_local: other threads of the process (the LLM engine) may use CUDA meanwhile
                    with torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local"):
                        for _ in range(steps):
                            self._step(rows)
                    self._graphs[(batch, steps)] = graph
        torch.cuda.synchronize(self.device)

    # ---- a batch ------------------------------------------------------------------------------------------
    def decode(self, audio: torch.Tensor, prompts: list[RowPrompt]) -> list[RowResult]:
        """Decode ``prompts[i]`` against encoder output ``audio[i]``, ``max_batch`` rows at a time.

        A row's leader must come before it; a row whose leader went in an earlier batch is
        forced to the language its leader detected.
        """
        results: list[RowResult] = []
        for start in range(0, len(prompts), self.max_batch):
            chunk = []
            for prompt in prompts[start : start + self.max_batch]:
                if prompt.leader is not None and prompt.leader < start:
                    known = results[prompt.leader].language_token
                    forced = list(prompt.forced)
                    if known is not None:
                        forced[1] = known
                    prompt = RowPrompt(forced)
                elif prompt.leader is not None:
                    prompt = RowPrompt(prompt.forced, prompt.auto_language, prompt.leader - start)
                chunk.append(prompt)
            results += self._decode_batch(audio[start : start + len(chunk)], chunk)
        return results

    def _bucket(self, count: int) -> int:
        if not self.use_graphs:
            return count
        return next(b for b in self.buckets if b >= count)

    def _decode_batch(self, audio: torch.Tensor, prompts: list[RowPrompt]) -> list[RowResult]:
        rules = self.rules
        count = len(prompts)
        rows = self._rows.get(self._bucket(count)) or _Rows(self.full, count, self.cache, self.positions, self.device)
        self.model.fill_cross(rows.cache, audio)
        forced = torch.full((rows.batch, self.positions + 1), rules.eot, dtype=torch.long)
        n_forced = torch.ones(rows.batch, dtype=torch.long)
        stop_at = torch.ones(rows.batch, dtype=torch.long)
        leader = torch.arange(rows.batch)
        auto = torch.zeros(rows.batch, dtype=torch.bool)
        alive = torch.zeros(rows.batch, dtype=torch.bool)
        for i, prompt in enumerate(prompts):
            tokens = prompt.forced[: rules.prompt_length + rules.max_new - 1]
            forced[i, : len(tokens)] = torch.tensor(tokens)
            n_forced[i] = len(tokens)
            last = rules.prompt_length + rules.max_new - 1
            if not rules.allow_eot:  # exactly max_new tokens after the prefix
                last = len(tokens) + rules.max_new - 1
            stop_at[i] = min(last, self.positions - 1)
            leader[i] = i if prompt.leader is None else prompt.leader
            auto[i] = prompt.auto_language
            alive[i] = True
        for name, value in (("forced", forced), ("n_forced", n_forced), ("stop_at", stop_at),
                            ("leader", leader), ("auto", auto), ("alive", alive)):  # fmt: skip
            getattr(rows, name).copy_(value, non_blocking=True)
        rows.tokens.copy_(forced[:, 0], non_blocking=True)
        for name in ("end", "sum_logprob", "no_speech", "out", "step"):
            getattr(rows, name).zero_()
        steps = int(stop_at[:count].max())
        self._loop(rows, steps)
        return self._results(rows, count)

    def _loop(self, rows: _Rows, steps: int) -> None:
        """Run up to ``steps`` steps, ``steps_per_graph`` a replay while that many remain, stopping
        once no row is alive. On CUDA the check lags one replay behind (the next replay is queued
        before the host waits for the flag), so the GPU never idles."""
        self.steps_run = 0
        flags, events = self._flags, self._events
        replay = 0
        while self.steps_run < steps:
            count = self.steps_per_graph if steps - self.steps_run >= self.steps_per_graph else 1
            self._run_steps(rows, count)
            self.steps_run += count
            if not events:
                if not bool(rows.alive.any()):
                    return
                continue
            flags[replay % 2].copy_(rows.alive.any(), non_blocking=True)
            events[replay % 2].record()
            if replay > 0:
                events[(replay - 1) % 2].synchronize()
                if not bool(flags[(replay - 1) % 2]):
                    return
            replay += 1

    def _results(self, rows: _Rows, count: int) -> list[RowResult]:
        start = self.rules.prompt_length
        out, end = rows.out[:count].cpu(), rows.end[:count].cpu()
        sums, no_speech = rows.sum_logprob[:count].cpu(), rows.no_speech[:count].cpu()
        multilingual = start > 2
        return [
            RowResult(out[i, start : int(end[i])].tolist(), float(sums[i]), float(no_speech[i]),
                      int(out[i, 1]) if multilingual else None)
            for i in range(count)
        ]  # fmt: skip

    def stream_context(self):
        """The ASR stream as the current stream (a no-op context off CUDA or without a stream)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()


__all__ = ["BUCKETS", "batch_buckets", "DecodeRules", "GreedyDecoder", "RowPrompt", "RowResult"]
