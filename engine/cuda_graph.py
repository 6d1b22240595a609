"""CUDA graphs: whole decode steps, and the pieces between attentions of small mixed steps.

At batch 1 an 8B decode step is ~3.5 ms of memory traffic spread over ~400 kernels; launched
one by one from Python that becomes ~80 ms (measured for HF eager on an H200). Captured once per
bucket, a step is a few host->device copies into persistent buffers and one replay.

:class:`CudaGraphRunner`: decode-only batches (one query per request), the whole forward and the
lm_head (every decode row is sampled) as one graph per batch-size bucket: at batch 1 the lm_head
follows the last norm inside the graph instead of after an eager row gather and a launch gap.
Padding rows point at the null block with context length 0.

:class:`PiecewiseGraphRunner`: steps with prefill chunks. Their attention launch shape depends on
the batch (tiles per request, context splits), so it runs eagerly; everything else - the
projections, norms and MLPs between two attentions - is one graph per (token bucket, piece):
33 replays and 32 eager attentions instead of ~450 launches. A 30-token question after a cached
32k prefix was host-bound at ~20 ms of eager launches (H200 host) for ~10 ms of device work.
Padding rows compute garbage that no attention reads and no sample uses (every op of a piece is
row-wise).
"""

from __future__ import annotations

import logging

import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.model import LlamaForCausalLM

log = logging.getLogger(__name__)


def graph_bucket(batch_sizes: list[int], num_seqs: int) -> int | None:
    """The smallest captured batch size (sorted ascending) that holds ``num_seqs`` decodes;
    None when the batch is larger than every graph (it then runs eagerly)."""
    for bs in batch_sizes:
        if bs >= num_seqs:
            return bs
    return None


class CudaGraphRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
        batch_sizes: list[int],
        max_blocks_per_seq: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.batch_sizes = sorted(set(batch_sizes))
        max_bs = self.batch_sizes[-1]
        # Persistent inputs: graphs read from these addresses on every replay.
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_bs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.batch_sizes):  # largest first: later graphs reuse its pool
            meta = self._meta(bs)
            with torch.inference_mode():
                for _ in range(2):  # compile Triton kernels, settle cuBLAS heuristics
                    model.compute_logits(model(self.input_ids[:bs], self.positions[:bs], backend, meta, kv_layers))
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = model(self.input_ids[:bs], self.positions[:bs], backend, meta, kv_layers)
                    self.outputs[bs] = model.compute_logits(hidden)
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
            seq_lens_host=[0] * bs,  # not read on the decode path
            num_decodes=bs,
            max_seq_len=0,
        )

    def bucket(self, num_seqs: int) -> int | None:
        return graph_bucket(self.batch_sizes, num_seqs)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, bs: int) -> torch.Tensor:
        """Copy one decode batch into the persistent buffers, replay, return logits [n, vocab]
        (float32) for its n rows."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        if bs > n:  # padding rows: no context, KV written to the null block
            self.seq_lens[n:bs].zero_()
            self.slot_mapping[n:bs].zero_()
        self.graphs[bs].replay()
        return self.outputs[bs][:n]


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
                with torch.cuda.graph(self.graph, pool=pool):
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

    def __init__(self, model: LlamaForCausalLM, token_sizes: list[int], device: torch.device) -> None:
        self.model = model
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
        m, ids, attn = self.model, self.input_ids[:t], self.attn_out[:t]
        qkv_out, residual, hidden = self.qkv[:t], self.residual[:t], self.hidden[:t]

        def store(result: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            qkv_out.copy_(result[0])
            residual.copy_(result[1])  # read by this piece before it is overwritten: same stream order
            return qkv_out, residual

        pieces = [_Piece(lambda: store(m.first_piece(ids)), pool, device)]
        for i in range(len(m.layers) - 1):
            pieces.append(_Piece(lambda i=i: store(m.middle_piece(i, attn, residual)), pool, device))
        pieces.append(_Piece(lambda: hidden.copy_(m.last_piece(attn, residual)), pool, device))
        return pieces

    def bucket(self, num_tokens: int) -> int | None:
        return graph_bucket(self.token_sizes, num_tokens)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend, meta: AttentionMetadata,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]], bucket: int,
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
