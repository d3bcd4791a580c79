"""The drain scenario: full batches queued while no worker runs, then one worker drains them
(bench.gap)."""

from __future__ import annotations

import time

import redis
from celery import Celery

from batching.aggregator import BatchAggregator
from batching.outcomes import ItemOutcome
from batching.protocol import RUN_BATCH_TASK
from bench.gap.calls import ResultTimes, gaps_ms, read_calls
from bench.gap.runs import MAX_BATCH, Bench
from bench.harness.stats import median, percentile
from bench.harness.trees import Tree
from workers.samplers.simulated import expected_completion

DRAIN_BATCHES = 40


def drain(bench: Bench, tree: Tree) -> None:
    deadline_ms = 120_000  # nothing expires while the batches wait for the worker
    env = {"SAMPLING_DEADLINE_MS": str(deadline_ms)}
    with bench.stack(tree, "drain", gpus=[], env=env) as (stack, log):
        client = redis.Redis.from_url(bench.redis_url)
        queue = stack.env["SAMPLING_QUEUE"]
        app = Celery("gap-bench", set_as_current=False)
        app.conf.update(broker_url=bench.redis_url, result_backend=bench.redis_url)
        aggregator = BatchAggregator(
            client, queue, max_batch_size=MAX_BATCH, deadline_ms=deadline_ms
        )
        batch_ids: list[str] = []
        for k in range(DRAIN_BATCHES):
            for i in range(MAX_BATCH):
                ticket = aggregator.append(f"drain {k} {i}", deadline_ms)
                if ticket.opened:
                    app.send_task(
                        RUN_BATCH_TASK,
                        args=(ticket.batch_id, queue),
                        task_id=ticket.batch_id,
                        queue=queue,
                    )
                    aggregator.dispatched(ticket.batch_id)
                    batch_ids.append(ticket.batch_id)
        published = ResultTimes(bench.redis_url, batch_ids)
        stack.start_worker(None)
        give_up = time.monotonic() + 90
        while len(read_calls(log, "drain ")) < DRAIN_BATCHES and time.monotonic() < give_up:
            time.sleep(0.2)
        time.sleep(0.5)
        published.stop()
        calls = read_calls(log, "drain ")
        wrong = 0
        for k, batch_id in enumerate(batch_ids):
            meta = app.backend.get_task_meta(batch_id)
            answers = meta.get("result") or []
            expected = [
                [ItemOutcome.OK, expected_completion(f"drain {k} {i}")] for i in range(MAX_BATCH)
            ]
            if len(answers) != MAX_BATCH:
                wrong += MAX_BATCH
                continue
            pairs = zip(answers, expected, strict=True)
            wrong += sum(1 for got, want in pairs if list(got) != want)
        ends = {int(call.first_prompt.split()[1]): call.end for call in calls}
        delivery = [
            (published.times[batch_id] - ends[k]) * 1000
            for k, batch_id in enumerate(batch_ids)
            if batch_id in published.times and k in ends
        ]
        gaps = gaps_ms(calls)
        bench.record(
            tree,
            "drain",
            {
                "calls": len(calls),
                "gap_p50": median(gaps),
                "gap_p90": percentile(gaps, 90),
                "gap_min": min(gaps, default=float("nan")),
                "result_p50": median(delivery),
                "result_p90": percentile(delivery, 90),
                "wrong": wrong,
            },
        )
