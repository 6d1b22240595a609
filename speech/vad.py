"""Voice activity detection and endpointing.

webrtcvad classifies each 10/20/30 ms frame; optionally the Silero model that ships inside
faster-whisper must agree (webrtcvad alone takes steady noise for speech). A run of ``start_ms``
voiced audio starts an utterance; ``hangover_ms`` of unvoiced audio after the last voiced frame
ends it. Two instants are reported apart: ``speech_end_s`` (end of the last voiced frame, when the
user stopped) and ``endpoint_s`` (when the hangover elapsed, i.e. when we decided). An utterance
still voiced at ``max_utterance_s`` is ended there (``cut``); its speech end is the cut.

With ``pause_ms`` (shorter than the hangover), ``pause_ms`` of silence inside an utterance reports
``SpeechPaused`` (the turn may be over: a caller can start answering speculatively) and a voiced
frame after it ``SpeechResumed`` (it was not: same utterance). ``end_turn()`` ends the utterance
at once, for a caller that decided the turn is complete before the hangover.

Silero runs either in the detector's own ONNX session (:class:`SileroVAD`) or, in a server, as a
stream of a :class:`~speech.silero_batch.SileroScorer` shared by every caller, which scores all
callers' windows in one ONNX call.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Protocol

import numpy as np
import webrtcvad

from speech.audio import Resampler, split_frames, to_float32, to_pcm16
from speech.config import VADConfig
from speech.messages import SpeechEnded, SpeechPaused, SpeechResumed, SpeechStarted

VADEvent = SpeechStarted | SpeechPaused | SpeechResumed | SpeechEnded


class SharedScorer(Protocol):
    """A Silero scorer that many detectors share (:class:`speech.silero_batch.SileroScorer`)."""

    def stream(self) -> SileroVAD: ...


def silero_model_path(model_path: Path | None) -> Path:
    """The Silero ONNX file to load: ``model_path``, or the v6 model shipped in faster-whisper."""
    if model_path is not None:
        return model_path
    from faster_whisper.utils import get_assets_path

    return Path(get_assets_path()) / "silero_vad_v6.onnx"


def silero_rows(audio: np.ndarray, context: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Silero's input rows for the whole windows of 16 kHz ``audio``: each window with the
    ``CONTEXT`` samples before it (``context`` for the first). Returns (rows, leftover samples,
    context for the next window)."""
    windows, rest = split_frames(audio, SileroVAD.WINDOW)
    if not len(windows):
        return np.zeros((0, SileroVAD.CONTEXT + SileroVAD.WINDOW), np.float32), rest, context
    contexts = np.vstack([context, windows[:-1, -SileroVAD.CONTEXT :]])
    rows = np.ascontiguousarray(np.hstack([contexts, windows]), dtype=np.float32)
    return rows, rest, windows[-1, -SileroVAD.CONTEXT :].copy()


