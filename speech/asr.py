"""Streaming speech recognition shared by many sessions.

- ``ASRBackend``: a recognizer over whole 16 kHz clips (``FasterWhisperBackend`` now; a torch
  Whisper for GPU co-scheduling can sit behind the same interface later).
- ``ASRWorker``: one thread owns the one loaded model and serves every session from a bounded
  queue. Finals go before partials and are never dropped; a session's queued partial is replaced
  by its newer one or removed when its final is queued; a partial that finds the queue full is
  dropped. ``stats`` counts all of it.
- ``ASRSession``: one user's stream. VAD endpointing; while the user speaks, the growing utterance
  is re-decoded every ``partial_interval_s`` and only the stable prefix is emitted (a word is
  stable once two decodes in a row agree on it; it is then forced as the decoder prefix of every
  later decode, so each partial is a prefix of the later ones and of the final). No partials are
  decoded while the speaker pauses, so the worker is free when the final comes.
- ``AsyncASRSession``: the same for asyncio code (``async for event in session``,
  ``await session.final()``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from speech.audio import Resampler, check_rate, to_float32
from speech.config import ASRConfig, ConfigError, VADConfig
from speech.messages import ASREvent, SpeechEnded, SpeechStarted, Transcript, TranscriptionFailed
from speech.vad import VoiceActivityDetector

log = logging.getLogger(__name__)

ASR_SAMPLE_RATE = 16000
PARTIAL_MAX_SILENCE_S = 0.15  # no partial decodes once the speaker pauses: nothing new to hear


class ASRError(RuntimeError):
    """Transcription of an utterance failed; the message carries the backend's error."""


@dataclass(frozen=True)
class Decoded:
    """A backend's transcript of one clip, after the hallucination guards."""

    text: str
    language: str
    rejected_segments: int = 0


class ASRBackend(ABC):
    """A speech recognizer over whole 16 kHz float32 clips; one instance serves every session."""

    sample_rate = ASR_SAMPLE_RATE
    supported_languages: tuple[str, ...]

    def check_language(self, language: str) -> None:
        """Raise ConfigError unless ``language`` is "auto" or one this model knows."""
        if language != "auto" and language not in self.supported_languages:
            known = ", ".join(self.supported_languages[:12])
            raise ConfigError(
                f"language {language!r} is not supported by this ASR model; use 'auto' or one "
                f"of: {known}{', ...' if len(self.supported_languages) > 12 else ''}"
            )

    @abstractmethod
    def transcribe(
        self, audio: np.ndarray, prefix: str = "", language: str | None = None
    ) -> Decoded:
        """Transcribe ``audio`` (text starting with ``prefix`` if given) in ``language``
        ("auto" detects; None: the backend's configured language)."""


class FasterWhisperBackend(ASRBackend):
    """Whisper through faster-whisper (CTranslate2), with guards against made-up text.

    faster-whisper skips a window whose ``no_speech_prob`` is above ``no_speech_threshold`` while
    its ``avg_logprob`` is below ``log_prob_threshold`` (silence, noise). A segment it keeps is
    still dropped here if its ``avg_logprob`` is below ``log_prob_threshold`` (e.g. babble that is
    not words) or its ``compression_ratio`` above ``compression_ratio_threshold`` (repetition
    loops). Decoding is greedy at temperature 0 with no fallback, so latency is predictable.
    """

    def __init__(self, config: ASRConfig) -> None:
        from faster_whisper import WhisperModel

        if config.model_path is None:
            raise ConfigError(
                "ASRConfig.model_path is not set: give a CTranslate2 Whisper directory "
                "(model.bin, config.json, tokenizer.json, vocabulary.*)"
            )
        path = Path(config.model_path)
        if not (path / "model.bin").is_file():
            raise ConfigError(f"{path} is not a CTranslate2 Whisper directory: no model.bin in it")
        self.config = config
        self._model = WhisperModel(
            str(path),
            device=config.device,
            compute_type=config.compute_type,
            cpu_threads=config.cpu_threads,
        )
        self.supported_languages = tuple(self._model.supported_languages)
        self.check_language(config.language)

    def transcribe(
        self, audio: np.ndarray, prefix: str = "", language: str | None = None
    ) -> Decoded:
        config = self.config
        language = config.language if language is None else language
        if len(self.supported_languages) == 1:
            language = self.supported_languages[0]  # an English-only model
        segments, info = self._model.transcribe(
            to_float32(audio),
            language=None if language == "auto" else language,
            beam_size=config.beam_size,
            temperature=0.0,
            vad_filter=False,  # our VAD already chose the audio
            without_timestamps=True,
            condition_on_previous_text=False,
            prefix=prefix or None,
            no_speech_threshold=config.no_speech_threshold,
            log_prob_threshold=config.log_prob_threshold,
            compression_ratio_threshold=config.compression_ratio_threshold,
        )
        kept, rejected = [], 0
        for segment in segments:
            if (
                segment.avg_logprob < config.log_prob_threshold
                or segment.compression_ratio > config.compression_ratio_threshold
            ):
                rejected += 1
            else:
                kept.append(segment.text)
        return Decoded("".join(kept).strip(), info.language, rejected)


