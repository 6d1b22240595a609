"""Who may call ``python -m web`` and what the page may read: a real server on 127.0.0.1 with an API
key, its Gradio API driven by ``gradio_client`` and raw HTTP (as an attacker without a browser
would), its OpenAI routes by raw HTTP and the official ``openai`` SDK (HTTP and Realtime)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from assistant.config import HANDBOOK_DIR, ServerConfig
from tests.conftest import REPO
from tests.web.conftest import running_web
from web.app import WebApp

pytestmark = pytest.mark.timeout(300)
KEY = "test-key-5f1c"
SECRET = "The vault code is 4711."


@dataclass(frozen=True)
class Secured:
    url: str
    root: Path  # the one --documents-root
    outside: Path  # a folder outside every root, with a secret document
    own: Path  # the app's own documents folder


@pytest.fixture(scope="module")
def secured(tmp_path_factory) -> Iterator[Secured]:
    """``python -m web`` with its key in ``$ASSISTANT_API_KEY``, document changes allowed, one root.

    The served folder (inside the root) also holds ``id_rsa`` and a link to a document outside."""
    base = tmp_path_factory.mktemp("secured")
    root, outside, own = base / "root", base / "outside", base / "own" / "documents"
    docs = root / "handbook"
    docs.mkdir(parents=True)
    outside.mkdir()
    (outside / "vault.md").write_text(f"# Vault\n\n## Code\n\n{SECRET}\n")
    shutil.copy(HANDBOOK_DIR / "en" / "01-annual-leave.md", docs)
    (docs / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nnot a document\n")
    (root / "escape").symlink_to(outside, target_is_directory=True)  # a folder link out of the root
    (root / "leaky").mkdir()
    (root / "leaky" / "01-annual-leave.md").write_text((docs / "01-annual-leave.md").read_text())
    (root / "leaky" / "vault.md").symlink_to(outside / "vault.md")  # a document link out of the root
    cmd = [sys.executable, "-m", "web", "--port", "0", "--docs", str(docs), "--documents-dir", str(own),
           "--documents-root", str(root), "--allow-document-changes", "--no-warm-up",
           "--asr", "tiny", "--lang", "en", "--max-tokens", "8", "--log-level", "warning"]  # fmt: skip
    with running_web(cmd, {"ASSISTANT_API_KEY": KEY}, base) as url:
        yield Secured(url.rstrip("/"), root, outside, own)


@pytest.fixture(scope="module")
def operator(secured):
    """A Gradio API client signed in with the key (the operator)."""
    from gradio_client import Client

    return Client(secured.url, auth=("operator", KEY), verbose=False)


def use_folder(operator, folder: str) -> str:
    return operator.predict(folder, api_name="/use_folder")[1]


def test_listening_beyond_loopback_needs_a_key() -> None:
    env = {k: v for k, v in os.environ.items() if k != "ASSISTANT_API_KEY"}
    done = subprocess.run([sys.executable, "-m", "web", "--host", "0.0.0.0", "--port", "0"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2
    assert "an API key is required: pass --api-key KEY or set ASSISTANT_API_KEY=KEY" in done.stderr


def test_http_needs_the_bearer_key_but_health_is_open(secured) -> None:
    assert httpx.get(secured.url + "/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for path in ("/v1/models", "/metrics"):
            refused = httpx.get(secured.url + path, headers=headers)
            assert refused.status_code == 401, (path, headers)
            assert refused.json()["error"]["code"] == "invalid_api_key"
    answer = httpx.post(secured.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 401
    assert httpx.get(secured.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    good = openai.OpenAI(base_url=secured.url + "/v1", api_key=KEY, max_retries=0)
    assert good.models.list().data
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=secured.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_realtime_needs_the_key_as_the_openai_sdk_sends_it(secured) -> None:
    ws = secured.url.replace("http://", "ws://")

    async def first_event(api_key: str) -> str:
        client = openai.AsyncOpenAI(api_key=api_key, websocket_base_url=f"{ws}/v1")
        async with client.realtime.connect(model="any") as conn:
            return (await conn.recv()).type

    async def scenario() -> None:
        assert await first_event(KEY) == "session.created"
        with pytest.raises(InvalidStatus) as refused:
            await first_event("wrong")
        assert refused.value.response.status_code == 401
        with pytest.raises(InvalidStatus):  # no key at all
            async with connect(f"{ws}/v1/realtime"):
                pass
        async with connect(f"{ws}/v1/realtime", subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"]) as conn:
            assert '"session.created"' in await conn.recv()

    # Its own thread: Playwright's sync API (tests/web/test_app.py) leaves an event loop running
    # in this one for the rest of the session.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, scenario()).result()


def test_the_gradio_api_needs_the_key(secured) -> None:
    from gradio_client import Client

    for path in ("/gradio_api/info", "/config"):
        assert httpx.get(secured.url + path).status_code == 401, path
    call = httpx.post(secured.url + "/gradio_api/call/use_folder", json={"data": [str(secured.outside)]})
    assert call.status_code == 401
    with pytest.raises(Exception):  # noqa: B017 (gradio_client's login failure has no type of its own)
        Client(secured.url, auth=("operator", "wrong"), verbose=False)


def test_only_folders_under_the_roots_can_be_served(secured, operator) -> None:
    for folder in ("/etc", "../../../../etc", str(secured.outside), str(secured.root / "escape")):
        assert "is not under an allowed documents folder" in use_folder(operator, folder), folder
    assert "is not under an allowed documents folder" in use_folder(operator, str(secured.root / "leaky"))
    answer = httpx.post(secured.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                        json={"messages": [{"role": "user", "content": "What is the vault code?"}], "max_tokens": 8}, timeout=180)  # fmt: skip
    assert answer.status_code == 200 and "4711" not in answer.text
    assert use_folder(operator, str(secured.root / "handbook")).startswith("Now answering from")


def test_a_huge_folder_is_refused_without_walking_it(secured, operator) -> None:
    huge = secured.root / "huge"
    huge.mkdir()
    for n in range(10_001):
        (huge / f"{n}.log").touch()
    assert "holds more than 10000 files and folders" in use_folder(operator, str(huge))


def test_an_upload_copies_only_documents(secured, operator, tmp_path) -> None:
    from gradio_client import handle_file

    assert use_folder(operator, str(secured.root / "handbook")).startswith("Now answering from")
    parking = tmp_path / "13-parking.md"
    parking.write_text("# Parking\n\n## Parking spaces\n\nEmployees park in garage B.\n")
    message = operator.predict(handle_file(str(parking)), api_name="/add_document")[1]
    assert message.startswith("Added 13-parking.md"), message
    copied = sorted(p.name for p in secured.own.rglob("*") if p.is_file())
    assert copied == [".web-documents", "01-annual-leave.md", "13-parking.md"]


def test_document_changes_are_off_unless_the_operator_allows_them() -> None:
    """Without --allow-document-changes the page has no folder or upload functions (none in its API)."""
    server = SimpleNamespace(config=ServerConfig())

    def api_names(allow: bool) -> set[str]:
        blocks = WebApp(server, "ws://unused", documents=None, allow_document_changes=allow).blocks()  # type: ignore[arg-type]
        return {d.get("api_name") for d in blocks.config["dependencies"]}

    assert {"use_folder", "add_document"} <= api_names(True)
    assert not {"use_folder", "add_document"} & api_names(False)
    assert "reload" in api_names(False)


def test_the_page_asks_for_the_key_then_opens_its_session(secured, browser) -> None:
    """A browser signs in with the key; the tab's own Realtime session (which carries the key) opens."""
    from playwright.sync_api import expect

    context = browser.chromium.new_context()
    tab = context.new_page()
    try:
        tab.goto(secured.url)
        tab.get_by_label("username").fill("operator")
        tab.get_by_label("password").fill(KEY)
        tab.get_by_role("button", name="Login").click()
        expect(tab.locator("#live")).to_contain_text("Press", timeout=60_000)
    finally:
        context.close()


def test_a_folder_of_too_many_document_bytes_is_refused(tmp_path, monkeypatch) -> None:
    from assistant.docs import DocumentError
    from web import documents

    monkeypatch.setattr(documents, "MAX_DOCUMENT_BYTES", 1000)
    big = tmp_path / "big"
    big.mkdir()
    (big / "a.md").write_text("# A\n\n" + "x" * 600)
    (big / "b.md").write_text("# B\n\n" + "x" * 600)
    library = documents.DocumentLibrary(SimpleNamespace(config=SimpleNamespace(docs_dir=tmp_path)), tmp_path / "own", [])  # type: ignore[arg-type]
    with pytest.raises(DocumentError, match="exceed"):
        library.use_folder(big)
