"""One user's stream through VAD and the shared ASR worker: partials while speaking, a final per utterance.

``ASRSession`` is the thread-based session; ``AsyncASRSession`` the same for asyncio code.
While the user speaks, the growing utterance is re-decoded every ``partial_interval_s`` and only
its stable prefix (:class:`~speech.asr.stable_prefix.StablePrefix`) is emitted, forced as the
decoder prefix of every later decode, so each partial is a prefix of the later ones and of the
final. No partials are decoded while the speaker pauses, so the worker is free when the final comes.

Speculation (``VADConfig.pause_ms``): at a short pause the utterance so far is decoded as a final
would be and delivered as a ``speculative`` transcript, so a caller can start answering before the
hangover. If the speech does not go on, that decode *is* the final (the audio differs only by
trailing silence): the final then comes without a second decode, at once if the speculative one
is done. Speech going on (``SpeechResumed``) drops it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from speech.asr.backend import ASR_SAMPLE_RATE, ASRError, Decoded
from speech.asr.stable_prefix import StablePrefix
from speech.asr.worker import ASRJob, ASRWorker
from speech.audio import check_rate
from speech.config import ASRConfig, ConfigError, VADConfig
from speech.messages import (
    ASREvent, SpeechEnded, SpeechPaused, SpeechResumed, SpeechStarted, Transcript, TranscriptionFailed,
)  # fmt: skip

PARTIAL_MAX_SILENCE_S = 0.15  # no partial decodes once the speaker pauses: nothing new to hear


@dataclass
class _Speculation:
    """The decode of an utterance at its pause, and whether its final is waiting for it."""

    utterance: int
    final: Transcript | None = None
    error: str | None = None
    final_wanted: bool = False


class ASRSession:
    """One user's audio stream through VAD and the shared worker.

    ``feed()`` takes audio at ``input_rate`` from one thread; ``on_event`` receives VAD events on
    that thread and transcripts on the worker thread. Bad audio raises ``AudioFormatError`` before
    any state changes, so the session carries on.
    """

    def __init__(
        self,
        worker: ASRWorker,
        on_event: Callable[[ASREvent], None],
        asr: ASRConfig,
        vad: VADConfig | None = None,
        input_rate: int = ASR_SAMPLE_RATE,
    ) -> None:
        vad = vad or VADConfig()
        if vad.sample_rate != ASR_SAMPLE_RATE:
            raise ConfigError(
                f"an ASR session runs its VAD on the 16 kHz ASR stream; VADConfig.sample_rate="
                f"{vad.sample_rate} (leave it at 16000; input_rate sets the incoming rate)"
            )
        worker.backend.check_language(asr.language)
        self.asr = asr
        self.id = worker.new_session_id()
        self._worker = worker
        self._on_event = on_event
        self._front = worker.front_end(check_rate(input_rate), vad)  # resampler and VAD
        self._lock = threading.Lock()
        self._audio = np.zeros(0, np.float32)
        self._audio_start = 0  # stream sample index of self._audio[0]
        self._total = 0  # samples received (at 16 kHz)
        self._utterance: int | None = None  # the utterance being spoken
        self._utterance_start = 0  # first sample of its audio, pre-roll included
        self._speech_start = 0
        self._last_partial = 0
        self._stable = StablePrefix()
        self._speculation: _Speculation | None = None
        self._vad_lock = threading.Lock()  # feed() runs VAD in a thread; end_turn() may come from another
        self._keep_idle = round((asr.pre_roll_s + vad.start_ms / 1000 + 1.0) * ASR_SAMPLE_RATE)
        self._closed = False

    def feed(self, audio: bytes | np.ndarray) -> None:
        """Feed the next piece of the stream (PCM16 bytes, int16 or float samples)."""
        with self._vad_lock:
            samples, events = self._front.hear(audio)
            if not len(samples):
                return
            with self._lock:
                self._audio = np.concatenate([self._audio, samples])
                self._total += len(samples)
            for event in events:
                if isinstance(event, SpeechStarted):
                    self._start(event)
                elif isinstance(event, SpeechPaused):
                    self._speculate(event)
                elif isinstance(event, SpeechResumed):
                    self._resume(event)
                else:
                    self._finish(event)
        self._maybe_partial()
        self._trim()

    def commit(self) -> SpeechEnded | None:
        """End the current utterance now (the client says the turn is over); None if silent."""
        with self._vad_lock:
            event = self._front.commit()
            if event is not None:
                self._finish(event)
        return event

    def end_turn(self) -> SpeechEnded | None:
        """End the current utterance now, as the hangover would (the caller judged it complete
        at a pause); None if silent."""
        with self._vad_lock:
            event = self._front.end_turn()
            if event is not None:
                self._finish(event)
        return event

    def close(self) -> None:
        """Stop delivering events (results still in the worker are discarded)."""
        with self._lock:
            self._closed = True
        self._worker.end_session(self.id)
        with self._vad_lock:
            self._front.close()

    def _emit(self, event: ASREvent) -> None:
        if not self._closed:
            self._on_event(event)

    def _start(self, event: SpeechStarted) -> None:
        with self._lock:
            start = round(event.start_s * ASR_SAMPLE_RATE)
            self._utterance = event.utterance
            self._speech_start = start
            self._utterance_start = max(
                self._audio_start, start - round(self.asr.pre_roll_s * ASR_SAMPLE_RATE)
            )
            self._last_partial = self._total
            self._stable = StablePrefix()
        self._emit(event)

    def _end_sample(self, speech_end_s: float) -> int:
        return min(self._total, round((speech_end_s + self.asr.post_roll_s) * ASR_SAMPLE_RATE))

    def _finish(self, event: SpeechEnded) -> None:
        with self._lock:
            job = self._job(event.utterance, True, self._end_sample(event.speech_end_s))
            self._utterance = None
            spec, self._speculation = self._speculation, None
        self._emit(event)
        if spec is None or spec.utterance != event.utterance:
            self._worker.submit(job)
            return
        with self._lock:  # the pause's decode is this final: use it, now or when it is done
            final, error = spec.final, spec.error
            spec.final_wanted = final is None and error is None
        if final is not None:
            self._emit(final)
        elif error is not None:
            self._worker.submit(job)

    def _speculate(self, event: SpeechPaused) -> None:
        with self._lock:
            spec = self._speculation = _Speculation(event.utterance)
            job = self._job(event.utterance, True, self._end_sample(event.speech_end_s))
        job = replace(job, on_done=lambda j, result, queue_s, decode_s: self._on_speculation(spec, j, result, queue_s, decode_s))
        self._emit(event)
        self._worker.submit(job)

    def _resume(self, event: SpeechResumed) -> None:
        with self._lock:
            self._speculation = None
        self._emit(event)

    def _on_speculation(
        self, spec: _Speculation, job: ASRJob, result: Decoded | Exception, queue_s: float, decode_s: float
    ) -> None:
        final = None
        with self._lock:
            if isinstance(result, Exception):
                spec.error = f"{type(result).__name__}: {result}"
            else:
                text = result.text if result.text.startswith(job.prefix) else job.prefix
                spec.final = final = Transcript(job.utterance, text, True, result.language, job.audio_end_s, queue_s, decode_s,
                                                decoded_at=decoded_at(job, queue_s, decode_s))
            wanted, current = spec.final_wanted, self._speculation is spec
        if wanted:
            self._emit(final if final is not None else TranscriptionFailed(job.utterance, spec.error or ""))
        elif current and final is not None:
            self._emit(replace(final, speculative=True))

    def _maybe_partial(self) -> None:
        interval = self.asr.partial_interval_s
        with self._lock:
            if self._utterance is None or interval is None:
                return
            if self._total - self._last_partial < interval * ASR_SAMPLE_RATE:
                return
            if self._total - self._speech_start < self.asr.min_partial_audio_s * ASR_SAMPLE_RATE:
                return
            if self._front.silence_s > PARTIAL_MAX_SILENCE_S:
                return  # keeps the worker free for the final that may follow
            self._last_partial = self._total
            job = self._job(self._utterance, False, self._total)
        self._worker.submit(job)

    def _job(self, utterance: int, is_final: bool, end: int) -> ASRJob:
        """A job for the utterance's audio up to sample ``end`` (call with the lock held)."""
        audio = self._audio[self._utterance_start - self._audio_start : end - self._audio_start]
        return ASRJob(
            session=self.id,
            utterance=utterance,
            is_final=is_final,
            audio=audio.copy(),
            prefix=self._stable.text,
            language=self.asr.language,
            audio_end_s=end / ASR_SAMPLE_RATE,
            on_done=self._on_result,
        )

    def _trim(self) -> None:
        with self._lock:
            keep_from = self._total - self._keep_idle
            if self._utterance is not None:
                keep_from = min(keep_from, self._utterance_start)
            if keep_from > self._audio_start:
                self._audio = self._audio[keep_from - self._audio_start :]
                self._audio_start = keep_from

    def _on_result(
        self, job: ASRJob, result: Decoded | Exception, queue_s: float, decode_s: float
    ) -> None:
        if not job.is_final:
            with self._lock:
                if job.utterance != self._utterance or isinstance(result, Exception):
                    return  # stale (the utterance ended) or failed: the final will follow
                grew = self._stable.update(result.text)
                text = self._stable.text
            if grew:
                self._emit(
                    Transcript(job.utterance, text, False, result.language, job.audio_end_s,
                               queue_s, decode_s, decoded_at=decoded_at(job, queue_s, decode_s))
                )  # fmt: skip
            return
        if isinstance(result, Exception):
            self._emit(TranscriptionFailed(job.utterance, f"{type(result).__name__}: {result}"))
            return
        # The stable prefix was forced into the decode; if the guards rejected all of it, the
        # prefix (agreed on by two decodes) stands, so partials stay prefixes of the final.
        text = result.text if result.text.startswith(job.prefix) else job.prefix
        self._emit(
            Transcript(job.utterance, text, True, result.language, job.audio_end_s, queue_s,
                       decode_s, decoded_at=decoded_at(job, queue_s, decode_s))
        )  # fmt: skip