BACKENDS: dict[str, type[ASRBackend]] = {"faster-whisper": FasterWhisperBackend}


def load_backend(config: ASRConfig) -> ASRBackend:
    """The ASR backend named by ``config.backend`` (one of ``ASR_BACKENDS``), model loaded."""
    return BACKENDS[config.backend](config)


JobCallback = Callable[["ASRJob", "Decoded | Exception", float, float], None]


@dataclass
class ASRJob:
    """One decode request: a session's utterance audio so far (partial) or complete (final)."""

    session: int
    utterance: int
    is_final: bool
    audio: np.ndarray
    prefix: str
    language: str
    audio_end_s: float
    on_done: JobCallback  # (job, result or exception, queue_s, decode_s), on the worker thread
    submitted: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class WorkerStats:
    """Counters of the shared worker, for tests and metrics."""

    queued_finals: int
    queued_partials: int
    max_queued_partials: int
    submitted_finals: int
    submitted_partials: int
    dropped_partials: int
    processed_finals: int
    processed_partials: int
    failed: int


class ASRWorker:
    """One thread, one model, many sessions (see the module docstring for the queue rules)."""

    def __init__(self, backend: ASRBackend, queue_size: int = 8) -> None:
        if queue_size < 1:
            raise ConfigError(f"ASR worker queue_size={queue_size}: must be >= 1")
        self.backend = backend
        self.queue_size = queue_size
        self._cond = threading.Condition()
        self._finals: deque[ASRJob] = deque()
        self._partials: OrderedDict[int, ASRJob] = OrderedDict()  # one per session, FIFO
        self._counts = dict.fromkeys(
            ("max_queued_partials", "submitted_finals", "submitted_partials", "dropped_partials",
             "processed_finals", "processed_partials", "failed"),
            0,
        )  # fmt: skip
        self._session_ids = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="asr-worker", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: ASRConfig) -> ASRWorker:
        """Load the configured backend and start a worker with the configured queue bound."""
        return cls(load_backend(config), config.queue_size)

    def __enter__(self) -> ASRWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def new_session_id(self) -> int:
        return next(self._session_ids)

    def submit(self, job: ASRJob) -> bool:
        """Queue a job; returns False when a partial was dropped because the queue was full."""
        with self._cond:
            if self._closed:
                raise ASRError("the ASR worker is closed")
            if job.is_final:
                self._counts["submitted_finals"] += 1
                if self._partials.pop(job.session, None) is not None:
                    self._counts["dropped_partials"] += 1
                self._finals.append(job)
            else:
                self._counts["submitted_partials"] += 1
                if job.session in self._partials:
                    self._counts["dropped_partials"] += 1  # superseded, keeps its place
                elif len(self._partials) >= self.queue_size:
                    self._counts["dropped_partials"] += 1
                    return False
                self._partials[job.session] = job
                self._counts["max_queued_partials"] = max(
                    self._counts["max_queued_partials"], len(self._partials)
                )
            self._cond.notify()
            return True

    @property
    def stats(self) -> WorkerStats:
        with self._cond:
            return WorkerStats(
                queued_finals=len(self._finals),
                queued_partials=len(self._partials),
                **self._counts,
            )

    def close(self) -> None:
        """Stop: queued partials are dropped, queued finals still decoded, then the thread ends."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._counts["dropped_partials"] += len(self._partials)
            self._partials.clear()
            self._cond.notify()
        self._thread.join()

    def _next_job(self) -> ASRJob | None:
        with self._cond:
            while not (self._finals or self._partials or self._closed):
                self._cond.wait()
            if self._finals:
                return self._finals.popleft()
            if self._partials:
                return self._partials.popitem(last=False)[1]
            return None

    def _run(self) -> None:
        while (job := self._next_job()) is not None:
            started = time.perf_counter()
            try:
                result: Decoded | Exception = self.backend.transcribe(
                    job.audio, job.prefix, job.language
                )
            except Exception as exc:  # delivered to the session; the worker keeps serving
                log.exception("ASR backend failed")
                result = exc
            decode_s = time.perf_counter() - started
            with self._cond:
                kind = "processed_finals" if job.is_final else "processed_partials"
                self._counts[kind] += 1
                self._counts["failed"] += isinstance(result, Exception)
            try:
                job.on_done(job, result, started - job.submitted, decode_s)
            except Exception:
                log.exception("ASR result callback failed")


_UNIT = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]|[^\s\u3400-\u9fff\uf900-\ufaff]+")


class StablePrefix:
    """Local agreement over decodes of a growing utterance.

    A unit (a word, or one CJK character) becomes stable once two decodes in a row agree on it;
    the newest decode's last unit is always held back (its audio may be cut mid-word).
    """

    def __init__(self) -> None:
        self.text = ""
        self._previous: list[str] | None = None

    def update(self, hypothesis: str) -> bool:
        """Take a new decode (which starts with the stable text); True if the stable text grew."""
        if not hypothesis.startswith(self.text):
            self._previous = None
            return False
        matches = list(_UNIT.finditer(hypothesis))
        units = [m.group() for m in matches]
        previous, self._previous = self._previous, units
        if previous is None:
            return False
        agreed = 0
        for a, b in zip(previous, units[:-1]):
            if a != b:
                break
            agreed += 1
        stable = hypothesis[: matches[agreed - 1].end()] if agreed else ""
        if len(stable) > len(self.text):
            self.text = stable
            return True
        return False


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
        self._resampler = Resampler(check_rate(input_rate), ASR_SAMPLE_RATE)
        self._vad = VoiceActivityDetector(vad)
        self._lock = threading.Lock()
        self._audio = np.zeros(0, np.float32)
        self._audio_start = 0  # stream sample index of self._audio[0]
        self._total = 0  # samples received (at 16 kHz)
        self._utterance: int | None = None  # the utterance being spoken
        self._utterance_start = 0  # first sample of its audio, pre-roll included
        self._speech_start = 0
        self._last_partial = 0
        self._stable = StablePrefix()
        self._keep_idle = round((asr.pre_roll_s + vad.start_ms / 1000 + 1.0) * ASR_SAMPLE_RATE)
        self._closed = False

    def feed(self, audio: bytes | np.ndarray) -> None:
        """Feed the next piece of the stream (PCM16 bytes, int16 or float samples)."""
        samples = self._resampler.process(to_float32(audio))
        if not len(samples):
            return
        with self._lock:
            self._audio = np.concatenate([self._audio, samples])
            self._total += len(samples)
        for event in self._vad.process(samples):
            if isinstance(event, SpeechStarted):
                self._start(event)
            else:
                self._finish(event)
        self._maybe_partial()
        self._trim()

    def commit(self) -> SpeechEnded | None:
        """End the current utterance now (the client says the turn is over); None if silent."""
        event = self._vad.commit()
        if event is not None:
            self._finish(event)
        return event

    def close(self) -> None:
        """Stop delivering events (results still in the worker are discarded)."""
        with self._lock:
            self._closed = True

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

    def _finish(self, event: SpeechEnded) -> None:
        with self._lock:
            end = min(
                self._total,
                round((event.speech_end_s + self.asr.post_roll_s) * ASR_SAMPLE_RATE),
            )
            job = self._job(event.utterance, True, end)
            self._utterance = None
        self._emit(event)
        self._worker.submit(job)

    def _maybe_partial(self) -> None:
        interval = self.asr.partial_interval_s
        with self._lock:
            if self._utterance is None or interval is None:
                return
            if self._total - self._last_partial < interval * ASR_SAMPLE_RATE:
                return
            if self._total - self._speech_start < self.asr.min_partial_audio_s * ASR_SAMPLE_RATE:
                return
            if self._vad.silence_s > PARTIAL_MAX_SILENCE_S:
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
                               queue_s, decode_s)
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
                       decode_s)
        )  # fmt: skip


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


__all__ = [
    "ASRBackend",
    "ASRError",
    "ASRJob",
    "ASRSession",
    "ASRWorker",
    "AsyncASRSession",
    "Decoded",
    "FasterWhisperBackend",
    "StablePrefix",
    "WorkerStats",
    "load_backend",
]
