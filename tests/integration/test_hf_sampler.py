"""The transformers sampler's real loading and generation code, on CPU: a tiny model the tests
build (random weights, real tokenizer) for the batching rules, and the packaged SmolLM2 GGUF
for loading a real model."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from accounts.budgets import prompt_bound
from batching.embeddings import decode
from batching.generation import (
    Completion,
    FinishReason,
    Row,
    RowSettings,
    SampleRequest,
    render_chat_plain,
)
from devstack.stack import ROOT
from tests.support.tiny_model import TINY_CONTEXT_TOKENS, build_tiny_model
from workers.samplers.base import MAX_BATCH, GenerationSettings, PromptRejected
from workers.samplers.hf import HFSampler
from workers.samplers.hf_embedder import HFEmbedder
from workers.samplers.hf_source import (
    PACKAGED_MODEL_FILE,
    ModelNotFound,
    choose_device,
    load_pretrained,
    packaged_model_path,
    resolve_model,
)

MIXED_PROMPTS = [
    "E equals ",
    "x",
    "For every action, there is an equal and opposite",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over",
    "Once upon a time",
]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny(tiny_model_dir: Path) -> HFSampler:
    return HFSampler(str(tiny_model_dir), GenerationSettings(max_new_tokens=8))


def completions_alone(sampler: HFSampler, prompts: list[str]) -> list[str | PromptRejected]:
    return [sampler.batched_sample([prompt])[0] for prompt in prompts]


# --- model resolution ----------------------------------------------------------------------


def test_empty_model_setting_means_the_packaged_gguf() -> None:
    source = resolve_model("")
    assert source.gguf_file == PACKAGED_MODEL_FILE
    assert (Path(source.name_or_path) / PACKAGED_MODEL_FILE).is_file()
    assert packaged_model_path().stat().st_size > 50_000_000


def test_local_directory_gguf_file_and_hub_id(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert resolve_model(str(tiny_model_dir)).name_or_path == str(tiny_model_dir)
    assert resolve_model(str(tiny_model_dir)).gguf_file is None
    gguf = packaged_model_path()
    assert resolve_model(str(gguf)).gguf_file == gguf.name
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct").name_or_path == (
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"x")
    with pytest.raises(ModelNotFound, match=r"not a \.gguf"):
        resolve_model(str(not_gguf))
    for missing in (str(tmp_path / "missing"), "./missing", "missing.gguf"):
        with pytest.raises(ModelNotFound, match="no such file"):
            resolve_model(missing)


def test_a_hub_id_missing_from_the_cache_says_how_to_fetch_it() -> None:
    with pytest.raises(ModelNotFound, match="hf download nobody/no-such-model"):
        HFSampler("nobody/no-such-model")


def test_generation_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerationSettings(max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        GenerationSettings(temperature=-0.1)
    with pytest.raises(ValueError, match="top_p"):
        GenerationSettings(top_p=0)


def test_no_room_for_a_prompt_fails_at_load(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="leaves no room"):
        HFSampler(str(tiny_model_dir), GenerationSettings(max_new_tokens=TINY_CONTEXT_TOKENS))


# --- batching on the tiny model --------------------------------------------------------------


def test_padded_batch_of_mixed_lengths_matches_each_prompt_alone(tiny: HFSampler) -> None:
    lengths = {len(tiny.tokenizer(p)["input_ids"]) for p in MIXED_PROMPTS}
    assert len(lengths) == len(MIXED_PROMPTS)  # every row of the batch is padded differently
    batched = tiny.batched_sample(MIXED_PROMPTS)
    assert batched == completions_alone(tiny, MIXED_PROMPTS)
    assert all(isinstance(c, str) and c for c in batched)
    assert len(set(batched)) == len(MIXED_PROMPTS)


def test_order_follows_the_prompts(tiny: HFSampler) -> None:
    forward = tiny.batched_sample(MIXED_PROMPTS)
    backward = tiny.batched_sample(MIXED_PROMPTS[::-1])
    assert backward == forward[::-1]


def test_temperature_zero_is_deterministic(tiny: HFSampler) -> None:
    assert tiny.batched_sample(MIXED_PROMPTS) == tiny.batched_sample(MIXED_PROMPTS)


def test_temperature_above_zero_samples(tiny_model_dir: Path) -> None:
    sampler = HFSampler(str(tiny_model_dir), GenerationSettings(max_new_tokens=8, temperature=1))
    draws = {tuple(sampler.batched_sample(MIXED_PROMPTS)) for _ in range(3)}
    assert len(draws) > 1  # 8 tokens drawn from 49,152 each: equal draws would be a bug


def test_completion_is_only_new_text_without_special_tokens(tiny: HFSampler) -> None:
    special = [t for t in tiny.tokenizer.all_special_tokens if t]
    for prompt, completion in zip(MIXED_PROMPTS, tiny.batched_sample(MIXED_PROMPTS), strict=True):
        assert isinstance(completion, str)
        assert not completion.startswith(prompt)
        assert not any(token in completion for token in special), completion


def test_max_new_tokens_bounds_the_completion(tiny_model_dir: Path, tiny: HFSampler) -> None:
    one = HFSampler(str(tiny_model_dir), GenerationSettings(max_new_tokens=1))
    short = one.batched_sample(MIXED_PROMPTS)
    full = tiny.batched_sample(MIXED_PROMPTS)
    for first, whole in zip(short, full, strict=True):
        assert isinstance(first, str)
        assert isinstance(whole, str)
        assert whole.startswith(first)
        assert len(first) < len(whole)


def test_stop_string_cuts_the_completion(tiny_model_dir: Path, tiny: HFSampler) -> None:
    prompt = MIXED_PROMPTS[0]
    full = tiny.batched_sample([prompt])[0]
    assert isinstance(full, str)
    assert len(full) > 4
    stop = full[len(full) // 2 :][:2]  # a string the greedy completion is known to contain
    settings = GenerationSettings(max_new_tokens=8, stop=stop)
    cut = HFSampler(str(tiny_model_dir), settings).batched_sample([prompt, *MIXED_PROMPTS[1:]])
    assert cut[0] == full[: full.find(stop)]
    assert all(stop not in c for c in cut if isinstance(c, str))


def test_too_long_prompt_is_rejected_alone(tiny: HFSampler) -> None:
    too_long = "word " * TINY_CONTEXT_TOKENS
    prompts = [MIXED_PROMPTS[0], too_long, MIXED_PROMPTS[2]]
    results = tiny.batched_sample(prompts)
    assert isinstance(results[1], PromptRejected)
    tokens = len(tiny.tokenizer(too_long)["input_ids"])
    assert str(results[1]) == (
        f"prompt is {tokens} tokens; at most {TINY_CONTEXT_TOKENS - 8} fit "
        f"({TINY_CONTEXT_TOKENS}-token context less 8 new tokens)"
    )
    assert [results[0], results[2]] == completions_alone(tiny, [prompts[0], prompts[2]])


def test_a_prompt_of_exactly_the_limit_is_sampled(tiny: HFSampler) -> None:
    ids = tiny.tokenizer("word " * TINY_CONTEXT_TOKENS)["input_ids"][: tiny.max_prompt_tokens]
    prompt = tiny.tokenizer.decode(ids)
    assert len(tiny.tokenizer(prompt)["input_ids"]) == tiny.max_prompt_tokens
    assert isinstance(tiny.batched_sample([prompt])[0], str)


def test_full_batch_and_over_the_limit(tiny: HFSampler) -> None:
    prompts = [f"prompt number {i}" for i in range(MAX_BATCH)]
    results = tiny.batched_sample(prompts)
    assert len(results) == MAX_BATCH
    assert results[:3] == completions_alone(tiny, prompts[:3])
    with pytest.raises(ValueError, match="at most 100"):
        tiny.batched_sample([*prompts, "one too many"])


def test_warm_up_reports_a_duration(tiny: HFSampler) -> None:
    assert 0 < tiny.warm_up() < 30_000


# --- the packaged SmolLM2 GGUF ------------------------------------------------------------


def test_packaged_smollm2_loads_and_writes_text(smollm2: HFSampler) -> None:
    assert smollm2.name == f"hf:{PACKAGED_MODEL_FILE}"
    # The worker's own choice (cuda:0 on a GPU machine, where these tests also run in bf16).
    assert smollm2.device == choose_device()
    assert smollm2.context_tokens == 8192
    # A fact a 135M model knows: garbled weights (a bad GGUF dequantisation) would miss it.
    completion = smollm2.batched_sample(["The capital of France is"])[0]
    assert isinstance(completion, str)
    assert "Paris" in completion


def test_a_gguf_file_converted_once_loads_the_same_from_its_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first load reads the GGUF file and keeps a copy; the next reads the copy and gets
    the same tokenizer, weights and generation settings."""
    monkeypatch.setenv("SAMPLING_MODEL_CACHE", str(tmp_path / "cache"))
    source = resolve_model("")
    converted = load_pretrained(source, torch.float32)
    kept = sorted(path.name for path in (tmp_path / "cache").glob("*/*"))
    assert kept == ["float32", "tokenizer"]
    copied = load_pretrained(source, torch.float32)
    assert getattr(converted[1], "hf_quantizer", None) is not None  # read from the GGUF file
    assert getattr(copied[1], "hf_quantizer", None) is None  # read from the copy
    texts = ["E equals ", "The quick brown fox", "\u00e9t\u00e9 \U0001f600 <|im_end|>"]
    assert [converted[0](t).input_ids for t in texts] == [copied[0](t).input_ids for t in texts]
    assert converted[0].chat_template == copied[0].chat_template
    assert converted[1].generation_config.to_dict() == copied[1].generation_config.to_dict()
    ours, theirs = converted[1].state_dict(), copied[1].state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_packaged_smollm2_batch_matches_alone(smollm2: HFSampler) -> None:
    prompts = MIXED_PROMPTS[:3]
    assert smollm2.batched_sample(prompts) == completions_alone(smollm2, prompts)


