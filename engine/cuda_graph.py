"""CUDA graphs: whole decode steps, and the pieces between attentions of small mixed steps.

At batch 1 an 8B decode step is ~3.5 ms of memory traffic spread over ~400 kernels; launched
one by one from Python that becomes ~80 ms (measured for HF eager on an H200). Captured once per
bucket, a step is a host->device copy into persistent buffers and one replay.

:class:`CudaGraphRunner`: decode-only batches (one query per request), the whole forward, the
lm_head and the greedy argmax (every decode row is sampled) as one graph per batch-size bucket:
at batch 1 the lm_head follows the last norm inside the graph instead of after an eager row
gather and a launch gap. The step's inputs arrive as one packed copy that the graph's first
kernel scatters. Padding rows point at the null block with context length 0.

A verifying step (speculative decoding: each request's last token and its drafts) replays
the same kind of graph with a row per *token*: row ``j`` of a request is a decode at position
``start + j`` with context ``start + j + 1`` and the request's block table; with the Triton
backend row ``j`` attends to the K/V of the rows before it from their raw k|v in the same fused
kernel (``AttentionMetadata.rows_are_tokens``, ``row_group``), not from the cache they write in
that kernel. A request's rows then read its context once each, which at the few rows of a verifying step (``k + 1``) is cheap next to a
launch-bound step outside a graph; and at up to 16 rows the projections stay on the batch-1
GEMVs, whose x is one 16-row tensor-core tile anyway: a row's projections run the batch-1 step's
kernels and tiles (its attention is split differently, so its rounding may differ there; on the
H200 the 1.5B's batch-1 answers came out token for token the same, docs/performance.md).

:class:`PiecewiseGraphRunner`: steps with prefill chunks. Their attention launch shape depends on
the batch (tiles per request, context splits), so it runs eagerly; everything else - the
projections, norms and MLPs between two attentions - is one graph per (token bucket, piece):
33 replays and 32 eager attentions instead of ~450 launches. A 30-token question after a cached
32k prefix was host-bound at ~20 ms of eager launches (H200 host) for ~10 ms of device work.
Padding rows compute garbage that no attention reads and no sample uses (every op of a piece is
row-wise).

:class:`MixedGraphRunner`: steps of decodes plus one prefill chunk whose shape repeats, attention
included, as one graph per (decode bucket, chunk length): no eager launch at all.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import logging
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.block_manager import NULL_BLOCK
from engine.kernels.argmax import argmax_rows
from engine.kernels.gemv_policy import GemvPolicy
from engine.kernels.step_inputs import packed_size, scatter_decode_inputs
from engine.kv_cache import LayerKV
from engine.model import LlamaForCausalLM
from engine.transfer import copy_to_device

log = logging.getLogger(__name__)


def graph_bucket(batch_sizes: list[int], num_seqs: int) -> int | None:
    """The smallest captured batch size (sorted ascending) that holds ``num_seqs`` decodes;
    None when the batch is larger than every graph (it then runs eagerly)."""
    for bs in batch_sizes:
        if bs >= num_seqs:
            return bs
    return None


@dataclass
class DecodeGraphStep:
    """A decode-only step for :class:`CudaGraphRunner`: its inputs packed on the host
    (engine/kernels/step_inputs.py), scattered on the device by the graph's first kernel."""

    bucket: int
    packed: np.ndarray
    pending: torch.Tensor | None  # the step in flight's sampled tokens, when this step reads some
    rows_are_tokens: bool = False  # a row graph's step (a row per token, several a request)

    @property
    def num_rows(self) -> int:
        return int(self.packed[0])  # the layout's header


