"""The transformers sampler's static-cache path on CPU: the same decode loop the CUDA graphs
replay on a GPU, with its steps run eagerly. What it generates must be what `generate` does,
row by row; the choice between the two paths and the fallback are tested here too. The
graphs themselves need a GPU: tests/gpu."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from batching.generation import Completion, Row, RowSettings
from devstack.stack import ROOT
from tests.integration.test_hf_sampler import MIXED_PROMPTS, check_rows_match_alone, mixed_rows
from tests.support.tiny_model import build_tiny_model
from tests.support.worker import worker_output_at_exit
from workers.samplers.base import GenerationSettings, PromptRejected
from workers.samplers.hf import CudaGraphsUnavailable, HFSampler

# 37 prompts of 1 to about 30 tokens: every bucket boundary below is crossed by some size.
PROMPTS = [f"{MIXED_PROMPTS[i % len(MIXED_PROMPTS)]} {'and then ' * (i % 7)}{i}" for i in range(37)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-static"))


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> HFSampler:
    return HFSampler(str(tiny_dir), GenerationSettings(max_new_tokens=8), device="cpu")


@contextmanager
def static_path(sampler: HFSampler, buckets: tuple[int, ...] | None = None) -> Iterator[None]:
    """The sampler on static caches (steps run eagerly) inside the block, eager after."""
    if buckets is None:
        assert sampler.use_static_cache(graphs=False)
    else:
        sampler.decoder = sampler.static_decoder(graphs=False, buckets=buckets)
    try:
        yield
    finally:
        sampler.decoder = None


def eager_and_static(sampler: HFSampler, prompts: list[str]) -> tuple[list, list]:
    assert sampler.decoder is None
    eager = sampler.batched_sample(prompts)
    with static_path(sampler):
        static = sampler.batched_sample(prompts)
    return eager, static


@pytest.mark.parametrize("size", [1, 2, 8, 9, 37])
def test_the_static_path_writes_what_generate_writes(tiny: HFSampler, size: int) -> None:
    eager, static = eager_and_static(tiny, PROMPTS[:size])
    assert static == eager
    assert all(isinstance(text, str) and text for text in static)


def test_a_bucket_of_100_serves_37_prompts_as_each_alone(tiny: HFSampler) -> None:
    prompts = PROMPTS[:37]
    eager = tiny.batched_sample(prompts)
    with static_path(tiny, buckets=(100,)):
        assert list(tiny.decoder.buckets) == [100]  # type: ignore[union-attr]
        batched = tiny.batched_sample(prompts)
        alone = [tiny.batched_sample([prompt])[0] for prompt in prompts]
    assert batched == alone == eager


def test_each_row_keeps_its_own_settings_on_the_static_path(tiny: HFSampler) -> None:
    rows = mixed_rows(tiny, 8)
    eager = tiny.batched_complete(rows)
    with static_path(tiny):
        completions = check_rows_match_alone(tiny, rows)
    # Greedy and seeded rows draw the same tokens on both paths.
    assert completions == eager


def test_a_too_long_prompt_is_still_rejected_alone(tiny: HFSampler) -> None:
    too_long = "word " * 200
    with static_path(tiny):
        short, rejected = tiny.batched_sample(["E equals ", too_long])
    assert isinstance(short, str)
    assert isinstance(rejected, PromptRejected)
    assert short == tiny.batched_sample(["E equals "])[0]


def test_a_prompt_past_the_bound_runs_eagerly_and_says_so_once(
    tiny_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sampler = HFSampler(
        str(tiny_dir), GenerationSettings(max_new_tokens=8), "cpu", graph_prompt_tokens=6
    )
    short, long = "E equals ", MIXED_PROMPTS[3]
    assert (
        len(sampler.tokenizer(long)["input_ids"]) > 6 >= len(sampler.tokenizer(short)["input_ids"])
    )
    expected = sampler.batched_sample([short, long])
    with static_path(sampler), caplog.at_level(logging.WARNING, "workers.samplers.hf"):
        assert sampler.decoder is not None
        assert sampler.decoder.capacity == 6 + 8 - 1
        caplog.clear()
        assert sampler.batched_sample([short]) == expected[:1]  # on the static path: no log
        assert not caplog.records
        assert sampler.batched_sample([short, long]) == expected
        assert sampler.batched_sample([long]) == expected[1:]
    notes = [r.getMessage() for r in caplog.records if "ran with eager generate" in r.message]
    assert len(notes) == 1, notes
    assert "SAMPLING_CUDA_GRAPH_PROMPT_TOKENS" in notes[0]
    assert "up to 6 tokens" in notes[0]


def test_more_new_tokens_make_the_caches_again_longer(tiny_dir: Path) -> None:
    sampler = HFSampler(
        str(tiny_dir), GenerationSettings(max_new_tokens=4), "cpu", graph_prompt_tokens=16
    )
    with static_path(sampler):
        first = sampler.decoder
        assert first is not None
        assert first.capacity == 16 + 4 - 1
        sampler.configure(GenerationSettings(max_new_tokens=12))
        second = sampler.decoder
        assert second is not None
        assert second is not first
        assert second.capacity == 16 + 12 - 1
        assert not second.graphs
        longer = sampler.batched_sample(PROMPTS[:9])
        sampler.configure(GenerationSettings(max_new_tokens=6))  # shorter: the caches stay
        assert sampler.decoder is second
    sampler.configure(GenerationSettings(max_new_tokens=12))
    assert longer == sampler.batched_sample(PROMPTS[:9])


def test_a_failed_capture_falls_back_to_generate_with_a_warning(
    tiny: HFSampler, caplog: pytest.LogCaptureFixture
) -> None:
    # auto on a CPU: eager generate, nothing captured.
    assert tiny.cuda_graphs == "auto"
    assert tiny.decoder is None
    expected = tiny.batched_sample(PROMPTS[:3])
    # A capture on a CPU fails for real (there is no CUDA): the sampler stays on generate.
    with caplog.at_level(logging.WARNING, "workers.samplers.hf"):
        assert tiny.use_static_cache(graphs=True) is False
    assert tiny.decoder is None
    [warning] = [r for r in caplog.records if "CUDA graph capture failed" in r.message]
    assert warning.levelno == logging.WARNING
    assert "eager generate" in warning.getMessage()
    assert "SAMPLING_CUDA_GRAPHS=off" in warning.getMessage()
    assert tiny.batched_sample(PROMPTS[:3]) == expected


def other_model(tiny_dir: Path, kind: str) -> Any:
    """The tiny model with eager attention, or a tiny sliding-window model (Mistral's)."""
    import torch
    from transformers import AutoModelForCausalLM, MistralConfig

    if kind == "eager attention":
        return AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="eager")
    config = MistralConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=16,
        max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(
    ("kind", "reason"),
    [("eager attention", "needs SDPA attention"), ("sliding window", "needs full-attention")],
)
def test_a_model_the_static_path_cannot_serve_stays_on_generate(
    tiny_dir: Path, tiny: HFSampler, kind: str, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    sampler = HFSampler(
        kind, GenerationSettings(max_new_tokens=8), "cpu",
        preloaded=(tiny.tokenizer, other_model(tiny_dir, kind)),
    )  # fmt: skip
    expected = sampler.batched_sample(PROMPTS[:3])
    with caplog.at_level(logging.WARNING, "workers.samplers.hf"):
        assert sampler.use_static_cache(graphs=False) is False
    assert sampler.decoder is None
    [warning] = [r for r in caplog.records if "capture failed" in r.message]
    assert reason in warning.getMessage()
    assert sampler.batched_sample(PROMPTS[:3]) == expected


def test_graphs_on_without_a_gpu_refuses_to_start(tiny_dir: Path) -> None:
    with pytest.raises(
        CudaGraphsUnavailable, match="needs a CUDA device, and this worker's is cpu"
    ):
        HFSampler(str(tiny_dir), device="cpu", cuda_graphs="on")
    with pytest.raises(ValueError, match="must be one of"):
        HFSampler(str(tiny_dir), device="cpu", cuda_graphs="always")


def test_a_worker_told_graphs_on_without_a_gpu_exits_saying_why(
    redis_url: str, tiny_dir: Path
) -> None:
    """SAMPLING_CUDA_GRAPHS reaches the sampler from the worker's settings."""
    status, output = worker_output_at_exit(
        redis_url, "graphs-on", SAMPLER="hf", SAMPLING_MODEL=str(tiny_dir),
        SAMPLING_CUDA_GRAPHS="on", CUDA_VISIBLE_DEVICES="",
    )  # fmt: skip
    assert status != 0, output[-2000:]
    assert "the sampler could not be loaded, exiting" in output
    assert "SAMPLING_CUDA_GRAPHS=on needs a CUDA device" in output


def test_packaged_smollm2_writes_the_same_on_the_static_path(smollm2: HFSampler) -> None:
    if smollm2.device != "cpu":
        pytest.skip(
            f"smollm2 is on {smollm2.device} in {smollm2.dtype}, on CUDA graphs: tests/gpu "
            "compares them with eager generate there, in float32 (bf16 rounds other shapes "
            "differently)"
        )
    eager, static = eager_and_static(smollm2, MIXED_PROMPTS)
    assert static == eager
    assert "Paris" in str(
        eager_and_static(smollm2, ["The capital of France is"])[1][0]
    )  # fmt: skip
    rows = [
        Row(MIXED_PROMPTS[0], RowSettings(max_tokens=8)),
        Row(MIXED_PROMPTS[2], RowSettings(max_tokens=5, temperature=0.7, seed=3)),
        Row(MIXED_PROMPTS[4], RowSettings(max_tokens=8, stop=("\n",))),
    ]
    eager_rows = smollm2.batched_complete(rows)
    with static_path(smollm2):
        static_rows = smollm2.batched_complete(rows)
    assert static_rows == eager_rows
    assert all(isinstance(c, Completion) for c in static_rows)


def table_rows(stdout: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in stdout.splitlines()
        if line.startswith("| ")
    ]


def test_the_model_benchmark_compares_eager_with_the_static_path(tiny_dir: Path) -> None:
    """python -m bench sampler --graphs both on a CPU: eager generate against the static
    cache's steps run eagerly, one table per number of new tokens, prompts spread over a
    range of tokens."""
    command = [sys.executable, "-m", "bench", "sampler", "--model", str(tiny_dir), "--device"]
    command += ["cpu", "--sizes", "1,3", "--repeats", "1", "--graphs", "both"]
    command += ["--max-new-tokens", "4,8", "--prompt-tokens", "5-30"]
    output = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert "prompts of 5 to 30 tokens" in output
    rows = table_rows(output)
    heads = [row for row in rows if row[0] == "batch size"]
    assert len(heads) == 2  # 4 and 8 new tokens
    assert heads[0][1:] == [
        "eager: call", "completions/s", "throughput vs batch 1",
        "static: call", "completions/s", "throughput vs batch 1", "static speed-up",
    ]  # fmt: skip
    sizes = [row[0] for row in rows if row[0] != "batch size"]
    assert sizes == ["1", "3", "1", "3"]
    for row in rows:
        if row[0] != "batch size":
            assert row[1].endswith(" ms")
            assert row[4].endswith(" ms")
            assert float(row[7].removesuffix("x")) > 0


def test_the_model_benchmark_builds_an_architecture_with_random_weights() -> None:
    command = [sys.executable, "-m", "bench", "sampler", "--arch", "smollm2-135m", "--device"]
    command += ["cpu", "--sizes", "1", "--repeats", "1", "--max-new-tokens", "2"]
    command += ["--prompt-tokens", "20-20"]
    output = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=180, check=True
    ).stdout
    assert "model smollm2-135m (random weights) on cpu" in output
    assert "prompts of 20 to 20 tokens" in output
    [_, row] = table_rows(output)
    assert row[0] == "1"


