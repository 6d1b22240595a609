"""The speech package's configuration: one frozen dataclass per stage, checked when created.

Everything the package needs from outside (model paths, devices, languages) arrives here, so
``speech`` never has to know where the assistant keeps its models.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

VAD_SAMPLE_RATES = (8000, 16000, 32000, 48000)  # the rates webrtcvad accepts
VAD_FRAME_MS = (10, 20, 30)  # the frame lengths webrtcvad accepts
TTS_BACKENDS = ("hibari", "coqui", "espeak")
ASR_BACKENDS = ("auto", "faster-whisper", "torch")
ASR_DEVICES = ("auto", "cpu", "cuda")
ASR_LOAD_FORMATS = ("auto", "dummy")
CUDA_STREAM_PRIORITIES = ("high", "default")


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the field and what is accepted."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass(frozen=True)
class VADConfig:
    """Voice activity detection and endpointing (webrtcvad, optionally vetoed by Silero).

    start_ms: voiced audio needed in a row before an utterance starts (speech-start hangover).
    hangover_ms: unvoiced audio after the last voiced frame before the endpoint is declared.
    use_silero: a frame counts as voiced only if Silero (the ONNX model shipped in faster-whisper)
    also hears speech; webrtcvad alone takes steady noise for speech.
    pause_ms: silence inside an utterance that reports ``SpeechPaused`` (and speech after it
    ``SpeechResumed``), for speculative endpointing; shorter than ``hangover_ms``. None: off.
    max_utterance_s: an utterance that reaches this length ends there as if the speaker had
    paused (``SpeechEnded.cut``), so it is transcribed as a turn and one caller's endless speech
    cannot hold the shared ASR worker with ever longer decodes; speech going on starts the next
    utterance. None: no limit.
    silero_batch_wait_ms: in a server, every session of an ASR worker scores Silero through one
    shared scorer (:class:`~speech.silero_batch.SileroScorer`) that runs all sessions' pending
    windows in one ONNX call; a call waits at most this long for the other open sessions' windows
    (never when only one session is open), trading that much VAD latency for fewer, larger calls
    and less GIL-held time per packet. 0: run at once (windows that arrive during a call are still
    batched into the next).
    """

    sample_rate: int = 16000
    frame_ms: int = 30
    aggressiveness: int = 3
    start_ms: int = 90
    hangover_ms: int = 500
    use_silero: bool = True
    silero_threshold: float = 0.5
    silero_model: Path | None = None  # None: faster_whisper/assets/silero_vad_v6.onnx
    max_utterance_s: float | None = 30.0
    pause_ms: int | None = None
    silero_batch_wait_ms: float = 1.0

    def __post_init__(self) -> None:
        _check(
            self.sample_rate in VAD_SAMPLE_RATES,
            f"VADConfig.sample_rate={self.sample_rate}: webrtcvad accepts {VAD_SAMPLE_RATES} Hz",
        )
        _check(
            self.frame_ms in VAD_FRAME_MS,
            f"VADConfig.frame_ms={self.frame_ms}: webrtcvad accepts frames of {VAD_FRAME_MS} ms",
        )
        _check(
            self.aggressiveness in (0, 1, 2, 3),
            f"VADConfig.aggressiveness={self.aggressiveness}: use 0 (least) to 3 (most aggressive)",
        )
        _check(self.start_ms > 0, f"VADConfig.start_ms={self.start_ms}: must be > 0")
        _check(self.hangover_ms > 0, f"VADConfig.hangover_ms={self.hangover_ms}: must be > 0")
        _check(
            0.0 < self.silero_threshold < 1.0,
            f"VADConfig.silero_threshold={self.silero_threshold}: must be in (0, 1)",
        )
        _check(
            self.max_utterance_s is None or self.max_utterance_s * 1000 > self.start_ms,
            f"VADConfig.max_utterance_s={self.max_utterance_s}: must be longer than start_ms, or None",
        )
        _check(
            self.pause_ms is None or 0 < self.pause_ms < self.hangover_ms,
            f"VADConfig.pause_ms={self.pause_ms}: must be > 0 and shorter than hangover_ms={self.hangover_ms}, or None",
        )
        _check(
            0 <= self.silero_batch_wait_ms <= 20,
            f"VADConfig.silero_batch_wait_ms={self.silero_batch_wait_ms}: use 0 to 20 ms",
        )

    @property
    def frame_samples(self) -> int:
        return self.sample_rate * self.frame_ms // 1000


@dataclass(frozen=True)
class ASRConfig:
    """Streaming speech recognition: the Whisper model, its decoding, partials and the worker queue.

    language: "auto" (detect), "en", "zh" or any other Whisper language code.
    partial_interval_s: re-decode the growing utterance this often (None: finals only).
    queue_size: at most this many partial jobs wait in the shared worker; finals are never dropped.
    pre_roll_s / post_roll_s: audio kept before the detected start and after ``speech_end``.
    The three thresholds reject text Whisper makes up on silence or noise (per segment).
    backend: "faster-whisper" (CTranslate2), "torch" (PyTorch, batched, CUDA graphs on a GPU) or
    "auto": torch when the device is cuda or the weights are dummy, else faster-whisper.
    device: "cpu", "cuda" or "auto" (cuda when PyTorch sees a GPU).
    compute_type: faster-whisper's (the torch backend runs float16 on cuda, float32 on the CPU).
    load_format: "auto" reads ``model_path``; "dummy" builds the large-v3-turbo shape with random
    weights (torch backend) whose every decode runs exactly ``dummy_tokens`` tokens: for timing.
    max_batch: clips the torch backend decodes together (the worker takes that many jobs a turn).
    cuda_stream_priority: "high" runs ASR kernels on a high-priority CUDA stream, "default" on the
    default stream. cuda_graphs: replay the decoder step from CUDA graphs (False: eager, for A/B);
    graph_steps: decoder steps one graph replay runs (1: a replay and a host check per token);
    encoder_cuda_graphs: replay the encoder from CUDA graphs too (per batch-size bucket). Both cut
    the Python calls a batch makes, each of which may wait for the GIL in a busy server.
    front_end_processes: run the sessions' resampling and VAD in this many worker processes
    (speech/front_end.py) instead of on the server's threads (0), which share its GIL.
    """

    model_path: Path | None = None
    backend: str = "auto"
    device: str = "auto"
    compute_type: str = "int8"
    load_format: str = "auto"
    dummy_tokens: int = 24
    max_batch: int = 64
    cuda_stream_priority: str = "high"
    cuda_graphs: bool = True
    graph_steps: int = 8
    encoder_cuda_graphs: bool = True
    front_end_processes: int = 0
    cpu_threads: int = 2
    language: str = "auto"
    beam_size: int = 1
    partial_interval_s: float | None = 0.5
    min_partial_audio_s: float = 1.0
    queue_size: int = 8
    pre_roll_s: float = 0.3
    post_roll_s: float = 0.3
    no_speech_threshold: float = 0.6
    log_prob_threshold: float = -1.0
    compression_ratio_threshold: float = 2.4
    reject_repeated_sentences: bool = True  # a segment saying one sentence twice in a row (a short repetition loop)

    def __post_init__(self) -> None:
        _check(
            self.backend in ASR_BACKENDS,
            f"ASRConfig.backend={self.backend!r}: available backends are {ASR_BACKENDS}",
        )
        _check(self.device in ASR_DEVICES, f"ASRConfig.device={self.device!r}: use one of {ASR_DEVICES}")
        _check(
            self.load_format in ASR_LOAD_FORMATS,
            f"ASRConfig.load_format={self.load_format!r}: use one of {ASR_LOAD_FORMATS}",
        )
        _check(
            self.cuda_stream_priority in CUDA_STREAM_PRIORITIES,
            f"ASRConfig.cuda_stream_priority={self.cuda_stream_priority!r}: use one of {CUDA_STREAM_PRIORITIES}",
        )
        _check(self.dummy_tokens >= 1, f"ASRConfig.dummy_tokens={self.dummy_tokens}: must be >= 1")
        _check(1 <= self.max_batch <= 64, f"ASRConfig.max_batch={self.max_batch}: use 1 to 64")
        _check(0 <= self.front_end_processes <= 64, f"ASRConfig.front_end_processes={self.front_end_processes}: use 0 to 64")
        _check(1 <= self.graph_steps <= 64, f"ASRConfig.graph_steps={self.graph_steps}: use 1 to 64")
        _check(self.beam_size >= 1, f"ASRConfig.beam_size={self.beam_size}: must be >= 1")
        _check(self.cpu_threads >= 0, f"ASRConfig.cpu_threads={self.cpu_threads}: must be >= 0")
        _check(self.queue_size >= 1, f"ASRConfig.queue_size={self.queue_size}: must be >= 1")
        _check(
            self.partial_interval_s is None or self.partial_interval_s > 0,
            f"ASRConfig.partial_interval_s={self.partial_interval_s}: must be > 0 or None",
        )
        _check(
            self.pre_roll_s >= 0 and self.post_roll_s >= 0,
            "ASRConfig.pre_roll_s and post_roll_s must be >= 0",
        )
        _check(
            bool(self.language) and self.language.strip() == self.language,
            f"ASRConfig.language={self.language!r}: use 'auto', 'en', 'zh' or a Whisper code",
        )


def default_tts_workers() -> int:
    """TTS threads when none are given: half the cores, at least 1 and at most 8 (1 on a 2-core
    machine, 8 on a 16-core one). Each thread runs its own voice instance on one core; the other
    half of the cores stays for the engine's host work, Whisper and the event loop."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


