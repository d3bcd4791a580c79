"""Offline jobs in the admin: each job's progress (a bar), its rate since it started and when it
should end at that rate; its files. Read-only: clients create and cancel jobs through the API,
an operator cancels one with the action below."""

from __future__ import annotations

from datetime import timedelta

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone
from django.utils.html import format_html

from offline.models import Job, Status, StoredFile


def progress(job: Job) -> tuple[int, float | None, timedelta | None]:
    """Lines answered, lines a second since it started, and the time left at that rate."""
    done = job.completed + job.failed
    if job.in_progress_at is None or done == 0:
        return done, None, None
    end = job.finalizing_at or timezone.now()
    elapsed_s = max((end - job.in_progress_at).total_seconds(), 1e-3)
    rate = done / elapsed_s
    left = (
        timedelta(seconds=(job.total - done) / rate) if job.status == Status.IN_PROGRESS else None
    )
    return done, rate, left


@admin.register(Job)
class JobAdmin(admin.ModelAdmin[Job]):
    list_display = ("id", "model", "endpoint", "status", "progress_bar", "rate", "finish_at",
                    "key_id", "created")  # fmt: skip
    list_filter = ("status", "model", "endpoint")
    search_fields = ("id", "key_id")
    actions = ["cancel"]
    readonly_fields = [field.name for field in Job._meta.get_fields() if field.concrete]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Job | None = None) -> bool:
        return False

    @admin.display(description="progress")
    def progress_bar(self, job: Job) -> str:
        done, _, _ = progress(job)
        percent = 100 * done / job.total if job.total else 0
        return format_html(
            '<progress value="{}" max="{}" title="{} of {}"></progress> {}%',
            done, max(job.total, 1), done, job.total, f"{percent:.0f}",
        )  # fmt: skip

    @admin.display(description="lines/s")
    def rate(self, job: Job) -> str:
        _, rate, _ = progress(job)
        return "-" if rate is None else f"{rate:,.1f}"

    @admin.display(description="ends at this rate")
    def finish_at(self, job: Job) -> str:
        _, _, left = progress(job)
        if left is None:
            return "-"
        return timezone.localtime(timezone.now() + left).strftime("%Y-%m-%d %H:%M:%S")

    @admin.action(description="Cancel the selected jobs")
    def cancel(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        running = queryset.filter(status__in=[Status.VALIDATING, Status.IN_PROGRESS])
        count = running.update(status=Status.CANCELLING, cancelling_at=timezone.now())
        self.message_user(request, f"{count} job(s) cancelling", messages.SUCCESS)


@admin.register(StoredFile)
class StoredFileAdmin(admin.ModelAdmin[StoredFile]):
    list_display = ("id", "filename", "purpose", "size", "lines", "key_id", "created")
    list_filter = ("purpose",)
    search_fields = ("id", "filename", "key_id")
    readonly_fields = ("id", "key_id", "purpose", "filename", "size", "lines", "created", "content")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False
