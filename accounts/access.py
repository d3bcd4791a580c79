"""Who may sample: API keys and tiers as the request path sees them.

Operators create keys and tiers in the admin or with `manage.py createapikey`
(operations.models); each change is published to Redis as a record in one hash, with a version
counter raised and the digest of the whole set written in the same MULTI. Every web process
polls the counter and the digest twice a second and reads the hash again only when one moved
(`AccessWatcher`), so a request checks its key in memory: no database, no Redis call. A new
key, a revocation or a limit change reaches every process within POLL_INTERVAL_S plus one read.

Redis losing the set (a restart with no data) changes nothing a request sees: a process keeps
its last good set while the digest is absent, and has it republished at once from the
database (the `republish` callback a web process is given; housekeeping does it too, every
few seconds). The digest, not the counter, tells a change: a counter restarts at 0 with
Redis's data and may climb back to the value a process last saw, a digest of other records
cannot.

Keys are random (`new_key`), shown once, and stored only as their SHA-256 (`digest_of`) with a
visible prefix for operators; the raw key is never logged. This module knows nothing of
Django: it takes a redis client.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass
from dataclasses import fields as dataclass_fields
from enum import StrEnum
from typing import Any

import redis

from batching.keys import AccessKeys
from batching.loop import PeriodicLoop

log = logging.getLogger(__name__)

KEYS = AccessKeys()
KEY_PREFIX = "sk-"
# What operators see of a key (its prefix, then the start of its random part).
VISIBLE_CHARS = 11
POLL_INTERVAL_S = 0.5
# The tier of requests without a key, while keys are not required.
ANONYMOUS_TIER = "anonymous"
# The tiers a new installation starts with: name -> priority (higher goes first).
STARTING_TIERS = {"enterprise": 30, "plus": 20, "free": 10, ANONYMOUS_TIER: 0}


def new_key() -> str:
    """A fresh API key: 256 random bits, URL-safe."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def digest_of(raw_key: str) -> str:
    return hashlib.sha256(raw_key.encode()).hexdigest()


def visible_prefix(raw_key: str) -> str:
    return raw_key[:VISIBLE_CHARS]


@dataclass(frozen=True)
class Caller:
    """Who sent a request, with what its tier and key allow (0: no limit)."""

    key_id: int  # 0: anonymous
    name: str
    tier: str
    priority: int
    rpm: int = 0  # requests per minute
    tpm: int = 0  # completion tokens per minute
    budget_nanos: int = 0  # spend per calendar month (UTC), in billionths (accounts.budgets)
    # The owner whose monthly budget the key shares with the owner's other keys, and that
    # budget ("" and 0: none; accounts.budgets).
    owner: str = ""
    owner_budget_nanos: int = 0

    def published(self) -> dict[str, Any]:
        """Its fields as published: those at their default left out, so that a web process
        of an older version, which does not know a newer field, reads every record that
        does not use it."""
        return {
            name: value
            for name, value in asdict(self).items()
            if name not in _CALLER_DEFAULTS or value != _CALLER_DEFAULTS[name]
        }

    def to_json(self) -> str:
        return json.dumps(self.published(), separators=(",", ":"))

    @classmethod
    def from_fields(cls, data: Mapping[str, Any]) -> Caller:
        """A caller from its published fields; a field this version does not know is
        ignored (a newer publisher during a rolling upgrade), one it lacks gets its
        default (an older publisher)."""
        return cls(**{name: value for name, value in data.items() if name in _CALLER_FIELDS})


