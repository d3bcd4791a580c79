"""Off the request path, every few seconds in each web process (a background job of
serving.runtime, registered by operations.apps).

1. The policy in Redis follows the database: republished when Redis lost it (a restart) or
   missed a save (Redis was down at the time).
2. The API keys and tiers in Redis follow the database the same way (a web process's key
   watcher republishes a lost set the moment it notices, accounts.access; this catches a
   save that could not publish, and a set without its digest); so does the model registry's
   catalog (operations.registry).
3. Completed minutes of statistics go from Redis to StatsMinute rows, the per-key usage in
   them to UsageMinute rows (operations.minutes: by Redis's clock, a late count re-writes its
   minute's totals), and rows older than SAMPLING_STATS_RETENTION_DAYS (usage:
   SAMPLING_USAGE_RETENTION_DAYS) are deleted. One process at a time does it (a Redis lock).
   The same process copies when each key was last used from Redis to its row.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

import redis
from django.conf import settings
from django.db import close_old_connections
from django.utils import timezone

from accounts import access
from batching import catalog as live_catalog
from batching import policy as live_policy
from batching.keys import QueueKeys
from operations.minutes import persist_minutes as persist_minutes  # the name tests call
from operations.minutes import redis_now_s
from operations.models import (
    ApiKey,
    SamplingPolicy,
    StatsMinute,
    UsageMinute,
    access_records,
    default_policy,
)
from operations.registry import catalog_snapshot

log = logging.getLogger(__name__)


def run(client: redis.Redis, queue: str, current: live_policy.Policy) -> None:
    # The keys and the registry are the deployment's, not a model's: reconciled in the run
    # of the default model (which every web process serves), not once per model.
    deployment_wide = queue == settings.SAMPLING_QUEUE
    try:
        reconcile_policy(client, queue, current)
        if deployment_wide:
            reconcile_access(client)
            reconcile_catalog(client)
        lock = client.lock(QueueKeys(queue).housekeeping_lock, timeout=60, blocking=False)
        if lock.acquire():
            try:
                persist_minutes(client, queue, redis_now_s(client))
                prune(
                    queue,
                    settings.SAMPLING_STATS_RETENTION_DAYS,
                    settings.SAMPLING_USAGE_RETENTION_DAYS,
                )
                if deployment_wide:
                    record_last_used(client)
            finally:
                lock.release()
    finally:
        close_old_connections()


def reconcile_policy(client: redis.Redis, queue: str, current: live_policy.Policy) -> None:
    row = SamplingPolicy.objects.filter(queue=queue).first()
    if row is not None and row.as_policy() != current:
        log.warning("republishing policy version %d of %s", row.version, queue)
        live_policy.publish(client, queue, row.as_policy())
    elif row is None and current != default_policy():
        log.warning("withdrawing a policy of %s that has no row", queue)
        live_policy.withdraw(client, queue)


def reconcile_access(client: redis.Redis) -> None:
    """Republish when Redis says other than the database (as parsed records: another
    version's wording of the same records stands), or its set has no right digest (read
    after Redis: a save between the two reads is in the database's snapshot, and replace_all
    rereads it if one publishes). A web process's key watcher republishes a lost set the
    moment it notices; this catches a save that could not publish (Redis was down)."""
    digest = client.get(access.KEYS.digest)
    published = access.published(client)
    wanted = {name: record.to_json() for name, record in access_records().items()}
    intact = digest == access.digest_of_records(published).encode()
    if not intact or not access.same_records(published, wanted):
        log.warning("republishing %d API key and tier records", len(wanted))
        access.replace_all(client, access_records)


def reconcile_catalog(client: redis.Redis) -> None:
    """Republish the registry when Redis lost it, or holds another snapshot than the
    database's (a save that could not publish; a newer published version stays)."""
    wanted = catalog_snapshot()
    try:
        published = live_catalog.published(client)
    except (ValueError, TypeError, KeyError):
        published = None  # unreadable: replaced
    if published is None and not wanted.version:
        return  # nothing ever registered
    if published != wanted and (published is None or published.version <= wanted.version):
        log.warning("republishing the model registry (version %d)", wanted.version)
        live_catalog.publish(client, wanted)


# Keys read from the database per query (SQLite takes up to 32,766 parameters, older builds
# 999): a few thousand keys' last use costs a few queries, not one per key.
LAST_USED_CHUNK = 500


def record_last_used(client: redis.Redis) -> int:
    """Copy when each key was last used from Redis to its row, in a few queries whatever the
    number of keys (this runs in a web process every few seconds: a query per key would hold
    its requests); a key deleted since is dropped from Redis. Returns the rows updated."""
    seen = access.last_used(client)
    changed: list[ApiKey] = []
    gone: list[int] = []
    ids = sorted(seen)
    for start in range(0, len(ids), LAST_USED_CHUNK):
        chunk = ids[start : start + LAST_USED_CHUNK]
        stored = dict(ApiKey.objects.filter(pk__in=chunk).values_list("pk", "last_used"))
        for key_id in chunk:
            if key_id not in stored:
                gone.append(key_id)
                continue
            moment = datetime.fromtimestamp(seen[key_id], tz=UTC)
            before = stored[key_id]
            if before is None or before < moment:
                changed.append(ApiKey(pk=key_id, last_used=moment))
    ApiKey.objects.bulk_update(changed, ["last_used"], batch_size=LAST_USED_CHUNK)
    if gone:
        client.hdel(access.KEYS.last_used, *gone)
    return len(changed)


def prune(queue: str, retention_days: int, usage_retention_days: int | None = None) -> int:
    """Delete the queue's rows past their retention; returns the statistics rows deleted."""
    now = timezone.now()
    deleted, _ = StatsMinute.objects.filter(
        queue=queue, minute__lt=now - timedelta(days=retention_days)
    ).delete()
    if usage_retention_days is not None:
        UsageMinute.objects.filter(
            queue=queue, minute__lt=now - timedelta(days=usage_retention_days)
        ).delete()
    return deleted
