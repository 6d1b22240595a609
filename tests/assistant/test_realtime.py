"""The Realtime WebSocket API end to end: a real server on 127.0.0.1, the official openai SDK's
realtime client, questions spoken by the bundled hibari voice, answers heard back by Whisper.

This file stays whole (over 500 lines): every test here shares one server with the real models
(tests/assistant/conftest.py, also test_http_chat.py's), which takes up to a minute to start on a
2-core machine. New Realtime tests with their own server settings go in their own file, as
test_realtime_hardening.py does."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from dataclasses import dataclass

import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from assistant.eval import FACTS_FILE
from assistant.eval_images import PICTURES, render
from assistant.image_reading import MAX_IMAGES, NO_TEXT, data_url
from assistant.server import AssistantServer
from assistant.timeline import OPTIONAL_STAGES, STAGES
from speech.asr.backend import FasterWhisperBackend
from tests.assistant.conftest import MAX_ERRORS, MAX_MESSAGE, MAX_SESSIONS
from speech.audio import resample, to_float32, to_pcm16
from speech.config import ASRConfig, TTSConfig
from speech.tts import load_tts
from speech.word_errors import word_error_rate, words

RATE = 24000
# Eight different short questions from assistant/eval_facts.json, all well heard by tiny.en.
QUESTIONS = [
    "How do I apply for annual leave?",
    "How many days of annual leave do I get per year?",
    "What is the minimum length of a password?",
    "How long is the probation period?",
    "How many days a week can I work remotely?",
    "How much is the home office allowance?",
    "How many public holidays do we get each year?",
    "What is the deadline for submitting an expense claim?",
]


@dataclass(frozen=True)
class Clip:
    text: str
    pcm: bytes  # PCM16 mono 24 kHz: 0.3 s silence, the question, 1.0 s silence


@pytest.fixture(scope="module")
def clips() -> list[Clip]:
    facts = {item["question_en"] for item in json.loads(FACTS_FILE.read_text("utf-8"))}
    assert set(QUESTIONS) <= facts
    tts = load_tts(TTSConfig(backend="hibari", seed=0))
    assert tts.sample_rate == RATE
    out = []
    for text in QUESTIONS:
        speech = tts.synthesize(text).pcm
        audio = np.concatenate([np.zeros(round(0.3 * RATE), np.float32), speech, np.zeros(RATE, np.float32)])
        out.append(Clip(text, to_pcm16(audio).astype("<i2").tobytes()))
    return out


@pytest.fixture(scope="module")
def server(assistant_server) -> AssistantServer:
    """The server this module shares with test_http_chat.py (tests/assistant/conftest.py)."""
    return assistant_server


@pytest.fixture(scope="module")
def finished(server) -> dict[str, str]:
    """request id -> finish reason of every engine request that ends from now on."""
    reasons: dict[str, str] = {}
    server.answerer.engine.add_finish_listener(lambda out: reasons.__setitem__(out.request_id, out.finish_reason))
    return reasons


async def finish_reason(finished: dict[str, str], request_id: str, timeout: float = 30.0) -> str:
    async with asyncio.timeout(timeout):
        while request_id not in finished:
            await asyncio.sleep(0.02)
    return finished[request_id]


async def in_engine(server: AssistantServer, request_id: str, timeout: float = 60.0) -> None:
    """Until the engine holds ``request_id`` (added, not yet finished)."""
    async with asyncio.timeout(timeout):
        while request_id not in server.answerer.engine.core.requests:
            await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def hearing(whisper_tiny_path) -> FasterWhisperBackend:
    """Our own Whisper, to hear the answers the server speaks."""
    return FasterWhisperBackend(ASRConfig(model_path=whisper_tiny_path, language="en"))


def realtime(server: AssistantServer) -> openai.AsyncOpenAI:
    ws = server.url.replace("http://", "ws://")  # type: ignore[attr-defined]
    return openai.AsyncOpenAI(api_key="unused", websocket_base_url=f"{ws}/v1")


def raw_url(server: AssistantServer) -> str:
    return server.url.replace("http://", "ws://") + "/v1/realtime"  # type: ignore[attr-defined]


async def send_audio(conn, pcm: bytes, chunk_ms: int = 100, speed: float = 1.0) -> None:
    """Stream PCM16 in ``chunk_ms`` packets, ``speed`` times faster than real time."""
    step = RATE * chunk_ms // 1000 * 2
    start = time.perf_counter()
    for k, i in enumerate(range(0, len(pcm), step)):
        await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i : i + step]).decode())
        await asyncio.sleep(max(0.0, start + (k + 1) * chunk_ms / 1000 / speed - time.perf_counter()))


async def recv_until(conn, kind: str, timeout: float = 120.0) -> list:
    """SDK events up to and including the first of type ``kind``."""
    events = []
    async with asyncio.timeout(timeout):
        while True:
            events.append(await conn.recv())
            if events[-1].type == kind:
                return events


def first(events: list, kind: str):
    return next(e for e in events if e.type == kind)


def check_timeline(timeline: dict, source: str = "voice", requested: bool = False) -> None:
    """Every stage, in order (``response_requested`` only if the client asked for the answer), and
    the shares add up to the totals."""
    instants = timeline["instants_ms"]
    wanted = [s for s in STAGES if s not in OPTIONAL_STAGES or (requested and s == "response_requested")]
    assert list(instants) == wanted, instants
    values = list(instants.values())
    assert values == sorted(values), instants
    assert timeline["source"] == source
    assert sum(timeline["stages_ms"].values()) == pytest.approx(timeline["total_ms"], abs=1e-6)
    assert timeline["speech_end_to_first_audio_ms"] == timeline["total_ms"]
    hangover_share = timeline["stages_ms"]["endpoint"]
    assert timeline["endpoint_to_first_audio_ms"] == pytest.approx(timeline["total_ms"] - hangover_share, abs=1e-6)
    check_breakdown(timeline)


def check_breakdown(timeline: dict) -> None:
    """Where the ASR final's and the first token's time went: every part measured, none negative;
    the ASR parts span at least the stage (the final is queued before the endpoint is handled, and
    its hand-off runs from the decode's end, so a batch's later results count their wait there),
    the LLM parts at most the stage (the engine is asked after the stage began)."""
    parts, shares = timeline["breakdown_ms"], timeline["stages_ms"]
    llm = ("llm_submit", "llm_queue", "llm_prefill", "llm_handoff")
    assert set(parts) == set(llm) | ({"asr_queue", "asr_decode", "asr_handoff"} if timeline["source"] == "voice" else set())
    assert all(v >= 0 for v in parts.values()) and parts["llm_prefill"] > 0
    assert sum(parts[k] for k in llm) <= shares["llm_first_token"] + 0.01
    if timeline["source"] == "voice":
        assert parts["asr_decode"] > 0
        assert parts["asr_queue"] + parts["asr_decode"] + parts["asr_handoff"] >= shares["asr_final"] - 0.01


def metric(server: AssistantServer, name: str, **labels: str) -> float:
    text = httpx.get(server.url + "/metrics").text  # type: ignore[attr-defined]
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise KeyError(name)


async def wait_idle(server: AssistantServer, timeout: float = 30.0) -> None:
    """Until no request runs or waits and every KV block is free again."""
    engine = server.answerer.engine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_blocks_free == s.kv_blocks_total:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"engine not idle: {engine.stats()}")


def prefix_tokens(server: AssistantServer) -> int:
    """Tokens of the documents prefix, the part of every prompt the KV cache shares."""
    (builder,) = server.answerer.builders.values()  # one handbook language in these tests
    return len(builder.prefix.token_ids)


# ---- the acceptance conversation -------------------------------------------------------------------
async def test_sdk_holds_a_spoken_and_a_typed_conversation(server, clips, hearing) -> None:
    clip = clips[0]
    async with realtime(server).realtime.connect(model="handbook") as conn:
        created = await conn.recv()
        assert created.type == "session.created" and created.session.audio.input.format.rate == RATE
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 32})
        assert (await conn.recv()).type == "session.updated"

        sender = asyncio.create_task(send_audio(conn, clip.pcm, speed=2.0))
        events = await recv_until(conn, "response.timeline")
        await sender
        types = [e.type for e in events]
        order = ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped", "input_audio_buffer.committed",
                 "conversation.item.input_audio_transcription.completed", "response.created",
                 "response.output_audio_transcript.delta", "response.output_audio.delta", "response.output_audio.done",
                 "response.output_audio_transcript.done", "response.done", "response.timeline"]  # fmt: skip
        assert [types.index(t) for t in order] == sorted(types.index(t) for t in order), types
        transcript = first(events, "conversation.item.input_audio_transcription.completed").transcript
        assert word_error_rate(clip.text, transcript) <= 0.2, transcript

        done = first(events, "response.done").response
        assert done.status in ("completed", "incomplete") and done.usage.output_tokens <= 32
        assert done.usage.input_token_details.cached_tokens >= prefix_tokens(server) - 16
        answer = first(events, "response.output_audio_transcript.done").transcript
        assert answer.strip() and done.output[0].content[0].transcript == answer
        audio = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
        assert len(audio) / 2 / RATE > 1.0
        heard = hearing.transcribe(resample(to_float32(audio), RATE, 16000)).text
        spoken = [w for w in words(answer) if w.isalpha() and len(w) > 2]
        assert sum(w in words(heard) for w in spoken) >= 0.6 * len(spoken), (answer, heard)

        timeline = events[-1].timeline  # the SDK passes our extra event through
        check_timeline(timeline)
        assert timeline["hangover_ms"] == 500 and timeline["cached_tokens"] == done.usage.input_token_details.cached_tokens

        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "How many days of sick leave can I self-certify?"}]})  # fmt: skip
        await conn.response.create(response={"output_modalities": ["text"]})
        events = await recv_until(conn, "response.timeline")
        text = first(events, "response.output_text.done").text
        assert text.strip() and text == "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert not any(e.type == "response.output_audio.delta" for e in events)
        done = first(events, "response.done").response
        # the documents prefix is cached (the spoken turn is not: its prompt carried its document
        # before the question, and the history keeps the question alone; from the third turn on the
        # earlier turns are shared too)
        assert done.usage.input_token_details.cached_tokens >= prefix_tokens(server) - 16
        assert events[-1].timeline["source"] == "text"
        # the cited handbook section travels with the timeline (sick leave is 02-sick-leave.md)
        assert events[-1].citation["path"].endswith("02-sick-leave.md")


async def test_a_refused_question_is_spoken_as_an_answer(server, hearing, monkeypatch) -> None:
    """With the refusal gate on, a question the documents do not answer gets the refusal as a spoken
    answer: the events of a model's answer, in their order, its audio heard back, no model tokens."""
    monkeypatch.setattr(server.answerer.config.refusal, "enabled", True)
    async with realtime(server).realtime.connect(model="handbook") as conn:
        await recv_until(conn, "session.created")
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "What is the dress code at the office?"}]})  # fmt: skip
        await conn.response.create()
        events = await recv_until(conn, "response.timeline")
        types = [e.type for e in events]
        order = ["response.created", "response.output_audio_transcript.delta", "response.output_audio.delta",
                 "response.output_audio.done", "response.output_audio_transcript.done", "response.done", "response.timeline"]  # fmt: skip
        assert [types.index(t) for t in order] == sorted(types.index(t) for t in order), types
        answer = first(events, "response.output_audio_transcript.done").transcript
        assert answer == "The handbook does not say."  # this folder has no contacts page to name one from
        done = first(events, "response.done").response
        assert done.status == "completed" and done.usage.output_tokens == 0 and done.usage.input_tokens == 0
        audio = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
        heard = hearing.transcribe(resample(to_float32(audio), RATE, 16000)).text
        spoken = [w for w in words(answer) if w.isalpha() and len(w) > 2]
        assert sum(w in words(heard) for w in spoken) >= 0.6 * len(spoken), (answer, heard)


