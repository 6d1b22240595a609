"""The assistant server that test_realtime.py and test_http_chat.py share: one real server on
127.0.0.1 with the real models (starting one takes 15-30 s on a 2-core machine). Tests that need
other server settings (limits, endpointing) start their own in their module."""

from __future__ import annotations

import shutil

import httpx
import pytest

from assistant.config import HANDBOOK_DIR, AssistantConfig, RefusalConfig, ServerConfig, VoiceConfig
from assistant.server import AssistantServer
from engine.serving.server import BackgroundServer

DOCS = ("01-annual-leave.md", "02-sick-leave.md", "05-it-accounts-and-passwords.md")
MAX_SESSIONS = 9
MAX_MESSAGE = 256 * 1024
MAX_ERRORS = 20


@pytest.fixture(scope="package")  # stopped after the assistant tests
def assistant_server(tmp_path_factory, whisper_tiny_path):
    """Three handbook documents, Whisper tiny.en, answers of at most 48 tokens, nine sessions.
    ``url`` is its address; ``fresh_metrics`` its /metrics text right after the warm-up, before
    any test asked anything (so a test can check a fresh server whatever ran before it)."""
    docs = tmp_path_factory.mktemp("handbook")
    for name in DOCS:
        shutil.copy(HANDBOOK_DIR / "en" / name, docs / name)
    config = ServerConfig(
        max_sessions=MAX_SESSIONS, max_sessions_per_client=MAX_SESSIONS, max_message_bytes=MAX_MESSAGE, max_errors=MAX_ERRORS,
        # the questions include documents this folder lacks, and these tests are about the protocol: the model
        # answers every one (the refusal gate is off; test_a_refused_question_is_spoken_as_an_answer turns it on)
        assistant=AssistantConfig(docs_dir=docs, language="en", max_tokens=48, refusal=RefusalConfig(enabled=False)),
        # the callers' resampling and VAD in a worker process, as a server with Whisper on a GPU runs them;
        # fixed endpointing, whose timelines these tests read (the hangover is the endpoint's share; the
        # CPU's default, speculative, has its own server in test_speculative_endpoint.py)
        voice=VoiceConfig(asr_model=whisper_tiny_path, front_end_processes=1, endpointing="fixed"),
    )  # fmt: skip
    assistant = AssistantServer(config)
    assistant.warm_up()
    with BackgroundServer(assistant.app, **config.uvicorn_options()) as http:
        assistant.url = http.url  # type: ignore[attr-defined]
        assistant.fresh_metrics = httpx.get(http.url + "/metrics").text  # type: ignore[attr-defined]
        yield assistant
    assistant.close()
