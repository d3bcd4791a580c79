"""The OpenAPI document of the JSON API (GET /v1/openapi.json), from serving.schemas."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from serving import schemas

JSON = "application/json"
REF = "#/components/schemas/{model}"


@dataclass(frozen=True)
class DocumentPart:
    """Paths an app adds to the document (offline.apps: the Files and Batch APIs), and the
    models their schemas refer to."""

    paths: Callable[[], dict[str, Any]]
    validated: tuple[type[BaseModel], ...] = ()
    serialized: tuple[type[BaseModel], ...] = ()


_parts: list[DocumentPart] = []


def register_part(part: DocumentPart) -> None:
    if part not in _parts:
        _parts.append(part)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _content(model: type[BaseModel]) -> dict[str, Any]:
    return {JSON: {"schema": _ref(model)}}


def ok(model: type[BaseModel]) -> dict[str, Any]:
    return {"description": "OK", "content": _content(model)}


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    return {"required": True, "content": _content(model)}


def errors(model: type[BaseModel], *statuses: int) -> dict[str, Any]:
    reasons = {
        400: "Invalid request: the message and `param` name the problem.",
        401: "A key is required and missing, unknown, revoked or expired.",
        404: "Unknown model, file or batch (another key's is unknown too).",
        409: "The file is the input of a job still running.",
        413: "The file is over the size limit.",
        429: "The key is over its rate limit: try again after Retry-After.",
        502: "The sampler failed for the batch.",
        503: "Overloaded, the queue unavailable, or the model without a live worker: try "
        "again after Retry-After.",
        504: "No completion within the deadline.",
    }
    return {str(status): {"description": reasons[status], "content": _content(model)}
            for status in statuses}  # fmt: skip


def _generation(request: type[BaseModel], answer: type[BaseModel], summary: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": request_body(request),
            "responses": {
                "200": {
                    "description": "The completion; with `stream`, server-sent events.",
                    "content": {
                        **_content(answer),
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                **errors(schemas.ErrorResponse, 400, 401, 404, 429, 502, 503, 504),
            },
        }
    }


VALIDATED = (
    schemas.CompletionRequest,
    schemas.ChatCompletionRequest,
    schemas.EmbeddingRequest,
    schemas.InferenceRequest,
)
SERIALIZED = (
    schemas.CompletionResponse,
    schemas.ChatCompletionResponse,
    schemas.EmbeddingResponse,
    schemas.ModelList,
    schemas.Model,
    schemas.ErrorResponse,
    schemas.InferenceResponse,
    schemas.InferenceError,
    schemas.UsageReport,
)
INFO = {
    "title": "Sampling service",
    "version": "1",
    "description": "OpenAI-compatible completions, chat, embeddings, models, files and batches "
    "(offline jobs), a plain JSON inference API, and each key's usage. POST /sample (a raw "
    "prompt in, a plain-text completion out) is documented in docs/guides/api.md.",
}


def openapi_document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": INFO,
        "paths": {
            "/v1/completions": _generation(
                schemas.CompletionRequest, schemas.CompletionResponse, "Complete prompts"
            ),
            "/v1/chat/completions": _generation(
                schemas.ChatCompletionRequest, schemas.ChatCompletionResponse, "Continue a chat"
            ),
            "/v1/embeddings": _embeddings(),
            **_models(),
            "/api/inference": _inference(),
            "/v1/usage": _usage(),
            **{path: item for part in _parts for path, item in part.paths().items()},
        },
        "components": {"schemas": _definitions()},
    }


def _definitions() -> dict[str, Any]:
    """The JSON schemas of the requests as validated and the answers as serialized."""
    _, definitions = models_json_schema(
        [(model, "validation") for model in VALIDATED]
        + [(model, "validation") for part in _parts for model in part.validated]
        + [(model, "serialization") for model in SERIALIZED]
        + [(model, "serialization") for part in _parts for model in part.serialized],
        ref_template=REF,
    )
    return definitions["$defs"]


def _embeddings() -> dict[str, Any]:
    return {
        "post": {
            "summary": "Embed texts",
            "requestBody": request_body(schemas.EmbeddingRequest),
            "responses": {
                "200": ok(schemas.EmbeddingResponse),
                **errors(schemas.ErrorResponse, 400, 401, 404, 429, 502, 503, 504),
            },
        }
    }


def _models() -> dict[str, Any]:
    model_id = {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
    return {
        "/v1/models": {
            "get": {
                "summary": "The served models and aliases with a live worker",
                "responses": {
                    "200": ok(schemas.ModelList),
                    **errors(schemas.ErrorResponse, 401),
                },
            }
        },
        "/v1/models/{model_id}": {
            "get": {
                "summary": "One model",
                "parameters": [model_id],
                "responses": {
                    "200": ok(schemas.Model),
                    **errors(schemas.ErrorResponse, 401, 404),
                },
            }
        },
    }


def _inference() -> dict[str, Any]:
    return {
        "post": {
            "summary": "One prompt, the queue's settings",
            "requestBody": request_body(schemas.InferenceRequest),
            "responses": {
                "200": ok(schemas.InferenceResponse),
                **errors(schemas.InferenceError, 400, 401, 429, 502, 503, 504),
            },
        }
    }


def _usage() -> dict[str, Any]:
    day = {
        "name": "date",
        "in": "query",
        "required": False,
        "description": "The UTC day, YYYY-MM-DD; today by default.",
        "schema": {"type": "string", "format": "date"},
    }
    return {
        "get": {
            "summary": "The calling key's usage on one day, per model",
            "parameters": [day],
            "responses": {
                "200": ok(schemas.UsageReport),
                # 401 also without a key when keys are not required: usage is per key.
                **errors(schemas.ErrorResponse, 400, 401, 503),
            },
        }
    }
