"""OpenAI-compatible HTTP server: the routes around a running engine (``python -m engine.serving`` runs it).

Routes: ``/v1/chat/completions`` and ``/v1/completions`` (SSE streaming or whole), ``/v1/models``,
``/health``, ``/metrics`` (Prometheus). :func:`create_app` builds them around a running
:class:`AsyncEngine`, so the assistant's server mounts the same app on its own engine.

The event loop never waits on model work: a body over the limit is refused before it is read
(:class:`~engine.serving.body_limit.BodyLimit`), prompts are tokenized in a worker thread, the engine
steps on its own thread, and each request is checked (:meth:`EngineCore.validate_request` plus the
context length) before anything is scheduled, so a bad request costs no KV block. A client that
goes away aborts its request: for a stream, Starlette (under uvicorn) watches for the disconnect
and cancels the streaming task, which raises inside the engine's stream, whose ``finally`` aborts
the request and frees its KV blocks; a whole (non-streamed) answer races a disconnect watcher.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from jinja2 import TemplateError
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.registry import Collector
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.engine_core import RequestError
from engine.outputs import RequestOutput
from engine.sampling import SamplingParams
from engine.serving.auth import APIKeyGuard
from engine.serving.body_limit import BodyLimit
from engine.serving.openai_protocol import (
    APIError, AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
    ChatCompletionRequest, ChatLogprobs, Completion, CompletionChoice, CompletionLogprobs, CompletionRequest,
    Delta, GenerationRequest, ModelCard, ModelList, TokenLogprob, TopLogprob, Usage,
)
from engine.serving.prometheus import EngineMetrics

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20  # the default request body limit (1 MiB)


@dataclass
class ChatPrompt:
    """What a chat hook (see :func:`create_app`) makes of a chat's messages."""

    token_ids: list[int]
    extra_keys: tuple = ()  # extra prefix-cache keys (see AsyncEngine.generate)
    max_tokens: int | None = None  # the default and the cap of the answer's length (None: the context's rest)
    footer: Callable[[str], str] | None = None  # the whole answer -> text sent after it (e.g. its source)
    # an answer the hook decided without the model (e.g. "the documents do not say"): sent as the
    # completion, finish_reason "stop", 0 completion tokens; the engine is not asked
    answer: str | None = None


ChatHook = Callable[[list[dict[str, Any]]], ChatPrompt]  # messages: role, content (text), images (URLs, if any)


# ---- one request ---------------------------------------------------------------------------------
async def _given(job: "_Job") -> AsyncIterator[RequestOutput]:
    """A hook's own answer (:attr:`ChatPrompt.answer`) as the one output a finished request gives."""
    assert job.answer is not None
    yield RequestOutput(request_id=job.request_id, text=job.answer, token_ids=[], finished=True, finish_reason="stop",
                        num_prompt_tokens=len(job.prompt_ids))  # fmt: skip


@dataclass
class _Job:
    """A validated request, ready for the engine."""

    request_id: str
    chat: bool
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    include_usage: bool
    extra_keys: tuple = ()  # extra prefix-cache keys (see AsyncEngine.generate)
    footer: Callable[[str], str] | None = None  # see ChatPrompt
    answer: str | None = None  # see ChatPrompt
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class _TokenLogprob:
    token: str
    logprob: float
    top: list[tuple[str, float]]  # the most likely tokens, best first (OpenAI's top_logprobs)
    alternatives: dict[str, float]  # chosen + top (the legacy completions format)


@dataclass
class _Answer:
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[_TokenLogprob] = field(default_factory=list)


