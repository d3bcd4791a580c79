"""Per-request settings: their wire format, their resolution against the queue's policy, the
sampler contract's default for samplers that only continue prompts, and the runner's answers."""

from __future__ import annotations

import redis

from batching.aggregator import BatchAggregator
from batching.generation import (
    Completion,
    FinishReason,
    Row,
    RowSettings,
    SampleRequest,
    cut_at_stop,
    render_chat_plain,
)
from batching.items import item_of, parse_item
from batching.outcomes import ItemOutcome
from batching.policy import GenerationSettings
from tests.support import unique_queue
from workers.runner import BatchRunner
from workers.samplers.base import PromptRejected, Sampler
from workers.samplers.simulated import (
    SimulatedSampler,
    expected_completion,
    expected_row_completion,
)


def test_a_request_survives_its_wire_format() -> None:
    requests = [
        SampleRequest(
            prompt="E equals: ",
            max_tokens=3,
            temperature=0.5,
            top_p=0.9,
            stop=("\n", "é"),
            seed=-(2**63),
        ),
        SampleRequest(messages=(("system", "Be brief."), ("user", "2 + 2 = ?"))),
        SampleRequest(prompt="{not json} 123 x", stop=()),
    ]
    for request in requests:
        assert SampleRequest.from_json(request.to_json()) == request
        parsed = parse_item(item_of(1234, request).encode())
        assert (parsed.expires_at_ms, parsed.prompt, parsed.request) == (1234, "", request)


def test_a_sample_prompt_keeps_its_bare_format_whatever_it_contains() -> None:
    for prompt in ("E equals ", "a: b", ":leading colon", '{"prompt": "json"}', " x", ""):
        item = item_of(99, prompt)
        assert item == f"99 {prompt}"
        parsed = parse_item(item.encode())
        assert (parsed.expires_at_ms, parsed.prompt, parsed.request) == (99, prompt, None)


def test_unset_settings_are_the_queue_s_and_max_tokens_is_bounded_by_it() -> None:
    queue = GenerationSettings(max_new_tokens=16, temperature=0.7, top_p=0.9, stop="\n")
    assert SampleRequest(prompt="x").settings(queue) == RowSettings(16, 0.7, 0.9, ("\n",))
    mine = SampleRequest(prompt="x", max_tokens=4, temperature=0, top_p=1, stop=(), seed=3)
    assert mine.settings(queue) == RowSettings(4, 0.0, 1.0, (), 3)
    assert SampleRequest(prompt="x", max_tokens=99).settings(queue).max_tokens == 16
    assert RowSettings.of(queue) == SampleRequest(prompt="x").settings(queue)


def test_cut_at_the_first_of_several_stops() -> None:
    assert cut_at_stop("one two three", ("three", "two")) == ("one ", True)
    assert cut_at_stop("one two", ("four",)) == ("one two", False)
    assert cut_at_stop("one", ()) == ("one", False)


def test_the_plain_chat_template() -> None:
    rendered = render_chat_plain((("system", "S"), ("user", "U")))
    assert rendered == "<|system|>\nS\n<|user|>\nU\n<|assistant|>\n"


class ContinuingSampler(Sampler):
    """A custom sampler as SAMPLER=module:factory loads one: it implements `sample` only."""

    name = "continuing"

    def sample(self, prompts: list[str]) -> list[str | PromptRejected]:
        return [PromptRejected("no") if p == "refuse" else f"{p} goes on. And on" for p in prompts]