@dataclass(frozen=True)
class TTSConfig:
    """Speech synthesis: which backend and its options.

    model_path: hibari: an ONNX voice file or the hibari package directory (None: the voice inside
    the installed package); coqui: the checkpoint directory (config.json + model.pth; required).
    voice: hibari voice name (default "heart") or espeak-ng voice (default from ``language``).
    speaker / speaker_wav: coqui multi-speaker name, or reference audio for XTTS voice cloning.
    workers: voice instances, each on a thread of its own, serving every session's replies side by
    side (one ONNX session cannot keep up with many concurrent answers); ``threads`` is each
    instance's intra-op threads, so it must be 1 when there are several workers. None:
    :func:`default_tts_workers` for hibari and espeak, 1 for coqui (a large model, maybe on a GPU).
    processes: each voice instance in a worker process of its own (speech/tts/process.py), so its
    Python does not hold the server's GIL; its worker thread only sends the text and reads pieces.
    """

    backend: str = "hibari"
    language: str = "en"
    speed: float = 1.0
    model_path: Path | None = None
    voice: str | None = None
    speaker: str | None = None
    speaker_wav: Path | None = None
    device: str = "cpu"
    threads: int = 1
    workers: int | None = None  # set in __post_init__ when None
    seed: int | None = None
    processes: bool = False

    def __post_init__(self) -> None:
        _check(
            self.backend in TTS_BACKENDS,
            f"TTSConfig.backend={self.backend!r}: available backends are {TTS_BACKENDS}",
        )
        _check(0.25 <= self.speed <= 4.0, f"TTSConfig.speed={self.speed}: use 0.25 to 4.0")
        _check(self.threads >= 1, f"TTSConfig.threads={self.threads}: must be >= 1")
        if self.workers is None:
            object.__setattr__(self, "workers", 1 if self.backend == "coqui" else default_tts_workers())
        _check(self.workers >= 1, f"TTSConfig.workers={self.workers}: must be >= 1")
        _check(
            self.workers == 1 or self.threads == 1,
            f"TTSConfig.threads={self.threads} with workers={self.workers}: each of several workers runs on one thread",
        )


