"""OpenAI's Files and Batch APIs, for offline jobs: upload a JSONL file of requests, create a
job of it, follow it, cancel it, download its output and error files.

Every endpoint needs an API key (anonymous callers would share one identity), and a key sees
only its own files and jobs: another key's id is answered as unknown (404). What a job does
once created is the feeder's (offline.feeder).
"""

from __future__ import annotations

import functools
import json
import re
from datetime import timedelta
from typing import Any, TypeVar

from django.conf import settings
from django.core.files.uploadedfile import UploadedFile
from django.db import transaction
from django.db.models import ProtectedError
from django.http import FileResponse, HttpRequest, HttpResponse
from django.http.response import HttpResponseBase
from django.utils import timezone

from accounts.access import Caller
from batching.problems import Failure, Problem
from offline.lines import ENDPOINTS, count_lines, storable
from offline.models import Job, Purpose, Status, StoredFile
from offline.uploads import receive_beside_the_files
from serving.blocking import off_the_loop
from serving.responses import Invalid, json_response
from serving.runtime import web_process
from serving.wrappers import openai_endpoint

# Every endpoint here: its objects belong to a key.
keyed = functools.partial(openai_endpoint, key_for="files and batches belong to an API key")
Owned = TypeVar("Owned", StoredFile, Job)
COMPLETION_WINDOW = "24h"
LIST_LIMIT = (1, 100)
# An id this server could have made (offline.models: `file-<hex>`, `batch_<hex>`); any other
# string is unknown without asking the database, which may refuse it (a NUL, say).
ID = re.compile(r"[a-z]{4,5}[-_][0-9a-f]{1,32}")
# OpenAI's bounds on a batch's metadata.
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


def _page(objects: list[dict[str, Any]], limit: int) -> HttpResponse:
    more = len(objects) > limit
    data = objects[:limit]
    body = {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": more,
    }
    return json_response(200, body)


def _limit(request: HttpRequest, default: int) -> int:
    raw = request.GET.get("limit", str(default))
    low, high = LIST_LIMIT
    # ASCII digits, and few: int() refuses "²" and numbers of over 4,300 digits.
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 6 and low <= int(raw) <= high):
        raise Invalid(f"limit must be an integer from {low} to {high}", "limit")
    return int(raw)


# --- files --------------------------------------------------------------------------------
@keyed("GET", "POST")
def files(request: HttpRequest, caller: Caller) -> HttpResponse:
    if request.method == "GET":
        limit = _limit(request, 100)
        found = StoredFile.objects.filter(key_id=caller.key_id)
        if purpose := request.GET.get("purpose"):
            if purpose not in Purpose.values:
                raise Invalid(f"purpose must be one of {Purpose.values}", "purpose")
            found = found.filter(purpose=purpose)
        return _page([f.as_openai() for f in found[: limit + 1]], limit)
    return _upload(request, caller)


def _upload(request: HttpRequest, caller: Caller) -> HttpResponse:
    limit = settings.SAMPLING_BATCH_FILE_MAX_BYTES
    declared = request.META.get("CONTENT_LENGTH") or "0"
    if declared.isdigit() and int(declared) > limit + 64 * 1024:  # room for the form's parts
        raise Invalid(f"the file is over the {limit}-byte limit", "file", status=413,
                      code="file_too_large")  # fmt: skip
    receive_beside_the_files(request)  # before the parse that writes it
    purpose = request.POST.get("purpose", "")
    if purpose != Purpose.BATCH:
        raise Invalid(f"purpose must be {Purpose.BATCH.value!r}, got {purpose!r:.100}", "purpose")
    upload = request.FILES.get("file")
    if not isinstance(upload, UploadedFile):
        raise Invalid("send the file as the multipart field 'file'", "file")
    if upload.size is None or upload.size > limit:
        raise Invalid(f"the file is over the {limit}-byte limit", "file", status=413,
                      code="file_too_large")  # fmt: skip
    stored = StoredFile(key_id=caller.key_id, purpose=purpose, size=upload.size,
                        filename=(upload.name or "upload.jsonl")[:255])  # fmt: skip

    def count_and_store() -> None:  # in constant memory, off the interactive requests' loop
        stored.lines = count_lines(upload.chunks())  # as validation reads them
        upload.seek(0)
        stored.content.save(f"{stored.id}.jsonl", upload, save=False)

    off_the_loop(count_and_store)
    stored.save()
    return json_response(200, stored.as_openai())


def _owned(model: type[Owned], caller: Caller, ident: str, param: str | None = None) -> Owned:
    """The caller's file or job `ident`; another key's is as unknown as a missing one."""
    found = None
    if ID.fullmatch(ident):
        found = model._default_manager.filter(id=ident, key_id=caller.key_id).first()
    if found is None:
        kind = "file" if model is StoredFile else "batch"
        raise Invalid(f"no {kind} {ident!r:.100}", param, status=404, code="not_found")
    return found


def _own_file(caller: Caller, file_id: str, param: str | None = None) -> StoredFile:
    return _owned(StoredFile, caller, file_id, param)


@keyed("GET", "DELETE")
def file(request: HttpRequest, caller: Caller, file_id: str) -> HttpResponse:
    found = _own_file(caller, file_id)
    if request.method == "DELETE":
        _delete(found)
        return json_response(200, {"id": file_id, "object": "file", "deleted": True})
    return json_response(200, found.as_openai())


