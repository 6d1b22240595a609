"""Answers handbook questions with the engine: shared documents prefix, streamed deltas.

One :class:`Answerer` per process holds the engine and one prompt builder per handbook language;
every session's prompt starts with the same prefix token ids, so its KV is computed once.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from assistant.config import SYSTEM_PROMPT, SYSTEM_PROMPT_ZH, AssistantConfig
from assistant.docs import DocumentSet, detect_language, load_library
from assistant.prompt import Message, PromptBuilder
from engine import AsyncEngine, EngineConfig, SamplingParams

INTERACTIVE = 0  # engine priority of a live conversation turn


@dataclass
class AnswerDelta:
    text: str
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float | None = None
    decode_tokens_per_s: float | None = None


def default_model_path() -> str:
    from assistant.models import resolve

    return str(resolve("llm"))


class Answerer:
    def __init__(self, config: AssistantConfig, engine: AsyncEngine, library: dict[str, DocumentSet]) -> None:
        self.config = config
        self.engine = engine
        self.library = library
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise ValueError("the model has no tokenizer; the assistant needs text")
        self.builders = {
            lang: PromptBuilder(tokenizer, SYSTEM_PROMPT_ZH if lang == "zh" else SYSTEM_PROMPT, docs)
            for lang, docs in library.items()
        }

    @classmethod
    def create(cls, config: AssistantConfig) -> "Answerer":
        config.validate()
        library = load_library(config.docs_dir)
        opts = config.engine
        engine_config = EngineConfig(
            model=str(opts.model) if opts.model else default_model_path(),
            device=opts.device,
            dtype=opts.dtype,  # type: ignore[arg-type]
            max_num_seqs=opts.max_num_seqs,
            max_num_batched_tokens=opts.max_num_batched_tokens,
            kv_cache_memory_bytes=opts.kv_cache_memory_bytes,
        )
        return cls(config, AsyncEngine(engine_config), library)

    def language_for(self, question: str) -> str:
        if "any" in self.builders:
            return "any"
        lang = self.config.language if self.config.language != "auto" else detect_language(question)
        return lang if lang in self.builders else next(iter(self.builders))

    def prompt_ids(self, question: str, history: list[Message]) -> list[int]:
        return self.builders[self.language_for(question)].build(history, question)

    async def answer(
        self, question: str, history: list[Message] | None = None, *, priority: int = INTERACTIVE, request_id: str | None = None
    ) -> AsyncIterator[AnswerDelta]:
        """Stream the answer to ``question`` after ``history`` (alternating user/assistant)."""
        if not question.strip():
            raise ValueError("the question is empty")
        ids = self.prompt_ids(question, history or [])
        params = SamplingParams(max_tokens=self.config.max_tokens, temperature=self.config.temperature)
        start = time.perf_counter()
        async for out in self.engine.generate(ids, params, priority=priority, request_id=request_id):
            delta = AnswerDelta(out.text, out.finished, out.finish_reason, out.num_prompt_tokens, out.num_cached_tokens, out.num_generated_tokens)
            if out.finished and out.metrics is not None:
                m = out.metrics
                delta.ttft_s = m.ttft if m.ttft is not None else time.perf_counter() - start
                delta.decode_tokens_per_s = (1.0 / m.tpot) if m.tpot else None
            yield delta

    def shutdown(self) -> None:
        self.engine.shutdown()