class SileroVAD:
    """Streaming speech probabilities from the Silero ONNX model, one per 32 ms of 16 kHz audio.

    It keeps one stream's state (LSTM h/c, the 64 samples before the next window, leftover
    samples) and scores its windows in an ONNX session of its own (:meth:`_score`);
    :class:`speech.silero_batch.SileroStream` keeps the same state and scores through a scorer
    shared by every caller.
    """

    SAMPLE_RATE = 16000
    WINDOW = 512
    CONTEXT = 64

    def __init__(self, model_path: Path | None = None) -> None:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        options.log_severity_level = 3
        self._session = onnxruntime.InferenceSession(
            str(silero_model_path(model_path)), options, providers=["CPUExecutionProvider"]
        )
        self.reset()

    def reset(self) -> None:
        self._h = np.zeros((1, 1, 128), np.float32)
        self._c = np.zeros((1, 1, 128), np.float32)
        self._context = np.zeros(self.CONTEXT, np.float32)
        self._pending = np.zeros(0, np.float32)

    def close(self) -> None:
        """Nothing is shared to leave (a stream of a shared scorer leaves it here)."""

    def process(self, samples: np.ndarray) -> np.ndarray:
        """Probabilities for the windows completed by these 16 kHz samples (maybe none)."""
        rows, pending, context = silero_rows(np.concatenate([self._pending, samples]), self._context)
        probs = np.zeros(0, np.float32)
        if len(rows):  # a failed call raises here and leaves the stream's state as it was
            probs, self._h, self._c = self._score(rows, self._h, self._c)
            self._context = context
        self._pending = pending
        return probs

    def _score(self, rows: np.ndarray, h: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This stream's rows scored from state (h, c): (probabilities, h, c) after them."""
        probs, h, c = self._session.run(None, {"input": rows, "h": h, "c": c})
        return np.asarray(probs, np.float32).reshape(-1), h, c


class VoiceActivityDetector:
    """Turns a stream of audio into ``SpeechStarted`` / ``SpeechEnded`` events with stream times.

    Feed any number of samples per call at ``config.sample_rate``; frames are cut internally, so
    the events do not depend on how the stream was chunked. With ``scorer`` (and
    ``config.use_silero``), Silero scores through that shared scorer instead of a session of the
    detector's own; :meth:`close` then leaves the scorer.
    """

    def __init__(self, config: VADConfig | None = None, scorer: SharedScorer | None = None) -> None:
        self.config = config or VADConfig()
        self._silero: SileroVAD | None = None
        if self.config.use_silero:
            self._silero = scorer.stream() if scorer is not None else SileroVAD(self.config.silero_model)
        self._frame = self.config.frame_samples
        self._start_frames = -(-self.config.start_ms // self.config.frame_ms)
        self._hangover = self.config.hangover_ms * self.config.sample_rate // 1000
        pause_ms = self.config.pause_ms
        self._pause = None if pause_ms is None else pause_ms * self.config.sample_rate // 1000
        max_s = self.config.max_utterance_s
        self._max_utterance = None if max_s is None else round(max_s * self.config.sample_rate)
        self.reset()

    def reset(self) -> None:
        """Forget the stream: times restart at 0 and any utterance in progress is dropped."""
        self._webrtc = webrtcvad.Vad(self.config.aggressiveness)  # it adapts to the stream
        self._pending = np.zeros(0, np.int16)
        self._received = 0  # samples received
        self._decided = 0  # samples whose frames have been decided
        self._webrtc_votes: deque[bool] = deque()  # frames classified by webrtcvad, not decided
        self._silero_windows: deque[tuple[int, bool]] = deque()  # (end, in speech) at 16 kHz
        self._silero_end = 0  # 16 kHz samples Silero has scored
        self._silero_on = False
        self._to16k: Resampler | None = None
        if self._silero is not None:
            self._silero.reset()
            if self.config.sample_rate != SileroVAD.SAMPLE_RATE:
                self._to16k = Resampler(self.config.sample_rate, SileroVAD.SAMPLE_RATE)
        self._utterance = 0
        self._in_speech = False
        self._run_start = 0  # first sample of the current voiced run
        self._run_frames = 0
        self._start = 0
        self._last_voiced_end = 0
        self._paused = False

    def close(self) -> None:
        """Leave the shared scorer, if any (its batches stop waiting for this stream)."""
        if self._silero is not None:
            self._silero.close()

    @property
    def in_speech(self) -> bool:
        return self._in_speech

    @property
    def silence_s(self) -> float:
        """How long the utterance in progress has been silent (0 when none is in progress)."""
        if not self._in_speech:
            return 0.0
        return (self._decided - self._last_voiced_end) / self.config.sample_rate

    @property
    def position_s(self) -> float:
        """Stream time up to which frames have been decided."""
        return self._decided / self.config.sample_rate

    def process(self, samples: bytes | np.ndarray) -> list[VADEvent]:
        """Feed audio (PCM16 bytes, int16 or float) and return the events it completes."""
        pcm = to_pcm16(samples)
        self._received += len(pcm)
        frames, self._pending = split_frames(np.concatenate([self._pending, pcm]), self._frame)
        rate = self.config.sample_rate
        self._webrtc_votes.extend(self._webrtc.is_speech(f.tobytes(), rate) for f in frames)
        if self._silero is not None:
            self._score_silero(to_float32(pcm))
        return self._decide()

    def commit(self) -> SpeechEnded | None:
        """End the utterance in progress now (a client "commit"); None if there is none."""
        if not self._in_speech:
            return None
        return self._end(endpoint=self._received, committed=True)

    def end_turn(self) -> SpeechEnded | None:
        """End the utterance in progress now, as the hangover would (the caller judged the turn
        complete during a pause); None if there is none."""
        if not self._in_speech:
            return None
        return self._end(endpoint=self._decided, committed=False)

    def _score_silero(self, floats: np.ndarray) -> None:
        audio16k = floats if self._to16k is None else self._to16k.process(floats)
        high, low = self.config.silero_threshold, self.config.silero_threshold - 0.15
        for prob in self._silero.process(audio16k):
            self._silero_on = prob >= high or (self._silero_on and prob >= low)
            self._silero_end += SileroVAD.WINDOW
            self._silero_windows.append((self._silero_end, self._silero_on))

    def _decide(self) -> list[VADEvent]:
        events: list[VADEvent] = []
        while self._webrtc_votes:
            start, end = self._decided, self._decided + self._frame
            voiced = self._webrtc_votes[0]
            if self._silero is not None:
                scale = SileroVAD.SAMPLE_RATE / self.config.sample_rate
                if self._silero_end < end * scale:
                    break  # wait until Silero has heard this whole frame
                while self._silero_windows and self._silero_windows[0][0] <= start * scale:
                    self._silero_windows.popleft()
                voiced = voiced and any(
                    on
                    for w_end, on in self._silero_windows
                    if w_end - SileroVAD.WINDOW < end * scale
                )
            self._webrtc_votes.popleft()
            self._decided = end
            events += self._step(voiced, start, end)
        return events

    def _step(self, voiced: bool, start: int, end: int) -> list[VADEvent]:
        rate = self.config.sample_rate
        events: list[VADEvent] = []
        if voiced:
            if self._run_frames == 0:
                self._run_start = start
            self._run_frames += 1
            self._last_voiced_end = end
            if self._paused:
                self._paused = False
                events.append(SpeechResumed(self._utterance, start / rate))
        else:
            self._run_frames = 0
        if not self._in_speech:
            if self._run_frames >= self._start_frames:
                self._in_speech = True
                self._start = self._run_start
                return [SpeechStarted(self._utterance, self._run_start / rate, end / rate)]
            return []
        silence = end - self._last_voiced_end
        if silence >= self._hangover:
            return [*events, self._end(endpoint=end, committed=False)]
        if self._max_utterance is not None and end - self._start >= self._max_utterance:
            return [*events, self._end(endpoint=end, committed=False, cut=True)]
        if self._pause is not None and silence >= self._pause and not self._paused:
            self._paused = True
            events.append(SpeechPaused(self._utterance, self._last_voiced_end / rate, end / rate))
        return events

    def _end(self, endpoint: int, committed: bool, cut: bool = False) -> SpeechEnded:
        rate = self.config.sample_rate
        event = SpeechEnded(
            utterance=self._utterance,
            start_s=self._start / rate,
            speech_end_s=(endpoint if cut else self._last_voiced_end) / rate,
            endpoint_s=endpoint / rate,
            committed=committed,
            cut=cut,
        )
        self._in_speech = False
        self._paused = False
        self._run_frames = 0
        self._utterance += 1
        return event
