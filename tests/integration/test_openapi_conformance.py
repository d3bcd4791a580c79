"""schemathesis runs the OpenAPI document (GET /v1/openapi.json) against the live server:
generated requests, valid and invalid, a bounded number per operation. No answer is a 500,
every answer conforms to the document (status, content type, body schema), and every request
the document forbids is refused with a 4xx.

Not checked: that every request the document allows succeeds. A valid request may name a
model this server does not serve (404), ask for more tokens than the policy allows, or more
choices than a batch holds (400): limits of the deployment, not of the document."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import positive_data_acceptance

from devstack.stack import Stack
from serving.openapi import openapi_document
from tests.support.batches import keyed_client

pytestmark = pytest.mark.integration

# Requests per operation and generation mode: enough to cover every field's kinds of value,
# few enough for the suite (each valid request is a real batch of 100 ms).
EXAMPLES = 25
# Sequences of linked calls, and calls a sequence at most.
LINKED_RUNS, LINKED_STEPS = 30, 6


@pytest.fixture(scope="module")
def stack(start_stack: Callable[..., Stack], tmp_path_factory: pytest.TempPathFactory) -> Stack:
    files = str(tmp_path_factory.mktemp("schemathesis-files"))
    env = {"SAMPLER": "simulated", "SIMULATED_BATCH_MS": "20", "SAMPLING_FILES_DIR": files}
    return start_stack("schemathesis", env=env)


@pytest.fixture(scope="module")
def api_schema(stack: Stack) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{stack.base_url}/v1/openapi.json")


# schemathesis' own pytest plugin (from_fixture) does not run under pytest 9: each operation
# and generation mode is driven here with hypothesis instead, as the plugin would.
@pytest.mark.parametrize("mode", list(GenerationMode), ids=str)
def test_the_api_conforms_to_its_document(
    api_schema: schemathesis.BaseSchema, mode: GenerationMode
) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]  # type: ignore[union-attr]
    # Every path and method of the document (read as served: no operation skipped).
    assert len(operations) == sum(len(methods) for methods in openapi_document()["paths"].values())
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and not operation.body:
            continue  # the GETs take nothing that could be invalid (an id is any string)

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        )
        def conforms(case: schemathesis.Case) -> None:
            case.call_and_validate(excluded_checks=[positive_data_acceptance], timeout=10)

        conforms()


def test_the_files_and_batch_apis_hold_through_their_links(
    stack: Stack, api_schema: schemathesis.BaseSchema
) -> None:
    """A keyed client's sequences of calls, as the document's links chain them: a file
    uploaded, read, deleted, made a job's input; the job read and cancelled. No answer is a
    500 or off the document, and a resource made is there until it is deleted."""
    # Every web process must know the key before the first step: one that does not answers the
    # Batch API 401, which leaves a link unfed and makes the draws differ between runs.
    key = keyed_client(stack, "schemathesis-links").api_key

    class Links(api_schema.as_state_machine()):  # type: ignore[misc]
        def get_call_kwargs(self, case: schemathesis.Case) -> dict[str, Any]:
            return {"headers": {"Authorization": f"Bearer {key}"}, "timeout": 10}

        def validate_response(
            self, response: Any, case: schemathesis.Case, additional_checks: Any = None,
            **kwargs: Any,
        ) -> None:  # fmt: skip
            case.validate_response(response, excluded_checks=[positive_data_acceptance],
                                   transport_kwargs=kwargs)  # fmt: skip

    Links.run(settings=settings(
        max_examples=LINKED_RUNS, stateful_step_count=LINKED_STEPS, deadline=None,
        suppress_health_check=list(HealthCheck), derandomize=True, database=None,
    ))  # fmt: skip
