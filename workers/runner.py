"""Runs one batch on this worker's sampler: the one place for deadlines, errors and records.

A sampler implements `sample`; everything around the call lives here: sealing the batch,
dropping items whose deadline cannot be met by one more call, checking the result's length,
turning a failure into per-item error markers, and keeping the estimate of a call's time.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict

from sampling import stats
from sampling.aggregator import ERROR, EXPIRED, OK, REJECTED, BatchAggregator, Item, SealedBatch
from sampling.policy import Policy
from workers.metrics import WorkerMetrics
from workers.samplers.base import GenerationSettings, PromptRejected, Sampler

log = logging.getLogger(__name__)

# Weight of the newest call in the running estimate of a sampling call's duration.
ESTIMATE_WEIGHT = 0.3


class BatchRunner:
    def __init__(
        self,
        aggregator: BatchAggregator,
        sampler: Sampler,
        worker: str,
        policy: Callable[[], Policy] | None = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.aggregator = aggregator
        self.sampler = sampler
        self.worker = worker
        # The live policy (a PolicyWatcher's current one in a worker); by default the
        # aggregator's settings and the sampler's own generation settings.
        self.policy = policy or (
            lambda: Policy(
                max_batch_size=aggregator.max_batch_size,
                deadline_ms=aggregator.deadline_ms,
                **asdict(sampler.generation),
            )
        )
        self.metrics = metrics or WorkerMetrics(worker)
        self.applied_version = -1
        self.estimate_ms = 0.0  # one sampling call: the deadline-drop cutoff
        # One batch's whole turn on this GPU (seal, calls, record): what admission predicts
        # queued batches with.
        self.turn_ms = 0.0
        self.batches = 0
        self.busy_s = 0.0
        self.busy_since: float | None = None  # monotonic time the running call started

    def warm_up(self) -> None:
        self.apply_policy()
        self.estimate_ms = self.turn_ms = self.sampler.warm_up()
        self.aggregator.publish_sampler_ms(self.turn_ms)
        log.info("sampler %s warmed up: %.1f ms per call", self.sampler.name, self.estimate_ms)

    def apply_policy(self) -> Policy:
        """Bring the sampler and aggregator to the live policy; called between calls only."""
        policy = self.policy()
        if policy.version != self.applied_version:
            generation = GenerationSettings(
                max_new_tokens=policy.max_new_tokens,
                temperature=policy.temperature,
                top_p=policy.top_p,
                stop=policy.stop,
            )
            if generation != self.sampler.generation:
                try:
                    self.sampler.configure(generation)
                except ValueError as exc:
                    log.error("policy %d not applied to the sampler: %s", policy.version, exc)
            self.aggregator.configure(
                max_batch_size=policy.max_batch_size, deadline_ms=policy.deadline_ms
            )
            self.applied_version = policy.version
        return policy

    def run(self, batch_id: str) -> list[list[str]]:
        started = time.perf_counter()
        policy = self.apply_policy()
        sealed = self.aggregator.seal(batch_id)
        items = sealed.items
        results: list[list[str]] = [[]] * len(items)
        # One more call must end before the item's deadline, or the item is dropped now and
        # the sampler never sees it.
        cutoff = sealed.now_ms + self.estimate_ms
        live: list[int] = []
        for index, item in enumerate(items):
            if item.deadline_ms < cutoff:
                results[index] = [EXPIRED, "deadline could not be met"]
            else:
                live.append(index)

        # A batch opened under a larger max batch size than the policy's now (just lowered)
        # runs as several calls of at most the new size.
        sampler_ms = 0.0
        chunks = [
            live[start : start + policy.max_batch_size]
            for start in range(0, len(live), policy.max_batch_size)
        ]
        for chunk in chunks:
            sampler_ms += self._sample(batch_id, items, chunk, results)

        # Written only by the task thread; the heartbeat thread just reads them.
        self.batches += 1
        self.busy_s += sampler_ms / 1000
        self._record(batch_id, sealed, results, sampler_ms, len(chunks), policy)
        if chunks:  # a batch dropped whole took no GPU time: not a turn to learn from
            turn_ms = (time.perf_counter() - started) * 1000
            self.turn_ms += ESTIMATE_WEIGHT * (turn_ms - self.turn_ms)
            self.aggregator.publish_sampler_ms(self.turn_ms)
        return results

    def _sample(
        self, batch_id: str, items: list[Item], indexes: list[int], results: list[list[str]]
    ) -> float:
        """One batched_sample call for items[indexes]; fills their results; returns its ms."""
        prompts = [items[i].prompt for i in indexes]
        started = time.perf_counter()
        self.busy_since = time.monotonic()
        try:
            completions = self.sampler.batched_sample(prompts)
            if len(completions) != len(prompts):
                raise RuntimeError(
                    f"sampler returned {len(completions)} completions for {len(prompts)} prompts"
                )
            for index, completion in zip(indexes, completions, strict=True):
                if isinstance(completion, PromptRejected):
                    results[index] = [REJECTED, str(completion) or "prompt rejected"]
                else:
                    results[index] = [OK, str(completion)]
        except Exception as exc:
            log.exception("sampler %s failed on batch %s", self.sampler.name, batch_id)
            reason = f"sampler failed: {type(exc).__name__}: {exc}".splitlines()[0][:200]
            for index in indexes:
                results[index] = [ERROR, reason]
        finally:
            self.busy_since = None
        sampler_ms = (time.perf_counter() - started) * 1000
        self.estimate_ms += ESTIMATE_WEIGHT * (sampler_ms - self.estimate_ms)
        return sampler_ms

    def _record(
        self,
        batch_id: str,
        sealed: SealedBatch,
        results: list[list[str]],
        sampler_ms: float,
        calls: int,
        policy: Policy,
    ) -> None:
        counts = {OK: 0, EXPIRED: 0, REJECTED: 0, ERROR: 0}
        for outcome, _ in results:
            counts[outcome] += 1
        queue_wait_ms = sealed.now_ms - sealed.opened_at_ms if sealed.opened_at_ms >= 0 else None
        record = {
            "batch_id": batch_id,
            "worker": self.worker,
            "size": len(results),
            "sampled": len(results) - counts[EXPIRED],
            **counts,
            "queue_wait_ms": queue_wait_ms,
            "sampler_ms": round(sampler_ms, 2),
            "sealed_at_ms": sealed.now_ms,
            "policy_version": policy.version,
            "max_batch_size": policy.max_batch_size,
        }
        self.metrics.observe_batch(
            size=len(results),
            expired=counts[EXPIRED],
            queue_wait_ms=queue_wait_ms,
            sampler_ms=sampler_ms,
        )
        try:
            self.aggregator.record_batch(
                json.dumps(record),
                stats.batch_counts(
                    worker=self.worker,
                    size=len(results),
                    expired=counts[EXPIRED],
                    queue_wait_ms=queue_wait_ms,
                    sampler_ms=sampler_ms,
                    calls=calls,
                    max_batch_size=policy.max_batch_size,
                ),
                time.time(),
            )
        except Exception:  # a lost record must never lose the batch's answers
            log.exception("could not record batch %s", batch_id)
