"""The voice pipeline without a socket: real Whisper, engine and voice; events collected as sent."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from assistant.answerer import Answerer
from assistant.config import HANDBOOK_DIR, AssistantConfig, RefusalConfig, VoiceConfig
from assistant.coscheduler import CoScheduler, UrgentCounts, Wait
from assistant.events import (
    Reply, ResponseAudioDelta, ResponseFinished, ResponseStarted, ResponseTextDelta, SessionSettings, TurnDetection,
    UserSpeechStarted, UserTranscriptDelta, UserTranscriptDone,
)  # fmt: skip
from assistant.outbox import Outbox
from assistant.pipeline import VoicePipeline
from assistant.timeline import Timeline
from assistant.voice_services import VoiceServices
from speech.asr.backend import ASRBackend
from speech.asr.worker import ASRJob, ASRWorker
from speech.messages import SpeechEnded, SpeechStarted, Transcript
from speech.cancel import CancelToken, Generation
from speech.config import TTSConfig
from speech.tts import load_tts
from speech.tts.worker import TTSWorker

RATE = 24000
# Long questions (about 35 tokens, so the partial transcripts cover at least one more whole KV
# block than the documents do), neither asked elsewhere here. One sentence each: spoken without a
# pause, each is one utterance (two sentences would be two, the first answered on its own).
LONG_A = "How quickly must I report a stolen laptop to the security team and which form do I need to fill in for it when I am travelling abroad?"
LONG_B = "How many unused annual leave days can I carry over into next year if I only started working here last month and have not taken any holiday yet?"
SHORT = "How do I apply for annual leave?"


@pytest.fixture(scope="module")
def voice():
    return load_tts(TTSConfig(backend="hibari", seed=0))


def spoken(voice, text: str, tail_s: float = 1.0) -> bytes:
    """``text`` spoken at 24 kHz after 0.3 s of silence, then ``tail_s`` of silence, as PCM16."""
    audio = np.concatenate([np.zeros(round(0.3 * RATE), np.float32), voice.synthesize(text).pcm, np.zeros(round(tail_s * RATE), np.float32)])
    return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()


@pytest.fixture(scope="module")
def services(tmp_path_factory, whisper_tiny_path):
    docs = tmp_path_factory.mktemp("handbook")
    for name in ("01-annual-leave.md", "06-information-security.md"):
        shutil.copy(HANDBOOK_DIR / "en" / name, docs / name)
    # one TTS worker: the first-piece test below watches one queue's order (the pool's own tests
    # are in tests/speech/test_tts_worker.py); fixed endpointing: a turn ends at the hangover
    # (the CPU's default, speculative, is tested in test_speculative_endpoint.py)
    config = VoiceConfig(asr_model=whisper_tiny_path, partial_interval_s=0.4, tts_workers=1, endpointing="fixed")
    coscheduler = CoScheduler.from_config(config)
    # LONG_A asks about documents this folder lacks: the model answers it all the same (the refusal gate is off)
    answerer = Answerer.create(AssistantConfig(docs_dir=docs, language="en", max_tokens=24, refusal=RefusalConfig(enabled=False)),
                               step_bound=coscheduler.step_bound)  # fmt: skip
    shared = VoiceServices.load(answerer, config, coscheduler)
    shared.warm_up()
    yield shared
    shared.close()
    answerer.shutdown()


class Client:
    """A pipeline and everything it sends, stamped with the time it was sent."""

    def __init__(self, services: VoiceServices) -> None:
        self.events: list[tuple[float, object]] = []
        self.arrived = asyncio.Event()
        self.pipeline = VoicePipeline(services, self.send)

    async def send(self, event: object) -> None:
        self.events.append((time.perf_counter(), event))
        self.arrived.set()

    async def speak(self, pcm: bytes, chunk_ms: int = 40) -> float:
        """Feed ``pcm`` at real-time pace; returns when the first sample was fed."""
        step = RATE * chunk_ms // 1000 * 2
        start = time.perf_counter()
        for k, i in enumerate(range(0, len(pcm), step)):
            await self.pipeline.feed(pcm[i : i + step])
            await asyncio.sleep(max(0.0, start + (k + 1) * chunk_ms / 1000 - time.perf_counter()))
        return start

    async def wait_for(self, kind: type, timeout: float = 60.0) -> object:
        async with asyncio.timeout(timeout):
            while True:
                for _, event in self.events:
                    if isinstance(event, kind):
                        return event
                self.arrived.clear()
                await self.arrived.wait()

    def of(self, kind: type) -> list:
        return [e for _, e in self.events if isinstance(e, kind)]

    async def speak_settled(self, pcm: bytes, asr: SettlingASR, chunk_ms: int = 40) -> None:
        """Feed ``pcm`` a chunk at a time, each once the pipeline is done with the audio before it:
        its decodes handled and, with early prefill, a prefill done for each partial transcript.

        Partials then come at fixed points of the audio (every ``partial_interval_s`` of it) and
        the final after the last partial's prefill, however fast or loaded the machine is."""
        step = RATE * chunk_ms // 1000 * 2
        for i in range(0, len(pcm), step):
            await self.pipeline.feed(pcm[i : i + step])
            try:
                async with asyncio.timeout(60):  # a guard: each wait is for one decode or one short prefill
                    await asr.settled()
                    await self.pipeline.outbox.sync()  # the partials' deltas have been sent
                    while self.pipeline.config.early_prefill and self.pipeline.prefills < len(self.of(UserTranscriptDelta)):
                        await asyncio.sleep(0.01)
            except TimeoutError:
                raise AssertionError(f"the pipeline did not settle: {self.pipeline.prefills} early prefills done "
                                     f"for {len(self.of(UserTranscriptDelta))} partial transcripts") from None


