"""Whisper in PyTorch over the embedded CTranslate2 weights: the ASR backend for a GPU.

``TorchWhisperBackend`` transcribes a batch of clips at once: every clip's 30 s windows go through
one encoder batch (:class:`~speech.asr.encoder_graphs.EncoderGraphs`, from CUDA graphs on a GPU),
then all rows decode together (:class:`~speech.asr.greedy_decode.GreedyDecoder`, ``graph_steps``
steps a CUDA graph replay on a GPU), on a high-priority CUDA stream unless
``ASRConfig.cuda_stream_priority`` is "default". It decodes as faster-whisper does with this
project's settings (greedy, temperature 0, no timestamps, no previous text; the prefix forced on a
clip's first window) and applies the same guards as
:class:`~speech.asr.backend.FasterWhisperBackend`: a window whose no-speech probability is above
``no_speech_threshold`` while its average log-probability is not above ``log_prob_threshold`` is
skipped; a kept window below ``log_prob_threshold``, above ``compression_ratio_threshold`` or
saying one sentence twice in a row is rejected. So on the CPU in float32 its transcripts equal
faster-whisper's.

``load_format="dummy"`` builds the large-v3-turbo shape with random weights for timing: every
decode runs exactly ``dummy_tokens`` tokens after the prompt and prefix, without guards, and is
marked ``Decoded.dummy``.
"""

from __future__ import annotations

import json
import logging
import zlib
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from speech.asr.backend import ASRBackend, Decoded, repeats_a_sentence, resolve_device
from speech.asr.ct2_weights import read_ct2_model
from speech.asr.encoder_graphs import EncoderGraphs
from speech.asr.greedy_decode import DecodeRules, GreedyDecoder, RowPrompt
from speech.asr.log_mel import LogMel
from speech.asr.whisper_model import TURBO_DIMS, WhisperDims, from_ct2, random_whisper
from speech.audio import to_float32
from speech.config import ASRConfig, ConfigError

log = logging.getLogger(__name__)

MAX_PREFIX_TOKENS = 223  # faster-whisper keeps a prefix under half the 448-token context


@dataclass(frozen=True)
class SpecialTokens:
    """Whisper's special token ids and its language tokens (code -> id)."""

    eot: int
    sot: int
    translate: int
    transcribe: int
    sot_lm: int
    sot_prev: int
    no_speech: int
    no_timestamps: int
    languages: dict[str, int]
    multilingual: bool

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, lang_ids: list[int], n_vocab: int) -> SpecialTokens:
        def token(*names: str) -> int:
            for name in names:
                if (found := tokenizer.token_to_id(name)) is not None:
                    return found
            raise ConfigError(f"the Whisper tokenizer has none of {names}")

        languages = {tokenizer.id_to_token(i)[2:-2]: i for i in lang_ids}
        return cls(token("<|endoftext|>"), token("<|startoftranscript|>"), token("<|translate|>"),
                   token("<|transcribe|>"), token("<|startoflm|>"), token("<|startofprev|>"),
                   token("<|nospeech|>", "<|nocaptions|>"), token("<|notimestamps|>"), languages,
                   n_vocab >= 51865)  # fmt: skip

    @classmethod
    def from_layout(cls, n_vocab: int) -> SpecialTokens:
        """The ids by Whisper's fixed layout (for random weights without a tokenizer; English only)."""
        multilingual = n_vocab >= 51865
        eot = 50257 if multilingual else 50256
        sot = eot + 1
        n_languages = n_vocab - 51765 - multilingual
        after = sot + 1 + n_languages
        return cls(eot, sot, after, after + 1, after + 2, after + 3, after + 4, after + 5,
                   {"en": sot + 1}, multilingual)  # fmt: skip

    @property
    def suppress_always(self) -> list[int]:
        """The special tokens faster-whisper always suppresses (besides the non-speech ones)."""
        return [self.transcribe, self.translate, self.sot, self.sot_prev, self.sot_lm, self.no_speech]