def decoded_at(job: ASRJob, queue_s: float, decode_s: float) -> float:
    """The ``time.perf_counter()`` instant ``job``'s decode ended (it was submitted, waited
    ``queue_s``, then decoded for ``decode_s``)."""
    return job.submitted + queue_s + decode_s


class AsyncASRSession:
    """An ``ASRSession`` for asyncio code; create it inside the running event loop.

    ``feed()`` and ``commit()`` are plain calls (cheap: VAD and bookkeeping only); events arrive
    through ``async for event in session`` and finals also through ``await session.final()``.
    """

    def __init__(
        self,
        worker: ASRWorker,
        asr: ASRConfig,
        vad: VADConfig | None = None,
        input_rate: int = ASR_SAMPLE_RATE,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._events: asyncio.Queue[ASREvent | None] = asyncio.Queue()
        self._finals: asyncio.Queue[Transcript | TranscriptionFailed] = asyncio.Queue()
        self._session = ASRSession(worker, self._deliver, asr, vad, input_rate)

    @property
    def id(self) -> int:
        return self._session.id

    def feed(self, audio: bytes | np.ndarray) -> None:
        self._session.feed(audio)

    def commit(self) -> SpeechEnded | None:
        return self._session.commit()

    def end_turn(self) -> SpeechEnded | None:
        return self._session.end_turn()

    def close(self) -> None:
        """Stop the session; an ``async for`` over it ends."""
        self._session.close()
        self._events.put_nowait(None)

    async def final(self) -> Transcript:
        """The next final transcript (in utterance order); raises ASRError if decoding failed."""
        result = await self._finals.get()
        if isinstance(result, TranscriptionFailed):
            raise ASRError(f"utterance {result.utterance}: {result.error}")
        return result

    def __aiter__(self) -> AsyncASRSession:
        return self

    async def __anext__(self) -> ASREvent:
        event = await self._events.get()
        if event is None:
            raise StopAsyncIteration
        return event

    def _deliver(self, event: ASREvent) -> None:
        if threading.get_ident() == self._loop_thread:
            self._put(event)
            return
        try:
            self._loop.call_soon_threadsafe(self._put, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _put(self, event: ASREvent) -> None:
        self._events.put_nowait(event)
        if isinstance(event, TranscriptionFailed) or (
            isinstance(event, Transcript) and event.is_final
        ):
            self._finals.put_nowait(event)


__all__ = ["ASRSession", "AsyncASRSession"]