class SettlingASR(ASRWorker):
    """The real ASR worker (over the shared, loaded Whisper) that a test can wait on: ``settled()``
    returns once every job submitted so far has been decoded and its transcript (if any) handled
    by the pipeline. For one session fed only after it settles (so no job is ever superseded)."""

    def __init__(self, backend: ASRBackend) -> None:
        super().__init__(backend)
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._unsettled = 0
        self._idle = asyncio.Event()

    def submit(self, job: ASRJob) -> bool:
        on_done = job.on_done

        def done(*result: object) -> None:
            try:
                on_done(*result)  # the session puts its event on the loop...
            finally:
                self._loop.call_soon_threadsafe(self._settle)  # ...ahead of this, so the pipeline has it first

        with self._lock:
            self._unsettled += 1
        job.on_done = done
        if not super().submit(job):
            self._loop.call_soon_threadsafe(self._settle)
            return False
        return True

    def _settle(self) -> None:
        with self._lock:
            self._unsettled -= 1
            if not self._unsettled:
                self._idle.set()

    async def settled(self) -> None:
        while True:
            with self._lock:
                if not self._unsettled:
                    return
                self._idle.clear()
            await self._idle.wait()


def cached_by(answerer: Answerer, question: str, earlier: str) -> int:
    """Prompt tokens of ``question`` found in the prefix cache if ``earlier``'s prompt (only) was
    computed: its whole blocks shared with ``question``'s, never the last token."""
    block = answerer.engine.core.config.block_size
    a, b = answerer.prompt_ids(question, []), answerer.prompt_ids(earlier, [])
    shared = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return min(shared, len(a) - 1) // block * block


# ---- early prefill -------------------------------------------------------------------------------------
def partial(utterance: int, text: str) -> Transcript:
    return Transcript(utterance, text, False, "en", 1.0, 0.0, 0.0)


async def prefills_settled(pipeline: VoicePipeline) -> None:
    """Wait for the running early prefill and any it left waiting."""
    while pipeline._prefill_task is not None and not pipeline._prefill_task.done():
        await pipeline._prefill_task


