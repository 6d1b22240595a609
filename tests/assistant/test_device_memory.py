"""Memory by owner across the three models: an ASR backend that reports memory joins the engine's ledger."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from assistant.answerer import Answerer
from assistant.config import HANDBOOK_DIR, AssistantConfig, EngineOptions
from assistant.device_memory import ServerModels, same_device
from speech.asr.backend import ASRBackend, Decoded
from speech.config import TTSConfig
from speech.tts import load_tts


class ReportingASR(ASRBackend):
    """Stands in for the GPU Whisper backend (no GPU here): it only reports its memory."""

    supported_languages = ("en",)

    def __init__(self, device: str, sizes: dict[str, int]) -> None:
        self.device = device
        self.sizes = sizes

    def memory_bytes(self) -> dict[str, int]:
        return dict(self.sizes)

    def transcribe(self, audio: np.ndarray, prefix: str = "", language: str | None = None) -> Decoded:
        raise NotImplementedError


@pytest.fixture(scope="module")
def answerer(tmp_path_factory):
    docs = tmp_path_factory.mktemp("handbook")
    shutil.copy(HANDBOOK_DIR / "en" / "01-annual-leave.md", docs)
    answerer = Answerer.create(AssistantConfig(docs_dir=docs, language="en", max_tokens=8, engine=EngineOptions(device="cpu")))
    yield answerer
    answerer.shutdown()


def test_asr_owners_on_the_engines_device_join_its_ledger_and_others_keep_their_device(answerer) -> None:
    core = answerer.engine.core
    tts = load_tts(TTSConfig(backend="hibari"))
    sizes = {"asr weights": 3 << 20, "asr buffers": 1 << 20}
    rows = ServerModels(core, ReportingASR("cpu", sizes), tts).memory_rows()
    assert {(r.owner, r.device): r.nbytes for r in rows} == {**{(f"llm {o}", "cpu"): b for o, b in core.memory_rows()},
                                                             **{(o, "cpu"): b for o, b in sizes.items()}}  # fmt: skip
    apart = ServerModels(core, ReportingASR("cuda:1", sizes), tts)
    assert [(r.owner, r.device) for r in apart.memory_rows()][-2:] == [("asr weights", "cuda:1"), ("asr buffers", "cuda:1")]
    assert apart.devices() == {"llm": "cpu", "asr": "cuda:1", "tts": "cpu"}


def test_same_device() -> None:
    assert same_device("cpu", "cpu") and not same_device("cpu", "cuda") and not same_device("cuda:0", "cuda:1")
