"""What every voice session shares, and early prefill.

:class:`VoiceServices`: the answerer (one engine, the documents prefix), one Whisper model behind
the speech package's :class:`~speech.asr.worker.ASRWorker`, and one TTS backend behind its
:class:`~speech.tts.worker.TTSWorker`, loaded and warmed up once per server, and the
:class:`~assistant.coscheduler.CoScheduler` whose hooks the workers are built with (the engine
gets its own when the answerer is created).

Early prefill (``VoiceConfig.early_prefill``): each partial transcript starts the answer to the
question so far and stops it after its first token (:func:`prefill`), so when the final arrives
the start of the question is already in the prefix cache and only the tail is prefilled.
"""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from assistant.answerer import INTERACTIVE, Answerer
from assistant.config import VoiceConfig
from assistant.coscheduler import CoScheduler
from assistant.image_reading import ImageReading
from assistant.models import resolve
from speech.asr.backend import Decoded, resolve_device
from speech.asr.worker import ASRJob, ASRWorker
from speech.audio import Resampler
from speech.cancel import CancelToken
from speech.config import ASRConfig, TTSConfig
from speech.tts.worker import TTSWorker

if TYPE_CHECKING:
    import torch


def front_end_processes(config: VoiceConfig) -> int:
    """``VoiceConfig.front_end_processes`` made concrete: a quarter of the cores (at most 8) when
    Whisper runs on a GPU, else 0 (in this process)."""
    if config.front_end_processes is not None:
        return config.front_end_processes
    return min(8, max(1, (os.cpu_count() or 4) // 4)) if resolve_device(config.asr_device) == "cuda" else 0


def partial_interval(config: VoiceConfig) -> float | None:
    """``VoiceConfig.partial_interval_s`` made concrete (None: no partials): as given (0: off), or by
    default at the speech package's cadence (``ASRConfig.partial_interval_s``, 0.5 s) when Whisper
    runs on a GPU or early prefill needs partials, else off."""
    if config.partial_interval_s is not None:
        return config.partial_interval_s or None
    return ASRConfig.partial_interval_s if config.early_prefill or resolve_device(config.asr_device) == "cuda" else None


def tts_processes(config: VoiceConfig) -> bool:
    """``VoiceConfig.tts_processes`` made concrete: voices in worker processes when Whisper runs on a GPU."""
    return config.tts_processes if config.tts_processes is not None else resolve_device(config.asr_device) == "cuda"


def endpointing(config: VoiceConfig, engine_device: torch.device) -> str:
    """``VoiceConfig.endpointing`` made concrete: "auto" is "speculative" when the LLM engine runs on
    the CPU (ASR and prefill take about a second there, and start at the short pause instead of after
    the hangover), "fixed" on a GPU (the VoiceConfig docstring has the measurements)."""
    if config.endpointing != "auto":
        return config.endpointing
    return "speculative" if engine_device.type == "cpu" else "fixed"


@dataclass
class VoiceServices:
    """What every session shares: the answerer (engine + documents), ASR worker and TTS worker."""

    answerer: Answerer
    asr: ASRWorker
    asr_config: ASRConfig
    tts: TTSWorker
    config: VoiceConfig
    coscheduler: CoScheduler
    images: ImageReading = field(default_factory=ImageReading)  # the image stage (OCR), shared like the others

    @classmethod
    def load(cls, answerer: Answerer, config: VoiceConfig, coscheduler: CoScheduler,
             gpu_lock: AbstractContextManager | None = None) -> VoiceServices:  # fmt: skip
        """Load Whisper (embedded base unless ``config.asr_model``) and the TTS voice (one instance
        per TTS worker thread, each warmed up), their workers built with the co-scheduler's hooks
        (``answerer``'s engine should have its step bound; ``gpu_lock`` is the lock its CUDA graph
        captures hold, which Whisper holds around its GPU batches). The services keep ``config`` with
        its endpointing made concrete for the answerer's engine (:func:`endpointing`)."""
        config = replace(config, endpointing=endpointing(config, answerer.engine.core.device))
        asr_config = ASRConfig(
            model_path=config.asr_model or resolve("asr"), language=config.asr_language,
            cpu_threads=config.asr_threads, partial_interval_s=partial_interval(config),
            device=config.asr_device, backend=config.asr_backend, load_format=config.asr_load_format,
            cuda_stream_priority=coscheduler.cuda_stream_priority, graph_steps=config.asr_graph_steps,
            encoder_cuda_graphs=config.asr_encoder_graphs, front_end_processes=front_end_processes(config),
        )  # fmt: skip
        tts_config = TTSConfig(backend=config.tts_backend, model_path=config.tts_model, voice=config.tts_voice,
                               workers=config.tts_workers, processes=tts_processes(config))  # fmt: skip
        asr = ASRWorker.from_config(asr_config, coscheduler.asr_policy(), gpu_lock)
        tts = TTSWorker.from_config(tts_config, first_pieces_first=coscheduler.enabled)
        return cls(answerer, asr, asr_config, tts, config, coscheduler)

    def warm_up(self) -> None:
        """Run each model once (documents prefix per handbook language, with
        ``AssistantConfig.warm_documents`` each document's part of a question too, Whisper, TTS),
        so the first caller pays no one-off costs. Call it outside any running event loop."""

        async def run() -> None:
            languages = {self.answerer.language_for(sample): sample for sample in ("Hello.", "你好。")}
            for sample in languages.values():
                await prefill(self.answerer, sample, [], f"warm-up-{uuid.uuid4().hex[:8]}")
            if self.answerer.config.warm_documents:
                await self.answerer.warm_documents()
            speech = np.concatenate([c.pcm async for c, _ in self.tts.stream("Hello, how are you?", CancelToken(), True)])
            self._transcribe(Resampler(self.tts.sample_rate, 16000).process(speech))

        asyncio.run(run())

    def _transcribe(self, audio16k: np.ndarray) -> None:
        """Decode a clip through the shared worker and wait for it (warm-up only)."""
        done = threading.Event()

        def on_done(job: ASRJob, out: Decoded | Exception, queue_s: float, decode_s: float) -> None:
            done.set()

        self.asr.submit(ASRJob(self.asr.new_session_id(), 0, True, audio16k, "", self.asr_config.language,
                               len(audio16k) / 16000, on_done))  # fmt: skip
        done.wait()

    def close(self) -> None:
        self.tts.close()
        self.asr.close()


async def prefill(answerer: Answerer, question: str, history: list[dict[str, str]], request_id: str) -> None:
    """Compute the KV of the answer's prompt: start the answer, stop it after its first token.

    It goes through :meth:`Answerer.answer` so the prompt and its prefix-cache keys are exactly
    those of the real answer; the engine counts the request as aborted."""
    answer = answerer.answer(question, history, priority=INTERACTIVE, request_id=request_id)
    try:
        async for _ in answer:
            return
    finally:
        await answer.aclose()


__all__ = ["VoiceServices", "prefill"]
