"""The soak of `make soak`, for 60 s (python -m bench soak): steady load, Redis killed and started
again, the worker stopped and started again; every request answered and none wrong, no process
growing, Redis' keys flat."""

from __future__ import annotations

from pathlib import Path

import pytest

from batching.outcomes import RequestOutcome
from bench import soak
from bench.soak.verdict import LIMIT_RPS

pytestmark = pytest.mark.integration

# A fifth of the simulated GPU's limit: batches of about 20, and a load the generator, the
# stack and another test process can carry together on two cores with one kept busy. `make
# soak` runs at 70% of what the slowest machine carries alone.
RATE_RPS = LIMIT_RPS / 5


def test_a_60_second_soak_with_redis_and_a_worker_restarted(tmp_path: Path) -> None:
    result = soak.run(60, log_dir=tmp_path, verbose=False, rate=RATE_RPS)
    report = soak.report(result)
    assert result.passed, report
    # The faults happened: Redis' restart and the worker's refused some requests.
    assert result.outcomes[RequestOutcome.OK] < sum(result.outcomes.values()), report
    # Every stretch of the run served, and the last, after both faults, served most of what it
    # was sent. How much a busy machine carries is the benchmark's figure, not this test's:
    # admission answers the rest with a fast 503, which the verdicts count as answered.
    served = [counts[RequestOutcome.OK] for _, _, counts in result.segments]
    assert len(served) >= 5, report
    assert all(served), report
    _, sent, counts = result.segments[-1]
    assert counts[RequestOutcome.OK] > sent / 2, report
