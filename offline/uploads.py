"""Where a /v1/files upload is written while it arrives: SAMPLING_UPLOAD_TEMP_DIR, by default a
directory on the files' own volume. The file is then stored by a rename, not a copy of up to
200 MB, and no small /tmp (a Kubernetes pod's is 64 Mi of memory) limits what can be sent.
Small uploads stay in memory, as Django keeps them. An upload whose web process was killed
while it arrived leaves its file there: the feeder sweeps files older than ABANDONED_S.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.files.uploadedfile import TemporaryUploadedFile, UploadedFile
from django.core.files.uploadhandler import (
    FileUploadHandler,
    MemoryFileUploadHandler,
    TemporaryFileUploadHandler,
)
from django.http import HttpRequest

# An upload's file this old is one its web process left (killed while it arrived): no upload
# takes so long.
ABANDONED_S = 6 * 3600
SUFFIX = ".upload"
# What the multipart parser reads at once (Django's default: 64 KiB). gunicorn reads a body
# ahead and copies what it holds at each read: fewer, larger reads copy less.
CHUNK_BYTES = 512 * 1024
PACE_SLACK_S = 0.1


class _BesideTheFiles(TemporaryUploadedFile):
    def __init__(self, name: str | None, content_type: str | None, size: int,
                 charset: str | None, content_type_extra: Any = None) -> None:  # fmt: skip
        directory = settings.SAMPLING_UPLOAD_TEMP_DIR
        os.makedirs(directory, exist_ok=True)
        file = tempfile.NamedTemporaryFile(suffix=SUFFIX, dir=directory)  # noqa: SIM115
        UploadedFile.__init__(self, file, name, content_type, size, charset, content_type_extra)


class _InMemoryHandler(MemoryFileUploadHandler):
    chunk_size = CHUNK_BYTES


class _BesideTheFilesHandler(TemporaryFileUploadHandler):
    chunk_size = CHUNK_BYTES

    def new_file(self, *args: Any, **kwargs: Any) -> None:
        FileUploadHandler.new_file(self, *args, **kwargs)
        self.file = _BesideTheFiles(self.file_name, self.content_type, 0, self.charset,
                                    self.content_type_extra)  # fmt: skip

    def receive_data_chunk(self, raw_data: bytes, start: int) -> None:
        """The chunk written, then paced (_pace)."""
        super().receive_data_chunk(raw_data, start)
        _pace(len(raw_data))


# When this process's uploads, read at SAMPLING_UPLOAD_BYTES_PER_S together, may go on
# (monotonic): the pace is the process's, however many uploads it receives at once.
_paced_until = 0.0


def _pace(size: int) -> None:
    """Wait out `size` bytes' share of SAMPLING_UPLOAD_BYTES_PER_S after this process's
    uploads' earlier bytes: the wait lets its other requests run (gevent), and the client
    waits in TCP."""
    global _paced_until
    rate = settings.SAMPLING_UPLOAD_BYTES_PER_S
    if rate:
        now = time.monotonic()
        # Behind by up to PACE_SLACK_S (the time spent reading), it catches up: the pace holds.
        _paced_until = max(_paced_until, now - PACE_SLACK_S) + size / rate
        time.sleep(max(0.0, _paced_until - now))


def receive_beside_the_files(request: HttpRequest) -> None:
    """The request's upload, once parsed, in memory (small) or beside the files (else); call
    before its POST or FILES is read."""
    request.upload_handlers = [_InMemoryHandler(request), _BesideTheFilesHandler(request)]


def sweep_abandoned(now: float | None = None) -> int:
    """Delete the uploads' files older than ABANDONED_S; how many."""
    directory = Path(settings.SAMPLING_UPLOAD_TEMP_DIR)
    if not directory.is_dir():
        return 0
    limit = (time.time() if now is None else now) - ABANDONED_S
    swept = 0
    for path in directory.glob(f"*{SUFFIX}"):
        with contextlib.suppress(FileNotFoundError):  # finished, or swept by another
            if path.stat().st_mtime < limit:
                path.unlink()
                swept += 1
    return swept