async def test_early_prefill_puts_the_spoken_question_in_the_prefix_cache(services, voice) -> None:
    """Real speech, Whisper and engine; the audio is fed as the pipeline settles (not at real-time
    pace), so what was heard and prefilled before the final does not depend on the machine's load."""
    cached = {}
    for early, question in ((False, LONG_A), (True, LONG_B)):
        asr = SettlingASR(services.asr.backend)
        client = Client(replace(services, asr=asr, config=replace(services.config, early_prefill=early)))
        try:
            await client.pipeline.start()
            await client.speak_settled(spoken(voice, question), asr)
            reply = (await client.wait_for(ResponseTextDelta)).reply  # the answer's first token: its usage is known
            (final,) = client.of(UserTranscriptDone)  # one utterance, answered once it was final
            assert final.transcript.lower().startswith(question.lower()[:12]) and reply.question == final.transcript
            partial = "".join(e.delta for e in client.of(UserTranscriptDelta))  # the last partial transcript
            timeline = reply.timeline
            assert timeline.early_prefill is early and timeline.partials >= 2
            assert timeline.prefills == (timeline.partials if early else 0)
            assert reply.prompt_tokens == len(services.answerer.prompt_ids(final.transcript, []))
            if early:  # the final found exactly what the last partial's prefill computed
                assert reply.cached_tokens == cached_by(services.answerer, final.transcript, partial), partial
            cached[early] = reply.cached_tokens
        finally:
            await client.pipeline.close()
            asr.close()
    # the final's prompt found at least one more block of the question already computed
    assert cached[True] >= cached[False] + 16, cached


async def test_speech_end_is_put_on_the_process_clock_where_the_speaker_stopped(services, voice) -> None:
    client = Client(services)
    await client.pipeline.start()
    audio = voice.synthesize(SHORT).pcm
    loud = np.nonzero(np.abs(audio) > 0.01 * np.abs(audio).max())[0]
    true_end_s = 0.3 + (loud[-1] + 1) / RATE
    start = await client.speak(spoken(voice, SHORT))
    timeline = (await client.wait_for(ResponseStarted)).reply.timeline
    speech_end = timeline.instants["speech_end"]
    assert abs(speech_end - (start + true_end_s)) < 0.1
    assert timeline.instants["endpoint"] - speech_end == pytest.approx(0.5, abs=0.1)  # the hangover
    await client.pipeline.close()


async def test_a_partial_overtaken_by_its_final_is_not_prefilled(services) -> None:
    """The ASR stage's events for one utterance, in the order a loaded machine gives them: two
    partials, the second waiting for the first's prefill, then the final before either prefill
    has started. Neither runs: the final's request computes that prompt itself. Partials of an
    utterance still being spoken are all prefilled (the first phase)."""
    client = Client(replace(services, config=replace(services.config, early_prefill=True)))
    pipeline = client.pipeline
    await pipeline.start()
    try:
        await pipeline.feed(bytes(RATE * 2 * 3))  # 3 s of silence: the stream times below have happened
        pipeline.on_speech_event(SpeechStarted(1, 0.0, 0.1))
        pipeline.on_speech_event(partial(1, "How many unused"))
        pipeline.on_speech_event(partial(1, "How many unused annual leave days"))  # waits for the first
        await prefills_settled(pipeline)
        assert pipeline.prefills == 2  # still being spoken: both prefilled
        pipeline.on_speech_event(partial(1, "How many unused annual leave days can I"))
        pipeline.on_speech_event(partial(1, "How many unused annual leave days can I carry"))  # waits
        pipeline.on_speech_event(SpeechEnded(1, 0.0, 2.0, 2.5))
        pipeline.on_speech_event(Transcript(1, "How many unused annual leave days can I carry over?", True, "en", 2.0, 0.0, 0.0))
        await prefills_settled(pipeline)
        assert pipeline.prefills == 2
        reply = (await client.wait_for(ResponseTextDelta)).reply
        assert reply.question == "How many unused annual leave days can I carry over?" and reply.timeline.prefills == 2
    finally:
        await pipeline.close()


# ---- the co-scheduler ---------------------------------------------------------------------------------------
class RecordingCoScheduler(CoScheduler):
    """The real co-scheduler, keeping what the pipeline told it in order."""

    def __init__(self) -> None:
        super().__init__()
        self.told: list[tuple[str, Wait | None]] = []

    def waits(self, session: str, turn: str, stage: Wait | None) -> None:
        self.told.append((turn, stage))
        super().waits(session, turn, stage)


