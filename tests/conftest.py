"""Shared fixtures: the embedded models, resolved once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def llm_gguf_path() -> Path:
    from assistant.models import resolve

    return resolve("llm")


@pytest.fixture(scope="session")
def whisper_base_path() -> Path:
    from assistant.models import resolve

    return resolve("asr")


@pytest.fixture(scope="session")
def whisper_tiny_path() -> Path:
    from assistant.models import resolve

    return resolve("asr-tiny")
