"""Speculative endpointing end to end: a real server on 127.0.0.1 with its engine on the CPU and the
default endpointing (``"auto"``: speculative there, as every turn's timeline says), questions
spoken by the bundled hibari voice (some with a pause in the middle) over the Realtime WebSocket
API, heard by the real Whisper tiny.en, answered by the real engine.

The hangover is long (6 s), so what the tests check does not depend on the machine's speed (a
decode may take seconds on a loaded 2-core machine): a pause shorter than it never ends the turn,
and a complete question is endpointed by the turn-completion rule well before it."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import time
from collections.abc import Callable

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect as ws_connect

from assistant.config import HANDBOOK_DIR, AssistantConfig, EngineOptions, ServerConfig, VoiceConfig
from assistant.server import AssistantServer
from engine.serving.server import BackgroundServer
from speech.audio import to_pcm16
from speech.config import TTSConfig
from speech.tts import load_tts
from speech.word_errors import word_error_rate
from tests.assistant.test_realtime import wait_idle

RATE = 24000
HANGOVER_MS = 6000
CHUNK_MS = 40


@pytest.fixture(scope="module")
def voice():
    return load_tts(TTSConfig(backend="hibari", seed=0))


def spoken(voice, text: str, lead_s: float = 0.0) -> bytes:
    """``text`` spoken by the bundled voice after ``lead_s`` of silence, as PCM16 at 24 kHz."""
    audio = np.concatenate([np.zeros(round(lead_s * RATE), np.float32), voice.synthesize(text).pcm])
    return to_pcm16(audio).astype("<i2").tobytes()


@pytest.fixture(scope="module")
def server(tmp_path_factory, whisper_tiny_path):
    docs = tmp_path_factory.mktemp("handbook")
    shutil.copy(HANDBOOK_DIR / "en" / "01-annual-leave.md", docs / "01-annual-leave.md")
    config = ServerConfig(
        assistant=AssistantConfig(docs_dir=docs, language="en", max_tokens=12, engine=EngineOptions(device="cpu")),
        voice=VoiceConfig(asr_model=whisper_tiny_path, hangover_ms=HANGOVER_MS, speculative_pause_ms=200, output_lead_ms=100),
    )  # fmt: skip
    assistant = AssistantServer(config)
    assistant.warm_up()
    with BackgroundServer(assistant.app) as http:
        assistant.url = http.url  # type: ignore[attr-defined]
        yield assistant
    assistant.close()


def metric(server: AssistantServer, name: str, **labels: str) -> float:
    text = httpx.get(server.url + "/metrics").text  # type: ignore[attr-defined]
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def speculations(server: AssistantServer) -> dict[str, float]:
    return {o: metric(server, "assistant_speculations_total", outcome=o) for o in ("started", "confirmed", "cancelled")}


async def ask(
    server: AssistantServer, parts: list[bytes], pause_s: float = 0.0, until: Callable[[], bool] | None = None,
    linger_s: float = 1.5,
) -> tuple[list[tuple[float, dict]], float | None]:
    """Stream the parts at real-time pace with ``pause_s`` of silence between them (and then, if
    ``until`` is given, silence until it holds), then silence, until the first ``response.timeline``
    and ``linger_s`` more. Returns the server events with their arrival instants and the instant the
    last part's last packet was sent (None if that came later)."""
    url = server.url.replace("http://", "ws://") + "/v1/realtime"  # type: ignore[attr-defined]
    events: list[tuple[float, dict]] = []
    step = RATE * CHUNK_MS // 1000 * 2
    sent_all = asyncio.get_running_loop().create_future()
    async with ws_connect(url, max_size=None) as ws:

        async def send(pcm: bytes) -> None:
            for i in range(0, len(pcm), step):
                piece = pcm[i : i + step]
                piece += bytes(step - len(piece))
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(piece).decode()}))
                await asyncio.sleep(CHUNK_MS / 1000)

        async def microphone() -> None:
            await send(bytes(round(0.3 * RATE) * 2))
            for i, part in enumerate(parts):
                if i:
                    await send(bytes(round(pause_s * RATE) * 2))
                    while until is not None and not await asyncio.to_thread(until):
                        await send(bytes(step))
                await send(part)
            sent_all.set_result(time.perf_counter())
            while True:
                await send(bytes(step))

        mic = asyncio.create_task(microphone())
        try:
            async with asyncio.timeout(120):
                while not any(e["type"] == "response.timeline" for _, e in events):
                    events.append((time.perf_counter(), json.loads(await ws.recv())))
            try:
                async with asyncio.timeout(linger_s):
                    while True:
                        events.append((time.perf_counter(), json.loads(await ws.recv())))
            except TimeoutError:
                pass
        finally:
            mic.cancel()
    return events, sent_all.result() if sent_all.done() else None


