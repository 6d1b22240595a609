"""Memory by owner across the three models of one server: the LLM engine, Whisper and the voice.

The engine's ledger (weights, KV cache, profiled activations, CUDA graph pools) is merged with
what the ASR backend reports (:meth:`~speech.asr.backend.ASRBackend.memory_bytes`: "asr weights",
"asr buffers"); engine owners are prefixed "llm ". Owners on the engine's device share one
ledger, so on CUDA its "other" row (peak reserved minus every owner) is not charged with Whisper's
memory. A part that reports nothing (faster-whisper on the CPU, the hibari voice, which is ONNX
on the CPU) has no memory row; where each model runs is its own gauge.

On ``/metrics``: ``assistant_memory_bytes{owner, device}`` and ``assistant_model_device{model,
device}`` (1 per model: llm, asr, tts).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.engine_core import EngineCore
from engine.memory import MemoryLedger
from speech.asr.backend import ASRBackend
from speech.tts.base import TTSBackend


@dataclass(frozen=True)
class MemoryRow:
    owner: str
    device: str
    nbytes: int


@dataclass(frozen=True)
class ServerModels:
    """The three models of a server, whose memory is reported."""

    engine: EngineCore
    asr: ASRBackend
    tts: TTSBackend

    def devices(self) -> dict[str, str]:
        """Where each model runs: {"llm": ..., "asr": ..., "tts": ...}."""
        return {"llm": self.engine.memory.device, "asr": self.asr.device, "tts": self.tts.device}

    def memory_rows(self) -> list[MemoryRow]:
        """Every owner's bytes on its device (engine device first, with its "other" and peak rows on CUDA)."""
        ledger = self.engine.memory_ledger()
        merged = MemoryLedger(ledger.device, {f"llm {owner}": nbytes for owner, nbytes in ledger.entries.items()})
        apart: list[MemoryRow] = []
        for owner, nbytes in self.asr.memory_bytes().items():
            if same_device(self.asr.device, ledger.device):
                merged.record(owner, nbytes)
            else:
                apart.append(MemoryRow(owner, self.asr.device, nbytes))
        return [MemoryRow(owner, ledger.device, nbytes) for owner, nbytes in merged.rows()] + apart


def same_device(a: str, b: str) -> bool:
    """Whether two device names are one device ("cuda" is the current CUDA device)."""
    da, db = torch.device(a), torch.device(b)
    if da.type != db.type:
        return False
    if da.type != "cuda":
        return True
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (da.index if da.index is not None else current) == (db.index if db.index is not None else current)


class MemoryCollector(Collector):
    """``assistant_memory_bytes`` and ``assistant_model_device``, read at scrape time."""

    def __init__(self, models: ServerModels) -> None:
        self.models = models

    def collect(self) -> Iterator[Metric]:
        memory = GaugeMetricFamily("assistant_memory_bytes", "Memory held by each owner (LLM, ASR) on its device, in bytes.",
                                   labels=("owner", "device"))  # fmt: skip
        for row in self.models.memory_rows():
            memory.add_metric([row.owner, row.device], row.nbytes)
        yield memory
        placed = GaugeMetricFamily("assistant_model_device", "Where each model runs (1 per model).", labels=("model", "device"))
        for model, device in self.models.devices().items():
            placed.add_metric([model, device], 1)
        yield placed


__all__ = ["MemoryCollector", "MemoryRow", "ServerModels", "same_device"]