# ---- barge-in and disconnects ------------------------------------------------------------------------
def hold_answers_short_of_their_end(core, monkeypatch) -> None:
    """While any request is one step short of its ``max_tokens``, the engine loop steps nothing
    (it still applies commands, such as an abort): an answer cannot end by length before the test
    interrupts it, however fast the engine is next to the voice and the VAD. With speculative
    decoding (the CPU default) a step may append 1 + num_speculative_tokens tokens."""
    step = core.step
    per_step = 1 + (core.config.num_speculative_tokens if core.proposer is not None else 0)

    def held_step() -> list:
        if any(r.num_output_tokens >= r.sampling_params.max_tokens - per_step for r in core.requests.values()):
            time.sleep(0.01)  # the engine loop drains its commands between steps
            return []
        return step()

    monkeypatch.setattr(core, "step", held_step)


async def test_speech_during_the_answer_cancels_it_and_aborts_the_engine_request(server, clips, finished, monkeypatch) -> None:
    hold_answers_short_of_their_end(server.answerer.engine.core, monkeypatch)
    async with realtime(server).realtime.connect(model="handbook") as conn:
        session_id = (await recv_until(conn, "session.created"))[-1].session.id
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "What are the password rules?"}]})  # fmt: skip
        await conn.response.create()
        events = await recv_until(conn, "response.output_audio.delta")
        response_id = first(events, "response.created").response.id
        # the user talks over the answer, at real-time pace, in 20 ms packets like a microphone
        sender = asyncio.create_task(send_audio(conn, clips[2].pcm, chunk_ms=20))
        events = await recv_until(conn, "response.timeline", timeout=60)
        types = [e.type for e in events]
        assert types.index("input_audio_buffer.speech_started") < types.index("response.done")
        done = first(events, "response.done").response
        assert done.id == response_id and done.status == "cancelled"
        assert done.status_details.reason == "turn_detected"
        barge_in = events[-1].timeline["barge_in"]  # about 90 ms from speech start measured: 60 ms start_ms + Silero + packet
        assert 0 <= barge_in["from_detection_ms"] <= barge_in["from_speech_start_ms"], barge_in
        heard = first(events, "response.output_audio_transcript.done").transcript
        assert done.output[0].content[0].transcript == heard

        # nothing more of the cancelled answer; the interruption itself is heard and answered
        events = await recv_until(conn, "response.created", timeout=60)
        assert not [e for e in events if getattr(e, "response_id", None) == response_id]
        transcript = first(events, "conversation.item.input_audio_transcription.completed").transcript
        assert word_error_rate(clips[2].text, transcript) <= 0.2, transcript
        left = first(events, "response.created").response.id
        # walk out once the answer is in the engine: response.created comes before its prompt is
        # built, and a turn cancelled before then never reaches the engine (nothing to abort)
        await in_engine(server, f"{session_id}-{left}")
        sender.cancel()
    # the engine request of the interrupted answer was aborted, and so was the one we walked out of
    assert await finish_reason(finished, f"{session_id}-{response_id}") == "abort"
    assert await finish_reason(finished, f"{session_id}-{left}") == "abort"
    await wait_idle(server)
    assert metric(server, "assistant_barge_in_seconds_count") >= 1
    assert metric(server, "assistant_turns_total", source="text", status="cancelled") >= 1