def test_packaged_smollm2_embeds_a_text_alike_alone_or_in_a_padded_batch(
    smollm2: HFSampler,
) -> None:
    """SAMPLER=hf-embedder's vectors, from the generator's loaded model (its tokenizer's left
    padding untouched: the embedder pads on the right per call)."""
    embedder = HFEmbedder("", preloaded=(smollm2.tokenizer, smollm2.model))
    texts = ["The cat sat on the mat.", "Quarterly revenue grew by five percent this year.", "hi"]
    batched = embedder.embed(texts)
    tolerance = 1e-4 if smollm2.dtype == torch.float32 else 2e-2
    for text, vector in zip(texts, batched, strict=True):
        assert len(vector) == embedder.dimensions == smollm2.model.config.hidden_size
        assert math.fsum(x * x for x in vector) == pytest.approx(1.0, abs=1e-4)
        assert list(vector) == pytest.approx(list(embedder.embed([text])[0]), abs=tolerance)
    assert list(batched[0]) != pytest.approx(list(batched[1]), abs=tolerance)
    assert smollm2.tokenizer.padding_side == "left"
    answer, over = embedder.batched_complete(
        [Row(texts[0], RowSettings(max_tokens=1, dimensions=32)),
         Row(texts[0], RowSettings(max_tokens=1, dimensions=embedder.dimensions + 1))]
    )  # fmt: skip
    assert isinstance(answer, Completion)
    assert len(decode(answer.text)) == 32
    assert answer.prompt_tokens == smollm2.count_tokens(texts[0])
    assert isinstance(over, PromptRejected)


