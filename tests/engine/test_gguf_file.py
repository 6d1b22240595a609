"""The fast GGUF reader: the same metadata and tensor views as gguf's GGUFReader, clear errors."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine.gguf_file import GGUFFile, GGUFFormatError


def test_metadata_and_tensors_equal_ggufs_own_reader(llm_gguf_path) -> None:
    ours, theirs = GGUFFile.read(llm_gguf_path), gguf.GGUFReader(llm_gguf_path)
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):  # the reader's own header entries, not metadata
            continue
        mine, expected = ours.metadata[key], field.contents()
        if isinstance(mine, np.ndarray):
            np.testing.assert_array_equal(mine, np.asarray(expected), err_msg=key)
        else:
            assert mine == pytest.approx(expected) if isinstance(expected, float) else mine == expected, key
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152 and ours.get("no.such.key", 7) == 7
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert (mine.tensor_type, mine.shape) == (reference.tensor_type, tuple(int(d) for d in reference.shape)), mine.name
        assert (mine.data.shape, mine.data.dtype) == (reference.data.shape, reference.data.dtype), mine.name
    for index in (0, len(ours.tensors) // 2, -1):  # the bytes themselves, first, middle and last tensor
        np.testing.assert_array_equal(np.asarray(ours.tensors[index].data), np.asarray(theirs.tensors[index].data))


def test_a_file_that_is_not_gguf_or_is_cut_short_is_a_clear_error(llm_gguf_path, tmp_path) -> None:
    text = tmp_path / "notes.gguf"
    text.write_bytes(b"these are meeting notes, not a model" * 4)
    with pytest.raises(GGUFFormatError, match=r"notes.gguf: not a GGUF file \(magic"):
        GGUFFile.read(text)
    cut = tmp_path / "cut.gguf"
    with open(llm_gguf_path, "rb") as f:
        cut.write_bytes(f.read(40_000_000))  # the header is whole, the last tensors are not
    with pytest.raises(GGUFFormatError, match="cut.gguf: .*truncated"):
        GGUFFile.read(cut)
    header_only = tmp_path / "header.gguf"
    with open(llm_gguf_path, "rb") as f:
        header_only.write_bytes(f.read(100_000))  # cut inside the vocabulary
    with pytest.raises(GGUFFormatError, match="header.gguf: not a readable GGUF file"):
        GGUFFile.read(header_only)
