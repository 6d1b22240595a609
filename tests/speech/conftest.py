"""Speech test fixtures: models loaded once, handbook questions spoken once by the bundled voice."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from speech.asr.backend import FasterWhisperBackend
from speech.audio import read_wav, write_wav
from speech.config import ASRConfig, TTSConfig
from speech.tts import load_tts
from speech.tts.hibari import HibariTTS
from speech.word_errors import word_errors

FACTS = Path(__file__).resolve().parents[2] / "assistant" / "eval_facts.json"
FALLBACK_QUESTIONS = [
    "How many days of annual leave do I get each year?",
    "What should I do if I am sick and cannot come to work?",
    "How do I claim back my travel expenses?",
    "Who approves a business trip abroad?",
    "How do I reset my password?",
    "What do I do if my laptop is stolen?",
    "What happens in my first week?",
    "How many days a week can I work from home?",
    "Which public holidays does the company observe?",
    "How long is parental leave?",
]
LEAD_SILENCE_S = 0.5
TAIL_SILENCE_S = 1.2


@dataclass(frozen=True)
class Clip:
    """A spoken question: 24 kHz audio padded with silence, and where the speech truly is."""

    text: str
    path: Path
    audio: np.ndarray
    sample_rate: int
    speech_start_s: float
    speech_end_s: float


def speech_bounds(audio: np.ndarray, sample_rate: int) -> tuple[float, float]:
    """First and last instant the 10 ms RMS envelope is within 40 dB of its peak."""
    window = sample_rate // 100
    envelope = np.sqrt(np.convolve(audio.astype(np.float64) ** 2, np.ones(window) / window, "same"))
    loud = np.nonzero(envelope > envelope.max() * 0.01)[0]
    return loud[0] / sample_rate, (loud[-1] + 1) / sample_rate


def handbook_questions() -> list[str]:
    """Ten questions: the first ten of assistant/eval_facts.json, or our own if it is absent."""
    if FACTS.is_file():
        questions = [item["question_en"] for item in json.loads(FACTS.read_text("utf-8"))]
        if len(questions) >= 10:
            return questions[:10]
    return FALLBACK_QUESTIONS


@pytest.fixture(scope="session")
def hibari() -> HibariTTS:
    tts = load_tts(TTSConfig(backend="hibari", seed=0))
    assert isinstance(tts, HibariTTS)
    return tts


@pytest.fixture(scope="session")
def question_clips(hibari: HibariTTS, tmp_path_factory: pytest.TempPathFactory) -> list[Clip]:
    """The ten questions spoken by hibari (24 kHz), cached as WAV files for the session."""
    directory = tmp_path_factory.mktemp("speech-clips")
    clips = []
    rate = hibari.sample_rate
    for i, text in enumerate(handbook_questions()):
        speech = hibari.synthesize(text).pcm
        audio = np.concatenate(
            [np.zeros(round(LEAD_SILENCE_S * rate), np.float32), speech,
             np.zeros(round(TAIL_SILENCE_S * rate), np.float32)]
        )  # fmt: skip
        path = write_wav(directory / f"q{i:02d}.wav", audio, rate)
        audio, rate = read_wav(path)  # what the tests use is exactly what is on disk
        start, end = speech_bounds(audio, rate)
        clips.append(Clip(text, path, audio, rate, start, end))
    return clips


@pytest.fixture(scope="session")
def long_clips(question_clips: list[Clip]) -> list[Clip]:
    """Clips whose speech lasts over 2 s (for partial transcripts)."""
    selected = [c for c in question_clips if c.speech_end_s - c.speech_start_s > 2.0]
    assert len(selected) >= 4, "need at least four questions longer than 2 s"
    return selected


@pytest.fixture(scope="session")
def base_config(whisper_base_path: Path) -> ASRConfig:
    return ASRConfig(model_path=whisper_base_path, language="en", cpu_threads=2)


@pytest.fixture(scope="session")
def tiny_config(whisper_tiny_path: Path) -> ASRConfig:
    return ASRConfig(model_path=whisper_tiny_path, language="en", cpu_threads=2)


@pytest.fixture(scope="session")
def whisper_base(base_config: ASRConfig) -> FasterWhisperBackend:
    return FasterWhisperBackend(base_config)


@pytest.fixture(scope="session")
def whisper_tiny(tiny_config: ASRConfig) -> FasterWhisperBackend:
    return FasterWhisperBackend(tiny_config)


@pytest.fixture(scope="session")
def wer():
    """Word error rate over pairs: ``wer([(reference, hypothesis), ...]) -> float``."""

    def rate(pairs: list[tuple[str, str]]) -> float:
        errors = [word_errors(ref, hyp) for ref, hyp in pairs]
        return sum(e for e, _ in errors) / max(1, sum(n for _, n in errors))

    return rate


@pytest.fixture(scope="session")
def hibari_path() -> Path:
    """The hibari package directory, as the assistant resolves it."""
    from assistant.models import resolve

    return resolve("tts")


@pytest.fixture(scope="session")
def coqui_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small VITS with random weights saved as a coqui checkpoint (config.json + model.pth).

    Its audio is noise (the weights are untrained): it proves the plumbing, not the voice.
    """
    import torch
    from TTS.tts.configs.shared_configs import CharactersConfig
    from TTS.tts.configs.vits_config import VitsArgs, VitsConfig
    from TTS.tts.models.vits import Vits

    args = VitsArgs(
        hidden_channels=32,
        hidden_channels_ffn_text_encoder=64,
        num_layers_text_encoder=2,
        num_layers_flow=2,
        num_layers_posterior_encoder=2,
        dropout_p_duration_predictor=0.0,
        use_sdp=False,  # the deterministic duration predictor
        init_discriminator=False,
        upsample_initial_channel_decoder=32,
        upsample_rates_decoder=[8, 8, 4],  # product = hop_length 256
        upsample_kernel_sizes_decoder=[16, 16, 8],
        resblock_kernel_sizes_decoder=[3],
        resblock_dilation_sizes_decoder=[[1, 3, 5]],
    )
    characters = CharactersConfig(
        characters_class="TTS.tts.models.vits.VitsCharacters",
        pad="_",
        eos="",
        bos="",
        blank=None,
        characters="abcdefghijklmnopqrstuvwxyz ",
        punctuations=".,!?;:'-",
        phonemes=None,
        is_unique=True,
        is_sorted=True,
    )
    config = VitsConfig(
        model_args=args,
        use_phonemes=False,  # characters in, so no phonemizer is needed
        text_cleaner="english_cleaners",
        characters=characters,
        add_blank=False,
    )
    torch.manual_seed(0)
    model = Vits(config)
    directory = tmp_path_factory.mktemp("coqui-vits-random")
    torch.save({"model": model.state_dict()}, directory / "model.pth")
    config.save_json(str(directory / "config.json"))
    return directory
