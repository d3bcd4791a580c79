"""The pace of a web process's uploads (offline.uploads): what its uploads read together stays
within SAMPLING_UPLOAD_BYTES_PER_S, however many arrive at once; 0 reads at full speed."""

from __future__ import annotations

import time
from typing import Any

from offline import uploads

RATE = 1_000_000  # bytes a second
CHUNK = 50_000


def test_uploads_read_together_within_the_process_s_pace(settings: Any) -> None:
    settings.SAMPLING_UPLOAD_BYTES_PER_S = RATE
    began = time.monotonic()
    for _ in range(10):  # two uploads' chunks in turn: 500,000 bytes in all
        uploads._pace(CHUNK)
        uploads._pace(CHUNK)
    elapsed = time.monotonic() - began
    assert elapsed >= 20 * CHUNK / RATE - uploads.PACE_SLACK_S  # a sleep never ends early


def test_no_pace_reads_at_full_speed(settings: Any) -> None:
    settings.SAMPLING_UPLOAD_BYTES_PER_S = 0
    before = uploads._paced_until
    uploads._pace(10**9)
    assert uploads._paced_until == before