class CudaGraphRunner:
    """Decode-only steps as one graph per batch-size bucket: the packed step's scatter into the
    persistent buffers, the forward, the lm_head and the greedy argmax. Around a replay only two
    copies remain: the packed step in, the tokens out (engine_core). The argmax writes
    ``tokens``, where the next step's graph reads its pending input tokens (read first, written
    last: one buffer, in stream order).

    On the CPU (tests) nothing is captured: a replay runs the same scatter, then the forward of
    the real rows eagerly on the same buffers (the torch attention reference needs the context
    lengths on the host), so the packing, the pending-token rows and the greedy output are the
    code the GPU runs.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        kv_layers: list[LayerKV],
        batch_sizes: list[int],
        max_blocks_per_seq: int,
        token_rows: int,
        device: torch.device,
        gemv: GemvPolicy,
        rows_are_tokens: bool = False,
        row_group: int = 1,
    ) -> None:
        """``rows_are_tokens``: the rows are tokens, up to ``row_group`` of one request may follow
        each other (a verifying step: see ``AttentionMetadata.rows_are_tokens``); ``batch_sizes``
        then count rows."""
        self.model = model
        self.gemv = gemv  # the batch-1 GEMV policy the graphs are captured with
        self.rows_are_tokens = rows_are_tokens
        self.row_group = row_group
        self.backend = backend
        self.kv_layers = kv_layers
        self.batch_sizes = sorted(set(batch_sizes))
        max_bs = self.batch_sizes[-1]
        # Persistent inputs: graphs read from these addresses on every replay.
        self.staging = torch.zeros(packed_size(max_bs, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_bs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        # Greedy tokens out, pending tokens in; rows for any step's samples (token_rows: the
        # engine's max_num_seqs), copied in when the step before was not a graph step.
        self.tokens = torch.zeros(max(max_bs, token_rows), dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.padding_rows = 0  # rows replayed for nothing: the price of the buckets
        if device.type != "cuda":
            return
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.batch_sizes):  # largest first: later graphs reuse its pool
            meta = self._meta(bs)
            with torch.inference_mode():
                for _ in range(2):  # compile Triton kernels, settle cuBLAS heuristics
                    self._step(bs, meta)
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    self.outputs[bs] = self._step(bs, meta)
            self.graphs[bs] = graph
        torch.cuda.synchronize(device)
        log.info("captured decode CUDA graphs for batch sizes %s", self.batch_sizes)

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            query_lens_host=[1] * bs,
            seq_lens_host=[0] * bs,  # not read on the Triton decode path
            num_decodes=bs,
            max_seq_len=0,
            rows_are_tokens=self.rows_are_tokens, row_group=self.row_group,
        )

    def _step(self, bs: int, meta: AttentionMetadata) -> torch.Tensor:
        """What a graph holds: scatter the staged step, forward ``bs`` rows, logits, argmax."""
        scatter_decode_inputs(self.staging, self.tokens, self.input_ids, self.positions, self.slot_mapping, self.seq_lens,
                              self.block_tables, bs)
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self.backend, meta, self.kv_layers, self.gemv)
        logits = self.model.compute_logits(hidden, self.gemv)
        argmax_rows(logits, out=self.tokens[:bs])
        return logits

    def _step_eager(self, bs: int) -> torch.Tensor:
        """The CPU's replay: the same scatter, then the real rows' forward with host lengths."""
        scatter_decode_inputs(self.staging, self.tokens, self.input_ids, self.positions, self.slot_mapping, self.seq_lens,
                              self.block_tables, bs)
        n, width = self.staging[:2].tolist()
        seq_lens = self.seq_lens[:n].tolist()
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:n], query_start_loc=self.query_start_loc[: n + 1], seq_lens=self.seq_lens[:n],
            block_tables=self.block_tables[:n, :width], query_lens_host=[1] * n, seq_lens_host=seq_lens, num_decodes=n,
            max_seq_len=max(seq_lens), rows_are_tokens=self.rows_are_tokens, row_group=self.row_group,
        )
        hidden = self.model(self.input_ids[:n], self.positions[:n], self.backend, meta, self.kv_layers, self.gemv)
        logits = self.model.compute_logits(hidden, self.gemv)
        argmax_rows(logits, out=self.tokens[:n])
        return logits

    def bucket(self, num_seqs: int) -> int | None:
        return graph_bucket(self.batch_sizes, num_seqs)

    def run(self, step: DecodeGraphStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage one decode step, replay its bucket's graph; logits [n, vocab] (float32) and the
        greedy tokens [n] of its n rows (views of persistent buffers: valid until the next run)."""
        n = step.num_rows
        self.padding_rows += step.bucket - n
        if step.pending is not None and step.pending.data_ptr() != self.tokens.data_ptr():
            # The step before ran another way (eager, mixed, sampled): its tokens come in here.
            if len(step.pending) > len(self.tokens):
                raise RuntimeError(f"{len(step.pending)} pending tokens for a token buffer of {len(self.tokens)} rows")
            self.tokens[: len(step.pending)].copy_(step.pending)
        copy_to_device(self.staging, step.packed)
        if self.graphs:
            self.graphs[step.bucket].replay()
            logits = self.outputs[step.bucket]
        else:
            logits = self._step_eager(step.bucket)
        return logits[:n], self.tokens[:n]


