"""The Files and Batch APIs' objects, as OpenAI's (the OpenAPI document's: offline.openapi;
the views build them as dicts, offline.models)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from offline.lines import ENDPOINTS
from offline.models import Status

EndpointName = Literal["/v1/completions", "/v1/chat/completions", "/v1/embeddings"]
assert set(EndpointName.__args__) == set(ENDPOINTS)  # type: ignore[attr-defined]


class FileObject(BaseModel):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["processed"]
    status_details: None = None


class FileList(BaseModel):
    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


class BatchCreateRequest(BaseModel):
    input_file_id: str = Field(description="A file of purpose batch: one request per line.")
    endpoint: EndpointName
    completion_window: Literal["24h"]
    metadata: (
        dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None
    ) = Field(None, max_length=16, description="Up to 16 pairs; no NUL in them.")


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None
    line: int | None


class BatchErrors(BaseModel):
    object: Literal["list"]
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class BatchUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class Batch(BaseModel):
    id: str
    object: Literal["batch"]
    endpoint: str
    model: str = Field(description="The model its lines run on ('' while validating).")
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: Status
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    expires_at: int | None
    in_progress_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    usage: BatchUsage
    metadata: dict[str, str] | None


class BatchList(BaseModel):
    object: Literal["list"]
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool
