"""An item's answer on the wire (batching.answers), and the one table of problems
(batching.problems): the formats a rolling upgrade mixes, and every problem's words."""

from __future__ import annotations

import json
from typing import Any

import pytest

from batching.answers import Answer, from_wire, to_wire
from batching.outcomes import ItemOutcome, RequestOutcome
from batching.problems import Failure, Problem

# As workers have written them, before and since the API: the wire format does not change.
WIRE: list[list[Any]] = [
    ["ok", "MC squared"],  # /sample
    ["ok", "MC squared", "length", 3, 5],  # an API request's completion
    ["expired", "deadline could not be met"],
    ["prompt_rejected", "too long"],
    ["error", "sampler failed: RuntimeError: CUDA out of memory"],
    ["not_dispatched", "batch queue unavailable"],
]


@pytest.mark.parametrize("wire", WIRE)
def test_the_wire_format_round_trips_exactly(wire: list[object]) -> None:
    answer = Answer.from_wire(wire)
    assert answer.to_wire() == wire
    assert json.loads(answer.to_json()) == wire  # as the response cache keeps it
    assert Answer.from_json(answer.to_json()) == answer


def test_a_batch_round_trips_and_encodes_as_the_runner_did() -> None:
    answers = from_wire(WIRE)
    assert to_wire(answers) == WIRE
    # The runner stored ItemOutcome members; JSON writes them as their values, as these.
    assert json.dumps(to_wire(answers)) == json.dumps(WIRE)


def test_an_api_answer_of_an_older_worker_ended_by_the_model_with_no_tokens() -> None:
    answer = Answer.from_wire(["ok", "text"])
    assert (answer.finish_reason, answer.prompt_tokens, answer.completion_tokens) == (None, 0, 0)


def test_an_outcome_of_a_newer_worker_is_no_completion() -> None:
    answer = Answer.from_wire(["something_new", "why"])
    assert answer.problem is Problem.SAMPLER_FAILED
    assert answer.text == "why"


def test_every_item_outcome_but_ok_means_one_problem() -> None:
    assert Answer(ItemOutcome.OK, "x").problem is None
    meant = {outcome: Problem.of_item(outcome) for outcome in ItemOutcome if outcome != "ok"}
    assert meant == {
        ItemOutcome.EXPIRED: Problem.DEADLINE,
        ItemOutcome.PROMPT_REJECTED: Problem.PROMPT_REJECTED,
        ItemOutcome.ERROR: Problem.SAMPLER_FAILED,
        ItemOutcome.NOT_DISPATCHED: Problem.UNAVAILABLE,
        ItemOutcome.CANCELLED: Problem.CLIENT_CLOSED,
    }


def test_the_table_keeps_the_statuses_outcomes_and_words_clients_know() -> None:
    rows = {
        problem.name: (problem.status, problem.outcome, problem.openai_code,
                       problem.inference_error, problem.retry_after)
        for problem in Problem
    }  # fmt: skip
    assert rows == {
        "OVERLOADED": (503, RequestOutcome.REJECTED, "overloaded", "SERVICE_OVERLOADED", True),
        "UNAVAILABLE": (503, RequestOutcome.ERROR, "queue_unavailable", "SERVICE_UNAVAILABLE",
                        True),
        "DEADLINE": (504, RequestOutcome.TIMEOUT, "deadline_exceeded", "DEADLINE_EXCEEDED", False),
        "PROMPT_REJECTED": (400, RequestOutcome.BAD_REQUEST, "prompt_rejected", "INVALID_REQUEST",
                            False),
        "SAMPLER_FAILED": (502, RequestOutcome.ERROR, "sampler_failed", "SAMPLER_FAILED", False),
        "UNAUTHORIZED": (401, RequestOutcome.UNAUTHORIZED, "invalid_api_key", "UNAUTHORIZED",
                         False),
        "RATE_LIMITED": (429, RequestOutcome.RATE_LIMITED, "rate_limit_exceeded", "RATE_LIMITED",
                         True),
        "MODEL_UNAVAILABLE": (503, RequestOutcome.ERROR, "model_unavailable", "MODEL_UNAVAILABLE",
                              True),
        "OVER_BUDGET": (429, RequestOutcome.RATE_LIMITED, "insufficient_quota", "QUOTA_EXCEEDED",
                        False),
        "CLIENT_CLOSED": (499, RequestOutcome.CANCELLED, "client_closed_request",
                          "CLIENT_CLOSED_REQUEST", False),
    }  # fmt: skip


def test_a_failure_carries_the_headers_its_problem_asks_for() -> None:
    assert Failure(Problem.OVERLOADED, "busy", 3).headers() == {"Retry-After": "3"}
    assert Failure(Problem.DEADLINE, "late").headers() == {}
    assert Failure(Problem.UNAUTHORIZED, "who").headers() == {
        "WWW-Authenticate": 'Bearer realm="sampling"'
    }