@dataclass(frozen=True)
class ChunkerConfig:
    """Cutting LLM text into speakable pieces.

    Lengths are in Latin-character equivalents: a CJK character counts as ``cjk_weight`` (one
    syllable is worth about three letters of speech). A clause boundary (comma, semicolon, colon,
    ，；：、) is used only once the piece reaches ``min_chars``; sentence ends and line breaks always
    cut. A piece longer than ``max_chars`` is cut at the last space (or between CJK characters).

    The first piece of an answer has a lower limit, ``first_max_chars`` (never below ``2 *
    min_chars`` nor above ``max_chars``): the voice synthesizes a whole piece before any of it is
    heard, so a short first piece is what brings first audio forward; later pieces are synthesized
    while earlier ones play.
    """

    min_chars: int = 16
    max_chars: int = 160
    first_max_chars: int = 48
    cjk_weight: int = 3

    @property
    def first_limit(self) -> int:
        """The length limit in effect for an answer's first piece."""
        return min(self.max_chars, max(self.first_max_chars, 2 * self.min_chars))

    def __post_init__(self) -> None:
        _check(self.min_chars >= 1, f"ChunkerConfig.min_chars={self.min_chars}: must be >= 1")
        _check(
            self.max_chars >= 2 * self.min_chars,
            f"ChunkerConfig.max_chars={self.max_chars}: must be >= 2 * min_chars "
            f"({self.min_chars})",
        )
        _check(
            self.first_max_chars >= 1,
            f"ChunkerConfig.first_max_chars={self.first_max_chars}: must be >= 1",
        )
        _check(self.cjk_weight >= 1, f"ChunkerConfig.cjk_weight={self.cjk_weight}: must be >= 1")