async def test_a_client_that_leaves_mid_answer_frees_its_kv(server, finished) -> None:
    async with ws_connect(raw_url(server)) as ws:
        session_id = json.loads(await ws.recv())["session"]["id"]
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "What are the password rules?"}]}}))  # fmt: skip
        await ws.send(json.dumps({"type": "response.create", "response": {"output_modalities": ["text"]}}))
        while (event := json.loads(await ws.recv()))["type"] != "response.output_text.delta":
            pass
    assert await finish_reason(finished, f"{session_id}-{event['response_id']}") == "abort"
    await wait_idle(server)


async def test_the_client_can_cancel_a_response(server, finished) -> None:
    async with realtime(server).realtime.connect(model="handbook") as conn:
        session_id = (await recv_until(conn, "session.created"))[-1].session.id
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "What are the password rules?"}]})  # fmt: skip
        await conn.response.create(response={"output_modalities": ["text"]})
        response_id = (await recv_until(conn, "response.output_text.delta"))[-1].response_id
        await conn.response.cancel(response_id=response_id)
        done = (await recv_until(conn, "response.done"))[-1].response
        assert done.status == "cancelled" and done.status_details.reason == "client_cancelled"
        assert await finish_reason(finished, f"{session_id}-{response_id}") == "abort"


async def test_commit_ends_the_turn_and_clear_drops_it(server, clips) -> None:
    clip = clips[3]
    speech_only = clip.pcm[: len(clip.pcm) - 2 * RATE]  # without the trailing second of silence
    async with realtime(server).realtime.connect(model="handbook") as conn:
        await recv_until(conn, "session.created")
        await conn.session.update(session={"type": "realtime", "output_modalities": ["text"], "max_output_tokens": 4})
        await send_audio(conn, speech_only, speed=4.0)
        await conn.input_audio_buffer.clear()  # the utterance in progress is dropped...
        events = await recv_until(conn, "input_audio_buffer.cleared")
        await send_audio(conn, bytes(2 * RATE), speed=4.0)  # ...so its end is never heard
        await send_audio(conn, speech_only, speed=4.0)
        await conn.input_audio_buffer.commit()  # the turn ends now, without waiting for silence
        events += await recv_until(conn, "response.done")
        types = [e.type for e in events]
        assert types.count("input_audio_buffer.speech_started") == 2 and types.count("input_audio_buffer.committed") == 1
        assert "input_audio_buffer.speech_stopped" not in types
        transcript = first(events, "conversation.item.input_audio_transcription.completed").transcript
        assert word_error_rate(clip.text, transcript) <= 0.2, transcript


