"""Runs one batch on this worker's sampler: the one place for deadlines, errors and records.

A sampler implements `sample`; everything around the call lives here: sealing the batch,
dropping items whose deadline cannot be met by one more call, checking the result's length,
turning a failure into per-item error markers, and keeping the estimate of a call's time.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, replace

import redis

from batching import backfill, cache
from batching.admission import AdmissionInputs
from batching.aggregator import BatchAggregator
from batching.answers import Answer
from batching.backfill import BackfillItem
from batching.deltas import STREAM_INTERVAL_MS
from batching.generation import Row
from batching.items import Item
from batching.outcomes import ItemOutcome
from batching.policy import Policy
from batching.protocol import BACKFILL_TURN, UNKNOWN_LANE
from batching.registry import WorkerRegistry
from telemetry import stats
from telemetry.batch_log import BatchLog
from workers.call_costs import ESTIMATE_WEIGHT, CallCosts
from workers.deltas import DeltaPublisher
from workers.metrics import WorkerMetrics
from workers.samplers.base import PromptRejected, Sampler
from workers.turns import QUEUE_TIMES_EVERY_S, Result, Turn, answer_of, record_of, statistics_of

log = logging.getLogger(__name__)

# How long a shard's seals take no backfill after a top-up none of whose items fitted: the
# lane's head holds lines too large for these calls, and moving them on every seal costs Redis.
BACKFILL_MISFIT_PAUSE_S = 1.0
# With no request sealed for this long, a backfill turn takes a full batch (an idle GPU runs
# a job at its limit); before, no more rows than a call of requests costs.
REQUESTS_QUIET_S = 1.0
# Sampler calls failing in a row that make a worker unhealthy: one failure is a batch's
# problem (a prompt, a bug), three in a row the GPU's (its memory, its driver), and the worker
# leaves admission (workers.lifecycle) rather than fail every batch it is given.
FAILED_CALLS_UNHEALTHY = 3


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
        self.workers = WorkerRegistry(aggregator.client, aggregator.keys)
        self.batch_log = BatchLog(aggregator.client, aggregator.queue)
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
        self.costs = CallCosts(sampler)  # its calls by their shape
        self.backfill_paused_until: dict[str, float] = {}  # per shard tag, monotonic
        self.requests_seen_at = float("-inf")  # monotonic time of the last seal with requests
        # The policy this worker runs under (the sampler's own settings until one applies),
        # and the last published version its sampler refused, with why.
        self.applied = Policy(
            max_batch_size=aggregator.max_batch_size,
            deadline_ms=aggregator.deadline_ms,
            **asdict(sampler.generation),
        )
        self.applied_version = -1
        self.refused_version: int | None = None
        self.refused_reason = ""
        self.estimate_ms = 0.0  # one sampling call: the deadline-drop cutoff
        # One batch's whole turn on this GPU (seal, calls, record): what admission predicts
        # queued batches with.
        self.turn_ms = 0.0
        self.batches = 0
        # Live workers of the queue, as the last heartbeat counted them (this one included):
        # passed with every seal for the shard's admission.
        self.live_workers = 1
        # Batches due for a hand-over that a seal took: their tasks must be sent again. A
        # worker's pipeline does it off the GPU's path; by default, only logged.
        self.on_handovers: Callable[[list[str]], None] = lambda batch_ids: log.warning(
            "batches due for a hand-over, not sent again: %s", batch_ids
        )
        # monotonic time of this worker's last seal, per shard tag: a shard sealed recently
        # needs no scan for hand-overs.
        self.sealed_at: dict[str, float] = {}
        self.busy_s = 0.0
        # The queue times (stats.QUEUE_TIME fields) of items sampled since the last heartbeat.
        self._queue_times: Counter[str] = Counter()
        self._queue_times_lock = threading.Lock()
        self._queue_times_taken_at = 0.0
        # Backfill items each shard's lane held at the last look (a seal's, or the
        # heartbeat's): a seal takes backfill only while its shard's is above 0.
        self.backfill_left: dict[str, int] = {}
        self.busy_since: float | None = None  # monotonic time the running call started
        self.failed_calls = 0  # sampler calls failed in a row
        self.unhealthy_after = FAILED_CALLS_UNHEALTHY  # SAMPLING_UNHEALTHY_AFTER_FAILED_CALLS
        self.last_failure = ""  # the last one's reason
        # A call with streaming rows publishes their new text this often at most
        # (SAMPLING_STREAM_INTERVAL_MS).
        self.stream_interval_ms: float = STREAM_INTERVAL_MS

    def take_queue_times(self, now: float) -> Counter[str]:
        """The queue-time counts of the items sampled since the last take, once every
        QUEUE_TIMES_EVERY_S (`now`, time.time()); none in between."""
        with self._queue_times_lock:
            if now - self._queue_times_taken_at < QUEUE_TIMES_EVERY_S:
                return Counter()
            taken, self._queue_times = self._queue_times, Counter()
            self._queue_times_taken_at = now
        return taken

    @property
    def unhealthy(self) -> bool:
        return self.failed_calls >= self.unhealthy_after

    def warm_up(self) -> None:
        self.apply_policy()
        self.estimate_ms = self.turn_ms = self.sampler.warm_up()
        self.batch_log.publish_turn_ms(self.turn_ms, self.aggregator.ttl_ms)
        self.aggregator.refresh_admission(self.admission_inputs())
        log.info("sampler %s warmed up: %.1f ms per call", self.sampler.name, self.estimate_ms)

    def apply_policy(self) -> Policy:
        """Bring the sampler and aggregator to the live policy; called between calls only.
        The policy this worker runs under is returned: the live one, or, when the sampler
        refuses the live one (its `max_new_tokens` above the model's context, say), the one
        it had, whole. A refused version is not applied in part nor reported as applied (the
        heartbeat reports `applied_version` and the refusal), and not tried again until a
        newer one is published."""
        policy = self.policy()
        if policy.version == self.applied_version or policy.version == self.refused_version:
            return self.applied
        if policy.generation != self.sampler.generation:
            try:
                self.sampler.configure(policy.generation)
            except ValueError as exc:
                log.error(
                    "policy %d refused by the sampler, this worker keeps policy %d: %s",
                    policy.version,
                    self.applied_version,
                    exc,
                )
                self.refused_version, self.refused_reason = policy.version, str(exc)
                return self.applied
        self.aggregator.configure(
            max_batch_size=policy.max_batch_size, deadline_ms=policy.deadline_ms
        )
        self.applied, self.applied_version = policy, policy.version
        self.refused_version, self.refused_reason = None, ""
        return policy

    def run(self, batch_id: str, lane: int = UNKNOWN_LANE) -> list[Result] | None:
        """One [outcome, text] per item of the batch sealed (the turn's `batch_id`), in order;
        None when there was nothing to seal (a duplicate task): there is nobody to answer. The
        three steps in one thread; a worker runs them in a pipeline (workers.pipeline)."""
        turn = self.begin(batch_id, lane)
        if turn is None:
            return None
        self.sample(turn)
        self.finish(turn)
        return turn.answers

    def begin(self, batch_id: str, lane: int = UNKNOWN_LANE) -> Turn | None:
        """Seal a batch for the task of `batch_id` (the GPU is free for it): that batch, or a
        higher lane's ready one (batching/lua/seal.lua); drop the items whose deadline
        one more call cannot meet. None when there was nothing left to seal."""
        began = time.perf_counter()
        policy = self.apply_policy()
        tag = self.aggregator.shard_of(batch_id).tag
        # The places a batch may take from the backfill lane: only while the shard's lane is
        # known to hold items (the last seal's or heartbeat's count), so that a queue without
        # offline jobs seals as it always did.
        paused = time.monotonic() < self.backfill_paused_until.get(tag, 0.0)
        places: int | list[int] = 0
        if self.backfill_left.get(tag) and not paused:
            steps = self.sampler.generation.max_new_tokens
            places = self.costs.top_up_sizes(policy.max_batch_size, steps)
            if lane == BACKFILL_TURN:
                places = self._backfill_turn_rows(policy.max_batch_size)
        sealed = self.aggregator.seal(batch_id, self.admission_inputs(), lane=lane, places=places)
        if sealed.items:
            self.requests_seen_at = time.monotonic()
        if places:
            self.backfill_left[tag] = sealed.backfill_left
        self.sealed_at[tag] = time.monotonic()
        if sealed.handovers:
            self.on_handovers(sealed.handovers)
        if sealed.sealed_before:
            if lane != BACKFILL_TURN:
                log.info("batch %s was sealed by an earlier task: nothing to run", batch_id)
            return None
        batch_id = sealed.batch_id or batch_id  # a backfill turn's own id, when it took none
        # A streaming item whose client left takes no place in the call (read only for a
        # batch that streams: the others cost what they did).
        streams = any(item.stream for item in sealed.items)
        cancelled = self._cancelled(batch_id) if streams else set()
        called = [item for index, item in enumerate(sealed.items) if index not in cancelled]
        contract = self.costs.profile.is_contract
        rows = [] if contract else self._rows_of(called)  # the call's shape, on a curve
        # One more call, of this batch's shape, must end before the item's deadline, or the
        # item is dropped now and the sampler never sees it.
        call_ms = self.estimate_ms if contract else self.costs.predict_ms(rows, 0.0)
        call_ms = call_ms if called else 0.0
        cutoff = sealed.now_ms + call_ms
        results: dict[int, Answer] = {}
        live: list[int] = []
        for index, item in enumerate(sealed.items):
            if item.expires_at_ms < cutoff:
                results[index] = Answer(ItemOutcome.EXPIRED, "deadline could not be met")
            elif index in cancelled:
                results[index] = Answer(ItemOutcome.CANCELLED, "the client left")
            else:
                live.append(index)
        taken, backfill, returned, call_ms = self._take_backfill(
            tag, sealed.backfill, rows, live, call_ms
        )
        # A batch opened under a larger max batch size than the policy's now (just lowered)
        # runs as several calls of at most the new size.
        size = policy.max_batch_size
        live += range(len(sealed.items), len(sealed.items) + len(backfill))  # the places left
        chunks = [live[start : start + size] for start in range(0, len(live), size)]
        ran = replace(policy, **asdict(self.sampler.generation))
        turn = Turn(batch_id, sealed, policy, results, chunks, began, ran=ran, backfill=backfill)
        turn.backfill_taken, turn.backfill_returned = taken, returned
        turn.predicted_ms = call_ms * len(chunks)
        return turn

    def _take_backfill(
        self, tag: str, taken: list[bytes], rows: list[Row], live: list[int], call_ms: float
    ) -> tuple[list[bytes], list[BackfillItem], list[bytes], float]:
        """Of the backfill items the seal `taken`, those the call runs (raw and parsed) and
        those it gives back, and the call's predicted time with them: on a curve, a top-up of
        the `live` items' `rows` keeps what stays in its bound (`_fit_backfill`); under the
        contract, all."""
        backfill = [BackfillItem.parse(raw) for raw in taken]
        if not taken or self.costs.profile.is_contract:
            return taken, backfill, [], call_ms
        if not live:  # a backfill turn, sized before its seal
            rows = self._rows_of([item.as_item() for item in backfill])
            return taken, backfill, [], self.costs.predict_ms(rows, 0.0)
        fits, call_ms = self._fit_backfill(tag, rows, backfill)
        kept = [(raw, item) for raw, item, fit in zip(taken, backfill, fits, strict=True) if fit]
        returned = [raw for raw, fit in zip(taken, fits, strict=True) if not fit]
        return [raw for raw, _ in kept], [item for _, item in kept], returned, call_ms

    def _rows_of(self, items: list[Item]) -> list[Row]:
        """The items as the sampler's rows, but those that make none (a chat its template
        refuses: rejected alone at the call)."""
        rows = []
        for item in items:
            try:
                rows.append(self._row(item))
            except ValueError:
                continue
        return rows

    def _learn(self, turn: Turn, items: list[Item], chunk: list[int], sampler_ms: float) -> None:
        """Learn from a call of a batch of the queue's (`items`: the turn's): the GPU's scale
        on the profile, and the running estimate of an interactive call, its top-up's
        predicted share left out (kept on the turn, for its turn time). A call of backfill
        items only teaches nothing: the queue's calls are what admission and the deadline cut
        predict."""
        first_backfill = len(turn.sealed.items)
        interactive = [items[i] for i in chunk if i < first_backfill]
        if not turn.interactive or not interactive:
            return
        share = 1.0
        if not self.costs.profile.is_contract:
            rows = self._rows_of([items[i] for i in chunk])
            share = self.costs.learn(rows, self._rows_of(interactive), sampler_ms)
        self.estimate_ms += ESTIMATE_WEIGHT * (sampler_ms * share - self.estimate_ms)
        turn.backfill_extra_ms += sampler_ms * (1 - share)

    def _backfill_turn_rows(self, max_rows: int) -> int:
        """A backfill turn's rows: while requests come, as many as a call of theirs costs, so
        that one arriving during it waits no longer than for one of theirs; after
        REQUESTS_QUIET_S without any, a full batch."""
        if time.monotonic() - self.requests_seen_at > REQUESTS_QUIET_S:
            return max_rows
        steps = self.sampler.generation.max_new_tokens
        return self.costs.rows_within(self.estimate_ms, max_rows, steps)

    def _fit_backfill(
        self, tag: str, rows: list[Row], backfill: list[BackfillItem]
    ) -> tuple[list[bool], float]:
        """Which backfill items (in the lane's order) the call of `rows` takes
        (CallCosts.fitting), and the call's predicted time with them. Those left out go back
        to the lane when the turn is reported; when none fitted, the shard's seals take no
        backfill for BACKFILL_MISFIT_PAUSE_S."""
        candidates = []
        for item in backfill:
            made = self._rows_of([item.as_item()])
            candidates.append(made[0] if made else None)
        fits, shape = self.costs.fitting(rows, candidates)
        left = fits.count(False)
        if left:
            self.backfill_left[tag] = self.backfill_left.get(tag, 0) + left
            if left == len(fits):
                self.backfill_paused_until[tag] = time.monotonic() + BACKFILL_MISFIT_PAUSE_S
        return fits, self.costs.scale * self.costs.profile.call_ms(shape)

    def _cancelled(self, batch_id: str) -> set[int]:
        """The indexes of the batch's items whose streaming client left (one round trip)."""
        key = self.aggregator.shard_of(batch_id).cancelled(batch_id)
        return {int(index) for index in self.aggregator.client.smembers(key)}

    def admission_inputs(self) -> AdmissionInputs:
        return AdmissionInputs(workers=self.live_workers, turn_ms=self.turn_ms)

    def sample(self, turn: Turn) -> None:
        """The turn's sampler calls: every live item gets its answer."""
        if turn.chunks:
            turn.called = time.perf_counter()
        items = turn.items
        for chunk in turn.chunks:
            sampler_ms = self._sample(turn.batch_id, items, chunk, turn.results, turn.tokens_by_key)
            turn.sampler_ms += sampler_ms
            turn.calls_ms.append(sampler_ms)
            if self.costs.profile.is_contract:  # one float: learnt before the next seal
                self._learn(turn, items, chunk, sampler_ms)
        turn.ended = time.perf_counter()

    def finish(self, turn: Turn, pipe: redis.client.Pipeline | None = None) -> None:
        """Count, record and learn from a sampled turn: off the GPU's path in a pipeline. The
        record is queued on `pipe` when given (a worker sends it with the batch's answers),
        else sent at once. The new turn figure reaches admission with the next seal."""
        # Written only by the thread that finishes turns; the heartbeat thread just reads.
        self.batches += 1
        self.busy_s += turn.sampler_ms / 1000
        if not self.costs.profile.is_contract:  # a curve's rows: off the GPU's path
            items = turn.items
            for chunk, sampler_ms in zip(turn.chunks, turn.calls_ms, strict=False):
                self._learn(turn, items, chunk, sampler_ms)
        self._record(turn, pipe)
        # A batch dropped whole took no GPU time, and a backfill turn is none of the queue's:
        # not turns to learn from; a top-up's predicted share is left out.
        if turn.chunks and turn.interactive:
            turn_ms = (turn.ended - turn.began) * 1000 - turn.backfill_extra_ms
            self.turn_ms += ESTIMATE_WEIGHT * (turn_ms - self.turn_ms)

    def _sample(
        self,
        batch_id: str,
        items: list[Item],
        indexes: list[int],
        results: dict[int, Answer],
        tokens_by_key: dict[int, tuple[int, int]],
    ) -> float:
        """One sampler call for items[indexes]; fills their results; returns its ms."""
        rows: list[Row] = []
        called: list[int] = []
        for index in indexes:
            try:
                rows.append(self._row(items[index]))
                called.append(index)
            except ValueError as exc:  # a chat its template refuses: this item alone
                results[index] = Answer(ItemOutcome.PROMPT_REJECTED, str(exc) or "prompt rejected")
        started = time.perf_counter()
        if not rows:
            return 0.0
        self.busy_since = time.monotonic()
        left: set[int] = set()  # items whose streaming client left during the call
        try:
            if any(row.stream for row in rows):  # its new text published as it comes
                publisher = DeltaPublisher(
                    self.aggregator.client, batch_id, called, self.stream_interval_ms,
                    self.aggregator.shard_of(batch_id).cancelled(batch_id),
                )  # fmt: skip
                with publisher:
                    completions = self.sampler.batched_complete(rows, sink=publisher.sink)
                    self.busy_since = None  # the call ended: its last deltas' wait is not its
                left = publisher.cancelled
            else:
                completions = self.sampler.batched_complete(rows)
            if len(completions) != len(rows):
                raise RuntimeError(
                    f"sampler returned {len(completions)} completions for {len(rows)} prompts"
                )
            for index, completion in zip(called, completions, strict=True):
                results[index] = answer_of(items[index], completion)
                if index in left:  # its row may have stopped early: no answer, none cached
                    results[index] = Answer(ItemOutcome.CANCELLED, "the client left")
                if not isinstance(completion, PromptRejected):
                    key_id = items[index].key_id
                    prompt, sampled = tokens_by_key.get(key_id, (0, 0))
                    tokens_by_key[key_id] = (
                        prompt + completion.prompt_tokens,
                        sampled + completion.completion_tokens,
                    )
            self.failed_calls = 0
        except Exception as exc:  # any sampler failure fails this call's items, not the worker
            log.exception("sampler %s failed on batch %s", self.sampler.name, batch_id)
            reason = f"sampler failed: {type(exc).__name__}: {exc}".splitlines()[0][:200]
            self.failed_calls += 1
            self.last_failure = reason
            for index in called:
                results[index] = Answer(ItemOutcome.ERROR, reason)
        finally:
            self.busy_since = None
        return (time.perf_counter() - started) * 1000

    def _row(self, item: Item) -> Row:
        """The item as the sampler's row: a /sample prompt with the queue's settings, or an
        API request's prompt (a chat rendered by the sampler's template) with its own."""
        request = item.request
        if request is None:
            return Row(item.prompt, self.sampler.row_settings(), bare=True, stream=item.stream)
        settings = request.settings(self.sampler.generation)
        if request.messages:
            prompt = self.sampler.render_chat(request.messages)
            return Row(prompt, settings, templated=True, stream=item.stream)
        return Row(request.prompt, settings, stream=item.stream)

    def _cached_answers(
        self, items: list[Item], results: list[Answer], policy: Policy
    ) -> dict[str, str]:
        """The answers the response cache keeps: sampled ones of the items that asked for it,
        each under the digest of what this worker ran (its policy, the item's key), not the
        one its web process computed from its own copy of the policy."""
        cached = {}
        for item, answer in zip(items, results, strict=True):
            if item.cache and answer.outcome == ItemOutcome.OK:
                asked = item.request if item.request is not None else item.prompt
                digest = cache.digest_of(self.aggregator.queue, asked, policy, item.key_id)
                if digest:
                    cached[digest] = answer.to_json()
        return cached

    def _record(self, turn: Turn, pipe: redis.client.Pipeline | None) -> None:
        batch_id, sealed, policy = turn.batch_id, turn.sealed, turn.policy
        results = turn.in_order
        record = record_of(turn, self.worker)
        queue_times_ms = turn.queue_times_ms(record["call_started_ms"])
        with self._queue_times_lock:
            self._queue_times.update(stats.queue_time_counts(queue_times_ms))
        if turn.interactive:
            self.metrics.observe_batch(
                size=len(results), expired=record["expired"],
                queue_wait_ms=record["queue_wait_ms"], sampler_ms=turn.sampler_ms,
                queue_times_ms=queue_times_ms,
            )  # fmt: skip
        elif turn.chunks:
            self.metrics.observe_backfill_call(turn.sampler_ms)
        if turn.chunks:
            self.metrics.observe_places(
                interactive=record["sampled"], backfill=len(turn.backfill),
                places=policy.max_batch_size * len(turn.chunks),
            )  # fmt: skip
        statistics = statistics_of(turn, record)
        cached = self._cached_answers(sealed.items, results, turn.ran or policy)
        cache_ttl_ms = policy.response_cache_ttl_s * 1000
        # The statistics' time is the Redis node's (its time at the seal, and the turn since),
        # as the web processes' flushes are: one clock for every minute, whatever this one says.
        at_s = sealed.now_ms / 1000 + (time.perf_counter() - turn.began)
        keys = self.aggregator.shard_of(batch_id)
        backfilled = (turn.backfill_taken, turn.backfill, turn.backfill_answers)
        if pipe is not None:
            backfill.queue_give_back(pipe, keys, turn.backfill_returned)
            backfill.queue_answers(pipe, keys, *backfilled)
            self.batch_log.queue_record(pipe, json.dumps(record), statistics, at_s)
            self.aggregator.queue_cached_answers(pipe, cached, cache_ttl_ms)
            return
        try:
            with self.aggregator.client.pipeline(transaction=False) as own:
                backfill.queue_give_back(own, keys, turn.backfill_returned)
                backfill.queue_answers(own, keys, *backfilled)
                self.batch_log.queue_record(own, json.dumps(record), statistics, at_s)
                self.aggregator.queue_cached_answers(own, cached, cache_ttl_ms)
                own.execute()
        except Exception:  # a lost record must never lose the batch's answers
            log.exception("could not record batch %s", batch_id)
