"""The decode graph's packed step (engine/kernels/step_inputs.py) on the CPU: the torch path the
CPU runs, against values written out by hand; the Triton kernel is checked against the same
expectations in test_triton_kernels.py."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.step_inputs import pack_decode_step, packed_size, scatter_decode_inputs


def test_a_packed_step_lands_in_the_buffers_with_padding_rows_after_it():
    rows, max_blocks = 4, 5
    staging = torch.full((packed_size(rows, max_blocks),), -9, dtype=torch.int32)
    packed = pack_decode_step([11, 0], [7, 30], [115, 482], [8, 31], [-1, 2], [3, 9, 4, 6], width=2)
    staging[: len(packed)] = torch.from_numpy(packed)
    tokens = torch.tensor([100, 101, 102], dtype=torch.long)  # the step in flight's samples
    ids, pos, slots = (torch.full((rows,), 55, dtype=torch.long) for _ in range(3))
    seq_lens = torch.full((rows,), 55, dtype=torch.int32)
    tables = torch.full((rows, max_blocks), 55, dtype=torch.int32)
    scatter_decode_inputs(staging, tokens, ids, pos, slots, seq_lens, tables, rows)
    assert ids.tolist() == [11, 102, 0, 0]  # row 1's token was pending: sample row 2
    assert pos.tolist() == [7, 30, 0, 0] and slots.tolist() == [115, 482, 0, 0] and seq_lens.tolist() == [8, 31, 0, 0]
    assert tables.tolist() == [[3, 9, 55, 55, 55], [4, 6, 55, 55, 55], [55] * 5, [55] * 5]  # past the width: untouched


def test_packing_rejects_columns_of_different_lengths():
    with pytest.raises(ValueError, match="2 ids but 1/2/2/2"):
        pack_decode_step([1, 2], [0], [0, 0], [1, 1], [-1, -1], [0, 0], width=1)