async def test_a_spoken_turn_tells_the_coscheduler_what_it_waits_for(services, voice) -> None:
    co = RecordingCoScheduler()
    client = Client(replace(services, coscheduler=co))
    await client.pipeline.start()
    await client.pipeline.configure(replace(client.pipeline.settings, max_output_tokens=6))  # little audio to play out
    try:
        await client.speak(spoken(voice, SHORT))
        reply = (await client.wait_for(ResponseFinished)).reply
        (final,) = client.of(UserTranscriptDone)
        assert reply.status in ("completed", "incomplete") and reply.audio_sent_s > 0
        assert co.told[:5] == [(final.item_id, Wait.ASR_FINAL), (final.item_id, None), (reply.id, Wait.FIRST_TOKEN),
                               (reply.id, Wait.FIRST_AUDIO), (reply.id, None)], co.told  # fmt: skip
        assert co.snapshot() == UrgentCounts()
    finally:
        await client.pipeline.close()


@pytest.mark.parametrize("enabled", [True, False], ids=["on", "off"])
async def test_early_prefill_waits_for_spare_capacity_when_on(services, enabled: bool) -> None:
    co = CoScheduler(enabled)
    client = Client(replace(services, coscheduler=co, config=replace(services.config, early_prefill=True)))
    pipeline = client.pipeline
    await pipeline.start()
    try:
        await pipeline.feed(bytes(RATE * 2 * 3))  # 3 s of silence: the stream times below have happened
        co.waits("another-session", "resp_x", Wait.FIRST_TOKEN)  # another caller's turn waits for its first token
        pipeline.on_speech_event(SpeechStarted(1, 0.0, 0.1))
        pipeline.on_speech_event(partial(1, "How many unused"))
        await prefills_settled(pipeline)
        assert pipeline.prefills == (0 if enabled else 1)
        co.waits("another-session", "resp_x", None)  # its first token is out
        pipeline.on_speech_event(partial(1, "How many unused annual leave days"))
        await prefills_settled(pipeline)
        assert pipeline.prefills == (1 if enabled else 2)
    finally:
        await pipeline.close()


# ---- turn-taking and barge-in ----------------------------------------------------------------------------
async def test_without_turn_detection_nothing_is_answered_until_asked(services, voice) -> None:
    client = Client(services)
    await client.pipeline.start()
    await client.pipeline.configure(SessionSettings(turn_detection=None))
    await client.speak(spoken(voice, SHORT))
    transcript = (await client.wait_for(UserTranscriptDone)).transcript
    await asyncio.sleep(0.5)
    assert not client.of(ResponseStarted)
    reply = client.pipeline.create_response(("text",))
    assert reply.question == transcript
    done = await client.wait_for(ResponseFinished)
    timeline = done.reply.timeline
    assert done.reply.status in ("completed", "incomplete") and timeline.source == "voice"  # a spoken turn, asked for
    assert list(timeline.instants) == ["speech_end", "endpoint", "asr_final", "response_requested", "llm_first_token"]
    assert timeline.shares_ms()["response_requested"] >= 500  # the half second we waited is not the LLM's
    assert not client.of(ResponseAudioDelta)
    await client.pipeline.close()


async def test_barge_in_after_the_text_is_done_still_stops_the_audio(services, voice) -> None:
    """The answer is generated long before its audio has been played: speech then cancels the rest,
    and the conversation keeps only what the user heard."""
    client = Client(services)
    await client.pipeline.start()
    client.pipeline.add_item("user", "What is the policy on annual leave?")
    reply = client.pipeline.create_response()
    await client.wait_for(ResponseAudioDelta)
    while reply.task is not None and not reply.task.done():  # generation and synthesis are over...
        await asyncio.sleep(0.05)
    await client.speak(spoken(voice, SHORT)[: 2 * RATE])  # ...while audio is still going out
    done = await client.wait_for(ResponseFinished)
    assert done.reply is reply and reply.status == "cancelled" and reply.reason == "turn_detected"
    assert 0 < len(reply.sent_text) < len(reply.text)
    assert client.pipeline.conversation.turns[-1].answer == reply.sent_text
    stopped = next(t for t, e in client.events if isinstance(e, ResponseFinished))
    assert not [e for t, e in client.events if isinstance(e, ResponseAudioDelta) and t > stopped]
    assert reply.timeline.barge_in is not None
    await client.pipeline.close()


