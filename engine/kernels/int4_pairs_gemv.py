"""The "pairs" GEMV: one row of x times a group-wise int4 weight, two weights an instruction.

A batch-1 decode step reads every weight once, so an int4 projection should take a quarter of
bf16's time; PyTorch's tinygemm reads the 8B's projections at 0.43-0.68 of the copy bandwidth,
and a kernel that widens one nibble at a time is bound by its CUDA-core instructions, not by
DRAM. This kernel (engine/kernels/_int4_pairs_triton.py) widens two nibbles into a bf16 pair with
one LOP3 and multiplies pairs with bf16x2 FMAs. It needs its own layout of the weight,
:func:`pack_pairs` (made once at load by engine/w4a16.py's ``W4A16Linear.add_pairs``), and takes x as
it lies (bf16). o_proj and down_proj (few rows, long K) split K for more programs; their float32
partials are summed by the next residual add + RMSNorm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TARGET_PROGRAMS = 264  # about two waves on 132 SMs
BLOCK_WORDS = (128, 64, 32, 16, 8, 4)  # words (8 inputs each) a loop step: the largest that divides the slice
SPLIT_STEP_WORDS = 64  # pairs_split_k's 4 or 2 slices: each a whole number of steps of this many words


@dataclass(frozen=True)
class PairsTile:
    """A program's weight rows, words a loop step, warps and pipeline stages."""

    block_n: int = 16
    block_w: int = 128
    num_warps: int = 4
    num_stages: int = 3