async def test_a_speech_front_end_process_that_dies_costs_one_utterance_not_the_session(server, clips) -> None:
    """The shared server runs its callers' front ends in a worker process. Killed mid-utterance:
    the caller gets a server_error event (not counted against it), its next question is heard
    through a restarted process and answered, and so is a new session's."""
    pool = server.services.asr._front_ends
    clip = clips[0]
    async with realtime(server).realtime.connect(model="handbook") as conn:
        await recv_until(conn, "session.created")
        await conn.session.update(session={"type": "realtime", "output_modalities": ["text"], "max_output_tokens": 4})
        await send_audio(conn, clip.pcm[: len(clip.pcm) // 3], speed=4.0)  # the question under way...
        victim = pool.processes[0]
        victim.kill()
        victim.join(10)
        await send_audio(conn, bytes(2 * RATE), speed=4.0)  # ...is lost: the next packet finds the process gone
        error = first(await recv_until(conn, "error"), "error").error
        assert (error.type, error.code) == ("server_error", "speech_front_end_restarted")
        await send_audio(conn, clips[1].pcm, speed=4.0)
        events = await recv_until(conn, "response.done")
        transcript = first(events, "conversation.item.input_audio_transcription.completed").transcript
        assert word_error_rate(clips[1].text, transcript) <= 0.2, transcript
    assert pool.processes[0].is_alive() and pool.processes[0] is not victim
    async with realtime(server).realtime.connect(model="handbook") as conn:
        await recv_until(conn, "session.created")
        await conn.session.update(session={"type": "realtime", "output_modalities": ["text"], "max_output_tokens": 4})
        await send_audio(conn, clips[2].pcm, speed=4.0)
        events = await recv_until(conn, "response.done")
        assert first(events, "conversation.item.input_audio_transcription.completed").transcript


async def test_a_push_to_talk_turn_keeps_its_voice_timeline_and_shows_the_wait_for_response_create(server, clips) -> None:
    """turn_detection null: the client commits, gets the transcript, waits, then asks for the
    answer. The turn is a voice turn with its speech stages, and the client's wait is the share of
    ``response_requested``, not of the LLM's first token."""
    clip = clips[5]
    speech_only = clip.pcm[: len(clip.pcm) - 2 * RATE]  # without the trailing second of silence

    def count(name: str, **labels: str) -> float:
        try:
            return metric(server, name, **labels)
        except KeyError:  # a labelled series appears with its first observation
            return 0.0

    def voice_turns() -> float:
        return sum(count("assistant_turns_total", source="voice", status=s) for s in ("completed", "incomplete"))

    voice_before = voice_turns()
    requested_before = count("assistant_turn_stage_seconds_count", stage="response_requested")
    async with realtime(server).realtime.connect(model="handbook") as conn:
        await recv_until(conn, "session.created")
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 12,
                                           "audio": {"input": {"turn_detection": None}}})  # fmt: skip
        updated = (await recv_until(conn, "session.updated"))[-1]
        assert updated.session.audio.input.turn_detection is None
        await send_audio(conn, speech_only, speed=2.0)
        await conn.input_audio_buffer.commit()  # the push-to-talk button is released
        events = await recv_until(conn, "conversation.item.input_audio_transcription.completed")
        heard_at = time.perf_counter()
        transcript = events[-1].transcript
        assert word_error_rate(clip.text, transcript) <= 0.2, transcript
        await asyncio.sleep(1.0)  # the client takes its time before asking for the answer
        asked_at = time.perf_counter()
        await conn.response.create()
        events, first_delta_at = [], None
        async with asyncio.timeout(120):
            while not events or events[-1].type != "response.timeline":
                events.append(await conn.recv())
                if first_delta_at is None and events[-1].type == "response.output_audio_transcript.delta":
                    first_delta_at = time.perf_counter()
        types = [e.type for e in events]
        assert types.count("response.created") == 1 and "error" not in types, types
        done = first(events, "response.done").response
        assert done.status in ("completed", "incomplete") and done.output[0].content[0].transcript.strip()

    timeline = events[-1].timeline
    assert timeline["source"] == "voice"
    check_timeline(timeline, requested=True)  # speech_end, endpoint and asr_final of the utterance are there
    shares = timeline["stages_ms"]
    assert shares["asr_final"] > 0
    # the server's clock is ours (the server runs in this process): asr_final came before we heard
    # the transcript and response_requested after we asked, so the wait is inside that share...
    waited_ms = (asked_at - heard_at) * 1000
    assert waited_ms >= 1000 and shares["response_requested"] >= waited_ms - 0.01, (waited_ms, shares)
    # ...and not in the LLM's: its first token came after we asked and before we got it
    assert first_delta_at is not None
    assert shares["llm_first_token"] <= (first_delta_at - asked_at) * 1000, shares
    assert timeline["speech_end_to_first_audio_ms"] == timeline["total_ms"] > shares["response_requested"]
    # /metrics counts it as a voice turn, with the wait as its own stage
    async with asyncio.timeout(10):
        while voice_turns() < voice_before + 1:
            await asyncio.sleep(0.05)
    assert count("assistant_turn_stage_seconds_count", stage="response_requested") == requested_before + 1


