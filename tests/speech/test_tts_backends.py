"""TTS backends: real synthesis, streaming, cancellation, and clear errors."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from speech.cancel import CancelToken, Generation
from speech.config import TTS_BACKENDS, ConfigError, TTSConfig
from speech.tts import TTSBackend, TTSUnavailable, load_tts
from speech.tts.espeak import EspeakTTS
from speech.tts.factory import BACKENDS

ENGLISH = "How do I apply for annual leave?"
CHINESE = "年假怎么申请？请登录人事系统。"
FOUR_SENTENCES = (
    "Annual leave is twenty five days a year. You can carry over five days. "
    "Ask your manager first. Then submit the form in PeopleHub."
)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", params=["hibari", "hibari in a process", "espeak", "coqui"])
def backend(request, coqui_checkpoint: Path) -> Iterator[TTSBackend]:
    """Each backend once: hibari (bundled voice; also in a worker process of its own, as a GPU
    server runs it), espeak-ng, coqui (random VITS: noise)."""
    name = request.param.split()[0]
    model_path = coqui_checkpoint if name == "coqui" else None
    voice = load_tts(TTSConfig(backend=name, model_path=model_path, seed=0, processes=request.param.endswith("process")))
    yield voice
    voice.close()


def test_a_voice_in_a_process_speaks_as_in_this_one() -> None:
    """The same pieces, sample for sample, from the process as from the voice here; a config
    error raised there is raised here as the same error."""
    here, there = load_tts(TTSConfig(seed=0)), load_tts(TTSConfig(seed=0, processes=True))
    try:
        assert there.name == "hibari (process)" and there.sample_rate == here.sample_rate
        ours, theirs = list(here.stream(FOUR_SENTENCES)), list(there.stream(FOUR_SENTENCES))
        assert len(ours) == len(theirs) >= 4
        for a, b in zip(ours, theirs):
            np.testing.assert_array_equal(a.pcm, b.pcm)
        there._process.kill()  # a voice process that dies: its next text starts a new one
        there._process.join(10)
        assert len(there.synthesize(ENGLISH).pcm) > 0 and there.restarts == 1
    finally:
        there.close()
    assert not there._process.is_alive()
    with pytest.raises(ConfigError, match="hibari voice speaks English only"):
        load_tts(TTSConfig(language="zh", processes=True))


def assert_audible(pcm: np.ndarray) -> None:
    assert pcm.dtype == np.float32 and np.isfinite(pcm).all()
    assert np.abs(pcm).max() > 0.05 and np.sqrt(np.mean(pcm**2)) > 0.005


def test_english_audio_is_audible_and_of_plausible_length(backend: TTSBackend) -> None:
    audio = backend.synthesize(ENGLISH)
    assert_audible(audio.pcm)
    if backend.name == "coqui":
        # Random weights: the audio is noise and its length comes from an untrained duration
        # predictor, so only "some audio per character, not absurdly much" is checked.
        assert 0.005 * len(ENGLISH) < audio.duration_s < 0.5 * len(ENGLISH)
    else:
        assert len(ENGLISH) / 25 < audio.duration_s < len(ENGLISH) / 5  # 5 to 25 characters/s


def test_espeak_speaks_chinese() -> None:
    tts = load_tts(TTSConfig(backend="espeak", language="zh"))
    assert tts.voice == "cmn"
    audio = tts.synthesize(CHINESE)
    assert_audible(audio.pcm)
    syllables = 13  # CJK characters
    assert syllables * 0.1 < audio.duration_s < syllables * 0.6


def test_stream_gives_a_chunk_per_piece_and_the_first_early(backend: TTSBackend) -> None:
    started = time.perf_counter()
    arrivals, chunks = [], []
    for chunk in backend.stream(FOUR_SENTENCES):
        arrivals.append(time.perf_counter() - started)
        chunks.append(chunk)
    assert len(chunks) >= 4
    assert all(c.sample_rate == backend.sample_rate and len(c.pcm) for c in chunks)
    assert arrivals[0] < arrivals[-1]  # the first chunk did not wait for the whole text


def test_cancel_mid_stream_stops_within_one_chunk(backend: TTSBackend) -> None:
    generation = Generation()
    received = []
    for chunk in backend.stream(FOUR_SENTENCES, cancel=generation.advance()):
        received.append(chunk)
        generation.advance()  # barge-in after the first chunk
    assert len(received) == 1
    token = CancelToken()
    token.cancel()
    assert list(backend.stream(FOUR_SENTENCES, cancel=token)) == []


def test_a_new_generation_cancels_only_older_tokens() -> None:
    generation = Generation()
    old = generation.advance()
    new = generation.advance()
    assert old.cancelled and not new.cancelled and generation.current == 2
    new.cancel()
    assert new.cancelled


@pytest.mark.parametrize("name", ["hibari", "espeak", "coqui"])
def test_speed_shortens_the_audio(name: str, coqui_checkpoint: Path) -> None:
    model_path = coqui_checkpoint if name == "coqui" else None
    normal = load_tts(TTSConfig(backend=name, model_path=model_path, seed=0))
    fast = load_tts(TTSConfig(backend=name, model_path=model_path, seed=0, speed=2.0))
    assert fast.synthesize(ENGLISH).duration_s < 0.8 * normal.synthesize(ENGLISH).duration_s


def test_hibari_loads_from_the_package_directory(hibari_path: Path) -> None:
    tts = load_tts(TTSConfig(backend="hibari", model_path=hibari_path, seed=0))
    assert tts.sample_rate == 24000
    assert_audible(tts.synthesize("Hello.").pcm)


def test_empty_text_gives_no_audio(backend: TTSBackend) -> None:
    assert list(backend.stream("")) == []
    with pytest.raises(TypeError, match="text must be a str"):
        list(backend.stream(b"bytes"))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (dict(backend="hibari", language="zh"), "hibari voice speaks English only"),
        (dict(backend="hibari", model_path=Path("/nonexistent")), "no hibari ONNX voice there"),
        (dict(backend="coqui"), "must name a coqui checkpoint directory"),
        (dict(backend="coqui", model_path=Path("/tmp")), "no config.json in it"),
        (dict(backend="espeak", voice="xx-nope"), "espeak-ng failed for voice 'xx-nope'"),
    ],
)
def test_bad_tts_settings_give_clear_errors(config: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_tts(TTSConfig(**config))


def test_unknown_backend_is_rejected_by_the_config() -> None:
    with pytest.raises(ConfigError, match=r"available backends are \('hibari', 'coqui', 'espeak'\)"):
        TTSConfig(backend="festival")
    assert tuple(BACKENDS) == TTS_BACKENDS  # every name the config accepts can be loaded


def test_missing_espeak_program_says_what_to_install() -> None:
    with pytest.raises(TTSUnavailable, match="apt-get install espeak-ng"):
        EspeakTTS(TTSConfig(backend="espeak"), binary="espeak-ng-not-installed")


@pytest.mark.parametrize(
    ("backend_name", "module", "install"),
    [
        ("coqui", "TTS", "pip install 'handbook-voice-assistant[coqui]'"),
        ("hibari", "hibari", "pip install --no-deps hibari-tts==0.2.1"),
    ],
)
def test_missing_python_package_says_what_to_install(
    backend_name: str, module: str, install: str, tmp_path: Path
) -> None:
    """In a fresh interpreter where importing the package fails, as if it were not installed."""
    code = (
        "import sys; sys.modules[%r] = None\n"  # makes `import <module>` raise ImportError
        "from speech.config import TTSConfig\n"
        "from speech.tts import TTSUnavailable, load_tts\n"
        "try:\n"
        "    load_tts(TTSConfig(backend=%r, model_path=%r))\n"
        "except TTSUnavailable as exc:\n"
        "    print(exc)\n"
    ) % (module, backend_name, str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert install in done.stdout, done.stdout + done.stderr
