"""The assistant's one process: every way in, on one engine and one set of speech models.

Routes: ``/v1/realtime`` (the OpenAI Realtime API over WebSocket: voice and text turns), the
OpenAI-compatible HTTP routes of :func:`engine.serving.server.create_app` with chats grounded in the
documents (``/v1/chat/completions`` answers from the handbook, like a voice turn: at most
``--max-tokens`` tokens, then a ``Source:`` line as the CLI prints it), ``/v1/models``,
``/health`` and ``/metrics`` (the engine's vLLM-named series plus the per-stage turn timings, the
session counters, the memory of all three models by owner, the co-scheduler's counts of waiting
turns and the event loop's lag; the warm-up's requests are not counted).
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

from fastapi import FastAPI, WebSocket
from prometheus_client import CollectorRegistry, Counter, Gauge

from assistant.answerer import Answerer, default_model_path
from assistant.config import ServerConfig
from assistant.device_memory import MemoryCollector, ServerModels
from assistant.coscheduler import CoScheduler
from assistant.image_reading import NO_TEXT, ImageError, check_count, image_prompt
from assistant.gil_wait import GilWait
from assistant.loop_lag import LoopLag
from assistant.prompt import PromptTooLong
from assistant.realtime import RealtimeSession, reject
from assistant.timeline import TimelineMetrics
from assistant.voice_services import VoiceServices
from engine.serving.openai_protocol import APIError
from engine.serving.prometheus import EngineMetrics
from engine.serving.server import ChatPrompt, create_app

SOURCE_LINE = re.compile(r"\n\nSource: [^\n]*\Z")  # what grounded_prompt's footer appends to an answer


class AssistantServer:
    """Loads the models (engine + documents, Whisper, TTS) and builds the app around them. An
    ``answerer`` given here keeps its engine as built: without the co-scheduler's step bound."""

    def __init__(self, config: ServerConfig, answerer: Answerer | None = None) -> None:
        config.validate()
        self.config = config
        coscheduler = CoScheduler.from_config(config.voice)
        # One lock for the GPU work that must not overlap a CUDA graph capture: the engine's
        # captures (at start-up and while serving) and Whisper's batches.
        self.gpu_lock = threading.Lock()
        self.answerer = answerer or Answerer.create(config.assistant, step_bound=coscheduler.step_bound, gpu_lock=self.gpu_lock)
        self.services = VoiceServices.load(self.answerer, config.voice, coscheduler, self.gpu_lock)
        self.model_name = config.model_name or Path(config.assistant.engine.model or default_model_path()).stem
        self.timelines = TimelineMetrics()
        self.sessions: set[RealtimeSession] = set()
        registry = CollectorRegistry()
        self._active = Gauge("assistant_realtime_sessions", "Open /v1/realtime sessions.", registry=registry)
        self._rejected = Counter("assistant_realtime_sessions_rejected", "Connections refused at the session limit (1013).",
                                 registry=registry)  # fmt: skip
        engine = self.answerer.engine
        self.models = ServerModels(engine.core, self.services.asr.backend, self.services.tts.backends[0])
        registry.register(MemoryCollector(self.models))
        self.loop_lag = LoopLag(registry)
        self.gil_wait = GilWait(registry)
        self.engine_metrics = EngineMetrics(engine, self.model_name, engine.core.max_model_len)
        self.app: FastAPI = create_app(
            engine, self.model_name, chat_prompt=self.grounded_prompt,
            collectors=[self.timelines.registry, registry, coscheduler.registry, self.services.images.registry],
            max_body_bytes=config.max_body_bytes, metrics=self.engine_metrics, api_key=config.api_key,
        )  # fmt: skip
        self.app.add_api_websocket_route("/v1/realtime", self.realtime)

    def grounded_prompt(self, messages: list[dict[str, Any]]) -> ChatPrompt:
        """A chat's prompt: the documents prefix, the earlier turns, then the last user message,
        with the documents' version as prefix-cache key, as the answerer's own requests have it
        (so HTTP chats and voice turns share the cached prefix). The answer is capped at the
        assistant's ``max_tokens`` (its default too) and followed by ``\\n\\nSource: path — heading``
        (the CLI's line; the Realtime API sends it as the timeline's ``citation``).

        The handbook's system prompt takes the place of the client's system messages; an earlier
        answer's source line is left out of the history, as the voice turns' history has none.

        A user message's images (data URLs only; a remote URL is refused: the server fetches
        nothing) are read by the image stage, in this worker thread, and their text put before the
        message's text, as in a Realtime turn; identical images are read once. A bad image, more
        than ``MAX_IMAGES``, or a last message whose images hold no text is a 400.

        A question the refusal gate judges the handbook does not answer (assistant/refusal.py) gets
        the gate's refusal without asking the model (its source: the contact's section)."""
        turns = [self._with_images(m) for m in messages if m["role"] in ("user", "assistant")]
        if not turns or turns[-1]["role"] != "user":
            raise ValueError("the last message must be the user's question")
        history: list[dict[str, str]] = []
        for m in turns[:-1]:
            content = SOURCE_LINE.sub("", m["content"]) if m["role"] == "assistant" else m["content"]
            if history and history[-1]["role"] == m["role"]:
                history[-1]["content"] += "\n" + content
            else:
                history.append({"role": m["role"], "content": content})
        question = turns[-1]["content"]
        lang = self.answerer.language_for(question)
        builder = self.answerer.builders[lang]
        try:
            ids = builder.build(history, question)
        except PromptTooLong as e:
            raise APIError(400, f"This chat does not fit the model's context: {e}.", param="messages",
                           code="context_length_exceeded") from e  # fmt: skip
        # the refusal gate, as for a voice turn; a question with a picture is left to the model
        refusal = None if messages[-1].get("images") else self.answerer.gates[lang].refusal(question)

        def footer(answer: str) -> str:
            citation = refusal.citation if refusal is not None else builder.index.cite(question, answer)
            return f"\n\nSource: {citation}" if citation is not None else ""

        return ChatPrompt(ids, (builder.docs.version,), max_tokens=self.config.assistant.max_tokens, footer=footer,
                          answer=refusal.text if refusal is not None else None)  # fmt: skip

    def _with_images(self, message: dict[str, Any]) -> dict[str, str]:
        """The message with its images' text before its own (see :meth:`grounded_prompt`)."""
        urls = message.get("images") or []
        if not urls:
            return {"role": message["role"], "content": message["content"]}
        try:
            if message["role"] != "user":
                raise ImageError("invalid_value", "only user messages may hold images")
            check_count(len(urls))
            texts = []
            for url in urls:
                data = self.services.images.image_bytes(url)
                texts.append(self.services.images.read(data))
        except ImageError as e:
            raise APIError(400, str(e), param="messages", code=e.code) from e
        if not any(t.lines for t in texts):
            raise APIError(400, NO_TEXT, param="messages", code="image_no_text")
        return {"role": "user", "content": image_prompt(texts, message["content"])}

    async def realtime(self, ws: WebSocket) -> None:
        """One Realtime session, or a refusal (close 1013) when ``max_sessions`` are open, or
        ``max_sessions_per_client`` from the client's address."""
        if len(self.sessions) >= self.config.max_sessions:
            self._rejected.inc()
            await reject(ws, "session_limit_reached", f"the server is at its limit of {self.config.max_sessions} sessions; try again later")
            return
        address = ws.client.host if ws.client else ""
        if sum(s.address == address for s in self.sessions) >= self.config.max_sessions_per_client:
            self._rejected.inc()
            await reject(ws, "client_session_limit_reached", f"this client address has {self.config.max_sessions_per_client} "
                         "sessions open, the most one address may hold; close one first")  # fmt: skip
            return
        await ws.accept()
        self.loop_lag.ensure_running()
        self.gil_wait.ensure_running()
        session = RealtimeSession(ws, self.services, self.config, self.model_name, self.timelines)
        self.sessions.add(session)
        self._active.set(len(self.sessions))
        try:
            await session.run()
        finally:
            self.sessions.discard(session)
            self._active.set(len(self.sessions))

    def warm_up(self) -> None:
        """Compute the documents prefix and run Whisper and the voice once (outside an event loop),
        then zero the engine's metrics: a fresh server reports no request."""
        self.services.warm_up()
        self.engine_metrics.reset()

    def close(self) -> None:
        self.gil_wait.stop()
        self.services.close()
        self.answerer.shutdown()
