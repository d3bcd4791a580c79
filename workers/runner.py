"""Runs one batch on this worker's sampler: the one place for deadlines, errors and records.

A sampler implements `sample`; everything around the call lives here: sealing the batch,
dropping items whose deadline cannot be met by one more call, checking the result's length,
turning a failure into per-item error markers, and keeping the estimate of a call's time.
"""

from __future__ import annotations

import json
import logging
import time

from sampling.aggregator import ERROR, EXPIRED, OK, REJECTED, BatchAggregator
from workers.samplers.base import PromptRejected, Sampler

log = logging.getLogger(__name__)

# Weight of the newest call in the running estimate of a sampling call's duration.
ESTIMATE_WEIGHT = 0.3


class BatchRunner:
    def __init__(self, aggregator: BatchAggregator, sampler: Sampler, worker: str) -> None:
        self.aggregator = aggregator
        self.sampler = sampler
        self.worker = worker
        self.estimate_ms = 0.0
        self.batches = 0
        self.busy_s = 0.0
        self.busy_since: float | None = None  # monotonic time the running call started

    def warm_up(self) -> None:
        self.estimate_ms = self.sampler.warm_up()
        self.aggregator.publish_sampler_ms(self.estimate_ms)
        log.info("sampler %s warmed up: %.1f ms per call", self.sampler.name, self.estimate_ms)

    def run(self, batch_id: str) -> list[list[str]]:
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

        sampler_ms = 0.0
        if live:
            prompts = [items[i].prompt for i in live]
            started = time.perf_counter()
            self.busy_since = time.monotonic()
            try:
                completions = self.sampler.batched_sample(prompts)
                if len(completions) != len(prompts):
                    raise RuntimeError(
                        f"sampler returned {len(completions)} completions "
                        f"for {len(prompts)} prompts"
                    )
                for index, completion in zip(live, completions, strict=True):
                    if isinstance(completion, PromptRejected):
                        results[index] = [REJECTED, str(completion) or "prompt rejected"]
                    else:
                        results[index] = [OK, str(completion)]
            except Exception as exc:
                log.exception("sampler %s failed on batch %s", self.sampler.name, batch_id)
                reason = f"sampler failed: {type(exc).__name__}: {exc}".splitlines()[0][:200]
                for index in live:
                    results[index] = [ERROR, reason]
            finally:
                self.busy_since = None
            sampler_ms = (time.perf_counter() - started) * 1000
            self.estimate_ms += ESTIMATE_WEIGHT * (sampler_ms - self.estimate_ms)
            self.aggregator.publish_sampler_ms(self.estimate_ms)

        # Written only by the task thread; the heartbeat thread just reads them.
        self.batches += 1
        self.busy_s += sampler_ms / 1000
        self._record(batch_id, sealed.now_ms, sealed.opened_at_ms, results, sampler_ms)
        return results

    def _record(
        self,
        batch_id: str,
        sealed_at_ms: int,
        opened_at_ms: int,
        results: list[list[str]],
        sampler_ms: float,
    ) -> None:
        counts = {OK: 0, EXPIRED: 0, REJECTED: 0, ERROR: 0}
        for outcome, _ in results:
            counts[outcome] += 1
        record = {
            "batch_id": batch_id,
            "worker": self.worker,
            "size": len(results),
            "sampled": len(results) - counts[EXPIRED],
            **counts,
            "queue_wait_ms": sealed_at_ms - opened_at_ms if opened_at_ms >= 0 else None,
            "sampler_ms": round(sampler_ms, 2),
            "sealed_at_ms": sealed_at_ms,
        }
        try:
            self.aggregator.record_batch(json.dumps(record))
        except Exception:  # a lost record must never lose the batch's answers
            log.exception("could not record batch %s", batch_id)