class OpenAIServer:
    """The route handlers' logic for one engine and one served model name."""

    def __init__(self, engine: AsyncEngine, model_name: str, chat_prompt: ChatHook | None = None,
                 metrics: EngineMetrics | None = None) -> None:  # fmt: skip
        self.engine = engine
        self.model_name = model_name
        self.chat_prompt = chat_prompt
        self.max_model_len = engine.core.max_model_len
        self.metrics = metrics or EngineMetrics(engine, model_name, self.max_model_len)

    # ---- validation -----------------------------------------------------------------------------
    async def prepare(self, body: GenerationRequest) -> _Job:
        """Check everything and tokenize (in a worker thread); raises :class:`APIError`."""
        if not self.engine.is_alive:
            raise APIError(503, "the engine loop has stopped", type="server_error", code="engine_dead")
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist. This server serves `{self.model_name}`.",
                           param="model", code="model_not_found")
        body.check_supported()
        chat = isinstance(body, ChatCompletionRequest)
        prompt_param = "messages" if chat else "prompt"
        prompt = None if chat else body.single_prompt()  # type: ignore[union-attr]
        try:
            made = await asyncio.to_thread(self._tokenize, body, prompt)
        except (ValueError, TemplateError) as e:  # no tokenizer, no chat template, or the template refuses the messages
            raise APIError(400, str(e), param=prompt_param) from e
        ids, requested = made.token_ids, body.requested_max_tokens
        max_tokens = requested if requested is not None else (made.max_tokens or max(1, self.max_model_len - len(ids)))
        if made.max_tokens is not None:
            max_tokens = min(max_tokens, made.max_tokens)
        if len(ids) + max_tokens > self.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(ids) + max_tokens} tokens ({len(ids)} in the {prompt_param}, {max_tokens} for the completion). "
                f"Please reduce the length of the {prompt_param} or max_tokens.",
                param=prompt_param, code="context_length_exceeded",
            )
        params = body.sampling_params(max_tokens, body.engine_logprobs)
        try:
            self.engine.core.validate_request(ids, params, None)
        except RequestError as e:
            first = str(e).split(" ", 1)[0]
            param = first if first in SamplingParams.__dataclass_fields__ else prompt_param
            raise APIError(400, str(e), param=param, code="invalid_value") from e
        return _Job(
            request_id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", chat=chat, prompt_ids=ids,
            params=params, priority=body.priority, include_usage=body.include_usage, extra_keys=made.extra_keys,
            footer=made.footer, answer=made.answer,
        )

    def _tokenize(self, body: GenerationRequest, prompt: str | list[int] | None) -> ChatPrompt:
        """The prompt's token ids (and, from the chat hook, what goes with them)."""
        tokenizer = self.engine.tokenizer
        if isinstance(prompt, list):
            return ChatPrompt(list(prompt))
        if tokenizer is None:
            raise ValueError("this model has no tokenizer (dummy weights): send the prompt as token ids")
        if isinstance(body, ChatCompletionRequest):
            if self.chat_prompt is not None:
                return self.chat_prompt(body.conversation())
            if any("images" in m for m in body.conversation()):
                raise APIError(400, "this server's model takes no images", param="messages", code="unsupported_content")
            return ChatPrompt(tokenizer.apply_chat_template(body.conversation()))
        return ChatPrompt(tokenizer.encode(prompt or ""))

    # ---- answering --------------------------------------------------------------------------------
    def _outputs(self, job: _Job) -> AsyncIterator[RequestOutput]:
        if job.answer is not None:
            return _given(job)
        return self.engine.generate(job.prompt_ids, job.params, priority=job.priority, request_id=job.request_id,
                                    extra_keys=job.extra_keys)

    async def stream(self, job: _Job) -> AsyncIterator[str]:
        """SSE events of one request. Closing this generator (the client went away) aborts it."""
        outputs = self._outputs(job)
        answer = _Answer()
        try:
            if job.chat:
                yield self._chunk(job, Delta(role="assistant", content=""), None, [])
            async for out in outputs:
                answer.completion_tokens, answer.cached_tokens = out.num_generated_tokens, out.num_cached_tokens
                logprobs = self._logprobs(job, out)
                text = out.text + (_footer(job, answer.text + out.text, out.finish_reason) if out.finished else "")
                if text or out.finished or logprobs:
                    yield self._chunk(job, text, out, logprobs, offset=len(answer.text))
                answer.text += out.text
            if job.include_usage:
                yield self._usage_chunk(job, answer)
        except Exception as e:  # noqa: BLE001 - the status line is sent: report it in the stream, as vLLM does
            yield _sse(_api_error(e).body())
        finally:
            await outputs.aclose()
        yield "data: [DONE]\n\n"

    async def answer(self, job: _Job, request: Request) -> BaseModel | Response:
        """The whole answer; if the client disconnects first, the request is aborted."""
        collect = asyncio.ensure_future(self._collect(job))
        watch = asyncio.ensure_future(_until_disconnected(request.receive))
        try:
            done, _ = await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            collect.cancel()  # no-op when done; otherwise the engine aborts the request
        if collect not in done:
            return Response(status_code=499)  # nobody is listening
        try:
            a = collect.result()
        except Exception as e:
            raise _api_error(e) from e
        usage = Usage.of(len(job.prompt_ids), a.completion_tokens, a.cached_tokens)
        if job.chat:
            chat_lp = ChatLogprobs(content=[_chat_logprob(t) for t in a.logprobs]) if job.params.logprobs is not None else None
            content = a.text + _footer(job, a.text, a.finish_reason)
            choice = ChatChoice(message=AssistantMessage(content=content), logprobs=chat_lp, finish_reason=a.finish_reason, stop_reason=a.stop_reason)
            return ChatCompletion(id=job.request_id, created=job.created, model=self.model_name, choices=[choice], usage=usage)
        lp = _completion_logprobs(a.logprobs, 0) if job.params.logprobs is not None else None
        choice = CompletionChoice(text=a.text, logprobs=lp, finish_reason=a.finish_reason, stop_reason=a.stop_reason)
        return Completion(id=job.request_id, created=job.created, model=self.model_name, choices=[choice], usage=usage)

    async def _collect(self, job: _Job) -> _Answer:
        a = _Answer()
        outputs = self._outputs(job)
        try:
            async for out in outputs:
                a.text += out.text
                a.logprobs += self._logprobs(job, out)
                a.completion_tokens, a.cached_tokens = out.num_generated_tokens, out.num_cached_tokens
                a.finish_reason, a.stop_reason = out.finish_reason, out.stop_reason
        finally:
            await outputs.aclose()
        return a

    # ---- rendering --------------------------------------------------------------------------------
    def _logprobs(self, job: _Job, out: RequestOutput) -> list[_TokenLogprob]:
        k = job.params.logprobs
        if k is None or not out.logprobs:
            return []
        entries = []
        for token, alts in zip(out.token_ids, out.logprobs):
            ranked = sorted(alts.items(), key=lambda kv: -kv[1])[:k]
            entries.append(_TokenLogprob(
                self._token_text(token), alts[token], [(self._token_text(t), lp) for t, lp in ranked],
                {self._token_text(t): lp for t, lp in alts.items()},
            ))
        return entries

    def _token_text(self, token: int) -> str:
        tok = self.engine.tokenizer
        return tok.decode([token], skip_special_tokens=False) if tok is not None else f"token_id:{token}"

    def _chunk(self, job: _Job, content: str | Delta, out: RequestOutput | None, logprobs: list[_TokenLogprob], offset: int = 0) -> str:
        finish = out.finish_reason if out is not None and out.finished else None
        stop = out.stop_reason if finish else None
        if job.chat:
            delta = content if isinstance(content, Delta) else Delta(content=content)
            lp = ChatLogprobs(content=[_chat_logprob(t) for t in logprobs]) if logprobs else None
            choice = ChatChunkChoice(delta=delta, logprobs=lp, finish_reason=finish, stop_reason=stop)
            return _sse(ChatCompletionChunk(id=job.request_id, created=job.created, model=self.model_name, choices=[choice]))
        lp = _completion_logprobs(logprobs, offset) if logprobs else None
        choice = CompletionChoice(text=str(content), logprobs=lp, finish_reason=finish, stop_reason=stop)
        return _sse(Completion(id=job.request_id, created=job.created, model=self.model_name, choices=[choice]))

    def _usage_chunk(self, job: _Job, a: _Answer) -> str:
        usage = Usage.of(len(job.prompt_ids), a.completion_tokens, a.cached_tokens)
        cls = ChatCompletionChunk if job.chat else Completion
        return _sse(cls(id=job.request_id, created=job.created, model=self.model_name, choices=[], usage=usage))


