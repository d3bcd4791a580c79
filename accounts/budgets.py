"""Monthly budgets: a key whose spend this month reached its budget, or whose owner's keys'
spend together reached the owner's budget, is refused (429 `insufficient_quota`) until the
month ends or the budget rises.

A key's spend is exact: each 200 answer's tokens at its model's price when it answered
(batching.catalog.Price), in billionths, counted in the web process's statistics and flushed
once a second; the flush adds it to the month's total per key and model
(QueueKeys.spend_of_month, telemetry.flush). Each web process reads those totals for the keys
that have a budget with its key poll (twice a second: one pipeline, a field per budgeted key
and model; an owner's: every key of the owner), and refuses from memory a key whose total, or
whose owner's, reached its budget: no Redis call on the request path.

A request's cost is known only once it is sampled, so a request of a budgeted key holds, at
admission, the most it may cost (its prompt's bound and every item's `max_tokens`, at its
model's price) in one script call (batching/lua/hold_spend.lua): refused while what the key's
requests hold already reaches what is left of its budget (and the same for its owner's).
Answered, its hold is settled to what it spent; that rest is released once it is in the
month's totals every process reads (after this process's next flush and two polls). So
requests in flight overrun a budget by one request's hold at most (docs/guides/usage.md).

Django-free: a redis client, the model names, the budgeted keys and owners in.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal

import redis

from accounts.access import KEYS, Caller
from batching import scripts
from batching.catalog import Price
from batching.generation import SampleRequest
from batching.keys import AccessKeys, QueueKeys
from batching.topology import REDIS_FAULTS
from telemetry.flush import month_of

log = logging.getLogger(__name__)

# How long a settled hold stays after the flush that put its spend in the month's totals:
# two polls of every other process (accounts.access.POLL_INTERVAL_S), which then read it.
RELEASE_AFTER_FLUSH_S = 1.0
# Holds count in windows of this length, the current and the previous one read: a hold lasts
# at least a window, longer than any request (a policy's deadline is 10 minutes at most) and
# its release; one never released (its process killed) lapses within two.
HOLD_WINDOW_S = 15 * 60
HOLD_TTL_MS = 3 * HOLD_WINDOW_S * 1000
# Tokens a tokenizer may add to a prompt, and a chat template to each message: with the
# prompt's UTF-8 bytes (each token is one at least), the bound of its tokens.
TEMPLATE_TOKENS = 8
# Tokens a chat template may add to a chat as a whole: its default system turn included
# (SmolLM2's is 19 tokens, with its generation prompt 22 in all).
CHAT_TEMPLATE_TOKENS = 64


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
KEY_HELD = (
    "this API key's requests running or just answered may spend what is left of its monthly "
    "budget: try again in a second, once their spend is counted"
)
OWNER_HELD = (
    "the requests running or just answered of this API key's owner may spend what is left of "
    "the owner's monthly budget: try again in a second, once their spend is counted"
)


@dataclass
class SpendHold:
    """The most a request of a budgeted key may cost, held against its key's (and owner's)
    budget from admission until its spend is in the month's totals (Budgets.hold)."""

    budgets: Budgets
    key: str  # the window's holds
    fields: tuple[str, ...]
    nanos: int
    settled: bool = False

    def settle(self, spent: int) -> None:
        """The hold lowered to `spent` now (once), and released after the next flush (best
        effort: Redis away leaves it held until its window lapses, which refuses, never
        serves, too much)."""
        if self.settled:
            return
        self.settled = True
        spent = min(max(0, spent), self.nanos)
        self.budgets.release(self.key, self.fields, self.nanos - spent)
        if spent:
            self.budgets.release_after_flush(self.key, self.fields, spent)


