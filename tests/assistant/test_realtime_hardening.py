"""The Realtime API against hostile and careless clients: a real server on 127.0.0.1, a raw
``websockets`` client sending the exact bytes (lone surrogates, deep nesting, huge texts, floods,
a client that stops reading), and the server's limits (docs/protocol.md, "Limits")."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading

import httpx
import pytest
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from assistant.config import HANDBOOK_DIR, AssistantConfig, ServerConfig, VoiceConfig
from assistant.fuzz import FuzzReport, fuzz
from assistant.outbox import Outbox
from assistant.server import AssistantServer
from engine.serving.server import BackgroundServer

MAX_ERRORS = 20
MAX_ITEM = 100_000
MAX_CONVERSATION = 250_000
EVENTS_PER_S = 100.0
PER_CLIENT = 3
SEND_TIMEOUT_S = 1.0
UPDATE = json.dumps({"type": "session.update", "session": {}})  # a valid event with a one-event answer


@pytest.fixture(scope="module")
def server(tmp_path_factory, whisper_tiny_path):
    docs = tmp_path_factory.mktemp("handbook")
    shutil.copy(HANDBOOK_DIR / "en" / "01-annual-leave.md", docs / "01-annual-leave.md")
    config = ServerConfig(
        max_sessions=8, max_sessions_per_client=PER_CLIENT, max_errors=MAX_ERRORS, max_events_per_s=EVENTS_PER_S,
        send_timeout_s=SEND_TIMEOUT_S, max_item_chars=MAX_ITEM, max_conversation_chars=MAX_CONVERSATION,
        assistant=AssistantConfig(docs_dir=docs, language="en", max_tokens=8),
        voice=VoiceConfig(asr_model=whisper_tiny_path, partial_interval_s=None),
    )  # fmt: skip
    assistant = AssistantServer(config)
    with BackgroundServer(assistant.app) as http:
        assistant.url = http.url  # type: ignore[attr-defined]
        yield assistant
    assistant.close()


def raw_url(server: AssistantServer) -> str:
    return server.url.replace("http://", "ws://") + "/v1/realtime"  # type: ignore[attr-defined]


async def until(condition, timeout: float = 120.0) -> None:
    """Wait for ``condition()`` (a generous bound: it fails only if the server never gets there)."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.02)


async def next_of(ws, *kinds: str) -> dict:
    """The next server event of one of ``kinds`` (others are skipped)."""
    while (event := json.loads(await ws.recv()))["type"] not in kinds:
        pass
    return event


def user_item(text: str) -> str:
    return json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}, ensure_ascii=False)  # fmt: skip


async def answered(ws, question: str = "How many days of annual leave do I get?") -> dict:
    await ws.send(user_item(question))
    await ws.send(json.dumps({"type": "response.create", "response": {"output_modalities": ["text"]}}))
    return await next_of(ws, "response.done")


# ---- lone surrogates ------------------------------------------------------------------------------------
SURROGATES = [  # the exact text frames: JSON escapes that decode to a lone surrogate
    '{"type": "conversation.item.create", "item": {"type": "message", "role": "user", '
    '"content": [{"type": "input_text", "text": "hi \\ud800"}]}}',
    '{"type": "session.update", "session": {}, "event_id": "\\ud800"}',
    '{"type": "\\ud800"}',
    '{"type": "conversation.item.create", "event_id": "e\\udfff", "item": {"type": "message", "role": "user", '
    '"content": [{"type": "input_text", "text": "x"}]}}',
]


async def test_a_lone_surrogate_gets_invalid_text_and_the_session_keeps_talking(server) -> None:
    async with ws_connect(raw_url(server)) as ws:
        await next_of(ws, "session.created")
        for frame in SURROGATES:
            await ws.send(frame)
            error = await next_of(ws, "error", "conversation.item.added")
            assert error["type"] == "error" and error["error"]["code"] == "invalid_text", error
            assert error["error"]["event_id"] is None  # nothing of the client's is echoed
        done = await answered(ws)
        assert done["response"]["status"] in ("completed", "incomplete")


async def test_a_session_is_released_when_its_client_leaves_after_surrogates_and_a_run_of_errors(server) -> None:
    async with ws_connect(raw_url(server)) as ws:
        await next_of(ws, "session.created")
        for frame in SURROGATES:
            await ws.send(frame)
        for _ in range(40):
            await ws.send("{")
    await until(lambda: not server.sessions)


async def test_an_event_that_cannot_be_sent_does_not_stop_the_sender() -> None:
    sent: list[object] = []

    async def send(event: object) -> None:
        if event == "bad":
            raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")
        sent.append(event)

    outbox = Outbox(send, lead_s=0.0)
    writer = asyncio.create_task(outbox.run())
    outbox.put("bad")
    outbox.put("good")
    async with asyncio.timeout(30):
        await outbox.sync()
    writer.cancel()
    assert sent == ["good"]


def test_a_server_event_with_text_that_is_not_unicode_becomes_a_server_error() -> None:
    from assistant.realtime import _dumps

    event = json.loads(_dumps({"type": "response.output_text.delta", "delta": "a\ud800"}))
    assert event["type"] == "error" and event["error"]["code"] == "unencodable_event"
    assert "\ud800" not in json.dumps(event)


