"""The web UI under test: ``python -m web`` as a real process on 127.0.0.1 (a free port), and
Debian's headless Chromium driven by Playwright, its fake microphone playing a question spoken
by the bundled hibari voice. Screenshots go to tests/web/artifacts/."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from assistant.config import HANDBOOK_DIR
from assistant.eval import FACTS_FILE
from speech.audio import resample, write_wav
from speech.config import TTSConfig
from speech.tts import load_tts
from tests.conftest import REPO

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
DOCS = ("01-annual-leave.md", "02-sick-leave.md", "05-it-accounts-and-passwords.md")
MIC_RATE = 48000  # Chromium's fake capture device runs at 48 kHz; give it a 48 kHz 16-bit mono WAV
START_TIMEOUT_S = 240


@dataclass(frozen=True)
class WebServer:
    url: str
    documents_dir: Path  # the app's own folder for uploads


@dataclass
class Browser:
    """Chromium, with every request any of its pages made (to check nothing leaves 127.0.0.1)."""

    chromium: Any  # playwright.sync_api.Browser
    requests: list[str] = field(default_factory=list)


@pytest.fixture(scope="session")
def question() -> str:
    return json.loads(FACTS_FILE.read_text("utf-8"))[0]["question_en"]


@pytest.fixture(scope="session")
def question_wav(tmp_path_factory, question) -> Path:
    """The first handbook question, spoken: 1 s of silence, the question, then 30 s of silence
    (Chromium plays the file once, ``%noloop``; the silence lets the server's VAD end the turn)."""
    tts = load_tts(TTSConfig(backend="hibari", seed=0))
    speech = resample(tts.synthesize(question).pcm, tts.sample_rate, MIC_RATE)
    audio = np.concatenate([np.zeros(MIC_RATE, np.float32), speech, np.zeros(30 * MIC_RATE, np.float32)])
    return write_wav(tmp_path_factory.mktemp("mic") / "question.wav", audio, MIC_RATE)


@pytest.fixture(scope="package")  # stopped after the web tests, whatever runs next
def web_server(tmp_path_factory) -> Iterator[WebServer]:
    """``python -m web`` on a free port, with three handbook documents, Whisper tiny.en and short
    answers; page users may change the documents (as an operator on a loopback-only server)."""
    docs = tmp_path_factory.mktemp("handbook")
    for name in DOCS:
        shutil.copy(HANDBOOK_DIR / "en" / name, docs / name)
    own = tmp_path_factory.mktemp("web") / "documents"
    cmd = [sys.executable, "-m", "web", "--port", "0", "--docs", str(docs), "--documents-dir", str(own),
           "--asr", "tiny", "--lang", "en", "--max-tokens", "24", "--log-level", "warning",
           "--allow-document-changes", "--partial-interval", "0.5", "--endpointing", "fixed"]  # fmt: skip
    # (partials are off by default on the CPU; the push-to-talk test reads one. Fixed endpointing: these tests read
    # the page, and Whisper tiny's wording at a 200 ms pause varies; tests/assistant/test_speculative_endpoint.py
    # covers the CPU's default)
    with running_web(cmd, {}, tmp_path_factory.mktemp("web-log")) as url:
        yield WebServer(url, own)


@contextmanager
def running_web(cmd: list[str], env: dict[str, str], log_dir: Path) -> Iterator[str]:
    """Run ``cmd`` (a ``python -m web`` command line, ``env`` added to this environment) until the
    block ends, then stop it with Ctrl-C; yields the URL it prints once its page answers."""
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1", **env}
    with (log_dir / "server.log").open("w+") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            yield _wait_for_url(proc, log)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_for_url(proc: subprocess.Popen, log) -> str:
    """The URL the server prints, once its page answers."""
    import httpx

    deadline = time.monotonic() + START_TIMEOUT_S
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)  # the URL is its only stdout line
    line = proc.stdout.readline() if ready else ""
    if not line.startswith("Web UI: "):
        log.seek(0)
        raise RuntimeError(f"python -m web did not start (exit {proc.poll()}):\n{log.read()[-4000:]}")
    url = line.removeprefix("Web UI: ").strip()
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {START_TIMEOUT_S} s")


@pytest.fixture(scope="package")  # playwright's sync API runs an event loop on this thread until it
def browser(question_wav) -> Iterator[Browser]:  # stops: asyncio.run() in later test files fails meanwhile
    if not CHROMIUM.exists():
        pytest.skip("Debian chromium is not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    args = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
            f"--use-file-for-fake-audio-capture={question_wav}%noloop", "--autoplay-policy=no-user-gesture-required"]  # fmt: skip
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=args)
        yield Browser(chromium)
        chromium.close()


@pytest.fixture
def page(browser, web_server):
    """A fresh tab (its own Realtime session) with the microphone allowed, on the page."""
    from playwright.sync_api import expect

    context = browser.chromium.new_context(permissions=["microphone"], viewport={"width": 1400, "height": 1000})
    tab = context.new_page()
    tab.on("request", lambda r: browser.requests.append(r.url))
    tab.goto(web_server.url)
    expect(tab.locator("#live")).to_contain_text("Press", timeout=30_000)
    yield tab
    context.close()


def screenshot(tab, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    tab.screenshot(path=path, full_page=True)
    return path
