"""The JSON API's requests and answers, as pydantic models: validation and the OpenAPI schema.

Requests are validated strictly (no coercion: `"5"` is not a number, `true` is not 1) and
refuse unknown fields, so a client never has a setting silently ignored. OpenAI's fields that
would change the output and are not served (log probabilities, best_of above 1, suffix,
penalties, logit bias, tools, response formats...) are declared, so that their neutral values
pass, and any other value is refused with a 400 that names the field (`unsupported`).

The answers are built as plain dicts on the request path (cheaper than pydantic's
serialisation); their models here are the OpenAPI document's, and the schemathesis test
checks that the two agree.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from batching.embeddings import MAX_DIMENSIONS
from batching.generation import (
    CHAT_ROLES,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    SEED_RANGE,
)
from batching.policy import BOUNDS, MAX_BATCH_SIZE

MAX_TOKENS_BOUND = int(BOUNDS["max_new_tokens"][1])

_STRICT = ConfigDict(strict=True, extra="forbid")

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(min_length=0, max_length=MAX_STOP_STRINGS)]


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool | None = None


class _Settings(BaseModel):
    """The generation settings both endpoints take."""

    model_config = _STRICT

    model: str | None = Field(
        None, description="A served model or alias (GET /v1/models); default: the default model."
    )
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_BOUND)] | None = Field(
        None, description="At most the policy's max new tokens, which is also the default."
    )
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] | None = Field(
        None, description="0 is greedy. Default: the policy's."
    )
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stop: Stop | None = Field(None, description="Up to 4 strings; the text ends before one.")
    seed: Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = Field(
        None, description="Same prompt, settings and seed: same completion. Choice i uses seed+i."
    )
    n: Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)] = Field(
        1, description="Choices per prompt, each its own item of a batch."
    )
    stream: bool | None = Field(
        None, description="Server-sent events: each choice whole in one chunk, then its finish."
    )
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="Accepted; does not change the output.")
    # Declared so that their neutral values pass; any other value is refused (`unsupported`).
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def limit(self) -> int | None:
        """The max tokens asked for (None: the policy's)."""
        return self.max_tokens

    def stops(self) -> tuple[str, ...] | None:
        if self.stop is None:
            return None
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, reason) for each field set to a value this server does not serve."""
        found = []
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0):
                found.append((name, f"{name} is not supported (only 0)"))
        if self.logit_bias:
            found.append(("logit_bias", "logit_bias is not supported (only empty)"))
        return found


class CompletionRequest(_Settings):
    """POST /v1/completions."""

    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[
            list[Annotated[str, Field(min_length=1)]],
            Field(min_length=1, max_length=MAX_BATCH_SIZE),
        ]
    ) = Field(description="A string, or a list of strings: each its own item of a batch.")
    echo: bool | None = Field(None, description="Put the prompt before the completion.")
    best_of: Annotated[int, Field(ge=1)] | None = None
    logprobs: Annotated[int, Field(ge=0)] | None = None
    suffix: str | None = None

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    def unsupported(self) -> list[tuple[str, str]]:
        found = super().unsupported()
        if self.best_of not in (None, 1):
            found.append(("best_of", "best_of is not supported (only 1)"))
        if self.logprobs is not None:
            found.append(("logprobs", "logprobs is not supported"))
        if self.suffix:
            found.append(("suffix", "suffix is not supported"))
        return found


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal[CHAT_ROLES]  # type: ignore[valid-type]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: str


class ChatCompletionRequest(_Settings):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=1000)
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_BOUND)] | None = Field(
        None, description="An alias of max_tokens (used when both are given)."
    )
    # Accepted, without effect on the output.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    parallel_tool_calls: bool | None = None
    # Declared so that their neutral values pass; any other value is refused.
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def unsupported(self) -> list[tuple[str, str]]:
        found = super().unsupported()
        if self.logprobs:
            found.append(("logprobs", "logprobs is not supported"))
        if self.top_logprobs is not None:
            found.append(("top_logprobs", "top_logprobs is not supported"))
        for name in ("tools", "functions"):
            if getattr(self, name):
                found.append((name, f"{name} are not supported (no tool calling)"))
        if self.tool_choice not in (None, "none"):
            found.append(("tool_choice", "tool_choice is not supported (only none)"))
        if self.function_call not in (None, "none"):
            found.append(("function_call", "function_call is not supported (only none)"))
        if self.response_format is not None and self.response_format.type != "text":
            found.append(("response_format", "response_format is not supported (only text)"))
        if self.modalities not in (None, ["text"]):
            found.append(("modalities", "modalities are not supported (only text)"))
        for name in ("audio", "prediction", "reasoning_effort", "verbosity", "web_search_options"):
            if getattr(self, name) is not None:
                found.append((name, f"{name} is not supported"))
        return found


EmbeddingInput = Annotated[str, Field(min_length=1)]


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings: one text or a list, each its own item of a batch."""

    model_config = _STRICT
    model: str | None = Field(None, description="An embedder (GET /v1/models) or an alias.")
    input: (
        EmbeddingInput
        | Annotated[list[EmbeddingInput], Field(min_length=1, max_length=MAX_BATCH_SIZE)]
    ) = Field(description=f"A text, or up to {MAX_BATCH_SIZE} texts.")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each vector's float32 values, little-endian."
    )
    dimensions: Annotated[int, Field(ge=1, le=MAX_DIMENSIONS)] | None = Field(
        None,
        description="The first this many values, normalized again; at most the model's own.",
    )
    user: str | None = Field(None, description="Keeps the caller on one target of an alias.")

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


class InferenceRequest(BaseModel):
    """POST /api/inference: one prompt, continued with the queue's settings."""

    model_config = _STRICT
    input: str = Field(min_length=1)


# --- answers (the OpenAPI document's; built as dicts on the request path) ------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(
        description="Of prompt_tokens: those of prompts answered from the response cache."
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


FinishReasonField = Literal["stop", "length"]


class CompletionChoice(BaseModel):
    text: str
    index: int
    finish_reason: FinishReasonField
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReasonField
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    kind: Literal["generator", "embedder", "alias"]
    description: str | None = None
    root: str | None = Field(None, description="What the model's live workers serve (sampler).")
    targets: list[str] | None = Field(None, description="An alias's models with a weight above 0.")
    workers: int = Field(description="Live workers of the model (an alias: of its targets).")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class InferenceResponse(BaseModel):
    output: str
    request_id: str
    latency_ms: float


class InferenceError(BaseModel):
    error: Literal[
        "INVALID_REQUEST",
        "UNAUTHORIZED",
        "RATE_LIMITED",
        "SERVICE_OVERLOADED",
        "SERVICE_UNAVAILABLE",
        "MODEL_UNAVAILABLE",
        "QUOTA_EXCEEDED",
        "DEADLINE_EXCEEDED",
        "SAMPLER_FAILED",
    ]
    message: str
    retry_after_ms: int | None = None


class UsageByModel(BaseModel):
    model: str
    usage: Usage
    requests: dict[str, int] = Field(
        description="The key's requests: `total`, and how many ended in each outcome."
    )
    spend: str = Field(
        description="What the answers cost at the model's price when each was answered: a "
        "decimal in the price's unit."
    )


class UsageReport(BaseModel):
    """GET /v1/usage: the calling key's usage on one UTC day, per model."""

    model_config = _STRICT
    object: Literal["list"]
    date: str = Field(description="The UTC day, YYYY-MM-DD.")
    data: list[UsageByModel]
