"""``python -m engine.serving`` with an API key: required beyond loopback, checked on every route but
/health (a real uvicorn on 127.0.0.1, raw HTTP and the official openai SDK)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

from engine import AsyncEngine, build_engine
from engine.llm import make_config
from engine.serving.cli import parse_settings
from engine.serving.server import BackgroundServer, create_app
from tests.conftest import REPO

MODEL = "smollm2-test"
KEY = "engine-key-93ab"


@pytest.fixture(scope="module")
def server(smollm, llm_gguf_path):
    engine = AsyncEngine(core=build_engine(make_config(str(llm_gguf_path), num_kv_blocks=256), smollm))
    try:
        with BackgroundServer(create_app(engine, MODEL, api_key=KEY)) as srv:
            yield srv
    finally:
        engine.shutdown()


def test_every_route_but_health_needs_the_bearer_key(server) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        for path in ("/v1/models", "/metrics", "/openapi.json"):
            refused = httpx.get(server.url + path, headers=headers)
            assert refused.status_code == 401, (path, headers)
            assert refused.json() == {"error": {"message": "Incorrect or missing API key: send Authorization: Bearer KEY.",
                                                "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}  # fmt: skip
    assert httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    reply = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert reply.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_listening_beyond_loopback_needs_a_key(llm_gguf_path, monkeypatch) -> None:
    monkeypatch.delenv("ENGINE_API_KEY", raising=False)
    done = subprocess.run([sys.executable, "-m", "engine.serving", "--model", str(llm_gguf_path), "--host", "0.0.0.0"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2
    assert "an API key is required: pass --api-key KEY or set ENGINE_API_KEY=KEY" in done.stderr
    assert parse_settings(["--model", str(llm_gguf_path)]).api_key is None  # loopback: no key needed
    assert parse_settings(["--model", str(llm_gguf_path), "--host", "0.0.0.0", "--api-key", "k"]).api_key == "k"
    monkeypatch.setenv("ENGINE_API_KEY", "from-env")
    assert parse_settings(["--model", str(llm_gguf_path), "--host", "0.0.0.0"]).api_key == "from-env"
