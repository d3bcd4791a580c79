"""POST /v1/embeddings, in OpenAI's shape: a text or a list of texts, each its own item of the
embedder's batches (one call per batch, as completions), answered as floats or base64.

The worker's answer for an item is its vector already encoded (batching.embeddings): for
`encoding_format: "base64"` it is handed over as is, for floats decoded once here. Usage is
the texts' tokens, charged as prompt tokens.
"""

from __future__ import annotations

from django.http import HttpRequest

from accounts.access import Caller
from batching.catalog import EMBEDDER
from batching.embeddings import decode
from batching.generation import SampleRequest
from batching.outcomes import RequestOutcome
from batching.problems import Failure
from serving import schemas
from serving.deadline import Deadline
from serving.responses import Invalid, json_response, openai_failure, openai_invalid
from serving.routing import Unrouted, route, sticky_of
from serving.runtime import WebProcess
from serving.submission import charge, submit
from serving.validation import check_size, parse, read_body
from serving.wrappers import Handled, answer_failure, counted, unrouted


def _embeddings(
    request: HttpRequest, process: WebProcess, arrival: float, caller: Caller
) -> Handled:
    try:
        parsed = parse(schemas.EmbeddingRequest, read_body(request))
        found = route(process, parsed.model, EMBEDDER, sticky_of(caller, parsed.user))
        if isinstance(found, Unrouted):
            return unrouted(openai_failure, found)
        policy = found.served.watcher.current
        texts = parsed.texts()
        for index, text in enumerate(texts):
            check_size(text, policy, "input" if isinstance(parsed.input, str) else f"input.{index}")
        items = [SampleRequest(prompt=text, dimensions=parsed.dimensions) for text in texts]
    except Invalid as invalid:
        return Handled(RequestOutcome.BAD_REQUEST, openai_invalid(invalid))
    model = found.served
    # A text's UTF-8 bytes bound its tokens: what a key with a tokens limit reserves.
    reserve = sum(len(text.encode()) for text in texts)
    deadline = Deadline(arrival, policy.deadline_ms)
    answers = submit(model, caller, items, deadline, price=found.entry.price, reserve=reserve)
    if isinstance(answers, Failure):
        return Handled(answers.outcome, answer_failure(openai_failure, answers), model)
    tokens = charge(model.stats, caller, answers, found.entry.price, embedding=True)
    as_base64 = parsed.encoding_format == "base64"
    data = [
        {"object": "embedding", "index": index,
         "embedding": answer.text if as_base64 else decode(answer.text)}
        for index, answer in enumerate(answers)
    ]  # fmt: skip
    body = {
        "object": "list",
        "data": data,
        "model": model.name,
        "usage": {"prompt_tokens": tokens.prompt, "total_tokens": tokens.prompt},
    }
    return Handled(RequestOutcome.OK, json_response(200, body, answers.headers()), model)


embeddings = counted(_embeddings, openai_failure)