def compression_ratio(text: str) -> float:
    """Bytes of ``text`` over bytes of its zlib compression (repetition loops score high)."""
    raw = text.encode("utf-8")
    return len(raw) / len(zlib.compress(raw))


class TorchWhisperBackend(ASRBackend):
    """Whisper in PyTorch, batched across sessions (see the module docstring).

    ``dummy_dims`` replaces the turbo shape of a ``load_format="dummy"`` model (tests use a small one).
    """

    def __init__(self, config: ASRConfig, dummy_dims: WhisperDims | None = None, gpu_lock: AbstractContextManager | None = None) -> None:
        self.config = config
        # Held around each batch's GPU work (and the captures here): the process's other CUDA graph
        # captures (the LLM engine's, while serving) take it too, so none runs beside this work.
        self.gpu_lock = gpu_lock or nullcontext()
        self.torch_device = torch.device(resolve_device(config.device))
        self.device = str(self.torch_device)
        dtype = torch.float16 if self.torch_device.type == "cuda" else torch.float32
        self.dummy = config.load_format == "dummy"
        path = None if config.model_path is None else Path(config.model_path)
        if self.dummy:
            dims = dummy_dims or TURBO_DIMS
            self.model = random_whisper(dims, self.torch_device, dtype)
            tokenizer_file = None if path is None else path / "tokenizer.json"
            self.tokenizer = Tokenizer.from_file(str(tokenizer_file)) if tokenizer_file and tokenizer_file.is_file() else None
            self.special = SpecialTokens.from_layout(dims.n_vocab)
            suppress, suppress_begin = self.special.suppress_always, [self.special.eot]
            log.warning("ASR: a %s-shaped Whisper with random weights (load_format dummy): every decode is "
                        "%d forced tokens, its transcripts mean nothing", "large-v3-turbo" if dims == TURBO_DIMS
                        else "test", config.dummy_tokens)  # fmt: skip
        else:
            if path is None or not (path / "model.bin").is_file():
                raise ConfigError(f"ASRConfig.model_path={path}: not a CTranslate2 Whisper directory "
                                  "(model.bin, config.json, tokenizer.json)")  # fmt: skip
            self.model = from_ct2(read_ct2_model(path), self.torch_device, dtype)
            self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
            settings = json.loads((path / "config.json").read_text("utf-8"))
            self.special = SpecialTokens.from_tokenizer(self.tokenizer, settings["lang_ids"], self.model.dims.n_vocab)
            suppress = sorted(set(settings["suppress_ids"]) | set(self.special.suppress_always))
            suppress_begin = settings["suppress_ids_begin"]
        special = self.special
        self.supported_languages = tuple(special.languages) if special.multilingual else ("en",)
        self.check_language(config.language)
        self.max_batch = config.max_batch
        self._prompt_length = 4 if special.multilingual else 2
        rules = DecodeRules(
            eot=special.eot, no_speech=special.no_speech,
            lang_ids=list(special.languages.values()) if special.multilingual else [],
            suppress=suppress, suppress_begin=suppress_begin, prompt_length=self._prompt_length,
            max_new=config.dummy_tokens if self.dummy else 224, allow_eot=not self.dummy,
        )  # fmt: skip
        stream = None
        if self.torch_device.type == "cuda" and config.cuda_stream_priority == "high":
            stream = torch.cuda.Stream(device=self.torch_device, priority=min(torch.cuda.Stream.priority_range()))
        # Off the GPU a multi-step replay would only add masked steps: one step, then the check.
        steps = config.graph_steps if self.torch_device.type == "cuda" and config.cuda_graphs else 1
        self.decoder = GreedyDecoder(self.model, rules, config.max_batch, config.cuda_graphs, stream, steps)
        self.encoder = EncoderGraphs(self.model, config.max_batch, config.encoder_cuda_graphs, stream)
        self.mel = LogMel(self.model.dims.n_mels, self.torch_device)
        with self.gpu_lock, self.decoder.stream_context():
            self.encoder.capture()
            self.decoder.capture()
        self._language_of = {token: code for code, token in special.languages.items()}

    # ---- the interface -------------------------------------------------------------------------------
    def transcribe(self, audio: np.ndarray, prefix: str = "", language: str | None = None) -> Decoded:
        return self.transcribe_batch([(audio, prefix, language)])[0]

    def transcribe_batch(self, clips: list[tuple[np.ndarray, str, str | None]]) -> list[Decoded]:
        """Transcribe every clip in one encoder batch and one decode (rows beyond ``max_batch``
        in further rounds); each clip as ``transcribe`` would."""
        if not clips:
            return []
        languages = [self._language(language) for _, _, language in clips]
        with self.gpu_lock, torch.inference_mode(), self.decoder.stream_context():
            windows = self.mel.windows([to_float32(audio) for audio, _, _ in clips])
            prompts, first_row = [], {}
            for row, (clip, first) in enumerate(zip(windows.clip, windows.first)):
                first_row.setdefault(clip, row)
                prefix = clips[clip][1] if first else ""
                prompts.append(self._prompt(languages[clip], prefix, first_row[clip]
                                            if first_row[clip] != row else None))  # fmt: skip
            rows = []
            if prompts:
                audio = torch.cat([self.encoder.encode(windows.features[i : i + self.max_batch])
                                   for i in range(0, len(prompts), self.max_batch)])  # fmt: skip
                rows = self.decoder.decode(audio, prompts)
        return [self._clip_result([r for r, c in zip(rows, windows.clip) if c == index], languages[index])
                for index in range(len(clips))]  # fmt: skip

    def memory_bytes(self) -> dict[str, int]:
        """Device memory this backend holds, by owner: weights and the decoder's KV cache (CUDA
        graphs' private pool not included: PyTorch does not report it apart)."""
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return {"asr weights": weights, "asr buffers": self.decoder.cache.nbytes + self.encoder.nbytes}

    # ---- helpers -------------------------------------------------------------------------------------
    def _language(self, language: str | None) -> str:
        language = self.config.language if language is None else language
        return "en" if not self.special.multilingual else language

    def _prompt(self, language: str, prefix: str, leader: int | None) -> RowPrompt:
        special = self.special
        if special.multilingual:
            auto = language == "auto"
            language_token = special.sot if auto else special.languages[language]  # "auto": chosen at step 0
            forced = [special.sot, language_token, special.transcribe, special.no_timestamps]
        else:
            auto, forced = False, [special.sot, special.no_timestamps]
        if prefix.strip() and self.tokenizer is not None:
            forced += self.tokenizer.encode(" " + prefix.strip(), add_special_tokens=False).ids[:MAX_PREFIX_TOKENS]
        return RowPrompt(forced, auto, leader if auto else None)

    def _text(self, tokens: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        limit = min(self.special.eot, self.tokenizer.get_vocab_size())
        return self.tokenizer.decode([t for t in tokens if t < limit])

    def _clip_result(self, rows: list, language: str) -> Decoded:
        config = self.config
        if language == "auto":
            token = rows[0].language_token if rows else None
            language = self._language_of.get(token, self.supported_languages[0])
        kept, rejected, tokens = [], 0, 0
        for row in rows:
            tokens += len(row.tokens)
            text = self._text(row.tokens)
            if self.dummy:
                kept.append(text)
                continue
            avg_logprob = row.sum_logprob / (len(row.tokens) + 1)
            if row.no_speech_prob > config.no_speech_threshold and avg_logprob <= config.log_prob_threshold:
                continue  # silence: faster-whisper skips the window
            if not text.strip():
                continue
            if (avg_logprob < config.log_prob_threshold or compression_ratio(text.strip()) > config.compression_ratio_threshold
                    or config.reject_repeated_sentences and repeats_a_sentence(text)):
                rejected += 1
            else:
                kept.append(text)
        return Decoded("".join(kept).strip(), language, rejected, tokens=tokens, dummy=self.dummy)


__all__ = ["SpecialTokens", "TorchWhisperBackend", "compression_ratio"]