# ---- many sessions ---------------------------------------------------------------------------------
async def test_eight_concurrent_sessions_share_the_documents_prefix(server, clips) -> None:
    prefix = prefix_tokens(server)
    computed_before = server.answerer.engine.stats().prompt_tokens

    async def caller(clip: Clip) -> list:
        async with realtime(server).realtime.connect(model="handbook") as conn:
            await recv_until(conn, "session.created")
            await conn.session.update(session={"type": "realtime", "max_output_tokens": 8})
            sender = asyncio.create_task(send_audio(conn, clip.pcm, speed=2.0))
            events = await recv_until(conn, "response.timeline", timeout=180)
            await sender
            return events

    results = await asyncio.gather(*(caller(c) for c in clips))
    for clip, events in zip(clips, results):
        transcript = first(events, "conversation.item.input_audio_transcription.completed").transcript
        assert word_error_rate(clip.text, transcript) <= 0.2, (clip.text, transcript)
        done = first(events, "response.done").response
        assert done.status in ("completed", "incomplete") and done.output[0].content[0].transcript.strip()
        assert done.usage.input_token_details.cached_tokens >= prefix - 16
        check_timeline(events[-1].timeline)
    # the eight prompts computed their own parts (the question and its document) and not the documents
    # prefix again: the warm-up computed it once for all
    computed = server.answerer.engine.stats().prompt_tokens - computed_before
    own = sum(first(events, "response.done").response.usage.input_token_details.text_tokens - prefix for events in results)
    assert computed < own + prefix // 2, (computed, own, prefix)
    # every stage of those turns is on /metrics, as histograms and as recent p50/p90/p99
    for stage in STAGES[1:]:
        if stage in OPTIONAL_STAGES:  # hands-free turns: the server answered, nobody asked
            continue
        assert metric(server, "assistant_turn_stage_seconds_count", stage=stage) >= 8
        for q in ("0.5", "0.9", "0.99"):
            assert metric(server, "assistant_turn_stage_recent_seconds", stage=stage, quantile=q) > 0
    for span in ("speech_end_to_first_audio", "endpoint_to_first_audio"):
        assert metric(server, "assistant_turn_total_seconds_count", span=span) >= 8
        assert metric(server, "assistant_turn_total_recent_seconds", span=span, quantile="0.99") > 0
    # the co-scheduler's counts are there too, and every turn it counted has left them
    assert metric(server, "assistant_coscheduler_enabled") == 1
    for stage in ("asr_final", "first_token", "first_audio"):
        assert metric(server, "assistant_coscheduler_turns_waiting", stage=stage) == 0


