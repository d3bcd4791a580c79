"""An offline job as a benchmark drives it, through the `openai` client: started with chat
lines, its progress read while a window runs, cancelled."""

from __future__ import annotations

import io
import json
import threading
import time

from openai import OpenAI

from bench.harness.stats import slope

# A window reads its job's answered lines this often: the rate is their slope over time. Two
# reads' difference is off by up to a feeder's write of lines at each end (2 to 3% in 10 s).
PROGRESS_EVERY_S = 0.25


def start(client: OpenAI, model: str, lines: int, tag: str) -> str:
    """A job created and under way (validated, its first items taken); its id."""
    content = b"".join(
        json.dumps({"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": model, "max_tokens": 16, "seed": i,
                             "messages": [{"role": "user", "content": f"{tag} {i}"}]}}).encode()
        + b"\n"
        for i in range(lines)
    )  # fmt: skip
    uploaded = client.files.create(file=("job.jsonl", io.BytesIO(content)), purpose="batch")
    job = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                completion_window="24h")  # fmt: skip
    deadline = time.monotonic() + 120
    while answered(client, job.id) == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    return job.id


def wait_cancelled(client: OpenAI, job_id: str) -> None:
    """Until the job stopped: cancelled, or done before the cancel reached it (a short job)."""
    deadline = time.monotonic() + 60
    while client.batches.retrieve(job_id).status not in ("cancelled", "completed", "failed"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job_id} was not cancelled within 60 s")
        time.sleep(0.1)


def answered(client: OpenAI, job_id: str) -> int:
    counts = client.batches.retrieve(job_id).request_counts
    return counts.completed + counts.failed if counts else 0


class Progress:
    """A job's answered lines over a window, read in a thread of its own."""

    def __init__(self, client: OpenAI, job_id: str) -> None:
        self.client, self.job_id = client, job_id
        self.points: list[tuple[float, float]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._read, name="progress", daemon=True)

    def __enter__(self) -> Progress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _read(self) -> None:
        while True:
            self.points.append((time.monotonic(), answered(self.client, self.job_id)))
            if self._done.wait(PROGRESS_EVERY_S):
                self.points.append((time.monotonic(), answered(self.client, self.job_id)))
                return

    def rate(self) -> float:
        return slope(self.points)
