"""The voice pipeline of one session: audio in -> VAD -> ASR -> LLM -> chunker -> TTS -> audio out.

Per session (:class:`VoicePipeline`): an ASR session (VAD + partials/final), the conversation, at
most one reply in flight, and the :class:`~assistant.outbox.Outbox` that writes its events
(:mod:`assistant.events`) to the client in order. What every session shares (the answerer, the
ASR and TTS workers) is :class:`~assistant.voice_services.VoiceServices`.

This file stays whole (over 500 lines): it is one session's turn-taking state machine. Barge-in,
speculative endpointing and the reply's lifetime all change the same state (the reply in flight,
the pending user text, the item order, the generation counter); split, each part would reach
into the others' private state.

Nothing here blocks the event loop: VAD runs in a worker thread, Whisper in the ASR worker, TTS
in its worker and the engine in its own thread. Stages talk through typed events. Each turn tells the
:class:`~assistant.coscheduler.CoScheduler` what it waits for at its timeline's instants.

Barge-in: speech that starts while a reply is in flight advances the session's generation
counter (the reply's :class:`~speech.cancel.CancelToken` turns cancelled: TTS stops between
pieces, queued audio is dropped), aborts the engine request, cancels the reply's task and sends
``ResponseFinished`` with status "cancelled" at once, ahead of any paced audio.

Early prefill (``VoiceConfig.early_prefill``): each partial transcript prefills the prompt of the
question so far (:func:`~assistant.voice_services.prefill`); the newest partial waits for the
running prefill, and a partial whose final has come is skipped.

Speculative endpointing (``VoiceConfig.endpointing``; by default when the engine runs on the CPU):
at a short pause the ASR session decodes the utterance so far and the answer starts at once, held
(:attr:`Reply.held`: the outbox sends none of its events). The turn is confirmed when the hangover passes, or at once when the
transcript reads as complete (:func:`~speech.turn_completion.is_complete`: the utterance is then
ended there); the final transcript is the pause's decode and the held answer is released. If the
user goes on first, the answer is discarded: engine request aborted, TTS stopped, no event of it
sent (the client never sees its ``response.created``), and the utterance continues as one turn.

Images (:mod:`assistant.image_reading`): a user item's images are read in a worker thread from
the moment the item arrives, so the reading overlaps the user's typing or speaking. The reply
waits for them, marks ``image_read`` and puts their text before the question (the question,
text included, is then the turn in the conversation). If none of them has any text, the answer
is :data:`~assistant.image_reading.NO_TEXT`, spoken or written like any other.

The conversation (:class:`~assistant.conversation.Conversation`) is handed to the answerer, which
trims it to the context budget and adds each finished turn; an interrupted turn keeps what the
user heard of the answer. With ``max_conversation_chars``, adding a typed item first drops the
oldest answered turns to make room; unanswered text beyond the limit is refused.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

from assistant.conversation import Conversation
from assistant.coscheduler import Wait
from assistant.image_reading import NO_TEXT, ImageText, check_count, image_prompt
from assistant.events import (
    Reply, ResponseAudioDelta, ResponseFinished, ResponseStarted, ResponseTextDelta, SessionSettings, TurnDetection,
    TurnError, UserAudioCommitted, UserSpeechStarted, UserSpeechStopped, UserTranscriptDelta, UserTranscriptDone,
    UserTranscriptFailed,
)  # fmt: skip
from assistant.outbox import Outbox
from assistant.timeline import BargeIn, StreamClock, Timeline, TimelineMetrics
from assistant.voice_services import VoiceServices, prefill
from speech.asr.session import AsyncASRSession
from speech.audio import Resampler, to_float32, to_pcm16
from speech.cancel import Generation
from speech.chunker import Chunker
from speech.config import VADConfig
from speech.front_end import FrontEndError
from speech.messages import SpeechEnded, SpeechPaused, SpeechResumed, SpeechStarted, Transcript, TranscriptionFailed
from speech.turn_completion import is_complete

log = logging.getLogger(__name__)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


@dataclass
class _Utterance:
    item_id: str
    prefills_before: int = 0  # the session's early-prefill count when the utterance began
    partial: str = ""
    partials: int = 0
    timeline: Timeline | None = None
    speech_end: float | None = None  # at the pause in progress (speculative endpointing)
    paused_at: float | None = None
    speculation: Reply | None = None  # the held answer started at the pause
    speculative_text: str = ""


class VoicePipeline:
    """One session's pipeline. Create it inside the serving event loop, then ``await start()``.

    ``send`` writes one event to the client (called by the outbox, in order). Methods that a
    client's state does not allow raise :class:`TurnError`; bad audio raises ``AudioFormatError``.
    """

    def __init__(
        self, services: VoiceServices, send: Callable[[object], Awaitable[None]],
        metrics: TimelineMetrics | None = None, session_id: str | None = None, max_conversation_chars: int | None = None,
    ) -> None:  # fmt: skip
        self.services = services
        self.max_conversation_chars = max_conversation_chars
        self.config = services.config
        self.id = session_id or new_id("sess")
        self.settings = SessionSettings(language=services.asr_config.language, turn_detection=TurnDetection(
            silence_duration_ms=self.config.hangover_ms, prefix_padding_ms=round(services.asr_config.pre_roll_s * 1000)))
        self.metrics = metrics
        self.clock = StreamClock()
        self.outbox = Outbox(self._deliver, self.config.output_lead_ms / 1000)
        self.prefills = 0  # early-prefill requests completed
        self._client_send = send
        self._generation = Generation()
        self._item_ids: list[str] = []  # every conversation item, in order (the protocol's view)
        self.conversation = Conversation()  # answered turns (the answerer's view)
        self._pending: list[str] = []  # user text not answered yet
        self._pending_images: list[asyncio.Future[ImageText]] = []  # the unanswered items' images, being read
        self._heard: Timeline | None = None  # voice timeline of the last utterance in _pending, if it is the newest input
        self._utterances: dict[int, _Utterance] = {}
        self._speaking = False
        self._reply: Reply | None = None
        self._asr: AsyncASRSession | None = None
        self._asr_offset_s = 0.0
        self._tasks: set[asyncio.Task[None]] = set()
        self._prefill_task: asyncio.Task[None] | None = None
        self._prefill_next: tuple[int, str] | None = None  # (utterance, partial) waiting for the running prefill
        self._answered_endpoint: float | None = None  # endpoint of the newest voice turn answered (false-endpoint count)
        self._closed = False

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        self._spawn(self.outbox.run())
        self._open_asr()

    async def close(self) -> None:
        """End the session: the reply in flight is cancelled (its engine request aborted)."""
        if self._closed:
            return
        self._closed = True
        self._interrupt("client_cancelled")
        self.services.coscheduler.end_session(self.id)
        if self._asr is not None:
            self._asr.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def active_reply(self) -> Reply | None:
        """The reply being generated or still being sent, if any."""
        return self._reply if self._reply is not None and not self._reply.delivered else None

    # ---- client requests ------------------------------------------------------------------------
    async def configure(self, settings: SessionSettings) -> None:
        """Apply new settings; a change of VAD or language restarts listening (an utterance in
        progress is dropped)."""
        old, self.settings = self.settings, settings
        if (old.turn_detection, old.language) != (settings.turn_detection, settings.language):
            self._open_asr()

    async def feed(self, pcm16: bytes) -> None:
        """Take the next piece of input audio (PCM16 mono at ``VoiceConfig.sample_rate``); bad audio
        raises ``speech.audio.AudioFormatError`` before anything changes."""
        to_float32(pcm16)  # validates
        self.clock.received(len(pcm16) / 2 / self.config.sample_rate, time.perf_counter())
        assert self._asr is not None
        try:
            await asyncio.to_thread(self._asr.feed, pcm16)
        except FrontEndError:
            self._open_asr()  # a new stream, in a restarted process: the utterance in progress is lost
            raise

    def commit(self) -> None:
        """End the utterance in progress now (the client says the turn is over)."""
        assert self._asr is not None
        if self._asr.commit() is None:
            raise TurnError("input_audio_buffer_commit_empty", "there is no speech in the input audio buffer to commit")

    def clear(self) -> None:
        """Forget buffered input audio (an utterance in progress is dropped)."""
        self._open_asr()

    def add_item(self, role: str, text: str, item_id: str | None = None, images: Sequence[bytes] = ()) -> str:
        """Add a typed message to the conversation, and the user's images (encoded, checked by
        :meth:`~assistant.image_reading.ImageReading.check`), whose reading starts now; returns its item id."""
        if role not in ("user", "assistant"):
            raise TurnError("unsupported_value", f"items with role {role!r} are not supported (user, assistant)")
        if images and role != "user":
            raise TurnError("invalid_value", "only user items may hold images")
        check_count(len(self._pending_images) + len(images))
        if item_id is not None and item_id in self._item_ids:
            raise TurnError("item_id_in_use", f"the conversation already has an item {item_id!r}")
        limit = self.max_conversation_chars
        if limit is not None:
            self._trim(limit - len(text))
            if self._chars() + len(text) > limit:
                raise TurnError("conversation_too_large", f"the conversation's unanswered text would exceed {limit} "
                                "characters; ask for a response first")  # fmt: skip
        if role == "assistant":
            if not self._pending:
                raise TurnError("unsupported_value", "an assistant item must answer a user item")
            self.conversation.add("\n".join(self._pending), text)
            self._pending.clear()
            self._pending_images.clear()  # answered by the client's own assistant item
            self._heard = None
        elif text.strip() or images:
            if text.strip():
                self._pending.append(text)
            self._heard = None  # typed after any speech: answering it is a text turn
            self._pending_images += [asyncio.ensure_future(asyncio.to_thread(self.services.images.read, data)) for data in images]
        self._item_ids.append(item_id or new_id("item"))
        return self._item_ids[-1]

    def _chars(self) -> int:
        """The text the conversation holds: answered turns and unanswered user text."""
        return sum(len(t.question) + len(t.answer) for t in self.conversation.turns) + sum(map(len, self._pending))

    def _trim(self, limit: int) -> None:
        """Drop the oldest answered turns until the conversation holds at most ``limit`` characters
        (unanswered text is never dropped)."""
        turns = self.conversation.turns
        excess = self._chars() - limit
        dropped = 0
        while excess > 0 and dropped < len(turns):
            excess -= len(turns[dropped].question) + len(turns[dropped].answer)
            dropped += 1
        self.conversation.drop_oldest(dropped)

    @property
    def last_item_id(self) -> str | None:
        return self._item_ids[-1] if self._item_ids else None

    def create_response(
        self, modalities: tuple[str, ...] | None = None, max_output_tokens: int | None = None,
        metadata: dict[str, str] | None = None,
    ) -> Reply:  # fmt: skip
        """Answer the user's pending message(s) now (a typed turn, or a committed utterance).

        If the newest pending input is a transcribed utterance (push to talk, or server VAD that
        did not answer it), the turn keeps that utterance's voice timeline and records now as
        ``response_requested``: the client's wait after the transcript is that stage's share, not
        the LLM's. Otherwise it is a text turn, its speech stages all now."""
        self._drop_speculation()
        if self.active_reply is not None:
            raise TurnError("conversation_already_has_active_response",
                            f"response {self.active_reply.id} is in progress; cancel it or wait for response.done")
        now = time.perf_counter()
        if self._heard is not None:
            timeline = self._heard
            timeline.mark("response_requested", now)
        else:
            timeline = Timeline("text", self._hangover_ms, early_prefill=self.config.early_prefill)
            for stage in ("speech_end", "endpoint", "asr_final"):
                timeline.mark(stage, now)
        return self._start_reply(timeline, modalities, max_output_tokens, metadata)

    def cancel_response(self, response_id: str | None = None) -> None:
        reply = self.active_reply
        if reply is None or (response_id is not None and response_id != reply.id):
            raise TurnError("response_cancel_not_active", f"no active response{' ' + response_id if response_id else ''} to cancel")
        self._interrupt("client_cancelled")

    # ---- listening ------------------------------------------------------------------------------
    @property
    def _hangover_ms(self) -> int:
        td = self.settings.turn_detection
        return td.silence_duration_ms if td else self.config.hangover_ms

    def _drop_speculation(self) -> None:
        """Discard a held answer (the client asks for something else, or restarts listening)."""
        if self._reply is not None and self._reply.held:
            self._discard(self._reply)

    def _open_asr(self) -> None:
        self._drop_speculation()
        if self._asr is not None:
            self._asr.close()
        td = self.settings.turn_detection or TurnDetection(silence_duration_ms=self.config.hangover_ms)
        pause = self.config.speculative_pause_ms
        speculate = self.config.endpointing == "speculative" and td.create_response and pause < td.silence_duration_ms
        vad = VADConfig(start_ms=self.config.start_ms, hangover_ms=td.silence_duration_ms, silero_threshold=td.threshold,
                        max_utterance_s=self.config.max_utterance_s, pause_ms=pause if speculate else None)
        asr = replace(self.services.asr_config, language=self.settings.language, pre_roll_s=td.prefix_padding_ms / 1000)
        self._asr = AsyncASRSession(self.services.asr, asr, vad, input_rate=self.config.sample_rate)
        self._asr_offset_s = self.clock.position_s
        for dropped in self._utterances.values():
            self.services.coscheduler.waits(self.id, dropped.item_id, None)
        self._utterances.clear()
        self._speaking = False
        self._spawn(self._listen(self._asr))

    async def _listen(self, asr: AsyncASRSession) -> None:
        async for event in asr:
            if asr is not self._asr:
                return
            self.on_speech_event(event)

    def on_speech_event(
        self, event: SpeechStarted | SpeechPaused | SpeechResumed | SpeechEnded | Transcript | TranscriptionFailed
    ) -> None:
        """One event of the session's ASR stage (speech/messages.py)."""
        if isinstance(event, SpeechStarted):
            self._on_speech_started(event)
        elif isinstance(event, SpeechPaused):
            self._on_paused(event)
        elif isinstance(event, SpeechResumed):
            self._on_resumed(event)
        elif isinstance(event, SpeechEnded):
            self._on_speech_ended(event)
        elif isinstance(event, Transcript):
            self._on_transcript(event)
        elif isinstance(event, TranscriptionFailed):
            self._on_failed(event)

    def _on_speech_started(self, event: SpeechStarted) -> None:
        detected = self.clock.at(self._asr_offset_s + event.detected_s)
        item_id = new_id("item")
        self._utterances[event.utterance] = _Utterance(item_id, self.prefills)
        self._speaking = True
        speech_start = self.clock.at(self._asr_offset_s + event.start_s)
        if self._answered_endpoint is not None and speech_start - self._answered_endpoint < self.config.false_endpoint_window_ms / 1000:
            if self.metrics is not None:
                self.metrics.false_endpoint()
        self._answered_endpoint = None
        td = self.settings.turn_detection
        if td is not None and td.interrupt_response and self.active_reply is not None:
            self._interrupt("turn_detected", speech_start=speech_start, detected=detected)
        self.outbox.put(UserSpeechStarted(item_id, round((self._asr_offset_s + event.start_s) * 1000)))

    def _on_speech_ended(self, event: SpeechEnded) -> None:
        now = time.perf_counter()
        self._speaking = False
        utterance = self._utterances.setdefault(event.utterance, _Utterance(new_id("item")))
        timeline = utterance.timeline if utterance.speculation is not None else None
        if timeline is None:
            timeline = self._new_timeline()
            timeline.mark("speech_end", min(self.clock.at(self._asr_offset_s + event.speech_end_s), now))
            timeline.pause = utterance.paused_at
        timeline.mark("endpoint", now)
        self.services.coscheduler.waits(self.id, utterance.item_id, Wait.ASR_FINAL)
        timeline.endpoint_by = timeline.endpoint_by or ("commit" if event.committed else "hangover")
        utterance.timeline = timeline
        previous = self.last_item_id
        self._item_ids.append(utterance.item_id)
        if not event.committed:
            self.outbox.put(UserSpeechStopped(utterance.item_id, round((self._asr_offset_s + event.speech_end_s) * 1000)))
        self.outbox.put(UserAudioCommitted(utterance.item_id, previous))

    def _new_timeline(self) -> Timeline:
        return Timeline("voice", self._hangover_ms, early_prefill=self.config.early_prefill, endpointing=self.config.endpointing)

    def _on_transcript(self, event: Transcript) -> None:
        utterance = self._utterances.get(event.utterance)
        if utterance is None:
            return
        if event.speculative:
            self._speculate(utterance, event)
            return
        if not event.is_final:
            utterance.partials += 1
            delta, utterance.partial = event.text[len(utterance.partial) :], event.text
            if delta:
                self.outbox.put(UserTranscriptDelta(utterance.item_id, delta))
            if self.config.early_prefill:
                self._prefill(event.utterance, event.text)
            return
        timeline = utterance.timeline
        assert timeline is not None
        if timeline.mark("asr_final"):
            timeline.asr_final_breakdown(event.queue_s, event.decode_s, event.decoded_at, time.perf_counter())
        self.services.coscheduler.waits(self.id, utterance.item_id, None)
        timeline.partials, timeline.prefills = utterance.partials, self.prefills - utterance.prefills_before
        self._utterances.pop(event.utterance, None)
        self.outbox.put(UserTranscriptDone(utterance.item_id, event.text, event.audio_end_s))
        speculation = utterance.speculation
        if speculation is not None:
            if speculation is self._reply and event.text == utterance.speculative_text:
                self._pending.clear()  # the held answer's question holds them
                self._pending_images.clear()
                self._release(speculation)
                return
            self._discard(speculation)
        if event.text.strip():
            self._pending.append(event.text)
            self._heard = timeline  # a response.create for it keeps this timeline
        td = self.settings.turn_detection
        if td is None or not td.create_response or self._speaking or self.active_reply is not None:
            return  # an utterance still being spoken will answer for both
        if self._pending:
            self._answered_endpoint = timeline.instants.get("endpoint")
            self._start_reply(timeline, None, None, None)

    def _on_failed(self, event: TranscriptionFailed) -> None:
        utterance = self._utterances.pop(event.utterance, None)
        if utterance is not None:
            self.services.coscheduler.waits(self.id, utterance.item_id, None)
            self.outbox.put(UserTranscriptFailed(utterance.item_id, event.error))

    # ---- speculative endpointing --------------------------------------------------------------------
    def _on_paused(self, event: SpeechPaused) -> None:
        utterance = self._utterances.get(event.utterance)
        if utterance is not None:
            utterance.paused_at = time.perf_counter()
            utterance.speech_end = min(self.clock.at(self._asr_offset_s + event.speech_end_s), utterance.paused_at)

    def _on_resumed(self, event: SpeechResumed) -> None:
        utterance = self._utterances.get(event.utterance)
        if utterance is None:
            return
        utterance.paused_at = None
        if utterance.speculation is not None:
            self._discard(utterance.speculation)
            utterance.speculation = None

    def _speculate(self, utterance: _Utterance, event: Transcript) -> None:
        """The pause's transcript: start the answer, held; end the turn now if it reads complete."""
        td = self.settings.turn_detection
        if (utterance.paused_at is None or utterance.speech_end is None or not event.text.strip() or td is None
                or not td.create_response or self.active_reply is not None):  # fmt: skip
            return
        timeline = self._new_timeline()
        timeline.mark("speech_end", utterance.speech_end)
        timeline.pause = utterance.paused_at
        timeline.mark("asr_final")
        timeline.asr_final_breakdown(event.queue_s, event.decode_s, event.decoded_at, time.perf_counter())
        utterance.timeline, utterance.speculative_text = timeline, event.text
        utterance.speculation = self._start_reply(timeline, None, None, None, speculative_text=event.text)
        if self.metrics is not None:
            self.metrics.speculation("started")
        if is_complete(event.text, event.language):
            timeline.endpoint_by = "completion"
            assert self._asr is not None
            self._asr.end_turn()  # its SpeechEnded and final (this decode) follow through _listen

    def _release(self, reply: Reply) -> None:
        """The turn is confirmed: the held answer goes out (what it generated so far first)."""
        reply.held = False
        self._item_ids.append(reply.item_id)
        self._heard = None
        self._answered_endpoint = reply.timeline.instants.get("endpoint")
        if self.metrics is not None:
            self.metrics.speculation("confirmed")
        self.outbox.flush()

    def _discard(self, reply: Reply) -> None:
        """The user went on: stop the held answer everywhere; none of its events is ever sent."""
        if reply.discarded:
            return
        reply.discarded = True
        if reply is self._reply:
            self._generation.advance()
            self._reply = None
        reply.token.cancel()
        self.services.answerer.engine.abort(reply.request_id)
        if reply.task is not None and not reply.task.done():
            reply.task.cancel()
        if reply.recorded:  # it finished: the answerer added the turn
            self.conversation.turns.pop()
            reply.recorded = False
        self.outbox.flush()
        if self.metrics is not None:
            self.metrics.speculation("cancelled")

    # ---- early prefill ---------------------------------------------------------------------------
    def _prefill(self, utterance: int, text: str) -> None:
        """Prefill the prompt for the partial ``text`` (the newest one waits for the running one;
        none starts without the co-scheduler's spare capacity)."""
        if self._prefill_task is not None and not self._prefill_task.done():
            self._prefill_next = (utterance, text)
            return
        self._prefill_task = self._spawn(self._run_prefill((utterance, text)))

    async def _run_prefill(self, partial: tuple[int, str] | None) -> None:
        while partial is not None:
            utterance, text = partial
            # A partial whose final has come meanwhile is not prefilled: the final's own request
            # computes that prompt (and the stale one would compete with it at the same priority).
            if utterance in self._utterances and self.services.coscheduler.spare_capacity():
                question = "\n".join([*self._pending, text])
                await prefill(self.services.answerer, question, self.conversation.messages(), f"{self.id}-prefill-{self.prefills}")
                self.prefills += 1
            partial, self._prefill_next = self._prefill_next, None

    # ---- answering ---------------------------------------------------------------------------------
    def _start_reply(
        self, timeline: Timeline, modalities: tuple[str, ...] | None, max_output_tokens: int | None,
        metadata: dict[str, str] | None, speculative_text: str | None = None,
    ) -> Reply:  # fmt: skip
        """Answer the pending text; or, held, the pending text and ``speculative_text`` (the
        utterance at a pause: the pending text stays until the turn is confirmed)."""
        images = list(self._pending_images)
        if speculative_text is not None:
            question = "\n".join([*self._pending, speculative_text])
        elif not self._pending and not images:
            raise TurnError("no_user_input", "there is no user message to answer; add one with conversation.item.create")
        else:
            question = "\n".join(self._pending)
            self._pending.clear()
            self._pending_images.clear()
            self._heard = None
        rid = new_id("resp")
        reply = Reply(
            rid, new_id("item"), f"{self.id}-{rid}", question, self._generation.advance(), timeline,
            modalities or self.settings.output_modalities, max_output_tokens or self.settings.max_output_tokens, metadata,
            held=speculative_text is not None, images=images,
        )  # fmt: skip
        self._reply = reply
        self.services.coscheduler.waits(self.id, reply.id, Wait.FIRST_TOKEN)
        if not reply.held:
            self._item_ids.append(reply.item_id)
        self.outbox.put(ResponseStarted(reply))
        reply.task = self._spawn(self._run_reply(reply))
        return reply

    async def _run_reply(self, reply: Reply) -> None:
        speaker = asyncio.create_task(self._speak(reply)) if reply.audio else None
        chunker = Chunker()
        finish_reason: str | None = None
        pictured = bool(reply.images)  # a turn with a picture skips the refusal gate (its text is the user's own)
        try:
            if pictured and not await self._read_images(reply):  # reading empties reply.images
                self._say(reply, NO_TEXT, chunker)
                return await self._end_reply(reply, speaker, chunker, "stop")
            asked_at = time.perf_counter()
            answer = self.services.answerer.answer(
                reply.question, self.conversation, priority=self.services.coscheduler.turn_priority,
                request_id=reply.request_id, max_tokens=reply.max_output_tokens, gate=not pictured,
            )  # fmt: skip
            try:
                async for delta in answer:
                    if reply.timeline.mark("llm_first_token"):
                        self.services.coscheduler.waits(self.id, reply.id, Wait.FIRST_AUDIO if reply.audio else None)
                        if (m := delta.metrics) is not None:
                            reply.timeline.first_token_breakdown(m.arrival_time, m.first_scheduled_time, m.first_token_time,
                                                                 reply.timeline.instants["llm_first_token"], asked_at)  # fmt: skip
                    reply.prompt_tokens, reply.cached_tokens = delta.prompt_tokens, delta.cached_tokens
                    reply.output_tokens = delta.generated_tokens
                    if delta.text:
                        reply.text += delta.text
                        self.outbox.put(ResponseTextDelta(reply, delta.text))
                        for piece in chunker.push(delta.text):
                            reply.pieces.put_nowait(piece)
                    if delta.finished:
                        finish_reason = delta.finish_reason
                        reply.recorded = finish_reason != "abort"
                        if delta.citation is not None:
                            reply.citation = {"path": delta.citation.path, "heading": delta.citation.heading}
                        break
            finally:
                await answer.aclose()
            await self._end_reply(reply, speaker, chunker, finish_reason)
            return
        except asyncio.CancelledError:
            if speaker is not None:
                speaker.cancel()
            raise
        except Exception as exc:  # a failed reply is reported; the session goes on
            log.exception("reply %s failed", reply.id)
            if speaker is not None:
                speaker.cancel()
            reply.token.cancel()
            reply.status, reply.error = "failed", f"{type(exc).__name__}: {exc}"
        self._finish(reply)

    async def _end_reply(self, reply: Reply, speaker: asyncio.Task[None] | None, chunker: Chunker,
                         finish_reason: str | None) -> None:  # fmt: skip
        """The answer's text is all out: flush the chunker, wait for the voice, set the status, finish."""
        for piece in chunker.flush():
            reply.pieces.put_nowait(piece)
        reply.pieces.put_nowait(None)
        if speaker is not None:
            await speaker
        reply.status, reply.reason = {
            "stop": ("completed", None), "length": ("incomplete", "max_output_tokens"),
        }.get(finish_reason or "", ("failed", None))  # fmt: skip
        if reply.status == "failed":
            reply.error = f"the engine ended the answer with finish_reason={finish_reason!r}"
        self._finish(reply)

    async def _read_images(self, reply: Reply) -> bool:
        """Wait for the turn's images, mark ``image_read`` and put their text before the question;
        False if none of them has any text."""
        texts = await asyncio.gather(*reply.images)
        reply.timeline.mark("image_read")
        reply.timeline.images = len(texts)
        reply.timeline.image_read_ms = round(sum(t.read_ms for t in texts), 3)
        reply.images = []
        if not any(t.lines for t in texts):
            return False
        reply.question = image_prompt(texts, reply.question)
        return True

    def _say(self, reply: Reply, text: str, chunker: Chunker) -> None:
        """A fixed answer (not the model's): sent and spoken as the model's would be."""
        if reply.timeline.mark("llm_first_token"):
            self.services.coscheduler.waits(self.id, reply.id, Wait.FIRST_AUDIO if reply.audio else None)
        reply.text += text
        self.outbox.put(ResponseTextDelta(reply, text))
        for piece in chunker.push(text):
            reply.pieces.put_nowait(piece)

    async def _speak(self, reply: Reply) -> None:
        """Chunker pieces -> TTS -> PCM16 slices of ``output_chunk_ms`` into the outbox."""
        tts = self.services.tts
        rate = self.config.sample_rate
        resampler = Resampler(tts.sample_rate, rate)
        slice_len = rate * self.config.output_chunk_ms // 1000
        first = True
        while (piece := await reply.pieces.get()) is not None:
            if not any(ch.isalnum() for ch in piece):
                continue
            reply.timeline.mark("first_chunk")
            async for chunk, ready_at in tts.stream(piece, reply.token, first):
                if reply.timeline.mark("tts_first_audio", ready_at):
                    self.services.coscheduler.waits(self.id, reply.id, None)
                pcm = to_pcm16(resampler.process(chunk.pcm))
                for start in range(0, len(pcm), slice_len):
                    part = pcm[start : start + slice_len]
                    self.outbox.put(ResponseAudioDelta(reply, part.astype("<i2").tobytes(), len(part) / rate))
            first = False

    def _finish(self, reply: Reply) -> None:
        """Queue the reply's end (once); a cancelled answer stays in the conversation as far as it
        was heard (not at all if nothing was: its question is then answered with the next one)."""
        self.services.coscheduler.waits(self.id, reply.id, None)
        if reply.status == "cancelled":
            content = None
            if reply.recorded:
                content = self.conversation.turns.pop().content  # the whole answer was added; only part of it was heard
                reply.recorded = False
            if reply.sent_text:
                self.conversation.add(reply.question, reply.sent_text, content)
            else:
                self._pending.insert(0, reply.question)
                self._pending_images[:0] = reply.images  # not read into the question yet
        if reply.finish_queued:
            return
        reply.finish_queued = True
        reply.timeline.prompt_tokens, reply.timeline.cached_tokens = reply.prompt_tokens, reply.cached_tokens
        self.outbox.put(ResponseFinished(reply))

    def _interrupt(self, reason: str, speech_start: float | None = None, detected: float | None = None) -> None:
        """Barge-in or cancel: stop the reply in flight everywhere at once."""
        reply = self.active_reply
        if reply is None:
            return
        if reply.held:  # a speculation the client does not know of: drop it unseen
            self._discard(reply)
            return
        self._generation.advance()  # the reply's token is cancelled: TTS stops, queued audio is stale
        self.services.answerer.engine.abort(reply.request_id)
        if reply.task is not None and not reply.task.done():
            reply.task.cancel()
        self.outbox.flush()
        if reply.status in ("in_progress", "completed", "incomplete"):
            reply.status, reply.reason = "cancelled", reason
        if speech_start is not None and detected is not None:
            reply.timeline.barge_in = BargeIn(speech_start, detected, time.perf_counter())
        self._reply = None
        self._finish(reply)

    # ---- audio out ------------------------------------------------------------------------------
    async def _deliver(self, event: object) -> None:
        """Write one event, then account for it (pacing, first audio, the reply's end)."""
        if isinstance(event, ResponseTextDelta):
            event.reply.sent_text += event.delta
        await self._client_send(event)
        if isinstance(event, ResponseAudioDelta):
            reply = event.reply
            if reply.play_start is None:
                reply.play_start = time.perf_counter()
                reply.timeline.mark("first_audio_sent", reply.play_start)
            reply.audio_sent_s += event.duration_s
        elif isinstance(event, ResponseFinished):
            event.reply.delivered = True
            if self.metrics is not None:
                self.metrics.observe(event.reply.timeline, event.reply.status)
            self._answer_waiting_turn()

    def _answer_waiting_turn(self) -> None:
        """A voice turn that ended while the last reply was in flight (audio sent faster than real
        time: both utterances ended before the first answer began) is answered now, as its own turn."""
        td = self.settings.turn_detection
        if self._heard is None or not self._pending or td is None or not td.create_response or self._speaking or self.active_reply is not None:
            return
        self._answered_endpoint = self._heard.instants.get("endpoint")
        self._start_reply(self._heard, None, None, None)

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("session %s: task failed", self.id, exc_info=task.exception())


__all__ = ["VoicePipeline", "new_id"]