async def test_over_capacity_is_refused_with_1013(server) -> None:
    sockets = await asyncio.gather(*(ws_connect(raw_url(server)) for _ in range(MAX_SESSIONS)))
    try:
        for ws in sockets:
            assert json.loads(await ws.recv())["type"] == "session.created"
        async with ws_connect(raw_url(server)) as extra:
            error = json.loads(await extra.recv())
            assert error["type"] == "error" and error["error"]["code"] == "session_limit_reached"
            with pytest.raises(ConnectionClosed) as closed:
                await extra.recv()
            assert closed.value.rcvd.code == 1013
        assert metric(server, "assistant_realtime_sessions") == MAX_SESSIONS
    finally:
        for ws in sockets:
            await ws.close()


# ---- bad input ------------------------------------------------------------------------------------
BAD_EVENTS = [
    ("not json", "invalid_json"),
    ("[1, 2]", "invalid_event"),
    (json.dumps({"audio": "AAAA"}), "invalid_event"),
    (json.dumps({"type": "conversation.item.teleport"}), "unknown_event_type"),
    (json.dumps({"type": "conversation.item.truncate", "item_id": "x"}), "unsupported_event_type"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "AAAA", "volume": 11}), "unknown_parameter"),
    (json.dumps({"type": "input_audio_buffer.append"}), "missing_required_parameter"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "%%%not base64%%%"}), "invalid_base64"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\x01\x02\x03").decode()}), "invalid_audio_format"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"RIFF\x24\x00\x00\x00WAVEfmt ").decode()}), "invalid_audio_format"),
    (json.dumps({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}}), "unsupported_value"),
    (json.dumps({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcmu"}}}}}), "invalid_value"),
    (json.dumps({"type": "session.update", "session": {"output_modalities": ["audio", "text"]}}), "invalid_value"),
    (json.dumps({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}}}), "invalid_value"),
    (json.dumps({"type": "session.update", "session": {"audio": {"input": {"transcription": {"language": "zh"}}}}}), "invalid_value"),
    (json.dumps({"type": "session.update", "session": {"audio": {"output": {"voice": "alloy"}}}}), "unsupported_value"),
    (json.dumps({"type": "session.update", "session": {"instructions": "Be a pirate."}}), "unsupported_value"),
    (json.dumps({"type": "session.update", "session": {"tools": [{"type": "function", "name": "f"}]}}), "invalid_value"),
    (json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": "assistant",
                                                              "content": [{"type": "output_text", "text": "Hi"}]}}), "unsupported_value"),
    (json.dumps({"type": "conversation.item.create", "previous_item_id": "item_nope", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}}), "invalid_value"),
    (json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": "system",
                                                              "content": [{"type": "input_text", "text": "Hi"}]}}), "invalid_value"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (MAX_MESSAGE + 4)}), "message_too_large"),
    (json.dumps({"type": "input_audio_buffer.commit"}), "input_audio_buffer_commit_empty"),
    (json.dumps({"type": "response.cancel"}), "response_cancel_not_active"),
    (json.dumps({"type": "response.create"}), "no_user_input"),
]  # fmt: skip


