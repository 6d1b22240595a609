"""A decode step's inputs as one host array, scattered into the decode graph's buffers on the device.

A decode step replayed as a CUDA graph reads its token ids, positions, KV slots, context lengths
and block tables from persistent buffers. Filled one ``copy_`` each, plus a gather of the tokens
the step in flight is still sampling and two argmax kernels after the replay, that was ~10 small
device operations around each replay: 36-38 us between graph replay and time per token at
batch 1 on an H200. Instead the host packs the step into one int32 array, one copy puts it into
a persistent staging buffer, and the graph's first kernel scatters it, taking each pending token
from the graph's own token output (the previous step's argmax, same buffer): 11-12 us left
outside the graph, -19 us a step in all (same-lease A/B, docs/performance.md).

Packed layout (int32), ``n`` rows of a step, block tables ``width`` wide::

    [n, width, ids[n], positions[n], slots[n], seq_lens[n], src[n], tables[n * width]]

``src[i]`` is the row of the token buffer holding request ``i``'s input token when the host
does not know it yet (async scheduling), else -1. Rows ``n..rows`` of the buffers become padding:
token 0 at position 0, KV written to slot 0 (the null block), context length 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.kernels.triton_utils import use_triton

HEADER = 2
FIELDS = 5  # ids, positions, slots, seq_lens, src


def packed_size(rows: int, max_blocks: int) -> int:
    """Elements of a staging buffer that holds any step of up to ``rows`` requests."""
    return HEADER + FIELDS * rows + rows * max_blocks


def pack_decode_step(
    ids: Sequence[int], positions: Sequence[int], slots: Sequence[int], seq_lens: Sequence[int], src: Sequence[int],
    tables: Sequence[int], width: int,
) -> np.ndarray:
    """One step's inputs in the packed layout (``tables``: ``n`` rows of ``width`` block ids, flat)."""
    n = len(ids)
    if not (len(positions) == len(slots) == len(seq_lens) == len(src) == n and len(tables) == n * width):
        raise ValueError(f"pack_decode_step: {n} ids but {len(positions)}/{len(slots)}/{len(seq_lens)}/{len(src)} "
                         f"positions/slots/seq_lens/src and {len(tables)} table entries for width {width}")
    return np.array([n, width, *ids, *positions, *slots, *seq_lens, *src, *tables], dtype=np.int32)


def scatter_decode_inputs(
    packed: torch.Tensor, tokens: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
    slot_mapping: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, rows: int,
) -> None:
    """Fill rows ``[0, rows)`` of the step buffers from ``packed``; nothing here reads the header
    on the host, so it can be captured in a CUDA graph (the step's ``n`` changes per replay)."""
    fn = scatter_decode_inputs_triton if use_triton(packed) else scatter_decode_inputs_torch
    fn(packed, tokens, input_ids, positions, slot_mapping, seq_lens, block_tables, rows)


def scatter_decode_inputs_torch(
    packed: torch.Tensor, tokens: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
    slot_mapping: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, rows: int,
) -> None:
    """Reference (and CPU path): the same with masked gathers over all ``rows`` and the buffers'
    full table width."""
    p = packed.long()
    n, width = p[0], p[1]
    r = torch.arange(rows, device=packed.device)
    real = r < n

    def field(k: int) -> torch.Tensor:  # column k of the real rows, 0 on padding rows
        return torch.where(real, p[(HEADER + k * n + r).clamp(max=p.numel() - 1)], 0)

    src = torch.where(real, field(4), -1)
    ids = torch.where(src >= 0, tokens[src.clamp(min=0)], field(0))
    input_ids[:rows].copy_(ids)
    positions[:rows].copy_(field(1))
    slot_mapping[:rows].copy_(field(2))
    seq_lens[:rows].copy_(field(3))
    cols = torch.arange(block_tables.shape[1], device=packed.device)
    at = (HEADER + FIELDS * n + r[:, None] * width + cols[None, :]).clamp(max=p.numel() - 1)
    keep = real[:, None] & (cols[None, :] < width)
    block_tables[:rows].copy_(torch.where(keep, p[at], block_tables[:rows].long()))


def scatter_decode_inputs_triton(
    packed: torch.Tensor, tokens: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
    slot_mapping: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, rows: int,
) -> None:
    from engine.kernels._step_inputs_triton import scatter_decode_inputs_kernel

    if rows:
        scatter_decode_inputs_kernel[(rows,)](
            packed, tokens, input_ids, positions, slot_mapping, seq_lens, block_tables, block_tables.stride(0),
            HEADER=HEADER, FIELDS=FIELDS, BLOCK=128, num_warps=1,
        )
