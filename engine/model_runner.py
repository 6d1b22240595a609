"""Turns a scheduled step into tensors, runs the model, and returns logits to sample from.

The step's tokens are flattened: decodes (one query token each) first, then prefill chunks,
so attention can batch all decodes in one call. Host-side lists are built once per step and
copied to the device in one transfer; a decode-only step that fits a decode graph goes packed
(engine/kernels/step_inputs.py) and is unpacked inside the graph, and so does a verifying step
(decodes with drafts) that fits a *row graph*: the same graph with a row per token
(engine/cuda_graph.py).
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from dataclasses import dataclass, replace

import numpy as np
import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.block_manager import NULL_BLOCK, BlockManager
from engine.cuda_graph import CudaGraphRunner, DecodeGraphStep, MixedGraphRunner, PiecewiseGraphRunner
from engine.execution_path import ExecutionPath
from engine.kernels.gemv_policy import GemvPolicy
from engine.kernels.linear import TILE_ROWS
from engine.kernels.step_inputs import pack_decode_step
from engine.kv_cache import KVCache
from engine.model import LlamaForCausalLM
from engine.native_decode import NativeDecodeStep
from engine.scheduler import ScheduledChunk
from engine.transfer import to_device


@dataclass
class DeviceTokens:
    """Tokens sampled by the step still in flight, left on the device (async scheduling): the
    next step's decodes read their input token from here instead of waiting for the host."""

    tokens: torch.Tensor  # [N] int64, one row per sampled request
    row_of: dict[str, int]  # request id -> row


@dataclass
class StepInputs:
    """One step's inputs and the path its forward takes: on the device for the eager, piecewise,
    mixed and native paths; packed on the host for a decode graph (``graph``), whose first kernel
    scatters them."""

    chunks: list[ScheduledChunk]  # in batch order
    sampled_chunks: list[ScheduledChunk]  # one per sample row: a verifying decode's chunk once per row
    num_tokens: int
    sample_rows_host: list[int]  # index into the flattened tokens of each chunk that yields a sample
    path: ExecutionPath
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    meta: AttentionMetadata | None = None
    sample_rows: torch.Tensor | None = None  # sample_rows_host on the device
    graph: DecodeGraphStep | None = None  # the GRAPH path's packed step
    pieces: int | None = None  # the PIECEWISE path's token bucket
    mixed_key: tuple[int, int] | None = None  # the MIXED path's (decode bucket, chunk bucket)