async def test_speech_does_not_interrupt_when_interrupt_response_is_off(services, voice) -> None:
    client = Client(services)
    await client.pipeline.start()
    await client.pipeline.configure(SessionSettings(turn_detection=TurnDetection(interrupt_response=False), max_output_tokens=8))
    client.pipeline.add_item("user", "What is the policy on annual leave?")
    reply = client.pipeline.create_response()
    await client.wait_for(ResponseAudioDelta)
    await client.speak(spoken(voice, SHORT)[: 2 * RATE])
    await client.wait_for(UserSpeechStarted)
    done = await client.wait_for(ResponseFinished)
    assert done.reply is reply and reply.status == "incomplete" and reply.reason == "max_output_tokens"
    assert reply.timeline.barge_in is None and reply.sent_text == reply.text
    await client.pipeline.close()


# ---- audio out ----------------------------------------------------------------------------------------------
def reply_for_test(generation: Generation) -> Reply:
    return Reply("resp_t", "item_t", "req_t", "q", generation.advance(), Timeline(), ("audio",), None)


async def test_outbox_paces_audio_lets_control_events_through_and_drops_cancelled_audio() -> None:
    sent: list[tuple[float, object]] = []

    async def send(event: object) -> None:
        sent.append((time.perf_counter(), event))
        if isinstance(event, ResponseAudioDelta):  # what the pipeline does after sending audio
            event.reply.play_start = event.reply.play_start or time.perf_counter()
            event.reply.audio_sent_s += event.duration_s

    outbox = Outbox(send, lead_s=0.2)
    writer = asyncio.create_task(outbox.run())
    generation = Generation()
    reply = reply_for_test(generation)
    start = time.perf_counter()
    for _ in range(10):
        outbox.put(ResponseAudioDelta(reply, bytes(4800), 0.1))
    await asyncio.sleep(0.35)
    outbox.put({"type": "error"})  # a control event does not wait behind the paced audio
    await asyncio.sleep(0.01)
    assert sent[-1][1] == {"type": "error"}
    generation.advance()  # barge-in: the reply's token is cancelled
    outbox.put(ResponseFinished(reply))
    outbox.flush()
    await outbox.sync()
    await asyncio.sleep(0.05)
    writer.cancel()
    audio = [(t, e) for t, e in sent if isinstance(e, ResponseAudioDelta)]
    for k, (t, _) in enumerate(audio):  # never more than lead_s ahead of real time
        assert t >= start + 0.1 * k - 0.2 - 0.02
    assert 3 <= len(audio) < 10  # about 0.35 s + 0.2 s lead worth, the rest dropped
    assert isinstance(sent[-1][1], ResponseFinished)


async def test_tts_worker_puts_first_pieces_first_and_stops_when_cancelled(services) -> None:
    tts: TTSWorker = services.tts
    long_text = " ".join(f"This is sentence number {i} of a long answer." for i in range(12))
    arrivals: list[tuple[str, float]] = []

    async def consume(name: str, text: str, token: CancelToken, first: bool) -> int:
        n = 0
        async for _chunk, ready in tts.stream(text, token, first):
            arrivals.append((name, ready))
            n += 1
        return n

    cancel = CancelToken()
    later = asyncio.create_task(consume("later", long_text, CancelToken(), False))
    queued_later = asyncio.create_task(consume("queued-later", "Later pieces wait for first ones.", CancelToken(), False))
    await asyncio.sleep(0.01)
    urgent = asyncio.create_task(consume("first", "A first piece goes ahead.", CancelToken(), True))
    cancelled = asyncio.create_task(consume("cancelled", long_text, cancel, False))
    await urgent
    cancel.cancel()
    assert await later == 12 and await cancelled <= 1 and await queued_later >= 1
    order = [name for name, _ in arrivals]
    assert order.index("first") < order.index("queued-later")
