"""``python -m assistant serve`` options reach the configs, and the voice they pick really speaks."""

from __future__ import annotations

import numpy as np
import pytest

from assistant.serve_command import parse_config
from speech.config import TTSConfig
from speech.tts.factory import load_tts


def test_tts_options_reach_the_voice_config_and_that_backend_speaks():
    config, _, _ = parse_config(["serve", "--tts-backend", "espeak", "--tts-voice", "en-us", "--port", "0"])
    voice = config.voice
    assert (voice.tts_backend, voice.tts_voice, voice.tts_model) == ("espeak", "en-us", None)
    tts = load_tts(TTSConfig(backend=voice.tts_backend, voice=voice.tts_voice))
    audio = np.concatenate([c.pcm for c in tts.stream("Annual leave is twenty days.")])
    assert audio.size > 0.5 * tts.sample_rate and np.abs(audio.astype(np.float64)).max() > 0


def test_max_utterance_length_reaches_the_voice_config():
    """30 s by default; 0 turns the cut off; a length shorter than the speech start is refused."""
    assert parse_config(["serve"])[0].voice.max_utterance_s == 30.0
    assert parse_config(["serve", "--max-utterance-s", "12.5"])[0].voice.max_utterance_s == 12.5
    config = parse_config(["serve", "--max-utterance-s", "0"])[0]
    assert config.voice.max_utterance_s is None
    config.validate()
    config.voice.max_utterance_s = 0.01
    with pytest.raises(ValueError, match="max_utterance_s must be longer than start_ms"):
        config.validate()


def test_unknown_tts_backend_is_refused_by_the_command_line(capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(["serve", "--tts-backend", "festival"])
    assert e.value.code == 2 and "festival" in capsys.readouterr().err


def test_bad_documents_folder_exits_2_with_one_line_for_both_entry_points(tmp_path):
    import subprocess
    import sys

    from tests.conftest import REPO

    for module in ("assistant", "web"):
        args = [sys.executable, "-m", module, *(["serve"] if module == "assistant" else []), "--docs", str(tmp_path / "nope"), "--port", "0"]
        r = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.returncode == 2 and len(errors) == 1 and "not found" in errors[0], (module, r.stderr)
        assert "Traceback" not in r.stderr


def test_asr_device_backend_and_load_format_reach_the_voice_config():
    """auto everywhere by default (the torch Whisper on a GPU, faster-whisper on the CPU)."""
    from speech.asr.backend import backend_name
    from speech.config import ASRConfig

    voice = parse_config(["serve"])[0].voice
    assert (voice.asr_device, voice.asr_backend, voice.asr_load_format) == ("auto", "auto", "auto")
    voice = parse_config(["serve", "--asr-device", "cuda", "--asr-load-format", "dummy"])[0].voice
    asr = ASRConfig(device=voice.asr_device, backend=voice.asr_backend, load_format=voice.asr_load_format)
    assert backend_name(asr) == "torch"
    voice = parse_config(["serve", "--asr-device", "cpu", "--asr-backend", "torch"])[0].voice
    assert (voice.asr_device, voice.asr_backend) == ("cpu", "torch")
