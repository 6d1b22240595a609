"""espeak-ng: formant synthesis, always available (apt), many languages including Mandarin."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator

import numpy as np

from speech.audio import AudioFormatError, decode_wav
from speech.chunker import chunk_text
from speech.config import ConfigError, TTSConfig
from speech.tts.base import TTSBackend, TTSUnavailable

INSTALL = "apt-get install espeak-ng"
DEFAULT_VOICES = {"en": "en-us", "zh": "cmn"}
WORDS_PER_MINUTE = 175  # espeak-ng's default rate, scaled by TTSConfig.speed


class EspeakTTS(TTSBackend):
    """Runs the ``espeak-ng`` program once per piece of text (pieces cut by the chunker)."""

    name = "espeak"

    def __init__(self, config: TTSConfig, binary: str = "espeak-ng") -> None:
        super().__init__(config)
        path = shutil.which(binary)
        if path is None:
            raise TTSUnavailable(f"the espeak backend needs the espeak-ng program: {INSTALL}")
        self._binary = path
        language = config.language.lower()
        self.voice = config.voice or DEFAULT_VOICES.get(language.split("-")[0], language)
        probe, self.sample_rate = self._run("a")  # checks the voice and learns the rate
        if not len(probe):
            raise ConfigError(f"espeak-ng produced no audio for voice {self.voice!r}")

    def _synthesize(self, text: str) -> Iterator[np.ndarray]:
        for piece in chunk_text(text):
            yield self._run(piece.strip())[0]

    def _run(self, text: str) -> tuple[np.ndarray, int]:
        speed = str(round(WORDS_PER_MINUTE * self.config.speed))
        done = subprocess.run(
            [self._binary, "-v", self.voice, "-s", speed, "--stdout"],
            input=text.encode("utf-8"),  # on stdin, so text is never taken for an option
            capture_output=True,
            check=False,
        )
        if done.returncode != 0 or not done.stdout:
            message = done.stderr.decode("utf-8", "replace").strip()
            raise ConfigError(f"espeak-ng failed for voice {self.voice!r}: {message}")
        try:
            return decode_wav(done.stdout)
        except AudioFormatError as exc:
            raise TTSUnavailable(f"espeak-ng wrote unreadable audio: {exc}") from exc