async def test_bad_events_get_an_error_and_the_session_lives_on(server) -> None:
    assert len(BAD_EVENTS) > MAX_ERRORS
    async with ws_connect(raw_url(server), max_size=None) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        for i, (message, code) in enumerate(BAD_EVENTS):
            event_id = f"evt_{i}"
            if message.startswith("{"):
                message = json.dumps({**json.loads(message), "event_id": event_id})
            await ws.send(message)
            error = json.loads(await ws.recv())
            assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
            assert error["error"]["code"] == code, (message[:80], error)
            if code not in ("invalid_json", "invalid_event", "message_too_large"):
                assert error["error"]["event_id"] == event_id
            if i % 10 == 9:  # a valid event resets the run of errors (there are more than MAX_ERRORS)
                await ws.send(json.dumps({"type": "session.update", "session": {}}))
                assert json.loads(await ws.recv())["type"] == "session.updated"
        await ws.send(b"\x00\x01")  # a binary frame
        assert json.loads(await ws.recv())["error"]["code"] == "binary_not_supported"
        # still alive: a valid update is applied and a typed turn is answered
        await ws.send(json.dumps({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
            "type": "server_vad", "silence_duration_ms": 300, "create_response": False}}}}}))  # fmt: skip
        updated = json.loads(await ws.recv())
        assert updated["type"] == "session.updated"
        detection = updated["session"]["audio"]["input"]["turn_detection"]
        assert detection["silence_duration_ms"] == 300 and detection["create_response"] is False
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello?"}]}}))  # fmt: skip
        await ws.send(json.dumps({"type": "response.create", "response": {"output_modalities": ["text"], "max_output_tokens": 3}}))
        while (event := json.loads(await ws.recv()))["type"] != "response.done":
            assert event["type"] != "error", event
        assert event["response"]["status"] == "incomplete" and event["response"]["status_details"]["reason"] == "max_output_tokens"
        assert event["response"]["usage"]["output_tokens"] == 3


async def test_a_flood_of_invalid_events_closes_the_socket_with_1008(server) -> None:
    async with ws_connect(raw_url(server)) as ws:
        json.loads(await ws.recv())
        for _ in range(MAX_ERRORS):
            await ws.send("{")
        codes = [json.loads(await ws.recv())["error"]["code"] for _ in range(MAX_ERRORS + 1)]
        assert codes == ["invalid_json"] * MAX_ERRORS + ["too_many_errors"]
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd.code == 1008


async def test_max_output_tokens_echoes_the_limit_actually_used(server) -> None:
    """Asking for more than the server's --max-tokens shows the server's cap, not the request."""
    cap = server.config.assistant.max_tokens
    async with ws_connect(raw_url(server)) as ws:
        assert json.loads(await ws.recv())["session"]["max_output_tokens"] == cap
        for asked, used in ((4096, cap), (cap - 8, cap - 8), ("inf", cap)):
            await ws.send(json.dumps({"type": "session.update", "session": {"max_output_tokens": asked}}))
            updated = json.loads(await ws.recv())
            assert updated["type"] == "session.updated" and updated["session"]["max_output_tokens"] == used, asked
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "What are the password rules?"}]}}))  # fmt: skip
        await ws.send(json.dumps({"type": "response.create", "response": {"output_modalities": ["text"], "max_output_tokens": 4096}}))
        limits = []
        while (event := json.loads(await ws.recv()))["type"] != "response.done":
            assert event["type"] != "error", event
            if event["type"] == "response.created":
                limits.append(event["response"]["max_output_tokens"])
        limits.append(event["response"]["max_output_tokens"])
        assert limits == [cap, cap] and event["response"]["usage"]["output_tokens"] <= cap


# ---- HTTP, health, metrics ---------------------------------------------------------------------------
def test_chat_completions_are_grounded_in_the_documents(server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)  # type: ignore[attr-defined]
    reply = client.chat.completions.create(model=server.model_name, max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": "How many days of annual leave do I get?"}])  # fmt: skip
    usage = reply.usage
    assert usage.prompt_tokens > prefix_tokens(server)  # the handbook is in the prompt
    assert usage.prompt_tokens_details.cached_tokens >= prefix_tokens(server) - 16  # and its KV was reused
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=server.model_name, max_tokens=4,
                                       messages=[{"role": "assistant", "content": "Hello"}])  # fmt: skip


def image_url(name: str) -> str:
    return data_url(render(next(p for p in PICTURES if p.name == name)))


def blank_image_url() -> str:
    out = io.BytesIO()
    Image.new("RGB", (640, 480), "#dde6ee").save(out, "PNG")
    return data_url(out.getvalue())