class Budgets:
    """This process's view of this month's spend of the keys that have a budget, and of the
    owners that have one."""

    def __init__(self, client: redis.Redis, keys: AccessKeys = KEYS) -> None:
        self.client = client
        self.keys = keys
        self.month = ""
        self.spent: dict[int, int] = {}  # key id -> spend this month, in billionths
        self.owners_spent: dict[str, int] = {}  # owner -> its keys' spend this month
        self._hold = scripts.register(client, "hold_spend")
        self._release = scripts.register(client, "release_spend")
        # Settled holds: waiting for the next flush, then for their release (monotonic time).
        self._settled: list[tuple[str, tuple[str, ...], int]] = []
        self._due: deque[tuple[float, str, tuple[str, ...], int]] = deque()

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
        # The month's models with spend too: a model's spend counts after it left the catalog.
        spent_in = self.client.smembers(self.keys.spent_models(month))
        names = sorted(set(models) | {name.decode() for name in spent_in})
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

    def hold(
        self, caller: Caller, nanos: int, now_s: float | None = None
    ) -> SpendHold | str | None:
        """`nanos` held against the caller's budgets (None: it has none), or why it is refused:
        what its requests in flight hold reaches what is left. Raises redis errors."""
        if not caller.budget_nanos and not caller.owner_budget_nanos:
            return None
        now_s = time.time() if now_s is None else now_s
        refused = self.refusal(caller, now_s)
        if refused is not None:
            return refused
        current = self.month == month_of(now_s)
        key_left = owner_left = 0
        if caller.budget_nanos:
            key_left = caller.budget_nanos - (self.spent.get(caller.key_id, 0) if current else 0)
        if caller.owner_budget_nanos:
            spent = self.owners_spent.get(caller.owner, 0) if current else 0
            owner_left = caller.owner_budget_nanos - spent
        window = int(now_s // HOLD_WINDOW_S)
        key = self.keys.spend_holds(window)
        fields = (f"k:{caller.key_id}", f"o:{caller.owner}")
        args = [fields[0], key_left, fields[1], owner_left, max(0, nanos), HOLD_TTL_MS]
        refusal, _ = self._hold(keys=[key, self.keys.spend_holds(window - 1)], args=args)
        if refusal:
            return KEY_HELD if int(refusal) == 1 else OWNER_HELD
        held = tuple(f for f, left in zip(fields, (key_left, owner_left), strict=True) if left)
        return SpendHold(self, key, held, max(0, nanos))

    def release(self, key: str, fields: tuple[str, ...], nanos: int) -> None:
        """`nanos` released from each field of the window's holds `key` now."""
        if nanos <= 0 or not fields:
            return
        try:
            self._release(keys=[key], args=[value for f in fields for value in (f, nanos)])
        except REDIS_FAULTS as exc:
            log.warning("a request's budget hold not released: %s", exc)

    def release_after_flush(self, key: str, fields: tuple[str, ...], nanos: int) -> None:
        self._settled.append((key, fields, nanos))

    def take_settled(self) -> list[tuple[str, tuple[str, ...], int]]:
        """The holds settled so far, taken before a flush (their spend is in it)."""
        settled, self._settled = self._settled, []
        return settled

    def flushed(self, settled: list[tuple[str, tuple[str, ...], int]], ok: bool) -> None:
        """A flush's end: its holds released RELEASE_AFTER_FLUSH_S from now, or, when it
        failed (its statistics kept for the next), kept for the next flush."""
        if not ok:
            self._settled[:0] = settled
            return
        due = time.monotonic() + RELEASE_AFTER_FLUSH_S
        self._due.extend((due, *hold) for hold in settled)

    def release_due(self) -> None:
        """The holds whose spend every process has read released (one call each)."""
        now = time.monotonic()
        while self._due and self._due[0][0] <= now:
            _, key, fields, nanos = self._due.popleft()
            self.release(key, fields, nanos)


def most_cost(
    items: Sequence[str | SampleRequest], max_new_tokens: int, price: Price, embedded: int | None
) -> int:
    """The most a request of `items` may cost at `price`: each prompt's bound, each item's
    `max_tokens` (else `max_new_tokens`); `embedded`: an embedding's input bound, its only
    tokens."""
    if embedded is not None:
        return price.of(embedded + TEMPLATE_TOKENS * len(items), 0)
    completions = sum(max_new_tokens if isinstance(item, str) else
                      (item.max_tokens or max_new_tokens) for item in items)  # fmt: skip
    return price.of(sum(prompt_bound(item) for item in items), completions)


def prompt_bound(item: str | SampleRequest) -> int:
    """The most tokens an item's prompt may take: its UTF-8 bytes, and the template's."""
    if isinstance(item, str):
        return len(item.encode()) + TEMPLATE_TOKENS
    if item.messages:
        return CHAT_TEMPLATE_TOKENS + sum(
            len(role.encode()) + len(content.encode()) + TEMPLATE_TOKENS
            for role, content in item.messages
        )
    return len(item.prompt.encode()) + TEMPLATE_TOKENS
