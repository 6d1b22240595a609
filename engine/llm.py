"""Offline API: ``LLM(model).generate(prompts, params)`` runs the engine to completion."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from engine.config import ConfigError, EngineConfig
from engine.engine_builder import build_engine
from engine.engine_core import EngineCore
from engine.loaded_model import LoadedModel
from engine.metrics import EngineStats
from engine.outputs import CompletionOutput
from engine.sampling import SamplingParams
from engine.tokenizer import Tokenizer

Prompt = str | Sequence[int]


def make_config(model: str, **kwargs: Any) -> EngineConfig:
    """An :class:`EngineConfig` from keyword arguments, rejecting unknown names."""
    unknown = sorted(set(kwargs) - EngineConfig.field_names())
    if unknown:
        raise ConfigError(f"unknown engine option(s): {', '.join(unknown)}")
    return EngineConfig(model=str(model), **kwargs)


class LLM:
    def __init__(
        self, model: str | None = None, *, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
        core: EngineCore | None = None, draft_loaded: LoadedModel | None = None, **kwargs: Any
    ) -> None:
        """``LLM(path, **EngineConfig fields)``; pass ``loaded`` (and ``draft_loaded``, a draft
        model's) to reuse already loaded weights, or ``core`` to drive an engine already built
        (:func:`engine.engine_builder.build_engine`)."""
        if core is not None:
            self.core = core
            return
        if config is None:
            if model is None:
                raise ConfigError("LLM needs a model path or an EngineConfig")
            config = make_config(model, **kwargs)
        self.core = build_engine(config, loaded, draft_loaded=draft_loaded)

    @property
    def tokenizer(self) -> Tokenizer:
        if self.core.tokenizer is None:
            raise ConfigError("this model has no tokenizer (dummy weights); pass token ids")
        return self.core.tokenizer

    def encode(self, prompt: Prompt) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: int = 0,
        use_tqdm: bool = False,
    ) -> list[CompletionOutput]:
        """Complete every prompt (text or token ids); results in input order.

        All prompts are validated before any is scheduled, so one bad prompt schedules nothing.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        token_lists = [self.encode(p) for p in prompts]  # type: ignore[union-attr]
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(token_lists)
        else:
            params_list = list(params)
            if len(params_list) != len(token_lists):
                raise ValueError(f"{len(params_list)} sampling params for {len(token_lists)} prompts")
        for ids, p in zip(token_lists, params_list):
            self.core.validate_request(ids, p, None)
        results: dict[str, CompletionOutput] = {}
        order = []
        for ids, p in zip(token_lists, params_list):
            req = self.core.add_request(ids, p, priority=priority)
            results[req.request_id] = CompletionOutput(req.request_id, ids)
            order.append(req.request_id)
        with tqdm(total=len(order), desc="Generating", disable=not use_tqdm, unit="req") as bar:
            while self.core.has_unfinished_requests():
                for delta in self.core.step():
                    results[delta.request_id].add(delta)
                    if delta.finished:
                        bar.update(1)
        return [results[rid] for rid in order]

    def chat(
        self,
        conversations: list[dict[str, str]] | list[list[dict[str, str]]],
        params: SamplingParams | None = None,
        **kwargs: Any,
    ) -> list[CompletionOutput]:
        """Apply the model's chat template to each conversation, then :meth:`generate`."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [self.tokenizer.apply_chat_template(c) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, params, **kwargs)

    def stats(self) -> EngineStats:
        return self.core.stats()