class _Piece:
    """One piece of the forward at one token bucket: a CUDA graph replayed in place, or on the
    CPU (tests) the same function run again with its results copied into the same outputs."""

    def __init__(self, fn, pool, device: torch.device) -> None:
        self.fn = fn
        with torch.inference_mode():
            if device.type == "cuda":
                fn()  # warm-up: cuBLAS heuristics, Triton compiles
                torch.cuda.synchronize(device)
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
                    self.outputs = fn()
            else:
                self.graph = None
                self.outputs = fn()

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
            return
        for out, new in zip(_flat(self.outputs), _flat(self.fn())):
            out.copy_(new)


def _flat(x) -> tuple[torch.Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


class PiecewiseGraphRunner:
    """Steps of up to ``max(token_sizes)`` tokens: graphs for the pieces, attention eager."""

    def __init__(self, model: LlamaForCausalLM, token_sizes: list[int], device: torch.device, gemv: GemvPolicy) -> None:
        self.model, self.gemv = model, gemv
        self.token_sizes = sorted(set(token_sizes))
        cfg = model.config
        tmax = self.token_sizes[-1]
        dtype = model.embed_tokens.weight.dtype
        # Persistent buffers shared by every bucket and piece (pieces run one after another):
        # the token ids, what attention reads (q|k|v) and writes, the residual stream, the output.
        # Without them each of the ~500 graphs would keep its own outputs alive (1.8 GB at 8B).
        qkv_size = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
        self.input_ids = torch.zeros(tmax, dtype=torch.long, device=device)
        self.qkv = torch.zeros(tmax, qkv_size, dtype=dtype, device=device)
        self.attn_out = torch.zeros(tmax, cfg.num_attention_heads * cfg.head_dim, dtype=dtype, device=device)
        self.residual = torch.zeros(tmax, cfg.hidden_size, dtype=dtype, device=device)
        self.hidden = torch.zeros(tmax, cfg.hidden_size, dtype=dtype, device=device)
        self.pieces: dict[int, list[_Piece]] = {}
        pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        for t in reversed(self.token_sizes):  # largest first: the smaller ones reuse its pool
            self.pieces[t] = self._capture(t, pool, device)
        log.info("captured piecewise CUDA graphs for %s tokens", self.token_sizes)

    def _capture(self, t: int, pool, device: torch.device) -> list[_Piece]:
        m, gemv, ids, attn = self.model, self.gemv, self.input_ids[:t], self.attn_out[:t]
        qkv_out, residual, hidden = self.qkv[:t], self.residual[:t], self.hidden[:t]

        def store(result: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            qkv_out.copy_(result[0])
            residual.copy_(result[1])  # read by this piece before it is overwritten: same stream order
            return qkv_out, residual

        pieces = [_Piece(lambda: store(m.first_piece(ids, gemv)), pool, device)]
        for i in range(len(m.layers) - 1):
            pieces.append(_Piece(lambda i=i: store(m.middle_piece(i, attn, residual, gemv)), pool, device))
        pieces.append(_Piece(lambda: hidden.copy_(m.last_piece(attn, residual, gemv)), pool, device))
        return pieces

    def bucket(self, num_tokens: int) -> int | None:
        return graph_bucket(self.token_sizes, num_tokens)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend, meta: AttentionMetadata,
        kv_layers: list[LayerKV], bucket: int,
    ) -> torch.Tensor:
        """The model's forward for one step of ``n <= bucket`` tokens -> hidden [n, H]."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        pieces = self.pieces[bucket]
        pieces[0].replay()
        cos_sin = self.model.rope.cos_sin
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn.attention(self.qkv[:n], positions, cos_sin, backend, meta, kv_layers[i])
            self.attn_out[:n].copy_(attn)
            pieces[i + 1].replay()
        return self.hidden[:n]


class MixedGraphRunner:
    """Steps of decodes plus one prefill chunk, attention included, as one CUDA graph per
    (decode bucket, chunk bucket).

    The piecewise runner leaves attention eager: ~32 x 5 Triton launches and their Python, 13-15
    ms of host time per step on the H200 host (docs/performance.md) - a step of 32 decodes and a
    32-token chunk needs at most 9.4 ms of device time (at 31k of context), so it was host-bound
    (p50 18 ms). That shape is the common one: a long prompt chunked at a fixed budget while
    others decode, or a question after a cached prefix, repeated step after step.

    Layout in the graph: rows ``[0, Db)`` decodes (real ones first, then padding rows with
    context 1 on the null block), rows ``[Db, Db + Cb)`` the chunk: its ``C`` real tokens, then
    ``Cb - C`` padding tokens up to the chunk bucket (the smallest of ``chunk_buckets`` that holds
    it). The chunk's context length counts the padding tokens, so its real rows sit at their own
    positions of the causal mask and attend to nothing after themselves; the padding rows write
    their keys and values into the null block's slot 0 and their outputs are never read. Bucketing
    keeps the number of shapes small: a question after a cached prefix has any length, and one
    graph per exact length would capture (and stall the engine) again and again. Everything a
    launch shape depends on is fixed by the key: decode splits by Db, prefill tiles by Cb, prefill
    splits by ``max_model_len`` (empty splits only write an empty partial). The per-step values
    (tokens, positions, slots, context lengths, block tables) are copied into persistent buffers.

    :meth:`capture_at_start` captures the keys ``(0, Cb)`` at start-up (a question after the
    cached documents while nothing else runs: the voice turn's shape), and with ``start_chunk`` > 0
    every ``(Db, Cb)`` whose chunk bucket is at most that (a question while other answers decode:
    the voice server's shape under load). Any other key is captured the second time it is seen (a one-off shape is not worth a capture: a stall
    for every running request, see EngineConfig.mixed_cuda_graph_max_graphs), and at most ``max_graphs`` keys in the
    runner's life: with eviction, shapes that keep changing (a serving mix of prompt lengths)
    would stall the engine again and again; later shapes take the piecewise path. On the CPU
    nothing is captured: the same padded batch runs eagerly, with the same bookkeeping (tests of
    the layout, the row mapping and the capture policy).
    """

    def __init__(
        self, model: LlamaForCausalLM, backend: AttentionBackend, kv_layers: list[LayerKV],
        decode_buckets: list[int], max_chunk: int, max_blocks_per_seq: int, max_model_len: int, max_graphs: int,
        device: torch.device, gemv: GemvPolicy, capture_lock: AbstractContextManager, chunk_buckets: list[int] = (),
    ) -> None:
        self.model, self.backend, self.kv_layers, self.device, self.gemv = model, backend, kv_layers, device, gemv
        self.capture_lock = capture_lock  # held while capturing: no other GPU work of the process meanwhile
        self.decode_buckets = sorted({0, *decode_buckets})  # 0: a lone chunk (a question after a cached prefix)
        self.max_chunk, self.max_model_len, self.max_graphs = max_chunk, max_model_len, max_graphs
        self.chunk_buckets = sorted({b for b in chunk_buckets if b < max_chunk} | {max_chunk})
        dmax = self.decode_buckets[-1]
        tmax = dmax + max_chunk
        self.input_ids = torch.zeros(tmax, dtype=torch.long, device=device)
        self.positions = torch.zeros(tmax, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(tmax, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(dmax + 1, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(dmax + 2, dtype=torch.int32, device=device)
        self.arange = self.query_start_loc.clone()  # decodes' query starts; the chunk's end is per key
        self.block_tables = torch.zeros(dmax + 1, max_blocks_per_seq, dtype=torch.int32, device=device)
        # key -> (graph, its hidden-state output, the metadata whose scratch tensors it reads);
        # None on the CPU (nothing captured)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, AttentionMetadata] | None] = {}
        self.seen: Counter[tuple[int, int]] = Counter()
        self.padding_rows = 0  # decode rows padded so far (diagnostics, tests)
        self.padding_tokens = 0  # chunk tokens padded so far
        self.start_captures = 0  # keys captured at start-up (they do not count against max_graphs)
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.pool_bytes = 0  # device memory reserved by the captures (after the KV budget was set)

    @property
    def captures(self) -> int:
        """CUDA graphs captured so far (0 on the CPU)."""
        return sum(entry is not None for entry in self.graphs.values())

    def key(self, meta: AttentionMetadata, num_tokens: int) -> tuple[int, int] | None:
        """(decode bucket, chunk bucket) for a step this runner can take, else None (also when
        the padded chunk would reach past ``max_model_len``)."""
        d = meta.num_decodes
        c = num_tokens - d
        if meta.num_requests != d + 1 or c > self.max_chunk:
            return None
        db = graph_bucket(self.decode_buckets, d)
        cb = graph_bucket(self.chunk_buckets, c)
        if db is None or cb is None or meta.seq_lens_host[d] + cb - c > self.max_model_len:
            return None
        return db, cb

    def ready(self, key: tuple[int, int]) -> bool:
        """Counts a sighting; True when the key has a graph, or is seen for the second time and
        fewer than ``max_graphs`` have been captured while serving."""
        self.seen[key] += 1
        return key in self.graphs or (self.seen[key] >= 2 and len(self.graphs) - self.start_captures < self.max_graphs)

    def capture_at_start(self, start_chunk: int = 0) -> None:
        """Capture ``(0, Cb)`` for every chunk bucket, and ``(Db, Cb)`` for every decode bucket and
        every chunk bucket of at most ``start_chunk`` tokens (CUDA only; the caller holds the
        capture lock): such a step then never waits for a capture, nor runs attention eagerly.
        Why the voice server wants the grid: its process has other Python threads (the ASR and
        TTS workers, the event loop), and the ~160 kernel launches of a piecewise step each wait
        for the GIL behind them (H200, 64 callers: 172 ms a piecewise step, against 20 ms for the
        same step in an engine alone)."""
        if self.pool is None:
            return
        for key in self.start_keys(start_chunk):
            if key not in self.graphs:
                self.graphs[key] = self._capture(*key, nullcontext(), count_pool=False)
                self.start_captures += 1

    def start_keys(self, start_chunk: int) -> list[tuple[int, int]]:
        """The keys :meth:`capture_at_start` captures (on the CPU too: tests of the grid)."""
        return [(db, cb) for db in self.decode_buckets for cb in self.chunk_buckets if db == 0 or cb <= start_chunk]

    def _meta(self, db: int, c: int, seq_lens_host: list[int]) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[: db + c],
            query_start_loc=self.query_start_loc[: db + 2],
            seq_lens=self.seq_lens[: db + 1],
            block_tables=self.block_tables[: db + 1],
            query_lens_host=[1] * db + [c],
            seq_lens_host=seq_lens_host,
            num_decodes=db,
            max_seq_len=max(seq_lens_host),
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, key: tuple[int, int],
            sample_rows: torch.Tensor) -> torch.Tensor:
        """Hidden states [len(sample_rows), H] of the step's sampled rows (indices into its
        unpadded order: decodes, then the chunk)."""
        db, cb = key
        d = meta.num_decodes
        c = len(input_ids) - d
        end, t = db + c, db + cb  # the real chunk's end, the padded one's
        self.input_ids[:d].copy_(input_ids[:d])
        self.input_ids[db:end].copy_(input_ids[d:])
        self.positions[:d].copy_(positions[:d])
        self.positions[db:end].copy_(positions[d:])
        self.slot_mapping[:d].copy_(meta.slot_mapping[:d])
        self.slot_mapping[db:end].copy_(meta.slot_mapping[d:])
        self.seq_lens[:d].copy_(meta.seq_lens[:d])
        self.seq_lens[db : db + 1].copy_(meta.seq_lens[d:] + (cb - c))  # the padding tokens are the chunk's last
        if cb > c:  # padding tokens: token 0 at position 0, their keys and values into the null block's slot 0
            for buf in (self.input_ids, self.positions, self.slot_mapping):
                buf[end:t].zero_()
            self.padding_tokens += cb - c
        width = meta.block_tables.shape[1]
        self.block_tables[:d, :width].copy_(meta.block_tables[:d])
        self.block_tables[db, :width].copy_(meta.block_tables[d])
        self.query_start_loc[: db + 1].copy_(self.arange[: db + 1])
        self.query_start_loc[db + 1].fill_(t)
        self.padding_rows += db - d
        if db > d:  # padding decodes: token 0 at position 0, one key and their own KV in the null block's slot 0
            for buf in (self.input_ids, self.positions, self.slot_mapping):
                buf[d:db].zero_()
            self.seq_lens[d:db].fill_(1)
            self.block_tables[d:db, 0].fill_(NULL_BLOCK)
        if self.pool is None:  # CPU: the padded batch eagerly, with its real host-side lengths
            self.graphs.setdefault(key, None)
            lens = meta.seq_lens_host
            hidden = self.model(self.input_ids[:t], self.positions[:t], self.backend,
                                self._meta(db, cb, lens[:d] + [1] * (db - d) + [lens[d] + cb - c]), self.kv_layers, self.gemv)
        else:
            hidden = self._replay(key)
        rows = sample_rows + (sample_rows >= d).to(sample_rows.dtype) * (db - d)
        return hidden[rows]

    def _replay(self, key: tuple[int, int]) -> torch.Tensor:
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(*key, self.capture_lock)
        graph, hidden, _ = entry
        graph.replay()
        return hidden

    def _capture(self, db: int, c: int, lock: AbstractContextManager, count_pool: bool = True,
                 ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, AttentionMetadata]:  # fmt: skip
        """Warm up (the step's own data is already in the buffers: its KV writes are the same
        on replay), then capture. The metadata's host values are the key's worst case, so the
        prefill splits do not depend on this step's context; its prefill tiles are built by the
        warm-up, outside the capture (a host->device copy inside one would replay from a freed
        staging buffer)."""
        started = time.perf_counter()
        meta = self._meta(db, c, [1] * db + [self.max_model_len])
        t = db + c
        with torch.inference_mode():
            # The warm-up runs outside the capture lock: it may compile Triton kernels for the new
            # shape (0.66 s for the first mixed step on the H200), and only the capture itself
            # must not overlap the process's other GPU work (Whisper's batches wait for the lock).
            self.model(self.input_ids[:t], self.positions[:t], self.backend, meta, self.kv_layers, self.gemv)
            torch.cuda.synchronize(self.device)
            warmed = time.perf_counter()
            with lock:
                # Capturing empties the allocator's cache first: measured from after that, the
                # difference is the pool's growth (from before the warm-up it went negative).
                torch.cuda.empty_cache()
                before = torch.cuda.memory_reserved(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    hidden = self.model(self.input_ids[:t], self.positions[:t], self.backend, meta, self.kv_layers, self.gemv)
                if count_pool:  # (start-up captures are in the start-up graphs' pool figure)
                    self.pool_bytes += torch.cuda.memory_reserved(self.device) - before
        # timed: the engine stalls for both parts, the process's other GPU users for the capture
        log.info("captured a mixed-step CUDA graph: %d decode rows + a %d-token chunk (warm-up %.0f ms, capture "
                 "%.0f ms under the lock)", db, c, (warmed - started) * 1000, (time.perf_counter() - warmed) * 1000)
        return graph, hidden, meta
