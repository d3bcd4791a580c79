"""Offline jobs' records: the files clients upload and the jobs' outputs (`StoredFile`, their
content in Django's storage), the jobs (`Job`, OpenAI's "batch" object), and their lines
(`JobLine`: its custom_id, and its answer once it has one; a line answered twice keeps its
first).

None is read on the request path: the Batch API's views and the feeder (offline.feeder) are
their only users.
"""

from __future__ import annotations

import secrets
from typing import Any

from django.db import models


def _file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def _job_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


class Purpose(models.TextChoices):
    BATCH = "batch"  # a job's input, uploaded by a client
    BATCH_OUTPUT = "batch_output"  # a job's output or error file, written by the feeder


class StoredFile(models.Model):
    id = models.CharField(primary_key=True, max_length=40, default=_file_id, editable=False)
    key_id = models.PositiveIntegerField(db_index=True, help_text="The API key that owns it.")
    purpose = models.CharField(max_length=20, choices=Purpose.choices)
    filename = models.CharField(max_length=255)
    size = models.PositiveBigIntegerField("bytes")
    lines = models.PositiveIntegerField(default=0, help_text="Its non-empty lines (JSONL).")
    created = models.DateTimeField(auto_now_add=True)
    content = models.FileField(upload_to="offline/%Y/%m/%d/", max_length=255)

    class Meta:
        ordering = ["-created"]
        verbose_name = "file"

    def __str__(self) -> str:
        return f"{self.id} ({self.filename})"

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.size,
            "created_at": int(self.created.timestamp()),
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
        }


class Status(models.TextChoices):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


# A job in one of these is the feeder's to move on; the others are done.
ACTIVE = (Status.VALIDATING, Status.IN_PROGRESS, Status.FINALIZING, Status.CANCELLING)

# Each status's time field (OpenAI's `<status>_at`).
_STATUS_TIMES = {
    Status.IN_PROGRESS: "in_progress_at",
    Status.FINALIZING: "finalizing_at",
    Status.COMPLETED: "completed_at",
    Status.FAILED: "failed_at",
    Status.EXPIRED: "expired_at",
    Status.CANCELLING: "cancelling_at",
    Status.CANCELLED: "cancelled_at",
}


class Job(models.Model):
    """An offline job (OpenAI's batch): its input file's lines run through the backfill lane of
    its model's queue; their answers go to its output file (200s) and error file (others)."""

    id = models.CharField(primary_key=True, max_length=40, default=_job_id, editable=False)
    key_id = models.PositiveIntegerField(db_index=True, help_text="The API key that owns it.")
    model = models.CharField(max_length=200, help_text="The model (queue) its lines run on.")
    alias = models.CharField(
        max_length=64,
        blank=True,
        default="",
        help_text="The alias its lines named, if any: each feed pass follows its split.",
    )
    endpoint = models.CharField(max_length=40)
    completion_window = models.CharField(max_length=10, default="24h")
    input_file = models.ForeignKey(StoredFile, on_delete=models.PROTECT, related_name="+")
    output_file = models.ForeignKey(
        StoredFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    error_file = models.ForeignKey(
        StoredFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.VALIDATING)
    errors = models.JSONField(null=True, blank=True, help_text="Why it failed validation.")
    metadata = models.JSONField(null=True, blank=True)
    total = models.PositiveIntegerField(default=0)
    completed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    # The tokens of its lines answered 200, as their bodies' usage says (charged to its key at
    # the model's batch price as they are written: offline.feeder).
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    # Its model's batch price per token (billionths) when it was validated: what every line
    # pays, whatever the catalog says later. None: a job from before prices were kept (it
    # pays the catalog's price of the moment).
    prompt_price_nanos = models.PositiveBigIntegerField(null=True, blank=True, editable=False)
    completion_price_nanos = models.PositiveBigIntegerField(null=True, blank=True, editable=False)
    spend_nanos = models.PositiveBigIntegerField("spend (billionths)", default=0)
    # Usage written with its lines and not yet charged to its key's statistics; the charge
    # being sent (sequence charges_sent + 1, its content fixed); how many charges were sent
    # (offline.charges: each sent once, whatever kills or stalls a feeder).
    uncharged_prompt_tokens = models.PositiveBigIntegerField(default=0, editable=False)
    uncharged_completion_tokens = models.PositiveBigIntegerField(default=0, editable=False)
    uncharged_spend_nanos = models.PositiveBigIntegerField(default=0, editable=False)
    charging_prompt_tokens = models.PositiveBigIntegerField(default=0, editable=False)
    charging_completion_tokens = models.PositiveBigIntegerField(default=0, editable=False)
    charging_spend_nanos = models.PositiveBigIntegerField(default=0, editable=False)
    charges_sent = models.PositiveIntegerField(default=0, editable=False)
    created = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    # The feeder's place in the input file: lines and bytes fed, under which Redis epoch
    # (batching.backfill: another epoch means the items fed were lost, and go again).
    fed_lines = models.PositiveIntegerField(default=0, editable=False)
    fed_offset = models.PositiveBigIntegerField(default=0, editable=False)
    epoch = models.CharField(max_length=40, blank=True, editable=False)

    class Meta:
        ordering = ["-created"]
        verbose_name = "offline job"

    def __str__(self) -> str:
        return self.id

    def time_of(self, status: str) -> Any:
        field = _STATUS_TIMES.get(Status(status))
        return getattr(self, field) if field else None

    def saved_where(self, fields: list[str], **conditions: Any) -> bool:
        """`fields` saved only where the job's row still meets `conditions` (a feeder that
        stalled past its lock must not undo its successor's work); whether they were."""
        rows = Job.objects.filter(id=self.id, **conditions)
        return bool(rows.update(**{name: getattr(self, name) for name in fields}))

    def mark(self, status: Status, now: Any) -> list[str]:
        """Move to `status` at `now`; the fields to save."""
        self.status = status
        field = _STATUS_TIMES.get(status)
        if field is None:
            return ["status"]
        setattr(self, field, now)
        return ["status", field]

    def as_openai(self) -> dict[str, Any]:
        def stamp(value: Any) -> int | None:
            return int(value.timestamp()) if value is not None else None

        errors = {"object": "list", "data": self.errors} if self.errors else None
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "model": self.model,
            "errors": errors,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": stamp(self.created),
            "expires_at": stamp(self.expires_at),
            **{field: stamp(getattr(self, field)) for field in _STATUS_TIMES.values()},
            "request_counts": {
                "total": self.total,
                "completed": self.completed,
                "failed": self.failed,
            },
            "usage": {
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": self.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + self.completion_tokens,
            },
            "metadata": self.metadata,
        }


class JobLine(models.Model):
    """One line of a job's input, made when the job is validated, and once answered its
    answer: the HTTP status and body the endpoint would have answered it with interactively,
    or a job-level error (the job expired or was cancelled first: no status). The first
    answer stays: a line answered twice (its item fed again) keeps it."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="lines")
    line = models.PositiveIntegerField()
    custom_id = models.CharField(max_length=512)
    answered = models.BooleanField(default=False)
    status_code = models.PositiveSmallIntegerField(null=True)
    body = models.JSONField(null=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["job", "line"], name="offline_one_row_per_line")
        ]
        indexes = [models.Index(fields=["job", "answered"], name="offline_line_answered")]

    def __str__(self) -> str:
        return f"{self.job_id} line {self.line + 1}"

    @property
    def ok(self) -> bool:
        return self.status_code == 200
