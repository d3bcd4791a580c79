"""The Files and Batch APIs' part of the OpenAPI document (serving.openapi asks for it:
offline.apps registers it)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from offline import schemas
from serving.openapi import errors, ok, request_body
from serving.schemas import ErrorResponse

SERIALIZED: tuple[type[BaseModel], ...] = (
    schemas.FileObject,
    schemas.FileList,
    schemas.FileDeleted,
    schemas.Batch,
    schemas.BatchList,
)
VALIDATED: tuple[type[BaseModel], ...] = (schemas.BatchCreateRequest,)


def _path(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}


def _list_query(*extra: dict[str, Any]) -> list[dict[str, Any]]:
    limit = {"name": "limit", "in": "query", "required": False,
             "schema": {"type": "integer", "minimum": 1, "maximum": 100}}  # fmt: skip
    return [limit, *extra]


def _operation(
    summary: str, answer: type[BaseModel], *statuses: int, **more: Any
) -> dict[str, Any]:
    return {"summary": summary, **more,
            "responses": {"200": ok(answer), **errors(ErrorResponse, 401, *statuses)}}  # fmt: skip


def _ref(path: str, method: str) -> str:
    return "#/paths/" + path.replace("~", "~0").replace("/", "~1") + "/" + method


def _linked(operation: dict[str, Any], links: dict[str, Any]) -> dict[str, Any]:
    """`operation` whose 200 names what a client may call next with its answer's id (OpenAPI
    links: a stateful test follows them)."""
    operation["responses"]["200"] = {**operation["responses"]["200"], "links": links}
    return operation


def _file_links() -> dict[str, Any]:
    by_id = {"file_id": "$response.body#/id"}
    job = {"input_file_id": "$response.body#/id", "endpoint": "/v1/chat/completions",
           "completion_window": "24h"}  # fmt: skip
    return {
        "GetFile": {"operationRef": _ref("/v1/files/{file_id}", "get"), "parameters": by_id},
        "GetFileContent": {"operationRef": _ref("/v1/files/{file_id}/content", "get"),
                           "parameters": by_id},
        "DeleteFile": {"operationRef": _ref("/v1/files/{file_id}", "delete"),
                       "parameters": by_id},
        "CreateBatch": {"operationRef": _ref("/v1/batches", "post"), "requestBody": job},
    }  # fmt: skip


def _batch_links() -> dict[str, Any]:
    by_id = {"batch_id": "$response.body#/id"}
    return {
        "GetBatch": {"operationRef": _ref("/v1/batches/{batch_id}", "get"), "parameters": by_id},
        "CancelBatch": {"operationRef": _ref("/v1/batches/{batch_id}/cancel", "post"),
                        "parameters": by_id},
        "GetInputFile": {"operationRef": _ref("/v1/files/{file_id}", "get"),
                         "parameters": {"file_id": "$response.body#/input_file_id"}},
    }  # fmt: skip


def paths() -> dict[str, Any]:
    upload = {
        "required": True,
        "content": {"multipart/form-data": {"schema": {
            "type": "object", "required": ["file", "purpose"],
            "properties": {"file": {"type": "string", "format": "binary"},
                           "purpose": {"type": "string", "enum": ["batch"]}},
        }}},
    }  # fmt: skip
    after = {"name": "after", "in": "query", "required": False, "schema": {"type": "string"}}
    purpose = {"name": "purpose", "in": "query", "required": False, "schema": {"type": "string"}}
    file_id, batch_id = [_path("file_id")], [_path("batch_id")]
    return {
        "/v1/files": {
            "get": _operation("The key's files", schemas.FileList, 400,
                              parameters=_list_query(purpose)),
            "post": _linked(_operation("Upload a JSONL file of requests", schemas.FileObject,
                                       400, 413, requestBody=upload), _file_links()),
        },
        "/v1/files/{file_id}": {
            "get": _operation("One file", schemas.FileObject, 404, parameters=file_id),
            "delete": _operation("Delete a file", schemas.FileDeleted, 404, 409,
                                 parameters=file_id),
        },
        "/v1/files/{file_id}/content": {
            "get": {"summary": "A file's content (JSONL)", "parameters": file_id,
                    "responses": {"200": {"description": "OK", "content": {
                        "application/jsonl": {"schema": {"type": "string"}}}},
                        **errors(ErrorResponse, 401, 404)}},
        },
        "/v1/batches": {
            "get": _operation("The key's offline jobs, newest first", schemas.BatchList, 400,
                              404, parameters=_list_query(after)),
            "post": _linked(_operation("Create an offline job of a file", schemas.Batch, 400,
                                       404, 429,
                                       requestBody=request_body(schemas.BatchCreateRequest)),
                            _batch_links()),
        },
        "/v1/batches/{batch_id}": {
            "get": _operation("One offline job", schemas.Batch, 404, parameters=batch_id),
        },
        "/v1/batches/{batch_id}/cancel": {
            "post": _operation("Cancel an offline job", schemas.Batch, 404, parameters=batch_id),
        },
    }  # fmt: skip