@dataclass(frozen=True)
class KeyRecord:
    """A key as published: its caller, and what may refuse it."""

    caller: Caller
    expires_at: float | None = None  # epoch seconds
    revoked: bool = False

    def to_json(self) -> str:
        return json.dumps(
            {**self.caller.published(), "expires_at": self.expires_at, "revoked": self.revoked},
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> KeyRecord:
        data = json.loads(raw)
        expires_at = data.pop("expires_at", None)
        revoked = bool(data.pop("revoked", False))
        return cls(Caller.from_fields(data), None if expires_at is None else float(expires_at),
                   revoked)  # fmt: skip


_CALLER_FIELDS = frozenset(field.name for field in dataclass_fields(Caller))
_CALLER_DEFAULTS = {
    field.name: field.default for field in dataclass_fields(Caller) if field.default != MISSING
}


def anonymous_caller(priority: int = 0, rpm: int = 0, tpm: int = 0) -> Caller:
    return Caller(0, ANONYMOUS_TIER, ANONYMOUS_TIER, priority, rpm, tpm)


class Refusal(StrEnum):
    """Why a request's key is refused (401), in the one line the client reads."""

    MISSING = "missing API key: send Authorization: Bearer <key>"
    MALFORMED = "malformed Authorization header: use Bearer <key>"
    UNKNOWN = "unknown API key"
    REVOKED = "API key revoked"
    EXPIRED = "API key expired"


def same_records(one: Mapping[str, str], other: Mapping[str, str]) -> bool:
    """Whether two sets of published records (field -> JSON) say the same, whatever fields
    at their default one of them writes out (a publisher of an older version writes them
    all): what housekeeping compares, so that two versions side by side in a rolling upgrade
    do not republish each other's records in turn."""
    if one.keys() != other.keys():
        return False
    try:
        return all(_parsed(name, one[name]) == _parsed(name, other[name]) for name in one)
    except (ValueError, TypeError):
        return False


def _parsed(field: str, value: str) -> KeyRecord | Caller:
    if field.startswith("tier:"):
        return Caller.from_fields(json.loads(value))
    return KeyRecord.from_json(value)


def digest_of_records(fields: Mapping[str, str]) -> str:
    """The SHA-256 of a set of published records (field -> JSON), whatever their order."""
    return hashlib.sha256(json.dumps(sorted(fields.items())).encode()).hexdigest()


def replace_all(
    client: redis.Redis,
    records: Callable[[], Mapping[str, KeyRecord | Caller]],
    keys: AccessKeys = KEYS,
    attempts: int = 5,
    unless_intact: bool = False,
) -> bool:
    """The published records become exactly `records()`: every key (digest -> its record)
    and every tier ("tier:<name>" -> the caller its anonymous requests get), in one MULTI
    with the version's raise and the set's digest. A few thousand records are one HSET, so
    every change republishes all, and Redis can never keep a record the database lost.

    `records()` reads the database after the version is watched: two publishers racing
    (two saves, or a save and housekeeping) cannot leave the older snapshot published, since
    the later EXEC fails when the version moved, and that publisher reads again. False when
    the version kept moving for `attempts` tries (the others published a newer snapshot).

    `unless_intact`: nothing is written when the published set is intact (its digest there
    and right), as when another process republished it first; many processes noticing a
    lost set at once read the database once or twice each, and one publishes."""
    with client.pipeline(transaction=True) as pipe:
        for _ in range(attempts):
            try:
                pipe.watch(keys.version, keys.digest)
                if unless_intact and intact(pipe, keys):
                    pipe.unwatch()
                    return True
                snapshot = {k: v.to_json() for k, v in records().items()}
                pipe.multi()
                pipe.delete(keys.records)
                if snapshot:
                    pipe.hset(keys.records, mapping=snapshot)
                pipe.set(keys.digest, digest_of_records(snapshot))
                pipe.incr(keys.version)
                pipe.execute()
                return True
            except redis.WatchError:
                continue
    return False


def intact(client: redis.Redis, keys: AccessKeys = KEYS) -> bool:
    """The published set is there and whole: its digest is present and matches its records
    (False after Redis lost its data, or when only an older publisher wrote it)."""
    digest = client.get(keys.digest)
    return digest is not None and digest.decode() == digest_of_records(published(client, keys))


def tier_field(tier: str) -> str:
    return f"tier:{tier}"


def published(client: redis.Redis, keys: AccessKeys = KEYS) -> dict[str, str]:
    """Every published record, raw (digest or tier field -> JSON)."""
    return {k.decode(): v.decode() for k, v in client.hgetall(keys.records).items()}


class AccessWatcher:
    """This process's copy of the published keys and tiers, refreshed by polling a counter;
    `identify` checks a request's Authorization header against it, in memory."""

    def __init__(
        self,
        client: redis.Redis,
        interval_s: float = POLL_INTERVAL_S,
        keys: AccessKeys = KEYS,
        republish: Callable[[], object] | None = None,
    ) -> None:
        self.client = client
        self.keys = keys
        # Called when the published set is missing or broken (Redis lost its data): publish
        # it again from the source of truth (a web process: the database; replace_all with
        # unless_intact). The last good set is kept meanwhile, and without one.
        self.republish = republish
        self.loaded = False  # False until the records were read once
        self.missing_since: float | None = None  # monotonic, while Redis has no intact set
        self._seen_as: tuple[bytes | None, bytes | None] | None = None  # (version, digest)
        self._keys: dict[str, KeyRecord] = {}
        self._by_id: dict[int, KeyRecord] = {}
        self._anonymous = anonymous_caller()
        self._seen: dict[int, float] = {}  # key id -> last seen (epoch s), not yet flushed
        # Some key or tier limits completion tokens: the token charges are read each poll.
        self.limits_tokens = False
        # Key id -> monthly budget, of the keys that have one: their spend is read each poll.
        self.budgeted: dict[int, int] = {}
        # Owner -> its key ids, of the owners that have a budget: all their keys' spend too.
        self.owners_keys: dict[str, frozenset[int]] = {}
        self._after_poll: list[Callable[[], None]] = []
        self.loop = PeriodicLoop("access-watcher", self._poll, interval_s, "read the API keys")

    @property
    def anonymous(self) -> Caller:
        return self._anonymous

    def refresh(self) -> bool:
        """Read the records again when their version or digest moved; True when the set this
        process applies was read again. A missing or broken set (Redis lost it) leaves the
        last good one in place and is republished at once. Raises redis errors."""
        version, digest = self.client.mget(self.keys.version, self.keys.digest)
        if digest is not None and self.loaded and (version, digest) == self._seen_as:
            changed = False
        elif digest is not None and self._load():
            changed = True
        else:
            self._on_missing()
            if self.client.get(self.keys.digest) is None or not self._load():
                return False
            changed = True
        if self.missing_since is not None:
            log.info(
                "the published API keys are back after %.1f s",
                time.monotonic() - self.missing_since,
            )
            self.missing_since = None
        return changed

    def _on_missing(self) -> None:
        if self.missing_since is None:
            self.missing_since = time.monotonic()
            action = "republishing them" if self.republish else "keeping the last ones read"
            # A process that never read a set meets a fresh Redis, not a lost one.
            say = log.warning if self.loaded else log.info
            say("the published API keys are missing in Redis: %s", action)
        if self.republish is not None:
            self.republish()

    def _load(self) -> bool:
        """Read the set, its version and digest at once; False (nothing applied) when the
        records do not match the digest."""
        with self.client.pipeline(transaction=True) as pipe:
            pipe.get(self.keys.version)
            pipe.get(self.keys.digest)
            pipe.hgetall(self.keys.records)
            version, digest, raw = pipe.execute()
        fields = {name.decode(): value.decode() for name, value in raw.items()}
        if digest is None or digest.decode() != digest_of_records(fields):
            return False
        self._apply(fields)
        self._seen_as, self.loaded = (version, digest), True
        return True

    def _apply(self, fields: Mapping[str, str]) -> None:
        keys: dict[str, KeyRecord] = {}
        anonymous = anonymous_caller()
        for field, value in fields.items():
            try:
                record = _parsed(field, value)
            except (ValueError, TypeError) as exc:  # one bad record must not drop the others
                log.error("ignoring an invalid published key record: %s", exc)
                continue
            if isinstance(record, KeyRecord):
                keys[field] = record
            elif field == tier_field(ANONYMOUS_TIER):
                anonymous = record
        self._keys, self._anonymous = keys, anonymous
        self._by_id = {record.caller.key_id: record for record in keys.values()}
        self.limits_tokens = bool(anonymous.tpm) or any(r.caller.tpm for r in keys.values())
        self.budgeted = {
            r.caller.key_id: r.caller.budget_nanos for r in keys.values() if r.caller.budget_nanos
        }
        owners: dict[str, set[int]] = {}
        for key in keys.values():
            if key.caller.owner_budget_nanos:
                owners.setdefault(key.caller.owner, set()).add(key.caller.key_id)
        self.owners_keys = {owner: frozenset(ids) for owner, ids in owners.items()}

    def after_poll(self, job: Callable[[], None]) -> None:
        """Run `job` after each poll, in the poller's thread (it may raise redis errors)."""
        self._after_poll.append(job)

    def standing(self, key_id: int, now: float | None = None) -> Caller | Refusal | None:
        """What key `key_id` may do now, for work it asked earlier (an offline job): its
        caller, or why it is refused (revoked, expired, deleted: UNKNOWN); None before the
        records were read once."""
        if not self.loaded:
            return None
        record = self._by_id.get(key_id)
        if record is None:
            return Refusal.UNKNOWN
        if record.revoked:
            return Refusal.REVOKED
        if record.expires_at is not None and (now or time.time()) >= record.expires_at:
            return Refusal.EXPIRED
        return record.caller

    def identify(self, authorization: str | None, required: bool) -> Caller | Refusal | None:
        """The caller of a request with this Authorization header; a Refusal (401); or None
        when a key must be checked and the records were never read (Redis away since this
        process started: a 503).

        Keys not required: a request without a known key is anonymous, as vLLM does without
        --api-key (clients such as `openai` always send some key, "EMPTY" or "not-needed"); a
        known key gets its tier and limits, and a revoked or expired one is refused all the
        same."""
        if not authorization:
            return Refusal.MISSING if required else self._anonymous
        scheme, _, raw_key = authorization.strip().partition(" ")
        raw_key = raw_key.strip()
        if scheme.lower() != "bearer" or not raw_key or " " in raw_key:
            return Refusal.MALFORMED if required else self._anonymous
        if not self.loaded:
            return None if required else self._anonymous
        record = self._keys.get(digest_of(raw_key))
        if record is None:
            return Refusal.UNKNOWN if required else self._anonymous
        if record.revoked:
            return Refusal.REVOKED
        now = time.time()
        if record.expires_at is not None and now >= record.expires_at:
            return Refusal.EXPIRED
        self._seen[record.caller.key_id] = now
        return record.caller

    def flush_last_used(self) -> None:
        """When this process last saw each key, for the admin's "last used" (once a second,
        off the request path)."""
        seen, self._seen = self._seen, {}
        if seen:
            try:
                self.client.hset(
                    self.keys.last_used, mapping={str(k): int(v) for k, v in seen.items()}
                )
            except Exception:  # Redis away, whatever the client raises: kept for the next try
                for key_id, at in seen.items():
                    self._seen[key_id] = max(at, self._seen.get(key_id, 0.0))
                raise

    def start(self) -> AccessWatcher:
        self.loop.run_once()  # a failure is logged, and the loop tries again
        self.loop.start()
        return self

    def stop(self) -> None:
        self.loop.stop()

    def _poll(self) -> None:
        self.refresh()
        for job in self._after_poll:
            job()


def last_used(client: redis.Redis, keys: AccessKeys = KEYS) -> dict[int, float]:
    """Key id -> when a web process last saw it (epoch seconds)."""
    return {int(k): float(v) for k, v in client.hgetall(keys.last_used).items()}
