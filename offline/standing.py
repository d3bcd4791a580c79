"""Whether an offline job's key may still spend, asked by the feeder before it feeds a job:
the key revoked, expired or deleted since the job was created, or over its monthly budget
(or its owner's), stops its jobs as it stops its requests.

A key with a budget has its jobs fed only what the budget left may pay for (at its jobs' cost
per line so far, less all their lines in flight; one call's worth before their first answer):
the lines in flight when the budget is crossed are few.

A refused job is fed no more: its waiting items are withdrawn from the lanes, the lines in a
running call are answered (and charged) as usual, and once none is left in a call its other
lines are failed with the error the interactive API gives (401 `invalid_api_key`, 429
`insufficient_quota`). The job then completes with them in its error file.
"""

from __future__ import annotations

from accounts.access import Caller, Refusal
from batching.catalog import Price
from batching.problems import Failure, Problem
from offline import charges
from offline.lines import failed
from offline.models import Job, JobLine
from serving.runtime import WebProcess

# Lines failed in one transaction.
STEP = 500


def refusal_of(process: WebProcess, key_id: int) -> Failure | None:
    """Why key `key_id` may not spend any more (as this process last read the keys and the
    month's spend; an unknown key read again first: its job may be fed before this
    process's next read of the keys); None while it may, or before the keys were read."""
    standing = process.access.standing(key_id)
    if standing == Refusal.UNKNOWN:  # a key made since this process last read the keys?
        process.access.refresh()
        standing = process.access.standing(key_id)
    if standing is None:
        return None
    if isinstance(standing, Refusal):
        return Failure(Problem.UNAUTHORIZED, standing.value)
    spent = process.budgets.refusal(standing)
    return None if spent is None else Failure(Problem.OVER_BUDGET, spent)


def affordable(
    process: WebProcess,
    key_id: int,
    job_ids: list[str],
    first_lines: int,
    price_of: charges.PriceOf,
) -> int | None:
    """How many more lines of its jobs `job_ids` key `key_id`'s budget left (and its owner's)
    may pay for, at their cost per line so far, less all their lines in flight, with one line
    to spare so that the budget is crossed, not approached forever; `first_lines` before any
    answer. None for a key without a budget."""
    caller = process.access.standing(key_id)
    if not isinstance(caller, Caller) or not (caller.budget_nanos or caller.owner_budget_nanos):
        return None
    budgets = process.budgets
    lefts = []
    if caller.budget_nanos:
        lefts.append(caller.budget_nanos - budgets.spent.get(key_id, 0))
    if caller.owner_budget_nanos:
        lefts.append(caller.owner_budget_nanos - budgets.owners_spent.get(caller.owner, 0))
    jobs = list(Job.objects.filter(id__in=job_ids))
    in_flight = sum(  # fed and not answered: waiting, taken or answered and not collected
        JobLine.objects.filter(job=job, answered=False, line__lt=job.fed_lines).count()
        for job in jobs
    )
    answered = sum(job.completed for job in jobs)
    if not answered:
        return max(0, first_lines - in_flight)
    cost = sum(price_of(job).of(job.prompt_tokens, job.completion_tokens) for job in jobs)
    per_line = max(1, cost // answered)
    return max(0, max(0, min(lefts)) // per_line + 1 - in_flight)


def fail_unanswered(job: Job, failure: Failure) -> int:
    """Every line of the job not answered yet, failed as `failure`; how many."""
    lines = list(JobLine.objects.filter(job=job, answered=False).values_list("line", flat=True))
    outcome = failed(failure)
    for start in range(0, len(lines), STEP):
        charges.settle(job, dict.fromkeys(lines[start : start + STEP], outcome), Price())
    return len(lines)