def test_a_sampler_with_only_sample_serves_rows_with_their_stops() -> None:
    sampler = ContinuingSampler()
    rows = [
        Row("It", RowSettings(max_tokens=8, stop=(".",))),
        Row("It", RowSettings(max_tokens=8)),
        Row("refuse", RowSettings(max_tokens=8)),
    ]
    stopped, whole, refused = sampler.batched_complete(rows)
    assert stopped == Completion("It goes on", FinishReason.STOP, 1, 3)
    assert whole == Completion("It goes on. And on", FinishReason.LENGTH, 1, 5)
    assert isinstance(refused, PromptRejected)
    # A /sample row (the queue's settings) gets the text as `sample` wrote it, as before the
    # API: the queue's stop is the sampler's own business.
    sampler.configure(GenerationSettings(stop="."))
    [plain] = sampler.batched_complete([Row("It", sampler.row_settings(), bare=True)])
    assert isinstance(plain, Completion)
    assert plain.text == "It goes on. And on"
    # An API row that sets nothing has the queue's settings too, but is answered in full.
    [api] = sampler.batched_complete([Row("It", sampler.row_settings())])
    assert api == Completion("It goes on", FinishReason.STOP, 1, 3)


def test_the_simulated_sampler_shapes_its_answer_by_each_row() -> None:
    prompt = "shape me"
    full = expected_completion(prompt).split(" ")
    greedy = RowSettings(max_tokens=32)
    assert expected_row_completion(prompt, greedy) == (" ".join(full), FinishReason.STOP)
    short = RowSettings(max_tokens=2)
    assert expected_row_completion(prompt, short) == (" ".join(full[:2]), FinishReason.LENGTH)
    stopped = RowSettings(max_tokens=32, stop=(full[1],))
    assert expected_row_completion(prompt, stopped) == (full[0] + " ", FinishReason.STOP)
    seeded = RowSettings(max_tokens=32, temperature=1.0, seed=11)
    assert expected_row_completion(prompt, seeded) == expected_row_completion(prompt, seeded)
    draws = {expected_row_completion(prompt, RowSettings(32, 1.0, seed=s))[0] for s in range(20)}
    assert len(draws) > 10  # a seed picks the draw
    # A /sample row is the contract's answer whatever the queue's policy.
    sampler = SimulatedSampler(batch_ms=0)
    sampler.configure(GenerationSettings(max_new_tokens=1, temperature=1.5, stop=full[0]))
    [answer] = sampler.batched_complete([Row(prompt, sampler.row_settings(), bare=True)])
    assert isinstance(answer, Completion)
    assert answer.text == expected_completion(prompt)


def test_a_batch_mixing_sample_and_api_items_answers_each_in_its_shape(
    redis_client: redis.Redis,
) -> None:
    aggregator = BatchAggregator(redis_client, unique_queue("gen"), deadline_ms=500)
    runner = BatchRunner(aggregator, SimulatedSampler(batch_ms=0), "w")
    chat = (("user", "hello"),)
    tickets = [
        aggregator.append("E equals ", 500),
        aggregator.append(SampleRequest(prompt="E equals ", max_tokens=1), 500),
        aggregator.append(SampleRequest(messages=chat), 500),
    ]
    results = runner.run(tickets[0].batch_id)
    assert results is not None
    plain, limited, chatted = (results[ticket.index] for ticket in tickets)
    assert plain == [ItemOutcome.OK, "MC squared"]
    assert limited == [ItemOutcome.OK, "MC", "length", 2, 1]
    rendered = render_chat_plain(chat)
    completion = expected_completion(rendered)
    assert chatted == [
        ItemOutcome.OK, completion, "stop", len(rendered.split()), len(completion.split())
    ]  # fmt: skip


class ChatRefusingSampler(SimulatedSampler):
    def render_chat(self, messages: tuple[tuple[str, str], ...]) -> str:
        raise ValueError("the template takes no system turn")


def test_a_chat_its_template_refuses_is_rejected_alone(redis_client: redis.Redis) -> None:
    aggregator = BatchAggregator(redis_client, unique_queue("gen"), deadline_ms=500)
    runner = BatchRunner(aggregator, ChatRefusingSampler(batch_ms=0), "w")
    refused = aggregator.append(SampleRequest(messages=(("system", "x"),)), 500)
    served = aggregator.append("E equals ", 500)
    results = runner.run(refused.batch_id)
    assert results is not None
    assert results[refused.index] == [
        ItemOutcome.PROMPT_REJECTED, "the template takes no system turn"
    ]  # fmt: skip
    assert results[served.index] == [ItemOutcome.OK, "MC squared"]