def _footer(job: _Job, text: str, finish_reason: str | None) -> str:
    """The text that follows a finished (not aborted) answer, if the chat hook gave one."""
    return job.footer(text) if job.footer is not None and finish_reason in ("stop", "length") else ""


def _chat_logprob(t: _TokenLogprob) -> TokenLogprob:
    return TokenLogprob(token=t.token, logprob=t.logprob, bytes=list(t.token.encode()),
                        top_logprobs=[TopLogprob(token=s, logprob=lp, bytes=list(s.encode())) for s, lp in t.top])


def _completion_logprobs(entries: list[_TokenLogprob], offset: int) -> CompletionLogprobs:
    lp = CompletionLogprobs()
    for t in entries:
        lp.tokens.append(t.token)
        lp.token_logprobs.append(t.logprob)
        lp.top_logprobs.append(t.alternatives)
        lp.text_offset.append(offset)
        offset += len(t.token)
    return lp


def _sse(obj: BaseModel) -> str:
    return f"data: {obj.model_dump_json()}\n\n"


def _api_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, RequestError):
        return APIError(400, str(e), code="invalid_value")
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), type="server_error", code="engine_dead")
    log.exception("request failed", exc_info=e)
    return APIError(500, f"the engine failed this request: {e}", type="server_error")


