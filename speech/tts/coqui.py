"""coqui TTS (``coqui-tts``, the project's ``[coqui]`` extra) from a user-given checkpoint.

The checkpoint directory holds ``config.json`` and the weights: ``model.pth`` for VITS-style
models (plus any speaker/language files their config names), or the XTTS files
(``model.pth``, ``vocab.json``, ``speakers_xtts.pth``), which the model loads from the directory.
XTTS streams with its own ``inference_stream`` (chunks while one sentence is generated); other
models give one chunk per piece of text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from speech.chunker import chunk_text
from speech.config import ConfigError, TTSConfig
from speech.tts.base import TTSBackend, TTSUnavailable

INSTALL = "pip install 'handbook-voice-assistant[coqui]'"


class CoquiTTS(TTSBackend):
    """A coqui-tts model run through its ``Synthesizer`` (CPU, or CUDA with device="cuda")."""

    name = "coqui"

    def __init__(self, config: TTSConfig) -> None:
        super().__init__(config)
        try:
            from TTS.utils.synthesizer import Synthesizer
        except ImportError as exc:
            raise TTSUnavailable(
                f"the coqui backend needs coqui-tts: {INSTALL} "
                "(then remove torchaudio's CUDA-linked .so files, see docs/speech.md)"
            ) from exc
        config_file, checkpoint = _checkpoint(config.model_path)
        self._synth = Synthesizer(
            tts_checkpoint=str(checkpoint),
            tts_config_path=str(config_file),
            use_cuda=config.device.startswith("cuda"),
        )
        self.device = "cuda" if config.device.startswith("cuda") else "cpu"
        self.sample_rate = int(self._synth.output_sample_rate)
        self._model = self._synth.tts_model
        self._latents = self._xtts_voice() if hasattr(self._model, "inference_stream") else None
        if self._latents is None and config.speed != 1.0 and hasattr(self._model, "length_scale"):
            self._model.length_scale = self._model.length_scale / config.speed

    def _synthesize(self, text: str) -> Iterator[np.ndarray]:
        for piece in chunk_text(text):
            piece = piece.strip()
            if self._latents is not None:
                gpt_cond_latent, speaker_embedding = self._latents
                for chunk in self._model.inference_stream(
                    piece, self.config.language, gpt_cond_latent, speaker_embedding,
                    speed=self.config.speed,
                ):  # fmt: skip
                    yield chunk.detach().cpu().numpy().reshape(-1)
                continue
            multilingual = getattr(self._model, "language_manager", None) is not None and (
                self._model.language_manager.num_languages > 1
            )
            wav = self._synth.tts(
                piece,
                speaker_name=self.config.speaker,
                language_name=self.config.language if multilingual else None,
                split_sentences=False,
            )
            yield np.asarray(wav, np.float32)

    def _xtts_voice(self) -> tuple[object, object]:
        """XTTS conditioning: from ``speaker_wav`` (cloning) or a named built-in ``speaker``."""
        if self.config.speaker_wav is not None:
            return self._model.get_conditioning_latents(audio_path=[str(self.config.speaker_wav)])
        speakers = getattr(self._model.speaker_manager, "speakers", None) or {}
        if self.config.speaker in speakers:
            voice = speakers[self.config.speaker]
            return voice["gpt_cond_latent"], voice["speaker_embedding"]
        raise ConfigError(
            "an XTTS checkpoint needs TTSConfig.speaker_wav (reference audio) or speaker (one of "
            f"{sorted(speakers)[:5]}...)"
        )


def _checkpoint(model_path: Path | None) -> tuple[Path, Path]:
    """(config.json, what Synthesizer loads) for a checkpoint directory."""
    if model_path is None:
        raise ConfigError(
            "TTSConfig.model_path must name a coqui checkpoint directory (config.json + model.pth)"
        )
    directory = Path(model_path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{directory} is not a coqui checkpoint directory: no config.json in it")
    if json.loads(config_file.read_text(encoding="utf-8")).get("model") == "xtts":
        return config_file, directory  # XTTS loads its files from the directory
    weights = directory / "model.pth"
    if not weights.is_file():
        found = sorted(directory.glob("*.pth"))
        if len(found) != 1:
            raise ConfigError(
                f"{directory}: expected model.pth (or exactly one *.pth), found "
                f"{[p.name for p in found]}"
            )
        weights = found[0]
    return config_file, weights