def pack_pairs(values: torch.Tensor) -> torch.Tensor:
    """A weight's 4-bit values (uint8 [N, K] in input order, 0..15: engine/w4a16.py ``unpack_groups``)
    as the kernel's int32 words [N, K/8]: input 8i + 2p + h in bits 16h + 4p of word i, so that
    each masked nibble pair meets the bf16 pair of x that lies beside it in memory."""
    q = values.to(torch.int32)
    words = torch.zeros((q.shape[0], q.shape[1] // 8), dtype=torch.int32, device=q.device)
    for j in range(8):  # input 8i + j: p = j // 2, h = j % 2
        words |= q[:, j::8] << (16 * (j % 2) + 4 * (j // 2))  # the top nibble's shift wraps into the sign bit, as meant
    return words


def unpack_pairs(words: torch.Tensor) -> torch.Tensor:
    """The 4-bit values of :func:`pack_pairs`'s words in input order, uint8 [N, K] (tests)."""
    shifts = torch.tensor([16 * (j % 2) + 4 * (j // 2) for j in range(8)], dtype=torch.int32, device=words.device)
    return ((words[:, :, None] >> shifts) & 0xF).reshape(words.shape[0], -1).to(torch.uint8)


def pairs_fit(n: int, k: int, group: int) -> bool:
    """Whether a weight [n, k] in groups of ``group`` fits the kernel: rows in tiles of 16, whole
    words a group (``group`` a multiple of 8), K whole groups."""
    return n % PairsTile.block_n == 0 and group % 8 == 0 and k % group == 0


# The measured best (tile, K slices) of weight shapes (rows, inputs), each kernel alone with PDL
# launches (H100, 2026-12-06 09:30 UTC, engine/bench/experiments/int4_pairs_gemv_sweep.py): a
# program that reads its whole slice in one or two steps keeps all of its loads in flight at once,
# where the general rule's 128-word steps through 3 stages spend a short slice in the pipeline's
# ramp. Shapes not here take the general rule (pairs_split_k, pairs_tile).
TUNED_TILES: dict[tuple[int, int], tuple[PairsTile, int]] = {
    (6144, 4096): (PairsTile(8, 256, 4, 1), 1),  # the 8B's q|k|v: 7.4 us against 9.3 (16 x 128 words, 3 stages)
    (4096, 4096): (PairsTile(8, 512, 8, 1), 1),  # o_proj: 5.6 against 6.3 (split 4)
    (28672, 4096): (PairsTile(16, 256, 4, 1), 1),  # gate|up: 22.9 against 23.6
    (4096, 14336): (PairsTile(16, 128, 4, 1), 7),  # down_proj: 14.5 against 16.5 (16 x 64 words, 2 warps, split 4)
}


def _tuned(n: int, k: int, group: int) -> tuple[PairsTile, int] | None:
    """TUNED_TILES' entry for this shape where its steps hold whole groups."""
    tuned = TUNED_TILES.get((n, k))
    return tuned if tuned and tuned[0].block_w % (group // 8) == 0 else None


def pairs_tile(n: int, k: int, group: int, split_k: int = 1) -> PairsTile:
    """The tile for a weight [n, k] over ``split_k`` slices: TUNED_TILES' where the shape and split
    are there; else 16 rows, 3 stages, the largest of BLOCK_WORDS words a step that divides the
    slice (whole groups a step), and 16 words a thread: 4 warps for 128-word steps, 2 for 64 (the
    8B's down_proj in 4 slices: graph replay 2.218 ms against 2.255 with 128-word steps, 4 warps,
    2 slices; H100, 2026-12-06); smaller steps 4."""
    tuned = _tuned(n, k, group)
    if tuned and tuned[1] == split_k:
        return tuned[0]
    slice_words, group_words = k // 8 // split_k, group // 8
    block_w = next(b for b in BLOCK_WORDS if slice_words % b == 0 and b % group_words == 0) if slice_words % group_words == 0 else 0
    if not block_w:
        raise ValueError(f"int4 pairs GEMV: {k} inputs in {split_k} slices do not split into whole groups of {group}")
    return PairsTile(block_w=block_w, num_warps=2 if block_w == 64 else 4)


def pairs_split_k(n: int, k: int, group: int) -> int:
    """K slices for o_proj or down_proj (few rows, so few programs unsplit): TUNED_TILES' where the
    shape is there (the 8B's o_proj 1, down_proj 7). Else the most of 4, 2 that
    leaves slices of whole 64-word steps: the 8B's o_proj 4 (6.0 us against 6.6 split 2, alone) and
    down_proj 4 (64-word steps, 2 warps: 16.6-17.0 us alone against 17.5-18.7 split 2 with
    128-word steps, and 2.218 against 2.255 ms a batch-1 step in the decode graph), H100,
    2026-12-06, engine/bench/experiments/int4_pairs_gemv_sweep.py. Otherwise (the small models' shapes: the
    1.5B's down_proj took 22 us unsplit against tinygemm's 8.6) the fewest slices, up to 8, that
    give TARGET_PROGRAMS programs in slices of whole groups and steps of at least 32 words."""
    tuned = _tuned(n, k, group)
    if tuned:
        return tuned[1]
    words, group_words, programs = k // 8, group // 8, n // PairsTile.block_n
    for split in (4, 2):
        if words % (split * SPLIT_STEP_WORDS) == 0:
            return split
    for split in range(max(2, -(-TARGET_PROGRAMS // programs)), 9):
        if words % split == 0 and (words // split) % group_words == 0 and (words // split) % 32 == 0:
            return split
    return 1


def int4_pairs_gemv(
    x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int,
    bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, *, split_k: int = 1, pdl: bool = False,
    prefetch_k: int = 0, tile: PairsTile | None = None, use_asm: bool | None = None, late_release: bool = False,
) -> torch.Tensor:
    """x [1, K] @ W^T (+ bias) -> [1, N] in ``out_dtype`` (default x's), W as :func:`pack_pairs`'s
    ``words`` [N, K/8] with ``scales`` and ``mins`` [N, K/group] fp16. x is read as bf16 (cast if
    it is not). ``split_k`` > 1: float32 partials [split_k, 1, N] (no bias, no ``out_dtype``) for
    the next residual add + RMSNorm. ``pdl``: programmatic dependent launch (Hopper+);
    ``prefetch_k`` (with it): inputs of each row's slice requested into L2 before the wait;
    ``late_release`` (with it): the next kernel launches after the K loop (GemvPolicy.late_release).
    ``use_asm``: the PTX products (default: on CUDA; Triton's interpreter runs the float32 ones)."""
    from engine.kernels._int4_pairs_triton import int4_pairs_gemv_kernel
    from engine.kernels.triton_utils import launch_options

    m, k = x.shape
    n = words.shape[0]
    tile = tile or pairs_tile(n, k, group, split_k)
    if (m != 1 or words.shape != (n, k // 8) or words.dtype != torch.int32 or not pairs_fit(n, k, group) or n % tile.block_n
            or split_k < 1 or (k // 8) % (split_k * tile.block_w) or tile.block_w % (group // 8)
            or scales.shape != (n, k // group) or mins.shape != scales.shape or not words.is_contiguous()
            or not scales.is_contiguous() or not mins.is_contiguous()
            or (bias is not None and (bias.shape != (n,) or split_k > 1)) or (split_k > 1 and out_dtype is not None)):
        raise ValueError(f"int4_pairs_gemv: x {tuple(x.shape)} words {tuple(words.shape)} {words.dtype} scales {tuple(scales.shape)} "
                         f"mins {tuple(mins.shape)} group {group} split_k {split_k} bias {None if bias is None else tuple(bias.shape)} "
                         f"out_dtype {out_dtype} do not fit {tile}")
    pairs = x.to(torch.bfloat16).contiguous().view(torch.int32)
    if split_k > 1:
        y = torch.empty((split_k, 1, n), dtype=torch.float32, device=x.device)
    else:
        y = torch.empty((1, n), dtype=out_dtype or x.dtype, device=x.device)
    int4_pairs_gemv_kernel[(n // tile.block_n, split_k)](
        pairs, words, scales, mins, y, words if bias is None else bias, n, k, y.stride(0) if split_k > 1 else 0,
        GROUP=group, BLOCK_N=tile.block_n, BLOCK_W=tile.block_w, SPLIT_K=split_k, HAS_BIAS=bias is not None, USE_PDL=pdl,
        PREFETCH_W=prefetch_k // 8 if pdl else 0, USE_ASM=x.is_cuda if use_asm is None else use_asm, LATE_RELEASE=late_release and pdl,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **launch_options(pdl),
    )
    return y