def check_one_turn(events: list[tuple[float, dict]], last_sent: float | None, question: str) -> dict:
    """One turn: one utterance, one transcript (the whole question), one response, all of whose
    events came after the question was spoken; returns its timeline."""
    types = [e["type"] for _, e in events]
    assert types.count("response.created") == 1 and types.count("response.done") == 1, types
    assert types.count("input_audio_buffer.speech_started") == 1 and types.count("input_audio_buffer.committed") == 1
    transcripts = [e["transcript"] for _, e in events if e["type"] == "conversation.item.input_audio_transcription.completed"]
    assert len(transcripts) == 1 and word_error_rate(question, transcripts[0]) <= 0.2, transcripts
    created_at, created = next((t, e) for t, e in events if e["type"] == "response.created")
    assert last_sent is not None and created_at > last_sent  # nothing of an answer came while the question was being spoken
    response_id = created["response"]["id"]
    ids = {e.get("response_id") or e["response"]["id"] for _, e in events if e["type"].startswith("response.")}
    assert ids == {response_id}
    assert any(e["type"] == "response.output_audio.delta" for _, e in events)
    timeline = next(e for _, e in events if e["type"] == "response.timeline")["timeline"]
    assert timeline["endpointing"] == "speculative" and timeline["endpoint_by"] in ("completion", "hangover")
    return timeline


PARTS = ("How do I apply for", "annual leave?")  # the first part ends on a preposition: never complete


async def test_a_question_with_a_short_pause_is_answered_once_as_one_turn(server, voice) -> None:
    before = speculations(server)
    events, last_sent = await ask(server, [spoken(voice, p) for p in PARTS], pause_s=0.4)
    check_one_turn(events, last_sent, " ".join(PARTS))
    after = speculations(server)
    assert after["confirmed"] - before["confirmed"] == 1
    assert after["started"] - before["started"] == after["confirmed"] - before["confirmed"] + after["cancelled"] - before["cancelled"]
    await wait_idle(server)


async def test_speech_after_a_speculation_started_cancels_it_unseen(server, voice) -> None:
    """The question goes on only once the server has started answering its first part (however
    long its decode takes here, within the hangover): that answer is dropped, never sent."""
    before = speculations(server)
    started = lambda: speculations(server)["started"] > before["started"]  # noqa: E731
    events, last_sent = await ask(server, [spoken(voice, p) for p in PARTS], pause_s=0.3, until=started)
    check_one_turn(events, last_sent, " ".join(PARTS))
    after = speculations(server)
    assert after["cancelled"] - before["cancelled"] == 1 and after["confirmed"] - before["confirmed"] == 1
    await wait_idle(server)  # the cancelled speculation's request was aborted and its KV freed


async def test_a_complete_question_is_endpointed_by_the_rule_before_the_hangover(server, voice) -> None:
    events, _ = await ask(server, [spoken(voice, "How many days of annual leave do I get per year?")])
    types = [e["type"] for _, e in events]
    assert types.count("response.created") == 1, types
    timeline = next(e for _, e in events if e["type"] == "response.timeline")["timeline"]
    instants = timeline["instants_ms"]
    assert timeline["endpoint_by"] == "completion" and timeline["hangover_ms"] == HANGOVER_MS
    # fixed endpointing waits the whole hangover after speech_end; here the turn ended at the pause
    assert instants["endpoint"] - instants["speech_end"] < HANGOVER_MS
    assert 200 <= timeline["pause_ms"] <= instants["endpoint"]
    assert instants["first_audio_sent"] >= instants["endpoint"]  # held until confirmed
    assert timeline["speech_end_to_first_audio_ms"] == pytest.approx(instants["first_audio_sent"] - instants["speech_end"], abs=1e-3)
    assert sum(timeline["stages_ms"].values()) == pytest.approx(timeline["total_ms"], abs=1e-6)


async def test_speech_right_after_a_released_answer_counts_a_false_endpoint(server, voice) -> None:
    """The user goes on just after the answer was released: a barge-in, counted on /metrics as a
    false endpoint (speech within 1.5 s of the endpoint)."""
    before = metric(server, "assistant_false_endpoints_total")
    confirmed = speculations(server)["confirmed"]
    released = lambda: speculations(server)["confirmed"] > confirmed  # noqa: E731
    parts = [spoken(voice, "How do I apply for annual leave?"), spoken(voice, "And how many days do I get?")]
    events, _ = await ask(server, parts, until=released)
    done = next(e for _, e in events if e["type"] == "response.done")["response"]
    assert done["status"] == "cancelled" and done["status_details"]["reason"] == "turn_detected"
    assert metric(server, "assistant_false_endpoints_total") == before + 1
