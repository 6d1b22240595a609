"""The assistant's configuration in one typed place (documents, prompt, generation, engine)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

HANDBOOK_DIR = Path(__file__).resolve().parent / "handbook"

SYSTEM_PROMPT = (
    "You are the employee handbook assistant of the company. Answer the employee's question "
    "using only the handbook below. Be brief: two or three sentences, with the concrete numbers, "
    "form names and steps from the handbook. If the handbook does not say, say so."
)
SYSTEM_PROMPT_ZH = (
    "你是公司的员工手册助手。只根据下面的员工手册回答员工的问题。回答要简短：两三句话，"
    "给出手册中的具体数字、表格名称和步骤。如果手册没有写，就直接说明。"
)


@dataclass
class EngineOptions:
    """The subset of engine settings the assistant exposes (see engine.EngineConfig)."""

    model: Path | None = None  # None: the embedded default (SmolLM2-135M-Instruct GGUF)
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    kv_cache_memory_bytes: int | None = None


@dataclass
class AssistantConfig:
    docs_dir: Path = HANDBOOK_DIR
    language: str = "auto"  # auto | en | zh: which handbook and system prompt to use
    max_tokens: int = 160
    temperature: float = 0.0
    engine: EngineOptions = field(default_factory=EngineOptions)

    def validate(self) -> None:
        if self.language not in ("auto", "en", "zh"):
            raise ValueError(f"language must be auto, en or zh, got {self.language!r}")
        if not self.docs_dir.is_dir():
            raise FileNotFoundError(f"documents folder not found: {self.docs_dir}")
        if self.engine.model is not None and not self.engine.model.exists():
            raise FileNotFoundError(f"model not found: {self.engine.model}")
