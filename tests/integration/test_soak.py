"""The soak of `make soak`, for 60 s (python -m bench soak): steady load at its default rate (70% of
what the slowest machine we ran it on carries), Redis killed and started again, the worker
stopped and started again; every request answered and none wrong, no process growing,
Redis' keys flat."""

from __future__ import annotations

from pathlib import Path

import pytest

from batching.outcomes import RequestOutcome
from bench import soak

pytestmark = pytest.mark.integration


def test_a_60_second_soak_with_redis_and_a_worker_restarted(tmp_path: Path) -> None:
    result = soak.run(60, log_dir=tmp_path, verbose=False)
    report = soak.report(result)
    assert result.passed, report
    # The faults happened: Redis' restart refused some requests, and the run served the rest.
    assert result.outcomes[RequestOutcome.OK] > 0.9 * sum(result.outcomes.values()), report
