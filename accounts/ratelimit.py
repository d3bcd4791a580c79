"""Per-key rate limits: requests per minute (rpm) and completion tokens per minute (tpm).

Both count in fixed one-minute windows (minutes since the epoch, in Redis), per API key.

Requests are counted by the request's own Redis call, and the limit is exact: at most `rpm`
requests of a key are served in a window, whatever the number of web processes. A keyed
request joins the shard its key is pinned to (BatchAggregator.shard_of_key), where its
window's counter lives. Far from the limit (the count this process last read, plus the
request, is within NEAR_FRACTION of it), a lone item's append MULTI raises the counter (INCR):
no extra round trip and no Lua, as before. Should that raise pass the limit (other processes
counted meanwhile), the request is refused all the same (429) and its raise given back
(DECRBY): only a request whose own raise kept the count within the limit is served; its item,
already in a batch, is sampled and not delivered (at most about one per process and window).
Near the limit, and for a request of several items or one the response cache may answer, the
request's one call is a script (batching/lua/append_items.lua) that raises the counter only
if the request fits, and else appends nothing. A process refuses a request itself, before
any Redis call, once a count it read reached the limit, until the window ends: a 429 costs
nothing.

A request counts once against `rpm` whatever its number of items (n choices, a list of
prompts), as OpenAI counts requests; with SAMPLING_RATE_LIMIT_PER_ITEM (`COUNT_ITEMS`) each
item counts one, and a request whose items do not all fit is refused whole.

Tokens are known only once sampled, so a request of a key with a tokens limit reserves at
admission the most it may use (each item's `max_tokens`; an embedding's input bytes, which
bound its tokens) in one script call (batching/lua/reserve_tokens.lua): refused while the
key's tokens in the window already reached the limit. Once answered it settles the
difference (`Reservation.settle`: the completion tokens its answers carry, an embedding's
input tokens, a cut stream's tokens sent; 0 for a failure). So requests in flight overrun the
limit by one request's reservation at most. Every web process also reads the window's tokens
with its key poll (AccessWatcher's loop, every 0.5 s) and refuses a key at its limit itself,
with no Redis call, until the window ends.

Anonymous requests share the anonymous tier's limits, counted as key 0. This module knows
nothing of Django.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from accounts.access import KEYS, Caller
from batching import scripts
from batching.keys import AccessKeys, ShardKeys
from batching.topology import REDIS_FAULTS

log = logging.getLogger(__name__)

WINDOW_S = 60
# A process whose last read count of a key, plus the request, is above this fraction of the
# key's rpm asks Redis whether the request fits before it joins a batch (one script call).
NEAR_FRACTION = 0.75
# Whether each item of a request counts against rpm (SAMPLING_RATE_LIMIT_PER_ITEM), or each
# request once (the default, as OpenAI counts).
COUNT_ITEMS = False
# A window's counters outlive it by one window: the next window's refusals need only their own.
COUNTER_TTL_MS = 2 * WINDOW_S * 1000


def window_of(now_s: float) -> int:
    return int(now_s // WINDOW_S)


def reset_in_s(now_s: float) -> float:
    """Seconds until the window of `now_s` ends."""
    return WINDOW_S - now_s % WINDOW_S


@dataclass(frozen=True)
class Limited:
    """A request refused by its key's rate limit (429 + Retry-After)."""

    kind: str  # "requests" or "tokens": the limit that refused it
    limit: int
    retry_after_s: int

    @property
    def message(self) -> str:
        per = "requests" if self.kind == "requests" else "completion tokens"
        return (
            f"rate limit reached: {self.limit} {per} per minute for this key; "
            f"try again in {self.retry_after_s} s"
        )


@dataclass
class TokenCharges:
    """The completion tokens charged to each key in one window, as a process last read them:
    one per process, shared by the limiters of its models (a key's tokens per minute count
    across models)."""

    window: int = -1
    by_key: dict[int, int] = field(default_factory=dict)  # key id -> tokens in `window`


@dataclass
class Reservation:
    """The tokens a request of a key with a tokens limit holds in its window from admission
    until it settles them to what it used (once: batching/lua/settle_tokens.lua)."""

    settle_script: Any
    key: str  # the window's tokens hash
    key_id: int
    tokens: int
    settled: bool = False

    def settle(self, used: int) -> None:
        """The reservation made `used` (best effort: Redis away leaves the count too high,
        which refuses, never serves, too much)."""
        if self.settled:
            return
        self.settled = True
        if used != self.tokens:
            try:
                self.settle_script(keys=[self.key], args=[self.key_id, used - self.tokens])
            except REDIS_FAULTS as exc:
                log.warning("a request's reserved tokens not settled: %s", exc)