def _delete(found: StoredFile) -> None:
    """The file's row, then (once that is committed) its content; 409 while a job names it
    as its input, running or ended (a job created meanwhile too: its row holds the file's)."""
    in_use = Invalid(f"file {found.id!r} is the input of a job", "file_id", status=409,
                     code="file_in_use")  # fmt: skip
    with transaction.atomic():
        locked = StoredFile.objects.select_for_update().filter(pk=found.pk).first()
        if locked is None:
            raise Invalid(f"no file {found.id!r}", "file_id", status=404, code="not_found")
        if Job.objects.filter(input_file=locked).exists():
            raise in_use
        try:
            locked.delete()
        except ProtectedError:
            raise in_use from None
        content = locked.content
        transaction.on_commit(lambda: content.delete(save=False))


@keyed("GET")
def file_content(request: HttpRequest, caller: Caller, file_id: str) -> HttpResponseBase:
    found = _own_file(caller, file_id)
    response = FileResponse(found.content.open("rb"), content_type="application/jsonl")
    response["Content-Length"] = str(found.size)
    return response


# --- batches ------------------------------------------------------------------------------
@keyed("GET", "POST")
def batches(request: HttpRequest, caller: Caller) -> HttpResponse | Failure:
    if request.method == "GET":
        limit = _limit(request, 20)
        found = Job.objects.filter(key_id=caller.key_id).select_related("input_file")
        if after := request.GET.get("after"):
            cursor = _owned(Job, caller, after, "after")
            found = found.filter(created__lt=cursor.created)
        return _page([job.as_openai() for job in found[: limit + 1]], limit)
    return _create(request, caller)


def _create(request: HttpRequest, caller: Caller) -> HttpResponse | Failure:
    spent = web_process().budgets.refusal(caller)
    if spent is not None:  # as its requests are: a job could only run past the budget
        return Failure(Problem.OVER_BUDGET, spent)
    try:
        body = json.loads(request.body or b"{}")
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise Invalid(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise Invalid("send a JSON object", code="invalid_json")
    endpoint = body.get("endpoint")
    if not isinstance(endpoint, str) or endpoint not in ENDPOINTS:
        raise Invalid(f"endpoint must be one of {sorted(ENDPOINTS)}, got {endpoint!r:.100}",
                      "endpoint")  # fmt: skip
    window = body.get("completion_window", COMPLETION_WINDOW)
    if window != COMPLETION_WINDOW:
        raise Invalid(f"completion_window must be {COMPLETION_WINDOW!r}", "completion_window")
    metadata = body.get("metadata")
    if metadata is not None and not _fair_metadata(metadata):
        raise Invalid(
            f"metadata must be an object of at most {METADATA_PAIRS} strings, keys of at most "
            f"{METADATA_KEY_CHARS} characters and values of at most {METADATA_VALUE_CHARS}, "
            "without NUL", "metadata",
        )  # fmt: skip
    input_file_id = body.get("input_file_id")
    if not isinstance(input_file_id, str):
        raise Invalid("input_file_id must be the id of a file of purpose 'batch'", "input_file_id")
    input_file = _own_file(caller, input_file_id, "input_file_id")
    if input_file.purpose != Purpose.BATCH:
        raise Invalid(f"file {input_file.id!r} is not of purpose 'batch'", "input_file_id")
    with transaction.atomic():  # the file locked: a delete meanwhile waits, or came first
        if not StoredFile.objects.select_for_update().filter(pk=input_file.pk).exists():
            raise Invalid(f"no file {input_file_id!r:.100}", "input_file_id", status=404,
                          code="not_found")  # fmt: skip
        job = Job.objects.create(
            key_id=caller.key_id, endpoint=endpoint, input_file=input_file, metadata=metadata,
            completion_window=window, expires_at=timezone.now() + timedelta(hours=24),
        )  # fmt: skip
    return json_response(200, job.as_openai())


def _fair_metadata(metadata: object) -> bool:
    return (
        isinstance(metadata, dict) and len(metadata) <= METADATA_PAIRS
        and all(isinstance(value, str) and len(key) <= METADATA_KEY_CHARS
                and len(value) <= METADATA_VALUE_CHARS and storable(key + value)
                for key, value in metadata.items())
    )  # fmt: skip


def _own_job(caller: Caller, job_id: str) -> Job:
    return _owned(Job, caller, job_id)


@keyed("GET")
def batch(request: HttpRequest, caller: Caller, job_id: str) -> HttpResponse:
    return json_response(200, _own_job(caller, job_id).as_openai())


@keyed("POST")
def cancel(request: HttpRequest, caller: Caller, job_id: str) -> HttpResponse:
    """A running job stops being fed at once; the feeder withdraws its waiting items and,
    once its taken ones are answered, writes what is done and marks it cancelled."""
    job = _own_job(caller, job_id)
    if job.status in (Status.VALIDATING, Status.IN_PROGRESS):
        updated = Job.objects.filter(id=job.id, status=job.status).update(
            status=Status.CANCELLING, cancelling_at=timezone.now()
        )
        if updated:
            job.refresh_from_db()
    return json_response(200, job.as_openai())