@dataclass
class StepLogits:
    """The forward's output for the sampled rows."""

    logits: torch.Tensor  # [sampled rows, vocab] float32
    argmax: torch.Tensor | None = None  # [sampled rows] int64, when the step computed the greedy tokens (decode graphs)


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, kv_cache: KVCache, backend: AttentionBackend, block_manager: BlockManager, device: torch.device,
        gemv: GemvPolicy, native: NativeDecodeStep | None = None,
    ) -> None:
        """``gemv``: which steps of few tokens run the batch-1 GEMVs (every forward and graph of
        this runner); ``native``: the CPU's native step for decode-only steps, if built."""
        self.model = model
        self.gemv = gemv
        self.kv_cache = kv_cache
        self.kv_layers = kv_cache.layers()
        self.backend = backend
        self.block_manager = block_manager
        self.device = device
        self.block_size = block_manager.block_size
        self.graphs: CudaGraphRunner | None = None
        self.row_graphs: CudaGraphRunner | None = None
        self.row_max_query = 0  # the most tokens of one request a row graph takes (1 + drafts)
        self.piecewise: PiecewiseGraphRunner | None = None
        self.mixed: MixedGraphRunner | None = None
        self.native = native

    def capture_cuda_graphs(self, batch_sizes: list[int], max_model_len: int, max_num_seqs: int) -> None:
        """Capture decode graphs (on the CPU only tests use it: nothing is captured, the same
        steps run eagerly); afterwards decode-only steps replay them."""
        self.graphs = CudaGraphRunner(
            self.model, self.backend, self.kv_layers, batch_sizes, -(-max_model_len // self.block_size), max_num_seqs, self.device,
            self.gemv,
        )

    def capture_row_graphs(self, row_sizes: list[int], max_query: int, max_model_len: int, max_num_seqs: int) -> None:
        """Capture row graphs (decode graphs with a row per token) for steps of at most
        ``max(row_sizes)`` tokens whose requests bring at most ``max_query`` tokens each: the
        verifying steps of speculative decoding (1 + drafts tokens a request), and a draft
        model's steps that catch up on the tokens its target accepted. Up to 16 rows they keep
        the batch-1 GEMVs (their x is one 16-row tile either way)."""
        gemv = replace(self.gemv, max_rows=TILE_ROWS) if self.gemv.max_rows else self.gemv
        self.row_graphs = CudaGraphRunner(
            self.model, self.backend, self.kv_layers, row_sizes, -(-max_model_len // self.block_size), max_num_seqs, self.device,
            gemv, rows_are_tokens=True, row_group=max_query,
        )
        self.row_max_query = max_query

    def _graph_bucket(self, chunks: list[ScheduledChunk]) -> tuple[CudaGraphRunner, int] | None:
        """The graph and bucket of a decode-only step, or of a step of few tokens a request that
        fits a row graph (its path is then GRAPH); None when it runs another way
        (``_choose_path``: the native CPU step first, where the runner has one)."""
        if self.graphs is None or self.native is not None:
            return None
        longest = max(c.num_tokens for c in chunks)
        if longest == 1:
            bucket = self.graphs.bucket(len(chunks))
            return None if bucket is None else (self.graphs, bucket)
        if self.row_graphs is None or longest > self.row_max_query:
            return None
        bucket = self.row_graphs.bucket(sum(c.num_tokens for c in chunks))
        return None if bucket is None else (self.row_graphs, bucket)

    def capture_piecewise_graphs(self, token_sizes: list[int]) -> None:
        """Capture the pieces between attentions (CUDA; on the CPU only tests use it): afterwards
        steps of at most ``max(token_sizes)`` tokens that are not decode-only replay them."""
        self.piecewise = PiecewiseGraphRunner(self.model, token_sizes, self.device, self.gemv)

    def enable_mixed_graphs(self, decode_buckets: list[int], max_chunk: int, max_model_len: int, max_graphs: int,
                            capture_lock: AbstractContextManager, chunk_buckets: list[int] = ()) -> None:  # fmt: skip
        """Steps of decodes plus one prefill chunk of at most ``max_chunk`` tokens (padded to the
        next of ``chunk_buckets``) replay whole (attention included) once their shape repeats
        (engine/cuda_graph.py MixedGraphRunner); each capture while serving holds ``capture_lock``."""
        self.mixed = MixedGraphRunner(
            self.model, self.backend, self.kv_layers, decode_buckets, max_chunk, -(-max_model_len // self.block_size),
            max_model_len, max_graphs, self.device, self.gemv, capture_lock, chunk_buckets,
        )

    def prepare(self, chunks: list[ScheduledChunk], pending: DeviceTokens | None = None) -> StepInputs:
        """The step's inputs; a decode whose input token is still pending takes it from
        ``pending`` on the device (no wait for the step in flight): one gather, or inside the
        decode graph."""
        chunks = sorted(chunks, key=lambda c: c.num_tokens != 1)  # decodes first (stable)
        graph = self._graph_bucket(chunks)
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qlens: list[int] = []
        slens: list[int] = []
        sample_rows: list[int] = []
        sampled: list[ScheduledChunk] = []
        fix_dst: list[int] = []  # flat rows whose token is pending, and their rows in ``pending``
        fix_src: list[int] = []
        max_blocks = 1
        for c in chunks:
            req, start, n = c.request, c.start, c.num_tokens
            tokens = req.all_token_ids
            known = n - len(c.drafts)  # a verifying decode: its last token, then the drafts
            if start + known > len(tokens):  # only a decode's single input token can be pending (drafts may follow it)
                if known != 1 or pending is None or req.request_id not in pending.row_of:
                    raise RuntimeError(f"request {req.request_id}: tokens {start}..{start + n} are not known to the host")
                fix_dst.append(len(ids))
                fix_src.append(pending.row_of[req.request_id])
                ids.append(0)
            else:
                ids += tokens[start : start + known]
            ids += c.drafts
            blocks = req.block_ids
            # flat KV slots (block id x block size + offset), inline: this loop is per token
            if n == 1:
                positions.append(start)
                slots.append(blocks[start // bs] * bs + start % bs)
            else:
                pos = range(start, start + n)
                positions += pos
                slots += [blocks[p // bs] * bs + p % bs for p in pos]
            qlens.append(n)
            slens.append(start + n)
            max_blocks = max(max_blocks, len(blocks))
            if c.completes_prompt:  # a sample after the last token, and one after each draft
                for row in range(len(ids) - 1 - len(c.drafts), len(ids)):
                    sample_rows.append(row)
                    sampled.append(c)
        n_req, width = len(chunks), max_blocks
        table: list[int] = []
        for c in chunks:
            table += c.request.block_ids
            table += [NULL_BLOCK] * (width - len(c.request.block_ids))
        common = {"chunks": chunks, "sampled_chunks": sampled, "num_tokens": len(ids), "sample_rows_host": sample_rows}
        if graph is not None:  # ExecutionPath.GRAPH
            runner, bucket = graph
            if runner.rows_are_tokens:  # a row per token: its own context length, its request's table
                slens = [p + 1 for p in positions]
                table = [b for i, c in enumerate(chunks) for _ in range(c.num_tokens) for b in table[i * width : (i + 1) * width]]
            src = [-1] * len(ids)
            for dst, row in zip(fix_dst, fix_src):
                src[dst] = row
            step = DecodeGraphStep(bucket, pack_decode_step(ids, positions, slots, slens, src, table, width),
                                   pending.tokens if fix_dst else None, runner.rows_are_tokens)
            return StepInputs(**common, path=ExecutionPath.GRAPH, graph=step)
        qsl = [0]
        for q in qlens:
            qsl.append(qsl[-1] + q)
        # One host->device transfer for every per-step array (int64 views of one buffer).
        segments = [ids, positions, slots, qsl, slens, sample_rows, fix_dst, fix_src, table]
        packed: list[int] = []
        for seg in segments:
            # Every view starts 16-byte aligned: Triton compiles a kernel per alignment of its
            # pointer arguments, so views at odd offsets made new variants compile mid-run
            # (1.4-2.7 s steps on an H200, docs/performance.md).
            packed += seg
            packed += [0] * (len(seg) % 2)
        # numpy converts a Python list ~4x faster than torch.tensor (~1 ms saved at 256 requests);
        # to_device queues the copy without waiting for the step in flight.
        buf = to_device(np.array(packed, dtype=np.int64), torch.int64, self.device)
        views, offset = [], 0
        for seg in segments:
            views.append(buf[offset : offset + len(seg)])
            offset += len(seg) + len(seg) % 2
        t_ids, t_pos, t_slots, t_qsl, t_slens, t_rows, t_dst, t_src, t_table = views
        if fix_dst:
            t_ids[t_dst] = pending.tokens[t_src]
        meta = AttentionMetadata(
            slot_mapping=t_slots,
            query_start_loc=t_qsl,
            seq_lens=t_slens,
            block_tables=t_table.view(n_req, width),
            query_lens_host=qlens,
            seq_lens_host=slens,
            num_decodes=sum(1 for q in qlens if q == 1),
            max_seq_len=max(slens),
        )
        path, pieces, mixed_key = self._choose_path(meta, len(ids))
        return StepInputs(**common, path=path, input_ids=t_ids, positions=t_pos, meta=meta, sample_rows=t_rows,
                          pieces=pieces, mixed_key=mixed_key)

    def _choose_path(self, meta: AttentionMetadata, num_tokens: int) -> tuple[ExecutionPath, int | None, tuple[int, int] | None]:
        """The path of a step that is not a decode graph's (``_graph_bucket`` took those), with
        its piecewise token bucket or mixed-step key: the native CPU step for a decode-only step or
        a step of at most ``native.max_tokens`` tokens (a question after a cached prefix), else a mixed-step graph whose shape is ready (this counts the shape's sighting),
        else piecewise graphs where a token bucket holds the step, else eager."""
        decode_only = meta.num_decodes == meta.num_requests
        if self.native is not None and (decode_only or num_tokens <= self.native.max_tokens):
            return ExecutionPath.NATIVE, None, None
        mixed = self.mixed.key(meta, num_tokens) if self.mixed and not decode_only else None
        if mixed is not None and self.mixed.ready(mixed):
            return ExecutionPath.MIXED, None, mixed
        pieces = self.piecewise.bucket(num_tokens) if self.piecewise else None
        if pieces is not None:
            return ExecutionPath.PIECEWISE, pieces, None
        return ExecutionPath.EAGER, None, None

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> StepLogits:
        """Logits [num sampled chunks, vocab] (float32) for the chunks that complete a prompt, and
        their argmax when the step computed it."""
        if inputs.path is ExecutionPath.GRAPH:
            runner = self.row_graphs if inputs.graph.rows_are_tokens else self.graphs
            logits, tokens = runner.run(inputs.graph)  # the graph ends with the lm_head and the argmax
            if len(inputs.sample_rows_host) != inputs.num_tokens:  # a prefill chunk (or part) that samples nothing
                rows = to_device(inputs.sample_rows_host, torch.long, self.device)
                logits, tokens = logits[rows], tokens[rows]
            return StepLogits(logits, tokens)
        return StepLogits(self._forward(inputs))

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        meta, path = inputs.meta, inputs.path
        if path is ExecutionPath.NATIVE:  # one row per token, each with its request's block table
            lens = torch.tensor(meta.query_lens_host, device=meta.block_tables.device)
            tables = meta.block_tables if len(inputs.input_ids) == len(lens) else meta.block_tables.repeat_interleave(lens, dim=0)
            return self.native.run(inputs.input_ids, inputs.positions, tables, inputs.sample_rows)
        if path is ExecutionPath.MIXED:
            hidden = self.mixed.run(inputs.input_ids, inputs.positions, meta, inputs.mixed_key, inputs.sample_rows)
            return self.model.compute_logits(hidden, self.gemv)
        if path is ExecutionPath.PIECEWISE:
            hidden = self.piecewise.run(inputs.input_ids, inputs.positions, self.backend, meta, self.kv_layers, inputs.pieces)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.backend, meta, self.kv_layers, self.gemv)
        return self.model.compute_logits(hidden[inputs.sample_rows], self.gemv)
