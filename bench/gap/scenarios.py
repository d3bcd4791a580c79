"""The saturated, lone and single scenarios (bench.gap)."""

from __future__ import annotations

import statistics
import time
import uuid

from batching.outcomes import RequestOutcome
from bench.gap.calls import gaps_ms, post, read_calls
from bench.gap.runs import CALL_MS, MAX_BATCH, Bench
from bench.harness import loadgen
from bench.harness.stats import median, percentile
from bench.harness.trees import Tree
from workers.samplers.simulated import expected_completion

SATURATED_LOAD = 1.2  # of the limit, 1,000 req/s for one worker
LONE_LOAD = 0.1  # of the calls two workers can run per second


def saturated(bench: Bench, tree: Tree) -> None:
    with bench.stack(tree, "saturated", gpus=[None]) as (stack, log):
        stack.start(timeout_s=60)
        tag = uuid.uuid4().hex[:6]
        results = loadgen.run(
            "127.0.0.1",
            stack.port,
            "/sample",
            SATURATED_LOAD * MAX_BATCH * 1000 / CALL_MS,
            bench.saturated_s,
            lambda i: f"sat {tag} {i}",
            expected_completion,
            client_timeout_s=3.0,
        )
        calls = read_calls(log, f"sat {tag} ")
        # The backlog's span: from one second in (the queue has formed) to the last call
        # that started while requests were still arriving.
        first = calls[0].start + 1.0 if calls else 0.0
        last = first - 1.0 + bench.saturated_s
        steady = [call for call in calls if first <= call.start <= last]
        gaps = gaps_ms(steady)
        span = (steady[-1].end - steady[0].start) if steady else float("nan")
        bench.record(
            tree,
            "saturated",
            {
                "calls": len(steady),
                "gap_p50": median(gaps),
                "gap_p90": percentile(gaps, 90),
                "gap_max": max(gaps, default=float("nan")),
                "busy_%": 100 * sum(c.end - c.start for c in steady) / span,
                "batch": statistics.mean(c.size for c in steady) if steady else 0.0,
                "ok_%": 100 * results.share(RequestOutcome.OK),
                "503_%": 100 * results.share(RequestOutcome.REJECTED),
                "504_%": 100 * results.share(RequestOutcome.TIMEOUT),
                "wrong": results.count(loadgen.WRONG) + results.count(loadgen.OTHER),
            },
        )


def lone(bench: Bench, tree: Tree) -> None:
    workers = 2
    with bench.stack(tree, "lone", gpus=[0, 1]) as (stack, log):
        stack.start(timeout_s=60)
        tag = uuid.uuid4().hex[:6]
        rate = LONE_LOAD * workers * 1000 / CALL_MS
        results = loadgen.run(
            "127.0.0.1",
            stack.port,
            "/sample",
            rate,
            bench.lone_s,
            lambda i: f"lone {tag} {i}",
            expected_completion,
            client_timeout_s=3.0,
            seed=int(time.time()),
        )
        call_ms = median([c.ms for c in read_calls(log, f"lone {tag} ")])
        intended = results.intended_s
        sent = [i + lag / 1000 for i, lag in zip(intended, results.send_lag_ms, strict=True)]
        answered = [i + ms / 1000 for i, ms in zip(intended, results.latencies_ms, strict=True)]
        lone = [
            results.latencies_ms[i] - call_ms
            for i, at in enumerate(sent)
            if results.outcomes[i] == RequestOutcome.OK
            and sum(1 for j in range(len(sent)) if j != i and sent[j] <= at < answered[j]) < workers
        ]
        for outcome, example in results.examples.items():
            if outcome != RequestOutcome.OK:
                print(f"  {tree.name:<8} lone: {outcome}: {example}", flush=True)
        bench.record(
            tree,
            "lone",
            {
                "requests": results.sent,
                "lone": len(lone),
                "p50_over_call": median(lone),
                "p99_over_call": percentile(lone, 99),
                "max_over_call": max(lone, default=float("nan")),
                "not_ok": results.sent - results.count(RequestOutcome.OK),
            },
        )


def single(bench: Bench, tree: Tree) -> None:
    with bench.stack(tree, "single", gpus=[None]) as (stack, log):
        stack.start(timeout_s=60)
        tag = uuid.uuid4().hex[:6]
        for i in range(5):  # connections, caches, the worker's first tasks
            post(stack.port, f"warm {tag} {i}")
        timings = []
        for i in range(bench.single_requests):
            prompt = f"single {tag} {i}"
            sent = time.time()
            status, body = post(stack.port, prompt)
            answered = time.time()
            if status != 200 or body != expected_completion(prompt):
                raise SystemExit(f"single: {status} {body!r} for {prompt!r}")
            timings.append((prompt, sent, answered))
            time.sleep(0.05)  # the worker back at rest
        calls = {c.first_prompt: c for c in read_calls(log, f"single {tag} ")}
        call_ms = median([c.ms for c in calls.values()])
        latency = [(answered - sent) * 1000 - call_ms for _, sent, answered in timings]
        dispatch = [(calls[p].start - sent) * 1000 for p, sent, _ in timings if p in calls]
        back = [(answered - calls[p].end) * 1000 for p, _, answered in timings if p in calls]
        bench.record(
            tree,
            "single",
            {
                "p50_over_call": median(latency),
                "p90_over_call": percentile(latency, 90),
                "dispatch_p50": median(dispatch),
                "return_p50": median(back),
                "call_ms": call_ms,
            },
        )
