"""The Realtime API against hostile and careless clients: a real server on 127.0.0.1, a raw
``websockets`` client sending the exact bytes (lone surrogates, deep nesting, huge texts, floods,
a client that stops reading), and the server's limits (docs/protocol.md, "Limits")."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest
from websockets.asyncio.client import connect as ws_connect
from websockets.client import ClientProtocol
from websockets.uri import parse_uri
from websockets.exceptions import ConnectionClosed

from assistant.config import HANDBOOK_DIR, AssistantConfig, RefusalConfig, ServerConfig, VoiceConfig
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
        # one document, questions about others: the model answers every one (the refusal gate is off)
        assistant=AssistantConfig(docs_dir=docs, language="en", max_tokens=8, refusal=RefusalConfig(enabled=False)),
        # fixed endpointing (the CPU's default, speculative, is tested in test_speculative_endpoint.py)
        voice=VoiceConfig(asr_model=whisper_tiny_path, partial_interval_s=None, endpointing="fixed"),
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


def non_reading_client(url: str) -> tuple[ClientProtocol, socket.socket]:
    """A WebSocket client on a plain socket that never reads after the handshake (websockets'
    sans-I/O protocol frames what it sends). A library client keeps reading its socket into its
    own buffers even with ``max_queue=1``, so the server's sends never block on it."""
    protocol = ClientProtocol(parse_uri(url))
    parts = urlparse(url)
    sock = socket.create_connection((parts.hostname, parts.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    protocol.send_request(protocol.connect())
    sock.sendall(b"".join(protocol.data_to_send()))
    while not protocol.events_received():  # the handshake's response
        protocol.receive_data(sock.recv(65536))
    sock.setblocking(False)
    return protocol, sock


async def test_a_client_that_stops_reading_is_closed_and_its_session_released(server) -> None:
    """The server's sends block once the socket's buffers are full; one that waits
    ``send_timeout_s`` closes the session, well before the keepalive ping would."""
    await until(lambda: not server.sessions)
    protocol, sock = non_reading_client(raw_url(server))
    try:
        await until(lambda: len(server.sessions) == 1)
        session = next(iter(server.sessions))
        big = "a" * MAX_ITEM
        started = time.perf_counter()
        for _ in range(200):  # each pair comes back four times over (added + done); the client reads none of it
            for text in (user_item(big), json.dumps({"type": "conversation.item.create", "item": {
                    "type": "message", "role": "assistant", "content": [{"type": "output_text", "text": big}]}})):  # fmt: skip
                protocol.send_text(text.encode())
                try:
                    sock.sendall(b"".join(protocol.data_to_send()))
                except (BlockingIOError, OSError):  # the server stopped reading too, or closed
                    break
            await asyncio.sleep(0.05)  # under the event rate
            if session not in server.sessions:
                break
        await until(lambda: session not in server.sessions, timeout=30)
        assert time.perf_counter() - started < 20  # the send timeout closed it, not uvicorn's 20 s ping (+20 s timeout)
        async with httpx.AsyncClient() as http:  # the server itself is fine
            assert (await http.get(server.url + "/health")).status_code == 200  # type: ignore[attr-defined]
    finally:
        sock.close()


# ---- the fuzz program's core --------------------------------------------------------------------------------
async def test_a_few_hundred_fuzzed_events_each_get_an_error_or_a_documented_close(server) -> None:
    await until(lambda: not server.sessions)
    report: FuzzReport = await fuzz(raw_url(server), server.config, events=300, connections=2, seed=1)
    assert report.sent >= 300 and not report.unexpected, report.unexpected[:5]
    assert report.clean_turn is not None and report.clean_turn.startswith("response.done")


# ---- audio faster than real time -------------------------------------------------------------------
async def test_audio_sent_faster_than_real_time_is_heard_and_another_session_is_unharmed(server) -> None:
    """One client sends two spoken questions (a second of silence after each) as fast as it can;
    another speaks a question at real-time pace meanwhile. Every question is transcribed right,
    the paced speaker gets its answer, and neither session gets an error."""
    import base64

    import numpy as np

    from speech.audio import to_pcm16
    from speech.config import TTSConfig
    from speech.tts import load_tts
    from speech.word_errors import word_error_rate

    rate, chunk_ms = 24000, 200
    tts = load_tts(TTSConfig(backend="hibari", seed=0))
    assert tts.sample_rate == rate

    def spoken(text: str) -> bytes:
        audio = np.concatenate([np.zeros(rate // 4, np.float32), tts.synthesize(text).pcm, np.zeros(rate, np.float32)])
        return to_pcm16(audio).astype("<i2").tobytes()

    fast_questions = ["How many days of annual leave do I get?", "How long is the probation period?"]
    paced_question = "How do I apply for annual leave?"
    fast_pcm, paced_pcm = b"".join(spoken(q) for q in fast_questions), spoken(paced_question)
    step = rate * chunk_ms // 1000 * 2

    async def append(ws, pcm: bytes, paced: bool) -> None:
        start = time.perf_counter()
        for k, i in enumerate(range(0, len(pcm), step)):
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[i : i + step]).decode()}))
            if paced:
                await asyncio.sleep(max(0.0, start + (k + 1) * chunk_ms / 1000 - time.perf_counter()))

    async def listen(ws, transcripts: int) -> tuple[list[str], list[str], list[dict]]:
        heard, statuses, errors = [], [], []
        async with asyncio.timeout(240):
            while len(heard) < transcripts or len(statuses) < transcripts:
                event = json.loads(await ws.recv())
                if event["type"] == "conversation.item.input_audio_transcription.completed":
                    heard.append(event["transcript"])
                elif event["type"] == "response.done":
                    statuses.append(event["response"]["status"])
                elif event["type"] == "error":
                    errors.append(event["error"])
        return heard, statuses, errors

    async with ws_connect(raw_url(server), max_size=None) as fast, ws_connect(raw_url(server), max_size=None) as paced:
        await next_of(fast, "session.created")
        await next_of(paced, "session.created")
        fast_heard, paced_heard = asyncio.create_task(listen(fast, 2)), asyncio.create_task(listen(paced, 1))
        await asyncio.gather(append(fast, fast_pcm, paced=False), append(paced, paced_pcm, paced=True))
        (heard, statuses, errors), (heard_paced, statuses_paced, errors_paced) = await fast_heard, await paced_heard
    assert errors == errors_paced == []
    assert [word_error_rate(q, h) <= 0.25 for q, h in zip(fast_questions, heard, strict=True)] == [True, True], heard
    answered = ("completed", "incomplete")  # incomplete: the fixture's 8-token answers
    assert word_error_rate(paced_question, heard_paced[0]) <= 0.25 and statuses_paced[0] in answered, (heard_paced, statuses_paced)
    assert len(statuses) == 2 and set(statuses) <= set(answered), statuses  # each question its own answer, none cancelled
