"""The OpenAI API subset the server speaks: request and response models, errors, sampling.

Requests follow vLLM's rules: OpenAI fields we do not implement but that change nothing about
the answer (``user``, ``metadata``, ...) are accepted and ignored; values we cannot honour
(``n > 1``, tools, ``logit_bias``, ...) are a 400 that says so; any other unknown field is a 400
too, so a typo never silently changes the sampling. vLLM's extra sampling fields are accepted
(``priority``, ``ignore_eos``, ``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``).
Range checks are the engine's own (:class:`engine.SamplingError`), passed through verbatim. Where
OpenAI is strict so are we: booleans must be JSON booleans, ``stop`` holds at most
:data:`MAX_STOP` strings, and no string may hold a lone UTF-16 surrogate (``"\\ud800"`` is valid
JSON but not text: no tokenizer or UTF-8 encoder accepts it).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_serializer, model_validator
from pydantic_core import PydanticCustomError

from engine.sampling import SamplingParams


class APIError(Exception):
    """An error to answer with an OpenAI-style body: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> "ErrorResponse":
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- requests ------------------------------------------------------------------------------------
MAX_STOP = 4  # OpenAI's limit on stop strings
PRIORITY_RANGE = (-(2**31), 2**31 - 1)  # a 32-bit signed integer


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def lone_surrogate(value: Any) -> str | None:
    """The JSON path (``messages.0.content``) of the first string, or object key, in ``value``
    that holds a lone UTF-16 surrogate (escaped, so the path itself is text); None if there is
    none. Iterative, so deep nesting costs no stack."""
    todo: list[tuple[str, Any]] = [("", value)]
    while todo:
        path, v = todo.pop()
        if isinstance(v, str) and not _is_text(v):
            return path
        if isinstance(v, dict):
            for k, item in v.items():
                sub = f"{path}.{k}" if path else str(k)
                if not _is_text(str(k)):
                    return sub.encode("utf-8", "backslashreplace").decode()
                todo.append((sub, item))
        elif isinstance(v, list):
            todo.extend((f"{path}.{i}" if path else str(i), item) for i, item in enumerate(v))
    return None


def _is_text(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict):
    """OpenAI's image content part. The engine takes no images: a chat hook may (it gets the URLs
    as the message's ``images``); without one a chat with an image is refused."""

    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]] | None = None
    name: str | None = None  # accepted, ignored (the chat template has no place for it)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    def image_urls(self) -> list[str]:
        return [p.image_url.url for p in self.content or () if isinstance(p, ImagePart)]


class GenerationRequest(_Strict):
    """Fields shared by chat and text completions."""

    # OpenAI's fields are nullable; null means the default.
    model: str | None = None  # as in vLLM: absent means the served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Accepted and ignored: it does not change the answer.
    user: str | None = None
    # vLLM's extensions.
    priority: int = Field(0, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1],
                          description="lower is served first; a waiting request may preempt running ones of a higher value")
    ignore_eos: StrictBool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        """Refuse a lone surrogate anywhere (a field's value or name) before any field is read."""
        path = lone_surrogate(data)
        if path is not None:
            raise PydanticCustomError("lone_surrogate", "a lone UTF-16 surrogate is not text", {"path": path})
        return data

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        """Raise a 400 :class:`APIError` for a value this server cannot honour."""
        if self.n not in (None, 1):
            raise APIError(400, f"n={self.n} is not supported: this server returns one choice per request; send n requests instead", param="n", code="unsupported_value")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by this server", param="logit_bias", code="unsupported_value")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise APIError(400, f"Invalid 'stop': array too long. Expected an array with maximum length {MAX_STOP}, "
                                f"but got an array with length {len(self.stop)} instead.", param="stop", code="array_above_max_length")

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's parameters; ranges are checked later by the engine (one source of truth)."""
        given = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "seed": self.seed, "stop_token_ids": self.stop_token_ids,
        }
        return SamplingParams(
            max_tokens=max_tokens, stop=_as_list(self.stop), ignore_eos=self.ignore_eos, logprobs=logprobs,
            **{k: v for k, v in given.items() if v is not None},
        )


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # Accepted and ignored.
    parallel_tool_calls: StrictBool | None = None
    metadata: dict[str, str] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise APIError(400, "tools are not supported by this server", param="tools", code="unsupported_value")
        if self.tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice is not supported by this server (no tools)", param="tool_choice", code="unsupported_value")
        if self.response_format and self.response_format.get("type") != "text":
            raise APIError(400, "only response_format {\"type\": \"text\"} is supported", param="response_format", code="unsupported_value")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, Any]]:
        """Messages for the chat template (``developer`` is the newer name of ``system``); a
        message with image parts also has ``images``, their URLs (for a chat hook that reads them)."""
        out: list[dict[str, Any]] = []
        for m in self.messages:
            message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.image_urls():
                message["images"] = m.image_urls()
            out.append(message)
        return out


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for text completions
    logprobs: int | None = None
    echo: StrictBool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo is not supported by this server", param="echo", code="unsupported_value")
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server", param="suffix", code="unsupported_value")
        if self.best_of not in (None, 1):
            raise APIError(400, f"best_of={self.best_of} is not supported: one sequence per request", param="best_of", code="unsupported_value")

    def single_prompt(self) -> str | list[int]:
        """The one prompt (text or token ids); a batch of several is a 400."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return p  # type: ignore[return-value]
        if len(p) != 1:
            raise APIError(400, f"a batch of {len(p)} prompts is not supported: send one prompt per request", param="prompt", code="unsupported_value")
        return p[0]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        return self.logprobs


def _as_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


# ---- responses -----------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> "Usage":
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended it


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    """A streamed message delta; unset fields are left out, as OpenAI does."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Completion(BaseModel):
    """A whole text completion, or (``usage`` None until the last) one streamed chunk of it."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "engine"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