def test_model_benchmark_prints_its_table(tiny_model_dir: Path) -> None:
    """python -m bench sampler at tiny scale: it runs and prints one row per batch size."""
    command = [sys.executable, "-m", "bench", "sampler", "--model", str(tiny_model_dir)]
    command += ["--sizes", "1,3", "--repeats", "1", "--device", "cpu"]
    output = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    rows = [line.split("|") for line in output.stdout.splitlines() if line.startswith("| ")]
    assert [row[1].strip() for row in rows[1:]] == ["1", "3"], output.stdout
    assert rows[2][4].strip().endswith("x")


# --- per-request settings, row by row in one call ------------------------------------------


def mixed_rows(sampler: HFSampler, max_tokens: int) -> list[Row]:
    """Greedy and sampled rows with different max tokens and stops; each stop is a word that
    its row writes when alone without one (so that the stop really cuts)."""
    base = [
        Row(MIXED_PROMPTS[0], RowSettings(max_tokens=max_tokens)),
        Row(MIXED_PROMPTS[1], RowSettings(max_tokens=3)),
        Row(MIXED_PROMPTS[2], RowSettings(max_tokens=max_tokens, temperature=0.8, top_p=0.9,
                                          seed=1)),
        Row(MIXED_PROMPTS[3], RowSettings(max_tokens=max_tokens - 2, temperature=1.3, seed=2)),
        Row(MIXED_PROMPTS[4], RowSettings(max_tokens=max_tokens)),
    ]  # fmt: skip
    rows = []
    for row in base:
        [alone] = sampler.batched_complete([row])
        assert isinstance(alone, Completion)
        words = alone.text.split()
        if row.settings.max_tokens == max_tokens and len(words) >= 3:
            settings = replace(row.settings, stop=("never written", words[len(words) // 2]))
            row = replace(row, settings=settings)
        rows.append(row)
    assert sum(bool(row.settings.stop) for row in rows) >= 2
    return rows


def check_rows_match_alone(sampler: HFSampler, rows: list[Row]) -> list[Completion]:
    batched = sampler.batched_complete(rows)
    alone = [sampler.batched_complete([row])[0] for row in rows]
    assert batched == alone
    completions = [c for c in batched if isinstance(c, Completion)]
    assert len(completions) == len(rows)
    for row, completion in zip(rows, completions, strict=True):
        assert completion.completion_tokens <= row.settings.max_tokens
        assert completion.prompt_tokens == len(sampler.tokenizer(row.prompt)["input_ids"])
        if completion.finish_reason == FinishReason.LENGTH:
            assert completion.completion_tokens == row.settings.max_tokens
        assert not any(stop in completion.text for stop in row.settings.stop)
    return completions


def test_each_row_of_a_mixed_batch_gets_what_it_gets_alone(tiny: HFSampler) -> None:
    rows = mixed_rows(tiny, 8)
    completions = check_rows_match_alone(tiny, rows)
    reasons = {completion.finish_reason for completion in completions}
    assert reasons == {FinishReason.STOP, FinishReason.LENGTH}
    assert completions[1].completion_tokens == 3  # its own max tokens, in a batch of 8
    # A greedy row is the queue's greedy completion (8 tokens), cut at its own 3.
    queue_greedy = tiny.batched_sample([MIXED_PROMPTS[1]])[0]
    assert isinstance(queue_greedy, str)
    assert queue_greedy.startswith(completions[1].text)


def test_a_seed_reproduces_a_draw_and_no_seed_draws_afresh(tiny: HFSampler) -> None:
    seeded = Row(MIXED_PROMPTS[3], RowSettings(max_tokens=8, temperature=1.5, seed=42))
    fresh = replace(seeded, settings=replace(seeded.settings, seed=None))
    others = [Row(prompt, RowSettings(8, 1.0)) for prompt in MIXED_PROMPTS[:3]]
    first = tiny.batched_complete([seeded])[0]
    assert tiny.batched_complete([*others, seeded])[-1] == first
    assert tiny.batched_complete([seeded, *others])[0] == first
    draws = {str(tiny.batched_complete([fresh])[0]) for _ in range(5)}
    assert len(draws) > 1


def test_a_chat_is_rendered_with_the_model_s_template(tiny: HFSampler) -> None:
    assert tiny.tokenizer.chat_template  # the packaged SmolLM2 tokenizer has one
    rendered = tiny.render_chat((("system", "Be brief."), ("user", "What is E?")))
    assert "Be brief." in rendered
    assert "What is E?" in rendered
    assert rendered != render_chat_plain((("system", "Be brief."), ("user", "What is E?")))


def test_packaged_smollm2_rows_match_alone(smollm2: HFSampler) -> None:
    check_rows_match_alone(smollm2, mixed_rows(smollm2, 8))


@pytest.mark.parametrize(
    "item",
    [
        "hi", "", "é" * 40, "漢字 " * 20, "E equals ",
        SampleRequest(messages=(("user", "hi"),)),
        SampleRequest(messages=(("user", ""),)),
        SampleRequest(messages=(("tool", "x"),)),
        SampleRequest(messages=(("system", "be brief"), ("user", "漢字 " * 20),
                                ("assistant", "ok"), ("user", "again"))),
    ],
)  # fmt: skip
def test_a_budget_hold_bounds_the_prompt_tokens_the_packaged_model_charges(
    smollm2: HFSampler, item: str | SampleRequest
) -> None:
    """A budgeted request holds its prompt's bound (serving.submission): never fewer tokens
    than the worker charges, its chat template's default system turn included."""
    text = item if isinstance(item, str) else smollm2.render_chat(item.messages)
    assert smollm2.count_tokens(text) <= prompt_bound(item)