async def ask_with_image(ws, text: str, url: str) -> tuple[dict, dict, list[dict]]:
    """One typed turn with an image: (the item as echoed, response.timeline, every event)."""
    content = [{"type": "input_text", "text": text}, {"type": "input_image", "image_url": url}]
    await ws.send(json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": content}}))
    await ws.send(json.dumps({"type": "response.create", "response": {"output_modalities": ["text"], "max_output_tokens": 6}}))
    events = []
    while (event := json.loads(await ws.recv()))["type"] != "response.timeline":
        assert event["type"] != "error", event
        events.append(event)
    return first_raw(events, "conversation.item.added")["item"], event["timeline"], events


def first_raw(events: list[dict], kind: str) -> dict:
    return next(e for e in events if e["type"] == kind)


async def test_a_typed_question_about_an_image_reads_it_once_and_times_it(server) -> None:
    async with ws_connect(raw_url(server), max_size=None) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        url = image_url("account-locked")
        item, timeline, _ = await ask_with_image(ws, "My account is locked, what now?", url)
        assert item["content"] == [{"type": "input_text", "text": "My account is locked, what now?"},
                                   {"type": "input_image", "image_url": None, "detail": None}]  # fmt: skip
        stages = list(timeline["instants_ms"])
        assert stages.index("asr_final") < stages.index("image_read") < stages.index("llm_first_token"), stages
        assert timeline["images"] == 1 and timeline["image_read_ms"] > 0
        session = next(s for s in server.sessions if s.pipeline.last_item_id)
        question = session.pipeline.conversation.turns[-1].question
        assert "Your account has been locked" in question and question.endswith("My account is locked, what now?")
        # The same picture again: read from the cache, no reader time.
        _, timeline, _ = await ask_with_image(ws, "And how many attempts lock it?", url)
        assert timeline["images"] == 1 and timeline["image_read_ms"] == 0
        assert metric(server, "assistant_images_total", outcome="cached") >= 1
        assert metric(server, "assistant_turn_stage_seconds_count", stage="image_read") >= 2
        # A picture without text gets the fixed answer, not the model's.
        _, _, events = await ask_with_image(ws, "What does this say?", blank_image_url())
        assert first_raw(events, "response.output_text.done")["text"] == NO_TEXT


async def test_a_question_with_a_picture_skips_the_refusal_gate(server, monkeypatch) -> None:
    """The gate judges a question by the handbook's words; a picture's text is the user's own, so
    with a picture even a question the gate refuses as text goes to the model."""
    monkeypatch.setattr(server.answerer.config.refusal, "enabled", True)
    question = "What is the dress code at the office?"  # refused as text (test_a_refused_question_is_spoken_as_an_answer)
    async with ws_connect(raw_url(server), max_size=None) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        _, timeline, events = await ask_with_image(ws, question, image_url("account-locked"))
        assert first_raw(events, "response.output_text.done")["text"] != "The handbook does not say."
        assert timeline["breakdown_ms"]["llm_prefill"] > 0  # the model was asked


@pytest.mark.parametrize("content, code", [
    ([{"type": "input_image", "image_url": "https://example.com/receipt.png"}], "remote_image_url"),
    ([{"type": "input_image", "image_url": "data:image/png;base64," + base64.b64encode(b"not a png").decode()}], "invalid_image"),
    ([{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}] * (MAX_IMAGES + 1), "too_many_images"),
    ([{"type": "input_image", "image_url": 7}], "invalid_value"),
])  # fmt: skip
async def test_bad_images_get_an_error_and_the_session_lives_on(server, content, code) -> None:
    async with ws_connect(raw_url(server), max_size=None) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        await ws.send(json.dumps({"type": "conversation.item.create", "event_id": "evt_img",
                                  "item": {"type": "message", "role": "user", "content": content}}))  # fmt: skip
        error = json.loads(await ws.recv())
        assert error["type"] == "error" and error["error"]["code"] == code, error
        await ws.send(json.dumps({"type": "response.create"}))  # nothing was added: nothing to answer
        assert json.loads(await ws.recv())["error"]["code"] == "no_user_input"


def test_chat_completions_take_image_url_parts(server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)  # type: ignore[attr-defined]

    def chat(*parts: dict):
        content = [{"type": "text", "text": "How long does the lock last?"}, *parts]
        return client.chat.completions.create(model=server.model_name, max_tokens=4, temperature=0,
                                              messages=[{"role": "user", "content": content}])  # fmt: skip

    plain = chat().usage.prompt_tokens
    with_image = chat({"type": "image_url", "image_url": {"url": image_url("account-locked")}}).usage.prompt_tokens
    assert with_image > plain + 20  # the picture's text is in the prompt
    for url, code in (("https://example.com/locked.png", "remote_image_url"), (blank_image_url(), "image_no_text")):
        with pytest.raises(openai.BadRequestError) as info:
            chat({"type": "image_url", "image_url": {"url": url}})
        assert info.value.code == code, info.value


async def test_the_realtime_socket_declines_compression(server) -> None:
    """A client that offers permessage-deflate (websockets does by default) gets none: base64 audio
    barely compresses and zlib would run on the server's event loop."""
    async with ws_connect(raw_url(server)) as conn:
        assert conn.response.status_code == 101 and conn.protocol.extensions == []
        assert "permessage-deflate" not in conn.response.headers.get("Sec-WebSocket-Extensions", "")
        assert json.loads(await conn.recv())["type"] == "session.created"


def test_health_and_the_engine_metrics_are_served_beside_ours(server) -> None:
    assert httpx.get(server.url + "/health").status_code == 200  # type: ignore[attr-defined]
    assert metric(server, "vllm:prefix_cache_hits_total") > 0
    assert metric(server, "assistant_realtime_sessions") == 0
    # the event loop's lag is measured from the first Realtime session on (earlier tests opened some)
    assert metric(server, "assistant_event_loop_lag_seconds_count") > 0