class RateLimiter:
    """One web process's view of its callers' rate windows for one model: requests per
    minute count per model (each model's counters live with its batches), tokens per minute
    across models (`charges`, shared)."""

    def __init__(
        self,
        client: redis.Redis,
        keys: AccessKeys = KEYS,
        *,
        count_items: bool = COUNT_ITEMS,
        charges: TokenCharges | None = None,
    ) -> None:
        self.client = client
        self.keys = keys
        self.count_items = count_items
        # key id -> (window, the highest request count this process saw in it)
        self._requests: dict[int, tuple[int, int]] = {}
        # (key id, window) whose counter this process has set to expire
        self._expiring: set[tuple[int, int]] = set()
        self.charges = charges or TokenCharges()
        self._reserve = scripts.register(client, "reserve_tokens")
        self._settle = scripts.register(client, "settle_tokens")

    def reserve(
        self, caller: Caller, tokens: int, now_s: float | None = None
    ) -> Reservation | Limited | None:
        """`tokens` reserved in the caller's window (None: no tokens limit), or the refusal
        of a key whose tokens already reached its limit. Raises redis errors."""
        if not caller.tpm:
            return None
        now_s = time.time() if now_s is None else now_s
        window = window_of(now_s)
        key = self.keys.tokens(window)
        held = max(0, tokens)
        args = [caller.key_id, held, caller.tpm, COUNTER_TTL_MS]
        reserved, used = self._reserve(keys=[key], args=args)
        if self.charges.window == window:  # what the key had used or held before this one
            self.charges.by_key[caller.key_id] = int(used) - (held if reserved else 0)
        if not reserved:
            return Limited("tokens", caller.tpm, max(1, math.ceil(reset_in_s(now_s))))
        return Reservation(self._settle, key, caller.key_id, held)

    def check(self, caller: Caller, now_s: float | None = None) -> Limited | None:
        """A refusal when the caller is over a limit, from what this process knows: no Redis
        call."""
        if not caller.rpm and not caller.tpm:
            return None
        now_s = time.time() if now_s is None else now_s
        window = window_of(now_s)
        retry = max(1, math.ceil(reset_in_s(now_s)))
        if caller.rpm and self._requests_seen(caller.key_id, window) >= caller.rpm:
            return Limited("requests", caller.rpm, retry)
        if caller.tpm and self._tokens_seen(caller.key_id, window) >= caller.tpm:
            return Limited("tokens", caller.tpm, retry)
        return None

    def cost(self, caller: Caller, items: int) -> int:
        """What a request of `items` items adds to its key's request counter."""
        return items if self.count_items else 1

    def near(self, caller: Caller, cost: int, now_s: float) -> bool:
        """Whether the caller's request (adding `cost`) may pass its request limit, from the
        count this process read last: then Redis decides before the request joins a batch."""
        if not caller.rpm:
            return False
        return self._requests_seen(caller.key_id, window_of(now_s)) + cost > (
            caller.rpm * NEAR_FRACTION
        )

    def refused(self, caller: Caller, count: int, now_s: float) -> Limited:
        """The refusal of a request that did not fit its key's request limit, where `count` is
        the counter as it found it (this process refuses by itself once that reached the
        limit)."""
        self.counted(caller, count, now_s, expiry_set=False)
        return Limited("requests", caller.rpm, max(1, math.ceil(reset_in_s(now_s))))

    def give_back(self, counter: str, cost: int) -> None:
        """Undo the raise of a request refused after it (best effort: a count left too high
        refuses, never serves, too much)."""
        try:
            self.client.decrby(counter, cost)
        except REDIS_FAULTS as exc:
            log.warning("a refused request's count not given back: %s", exc)

    def counter(self, caller: Caller, shard: ShardKeys, now_s: float | None = None) -> str | None:
        """The request counter the caller's append raises (None: no request limit)."""
        if not caller.rpm:
            return None
        now_s = time.time() if now_s is None else now_s
        return shard.requests_counter(caller.key_id, window_of(now_s))

    def needs_expiry(self, caller: Caller, now_s: float) -> int:
        """COUNTER_TTL_MS until this process's append has set the expiry of the caller's
        counter of this window (that append sets it too), then 0."""
        return 0 if (caller.key_id, window_of(now_s)) in self._expiring else COUNTER_TTL_MS

    def counted(self, caller: Caller, count: int, now_s: float, expiry_set: bool) -> None:
        """What the caller's append read: its window's count after this request, and whether
        it set the counter's expiry (only an append that ran can have)."""
        window = window_of(now_s)
        if count > self._requests_seen(caller.key_id, window):
            self._requests[caller.key_id] = (window, count)
        if expiry_set:
            if len(self._expiring) > 10_000:  # old windows' marks
                self._expiring.clear()
            self._expiring.add((caller.key_id, window))

    def headers(self, caller: Caller, now_s: float | None = None) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the caller's limits (none without a limit)."""
        if not caller.rpm and not caller.tpm:
            return {}
        now_s = time.time() if now_s is None else now_s
        window = window_of(now_s)
        reset = f"{max(1, math.ceil(reset_in_s(now_s)))}s"
        headers = {}
        if caller.rpm:
            used = self._requests_seen(caller.key_id, window)
            headers["x-ratelimit-limit-requests"] = str(caller.rpm)
            headers["x-ratelimit-remaining-requests"] = str(max(0, caller.rpm - used))
            headers["x-ratelimit-reset-requests"] = reset
        if caller.tpm:
            used = self._tokens_seen(caller.key_id, window)
            headers["x-ratelimit-limit-tokens"] = str(caller.tpm)
            headers["x-ratelimit-remaining-tokens"] = str(max(0, caller.tpm - used))
            headers["x-ratelimit-reset-tokens"] = reset
        return headers

    def refresh_tokens(self, now_s: float | None = None) -> None:
        """Read the window's token charges (the key poll's loop). Raises redis errors."""
        now_s = time.time() if now_s is None else now_s
        window = window_of(now_s)
        raw = self.client.hgetall(self.keys.tokens(window))
        self.charges.by_key = {int(k): int(v) for k, v in raw.items()}
        self.charges.window = window

    def _requests_seen(self, key_id: int, window: int) -> int:
        seen = self._requests.get(key_id)
        return seen[1] if seen is not None and seen[0] == window else 0

    def _tokens_seen(self, key_id: int, window: int) -> int:
        charges = self.charges
        return charges.by_key.get(key_id, 0) if window == charges.window else 0
