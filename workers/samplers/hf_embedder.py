"""SAMPLER=hf-embedder: a transformers model's mean-pooled last hidden state as an embedding.

For the default, the packaged SmolLM2-135M-Instruct (the same GGUF file the generator
serves): 576 values, the mean of its last layer's hidden states over the text's tokens,
normalized to length 1. What that is good for, and what not: it is a plain way to turn a
decoder into an embedder, good enough for near-duplicate detection, clustering and a demo of
the service's embeddings path; it was never trained for retrieval, so its similarities are
well below those of a trained embedding model (an E5, BGE or GTE) for search. Serve one of
those with SAMPLING_MODEL (any model `AutoModelForCausalLM` or its base model loads) when
quality matters.

A batch is right-padded with its attention mask, and the mean is taken over each text's own
tokens, so a text's vector does not depend on what shares its batch (in float32 on a CPU, to
rounding; a GPU's kernels for another batch shape round differently in bf16).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from workers.samplers.embedder import Embedder
from workers.samplers.hf import FALLBACK_CONTEXT_TOKENS
from workers.samplers.hf_source import (
    ModelSource,
    choose_device,
    choose_dtype,
    load_pretrained,
    resolve_model,
)

log = logging.getLogger(__name__)


class HFEmbedder(Embedder):
    def __init__(
        self,
        model: str = "",
        device: str = "",
        dtype: str = "",
        preloaded: tuple[Any, Any] | None = None,
    ) -> None:
        """`preloaded`: a (tokenizer, model) already loaded (a generator's, in the tests),
        used as is: its tokenizer is not changed."""
        import torch

        self._torch = torch
        self.source = ModelSource(model) if preloaded else resolve_model(model)
        self.device = choose_device(device)
        self.dtype = choose_dtype(self.device, dtype)
        self.name = f"hf-embedder:{self.source.label}"
        started = time.perf_counter()
        tokenizer, network = preloaded or load_pretrained(self.source, self.dtype)
        self.model = network.to(self.device).eval()
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token or tokenizer.convert_ids_to_tokens(0)
        self.tokenizer = tokenizer
        self.dimensions = int(self.model.config.hidden_size)
        limit = getattr(self.model.config, "max_position_embeddings", None)
        self.context_tokens = int(limit or FALLBACK_CONTEXT_TOKENS)
        log.info(
            "embedder %s loaded on %s in %.1f s: %d dimensions, %d-token context",
            self.source.label, self.device, time.perf_counter() - started,
            self.dimensions, self.context_tokens,
        )  # fmt: skip

    def embed(self, texts: list[str]) -> list[Sequence[float]]:
        torch = self._torch
        batch: Any = self.tokenizer(
            texts,
            padding=True,
            padding_side="right",  # the mean needs no position of the text's own shifted
            truncation=True,
            max_length=self.context_tokens,
            return_tensors="pt",
        ).to(self.device)
        with torch.inference_mode():
            output = self.model(**batch, output_hidden_states=True)
        hidden = output.hidden_states[-1].float()
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        means = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        unit = torch.nn.functional.normalize(means, dim=-1)
        return [row.tolist() for row in unit.cpu()]

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