def cut_call(sampler: HFSampler, cut: bool) -> tuple[int, list[Completion | PromptRejected], int]:
    """A call of 100 rows: 10 of up to 4 new tokens, 90 streams of up to 8 whose clients
    leave at their first text when `cut`. Its decode steps, its answers, and the last step at
    which a cut stream first had text (what its cut waits for)."""
    live = [Row(f"{PROMPTS[i]} live", RowSettings(max_tokens=4)) for i in range(10)]
    streams = [Row(f"{PROMPTS[i % 37]} cut {i}", RowSettings(max_tokens=8), stream=True)
               for i in range(90)]  # fmt: skip
    first_text: dict[int, int] = {}

    def sink(row: int, text: str, tokens: tuple[int, int] | None = None) -> bool:
        assert tokens is not None
        first_text.setdefault(row, tokens[1])
        return cut

    answers = sampler.batched_complete(live + streams, sink=sink)
    return sampler.last_steps, answers, max(first_text.values(), default=0)


@pytest.mark.parametrize("path", ["eager", "static"])
def test_a_call_whose_streams_were_cut_ends_with_its_live_rows(tiny: HFSampler, path: str) -> None:
    """90 of 100 rows cut after their first text: the call runs the steps its 10 live rows
    need (or until the last cut stream's first text), not the cut rows' 8. The decode steps
    are counted, not timed."""
    with static_path(tiny) if path == "static" else contextlib.nullcontext():
        whole, answers, _ = cut_call(tiny, cut=False)
        steps, cut_answers, last_first_text = cut_call(tiny, cut=True)
    live_steps = max(a.completion_tokens for a in answers[:10] if isinstance(a, Completion))
    assert whole == 8  # random weights: no row ends before its max tokens
    assert steps == max(live_steps, last_first_text) < whole
    assert cut_answers[:10] == answers[:10]  # the live rows' answers are what they were
