"""Monthly budgets: a key whose spend this month reached its budget, or whose owner's keys'
spend together reached the owner's budget, is refused (429 `insufficient_quota`) until the
month ends or the budget rises.

A key's spend is exact: each 200 answer's tokens at its model's price when it answered
(batching.catalog.Price), in billionths, counted in the web process's statistics and flushed
once a second; the flush adds it to the month's total per key and model
(QueueKeys.spend_of_month, batching.flush). Each web process reads those totals for the keys
that have a budget with its key poll (twice a second: one pipeline, a field per budgeted key
and model; an owner's: every key of the owner), and refuses from memory a key whose total, or
whose owner's, reached its budget: no Redis call on the request path.

The refusal comes late by at most the flush interval (SAMPLING_STATS_FLUSH_INTERVAL_S, 1 s)
plus one poll (0.5 s) after the answer that reached the budget; the key may overshoot its
budget by what its answers cost in that time, plus what its requests in flight when the
refusal starts cost. A request's cost is not known before it is sampled (its completion's
tokens), so no budget of tokens can be exact beforehand; this bound is documented and tested
(docs/guides/usage.md).

Django-free: a redis client, the model names, the budgeted keys and owners in.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Mapping
from decimal import Decimal

import redis

from batching.access import Caller
from batching.flush import month_of
from batching.keys import QueueKeys


def budget_nanos(budget: Decimal | None) -> int:
    """A budget in billionths of its unit (as spend is counted); 0: none. A budget of 0 is
    one billionth: spent by the first answer that costs anything."""
    if budget is None:
        return 0
    return max(1, int(Decimal(budget) * 1_000_000_000))


KEY_SPENT = (
    "this API key has spent its monthly budget: it is refused until the month ends (UTC) or "
    "its budget is raised"
)
OWNER_SPENT = (
    "the owner of this API key has spent its monthly budget across its keys: they are refused "
    "until the month ends (UTC) or the owner's budget is raised"
)


class Budgets:
    """This process's view of this month's spend of the keys that have a budget, and of the
    owners that have one."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.month = ""
        self.spent: dict[int, int] = {}  # key id -> spend this month, in billionths
        self.owners_spent: dict[str, int] = {}  # owner -> its keys' spend this month

    def refresh(
        self,
        budgeted: Mapping[int, int],
        models: Iterable[str],
        now_s: float | None = None,
        owners_keys: Mapping[str, Collection[int]] | None = None,
    ) -> None:
        """Read this month's spend of the keys of `budgeted` (key id -> budget) and of every
        key of `owners_keys` (owner -> its key ids) on every model of `models` (one
        pipeline). Raises redis errors."""
        month = month_of(time.time() if now_s is None else now_s)
        owners_keys = owners_keys or {}
        key_ids = sorted(set(budgeted).union(*owners_keys.values()))
        if not key_ids:
            self.month, self.spent, self.owners_spent = month, {}, {}
            return
        names = sorted(set(models))
        with self.client.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hmget(QueueKeys(name).spend_of_month(month), [str(k) for k in key_ids])
            replies = pipe.execute()
        spent = dict.fromkeys(key_ids, 0)
        for values in replies:
            for key_id, value in zip(key_ids, values, strict=True):
                if value is not None:
                    spent[key_id] += int(value)
        self.owners_spent = {
            owner: sum(spent[key_id] for key_id in ids) for owner, ids in owners_keys.items()
        }
        self.month, self.spent = month, spent

    def refusal(self, caller: Caller, now_s: float | None = None) -> str | None:
        """Why the caller is refused, when its key, or its owner, spent its budget this month
        (as last read); None to serve it."""
        if not caller.budget_nanos and not caller.owner_budget_nanos:
            return None
        if self.month != month_of(time.time() if now_s is None else now_s):
            return None  # a new month: nothing spent yet
        if caller.budget_nanos and self.spent.get(caller.key_id, 0) >= caller.budget_nanos:
            return KEY_SPENT
        owner_budget = caller.owner_budget_nanos
        if owner_budget and self.owners_spent.get(caller.owner, 0) >= owner_budget:
            return OWNER_SPENT
        return None