# ---- deep nesting ---------------------------------------------------------------------------------------
async def test_deeply_nested_json_gets_invalid_json_not_a_dropped_connection(server) -> None:
    async with ws_connect(raw_url(server), max_size=None) as ws:
        await next_of(ws, "session.created")
        for frame in ("[" * 50_000, '{"type": "session.update", "session": ' + "[" * 40 + "]" * 40 + "}", "{" * 50_000):
            await ws.send(frame)
            error = await next_of(ws, "error")
            assert error["error"]["code"] == "invalid_json", error
        await ws.send(UPDATE)
        assert (await next_of(ws, "session.updated", "error"))["type"] == "session.updated"


# ---- text limits ----------------------------------------------------------------------------------------
async def test_text_per_item_and_per_conversation_are_limited_before_tokenizing(server) -> None:
    await until(lambda: not server.sessions)
    threads: list[str] = []
    builder = server.answerer.builders[server.answerer.language_for("annual leave")]
    prompt = builder.prompt

    def recording(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return prompt(*args, **kwargs)

    builder.prompt = recording  # type: ignore[method-assign]
    try:
        async with ws_connect(raw_url(server), max_size=None) as ws:
            await next_of(ws, "session.created")
            session = next(iter(server.sessions))
            done = await answered(ws)
            assert done["response"]["status"] in ("completed", "incomplete")
            assert len(session.pipeline.conversation.turns) == 1
            await ws.send(user_item("x" * (MAX_ITEM + 1)))
            assert (await next_of(ws, "error"))["error"]["code"] == "item_too_large"
            for _ in range(2):
                await ws.send(user_item("y " * (MAX_ITEM // 2)))
                await next_of(ws, "conversation.item.done")
            # unanswered text is never dropped: one more item that would overflow is refused...
            await ws.send(user_item("z" * (MAX_CONVERSATION - 2 * MAX_ITEM + 1)))
            assert (await next_of(ws, "error"))["error"]["code"] == "conversation_too_large"
            # ...after the oldest answered turn has made what room it could
            assert not session.pipeline.conversation.turns and session.pipeline._chars() <= MAX_CONVERSATION
            await ws.send(json.dumps({"type": "response.create", "response": {"output_modalities": ["text"]}}))
            await next_of(ws, "response.done")  # 200k characters: tokenized off the event loop, whatever the outcome
            await ws.send(UPDATE)
            assert (await next_of(ws, "session.updated", "error"))["type"] == "session.updated"
    finally:
        del builder.prompt
    assert len(threads) == 2 and "uvicorn" not in threads  # the server's event loop runs on the "uvicorn" thread


# ---- floods and slow readers ----------------------------------------------------------------------------
async def test_a_flood_over_the_event_rate_gets_rate_limited_then_close_1008(server) -> None:
    async with ws_connect(raw_url(server)) as ws:
        await next_of(ws, "session.created")
        try:
            for _ in range(3000):
                await ws.send(UPDATE)
        except ConnectionClosed:  # closed before the last of them arrived
            pass
        codes: list[str] = []
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                event = json.loads(await ws.recv())
                if event["type"] == "error":
                    codes.append(event["error"]["code"])
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
        assert codes.count("rate_limited") == MAX_ERRORS and codes[-1] == "too_many_errors"


async def test_sessions_per_client_address_are_limited_with_1013(server) -> None:
    await until(lambda: not server.sessions)
    sockets = [await ws_connect(raw_url(server)) for _ in range(PER_CLIENT)]
    try:
        for ws in sockets:
            await next_of(ws, "session.created")
        async with ws_connect(raw_url(server)) as extra:
            error = json.loads(await extra.recv())
            assert error["type"] == "error" and error["error"]["code"] == "client_session_limit_reached"
            with pytest.raises(ConnectionClosed) as closed:
                await extra.recv()
            assert closed.value.rcvd.code == 1013
    finally:
        for ws in sockets:
            await ws.close()


async def test_a_client_that_stops_reading_is_closed_and_its_session_released(server) -> None:
    await until(lambda: not server.sessions)
    # max_queue=1: the client library stops reading the socket once one frame waits unread
    ws = await ws_connect(raw_url(server), max_queue=1, max_size=None)
    try:
        await until(lambda: len(server.sessions) == 1)
        session = next(iter(server.sessions))
        big = "a" * MAX_ITEM
        try:  # each pair comes back four times over (added + done); the client reads none of it
            for _ in range(200):
                await ws.send(user_item(big))
                await ws.send(json.dumps({"type": "conversation.item.create", "item": {
                    "type": "message", "role": "assistant", "content": [{"type": "output_text", "text": big}]}}))  # fmt: skip
                await asyncio.sleep(0.05)  # under the event rate
                if session not in server.sessions:
                    break
        except ConnectionClosed:
            pass
        await until(lambda: session not in server.sessions)
        async with httpx.AsyncClient() as http:  # the server itself is fine
            assert (await http.get(server.url + "/health")).status_code == 200  # type: ignore[attr-defined]
    finally:
        ws.transport.abort()


# ---- the fuzz program's core --------------------------------------------------------------------------------
async def test_a_few_hundred_fuzzed_events_each_get_an_error_or_a_documented_close(server) -> None:
    await until(lambda: not server.sessions)
    report: FuzzReport = await fuzz(raw_url(server), server.config, events=300, connections=2, seed=1)
    assert report.sent >= 300 and not report.unexpected, report.unexpected[:5]
    assert report.clean_turn is not None and report.clean_turn.startswith("response.done")