async def _until_disconnected(receive: Receive) -> None:
    """Return when the client closes the connection (the body has already been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


# ---- the app -------------------------------------------------------------------------------------
def create_app(
    engine: AsyncEngine, model_name: str, *, chat_prompt: ChatHook | None = None, collectors: Sequence[Collector] = (),
    max_body_bytes: int = MAX_BODY_BYTES, metrics: EngineMetrics | None = None, api_key: str | None = None,
) -> FastAPI:
    """The OpenAI-compatible API, ``/health`` and ``/metrics`` of ``engine``, served as ``model_name``.

    ``chat_prompt`` turns a chat's messages into a :class:`ChatPrompt` instead of the model's chat
    template (the assistant grounds chats in its documents, caps their length and cites the source;
    a ValueError is a 400, an :class:`APIError` is answered as it is); ``collectors`` add their
    series to ``/metrics``; ``metrics`` are the engine's series (default: new ones; pass your own
    to :meth:`~EngineMetrics.reset` them after a warm-up); a request body over ``max_body_bytes`` gets a 413;
    with ``api_key`` every route but ``/health`` requires it (:class:`~engine.serving.auth.APIKeyGuard`).
    """
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    server = OpenAIServer(engine, model_name, chat_prompt, metrics)
    for collector in collectors:
        server.metrics.registry.register(collector)
    app = FastAPI(title="engine OpenAI-compatible API")
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, paths=("/v1/chat/completions", "/v1/completions"))
    if api_key is not None:  # added last: the outermost check, before any body is read
        app.add_middleware(APIKeyGuard, key=api_key)

    async def generate(body: GenerationRequest, request: Request) -> Any:
        job = await server.prepare(body)
        if body.stream:
            return StreamingResponse(server.stream(job), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await server.answer(job, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await generate(body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await generate(body, request)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=server.max_model_len)])

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive:
            raise APIError(503, "the engine loop has stopped", type="server_error", code="engine_dead")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        content, content_type = server.metrics.render()
        return Response(content, media_type=content_type)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body().model_dump(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, e: RequestValidationError) -> JSONResponse:
        err = _validation_error(e.errors())
        return JSONResponse(err.body().model_dump(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 400: "invalid_json"}.get(e.status_code)  # FastAPI's 400: a body it could not parse (e.g. nested too deep)
        err = APIError(e.status_code, str(e.detail), code=code)
        return JSONResponse(err.body().model_dump(), status_code=e.status_code, headers=e.headers)

    return app


def _validation_error(errors: Sequence[Any]) -> APIError:
    """A 400 (never FastAPI's 422) naming the first problem the way OpenAI does."""
    e = errors[0] if errors else {"type": "missing", "loc": ("body",), "msg": "no body"}
    loc = [str(x) for x in e.get("loc", ())][1:]  # drop "body"
    kind = e.get("type")
    if kind == "json_invalid":
        detail = (e.get("ctx") or {}).get("error", e.get("msg"))
        return APIError(400, f"The request body is not valid JSON: {detail}.", code="invalid_json")
    if kind == "lone_surrogate":
        path = e["ctx"]["path"]
        return APIError(400, f"Invalid value for '{path}': the string holds a lone UTF-16 surrogate, which is not text.",
                        param=path.split(".", 1)[0] or None, code="invalid_value")
    if not loc:
        if kind == "missing":
            return APIError(400, "The request body is missing: send a JSON object.", code="invalid_json")
        return APIError(400, f"The request body must be a JSON object sent as Content-Type: application/json ({e.get('msg')}).", code="invalid_json")
    param = loc[0]
    if kind == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {'.'.join(loc)}", param=param, code="unknown_parameter")
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{'.'.join(loc)}'.", param=param, code="missing_required_parameter")
    code = _BOUND_CODES.get(kind, "invalid_type")
    return APIError(400, f"Invalid value for '{'.'.join(loc)}': {e.get('msg')}.", param=param, code=code)


_BOUND_CODES = {"less_than_equal": "integer_above_max_value", "greater_than_equal": "integer_below_min_value"}  # OpenAI's codes


# ---- running it ----------------------------------------------------------------------------------
class BackgroundServer:
    """Serve an app with uvicorn on a thread of its own (tests, or beside another UI's loop).

    The socket is bound at construction, so ``port=0`` picks a free port and :attr:`url` is known
    before the server starts."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", **options: Any) -> None:
        """``options``: further ``uvicorn.Config`` settings (e.g. ``ws_per_message_deflate``)."""
        self._socket = socket.create_server((host, port))
        bound_host, bound_port = self._socket.getsockname()[:2]
        self.url = f"http://{bound_host}:{bound_port}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5, **options))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, name="uvicorn", daemon=True)

    def __enter__(self) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()

