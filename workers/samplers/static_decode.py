"""The decode loop of the transformers sampler on a static KV cache, each step replayed as a
CUDA graph: the GPU path.

Why: `generate` in eager mode runs a decode step as hundreds of small kernels launched one by
one from Python (SmolLM2-135M: 30 layers of a dozen kernels each), a few microseconds of
arithmetic each. On a GPU the step then costs the launches, not the arithmetic, at any batch
size. A CUDA graph launches the whole step at once, but it needs every tensor the step touches
at a fixed address and of a fixed shape, and no host synchronisation inside the step.

How:
- Batch-size buckets (`GRAPH_BATCH_SIZES`): a call of n rows runs in the smallest bucket of at
  least n rows. The rows past n are filler (one pad token that attends to itself), and their
  outputs are dropped. Rows never mix in a transformer, so filler cannot change a real row.
- Each bucket has a transformers `StaticCache` of `capacity` positions (the prompt bound plus
  the queue's max new tokens) and static buffers: the step's input token and position per row,
  and the 4D attention mask over the cache. The mask is built here, not by transformers: a 4D
  mask passes through transformers' mask code untouched, so the step holds no data-dependent
  Python and can be captured.
- A call: the left-padded prompts are prefilled eagerly (one forward, of the call's own
  length). Then, per step: the logits become tokens (`RowSampling`, then argmax, as `generate`
  does), `RowEnds` checks the rows' ends (one copy to the host), and the token, its position
  and one more mask column are written into the buffers before the step is replayed. A row's
  tokens are therefore chosen exactly as in `generate`, from the same per-row settings.
- Capture: at start, for each bucket from the largest down, one prefill (which allocates the
  cache), two eager steps on a side stream (cuBLAS and the allocator settle), then the
  capture, then one replay checked against the same step run eagerly. The graphs share one
  memory pool: they never run at the same time, and each keeps its own output alive.
- Only for models whose layers all attend to the whole context, with SDPA (the mask is a
  boolean one for it): anything else raises at construction, and the sampler stays eager.
- Without `graphs` the same steps run eagerly: the static-cache path on a CPU, and the
  reference the graphs are compared with.

Works with the transformers versions whose StaticCache counts its own positions (5.17 to
5.23); the cache is rewound to position 0 at the start of every call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from workers.samplers.base import MAX_BATCH
from workers.samplers.rows import RowEnds

log = logging.getLogger(__name__)

# The batch sizes a graph is captured for: a call pads its rows to the next one. Each bucket
# has its own cache, so their sum (221 rows) sets the cache's memory.
GRAPH_BATCH_SIZES: tuple[int, ...] = (1, 8, 16, 32, 64, MAX_BATCH)
# The longest prompt, in tokens, a call on the static path takes (a longer one runs the call
# through eager `generate`): SAMPLING_CUDA_GRAPH_PROMPT_TOKENS's default.
DEFAULT_PROMPT_TOKENS = 512
# Eager steps run before a capture, on a side stream, as PyTorch's CUDA graph notes advise.
WARM_UP_STEPS = 2
# A capture's one-token prefill and its warm-up steps, and the check's two-token prefill and
# step, must fit the cache.
MIN_CAPACITY = 1 + WARM_UP_STEPS + 1

# Picks the tokens of one step: (the rows' tokens so far, their float32 logits) -> scores.
ScoreProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def bucket_for(rows: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds `rows` rows, or None when none does."""
    return min((size for size in buckets if size >= rows), default=None)


def left_padded(
    prompts: Sequence[Sequence[int]], rows: int, pad_token_id: int
) -> tuple[list[list[int]], list[list[bool]]]:
    """The prompts as `rows` rows of equal length, padded on the left, and which positions
    hold a real token. Rows past the prompts are filler: pad tokens with only the last
    position real, so that no query of theirs attends to nothing (a fully masked row of
    attention is NaN in some kernels)."""
    length = max(len(prompt) for prompt in prompts)
    ids: list[list[int]] = []
    valid: list[list[bool]] = []
    for prompt in prompts:
        padding = length - len(prompt)
        ids.append([pad_token_id] * padding + list(prompt))
        valid.append([False] * padding + [True] * len(prompt))
    for _ in range(rows - len(prompts)):
        ids.append([pad_token_id] * length)
        valid.append([False] * (length - 1) + [True])
    return ids, valid


def prefill_mask(valid: torch.Tensor, capacity: int) -> torch.Tensor:
    """The prefill's 4D boolean attention mask over the whole cache, [rows, 1, length,
    capacity]: a real token attends to the real tokens at or before it; a pad position to
    itself alone (its output is never read, but it must not be NaN: it fills the cache)."""
    rows, length = valid.shape
    causal = torch.ones(length, length, dtype=torch.bool, device=valid.device).tril()
    itself = torch.eye(length, dtype=torch.bool, device=valid.device)
    mask = torch.zeros(rows, 1, length, capacity, dtype=torch.bool, device=valid.device)
    mask[:, 0, :, :length] = (causal & valid[:, None, :]) | itself
    return mask


def prompt_positions(valid: torch.Tensor) -> torch.Tensor:
    """Each token's position in its own prompt, as `generate` numbers a left-padded batch:
    0 from the first real token on; pad positions get 0 too (they are masked)."""
    positions = valid.long().cumsum(-1) - 1
    return positions.masked_fill_(~valid, 0)


def cache_counters(cache: Any) -> list[torch.Tensor]:
    """The cache layers' position counters, where a StaticCache keeps them as tensors (so they
    can be rewound in place, where a captured step reads them); empty where it does not."""
    counters = [getattr(layer, "cumulative_length", None) for layer in getattr(cache, "layers", ())]
    if counters and all(isinstance(counter, torch.Tensor) for counter in counters):
        return counters
    return []


@dataclass
class Bucket:
    """One batch size's cache, input buffers and (once captured) graph."""

    rows: int
    cache: Any
    token: torch.Tensor  # [rows, 1]: the step's input token
    position: torch.Tensor  # [rows, 1]: its position in its row
    mask: torch.Tensor  # [rows, 1, 1, capacity]: which cache positions the step attends to
    counters: list[torch.Tensor] = field(default_factory=list)
    graph: Any = None
    logits: torch.Tensor | None = None  # the graph's output: [rows, vocabulary], float32


class StaticDecoder:
    """Generates for up to max(buckets) rows on static caches, each step a CUDA graph replay
    when `graphs` (on a CUDA device), else the same step run eagerly."""

    def __init__(
        self,
        model: Any,
        pad_token_id: int,
        capacity: int,
        buckets: Sequence[int] = GRAPH_BATCH_SIZES,
        graphs: bool = False,
    ) -> None:
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        # The mask built here is a boolean one for SDPA: another attention would add it as
        # numbers (eager attention) or ignore it. Sliding-window layers keep positions of
        # their own that a rewind does not reach.
        attention = getattr(model.config, "_attn_implementation", None)
        if attention != "sdpa":
            raise ValueError(f"the static path needs SDPA attention; this model has {attention}")
        if not buckets or min(buckets) < 1:
            raise ValueError(f"batch-size buckets must be positive, got {list(buckets)}")
        if capacity < MIN_CAPACITY:
            raise ValueError(
                f"a static cache needs at least {MIN_CAPACITY} positions, got {capacity}"
            )
        self.model = model
        self.pad_token_id = pad_token_id
        self.capacity = capacity
        self.device = next(model.parameters()).device
        self.graphs = graphs
        started = time.perf_counter()
        self.buckets: dict[int, Bucket] = {}
        # Every tensor here is made and used under inference mode (an inference tensor may
        # not be changed in place outside it).
        with torch.inference_mode():
            for rows in sorted(set(buckets), reverse=True):
                cache = StaticCache(config=model.config, max_cache_len=capacity)
                kinds = {type(layer).__name__ for layer in cache.layers}
                if any(type(layer) is not StaticLayer for layer in cache.layers):
                    raise ValueError(f"the static path needs full-attention layers, not {kinds}")
                self.buckets[rows] = Bucket(
                    rows=rows,
                    cache=cache,
                    token=torch.full((rows, 1), pad_token_id, dtype=torch.long, device=self.device),
                    position=torch.zeros((rows, 1), dtype=torch.long, device=self.device),
                    mask=torch.zeros((rows, 1, 1, capacity), dtype=torch.bool, device=self.device),
                )
            if graphs:
                self._capture_all()
        self.ready_s = time.perf_counter() - started

    @property
    def max_rows(self) -> int:
        return max(self.buckets)

    def fits(self, rows: int, prompt_length: int, max_new_tokens: int) -> bool:
        """Whether a call of `rows` prompts padded to `prompt_length` tokens, generating up to
        `max_new_tokens`, runs here. The last token is chosen without a forward, so the cache
        holds the prompt and all new tokens but the last."""
        return rows <= self.max_rows and prompt_length <= self.max_prompt_tokens(max_new_tokens)

    def max_prompt_tokens(self, max_new_tokens: int) -> int:
        """The longest prompt a call with `max_new_tokens` takes here."""
        return self.capacity - max_new_tokens + 1

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        processor: ScoreProcessor,
        ends: RowEnds,
        max_new_tokens: int,
    ) -> list[list[int]]:
        """Each prompt's new tokens: up to `max_new_tokens`, fewer once every row has ended
        (`ends` then says where each row ended)."""
        rows = len(prompts)
        length = max(len(prompt) for prompt in prompts)
        size = bucket_for(rows, list(self.buckets))
        if size is None or not self.fits(rows, length, max_new_tokens):
            raise ValueError(
                f"{rows} prompts of up to {length} tokens with {max_new_tokens} new tokens do "
                f"not fit buckets of {self.max_rows} rows and {self.capacity} positions"
            )
        bucket = self.buckets[size]
        logits, prompt_ids = self._prefill(bucket, prompts)
        sequences = torch.empty(
            (rows, length + max_new_tokens), dtype=torch.long, device=self.device
        )
        sequences[:, :length] = prompt_ids[:rows]
        generated = 0
        while True:
            scores = processor(sequences[:, : length + generated], logits[:rows])
            tokens = scores.argmax(dim=-1)
            sequences[:, length + generated] = tokens
            generated += 1
            if ends.observe(sequences[:, : length + generated]) or generated == max_new_tokens:
                break
            # The next step's input: the token just chosen, one position on, and the slot
            # it is written to (length + generated - 1) opened in the mask.
            bucket.token[:rows, 0] = tokens
            bucket.position.add_(1)
            bucket.mask[:, 0, 0, length + generated - 1] = True
            logits = self._step(bucket)
        return sequences[:, length : length + generated].tolist()

    # --- the forward passes ---------------------------------------------------------------

    def _prefill(
        self, bucket: Bucket, prompts: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rewinds the bucket's cache, runs the prompts through it and sets the buffers for the
        first step; returns the logits of each row's last prompt token and the padded ids."""
        ids, valid = left_padded(prompts, bucket.rows, self.pad_token_id)
        prompt_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        real = torch.tensor(valid, dtype=torch.bool, device=self.device)
        positions = prompt_positions(real)
        if bucket.counters:
            torch._foreach_zero_(bucket.counters)
        else:  # the first call, or a cache that keeps no counters: zero the whole cache
            bucket.cache.reset()
        output = self.model(
            input_ids=prompt_ids,
            attention_mask=prefill_mask(real, self.capacity),
            position_ids=positions,
            past_key_values=bucket.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        if not bucket.counters:  # allocated with the cache by its first update
            bucket.counters = cache_counters(bucket.cache)
        length = prompt_ids.shape[1]
        bucket.mask.zero_()
        bucket.mask[:, 0, 0, :length] = real
        # The last column is real in every row (left padding): the next position follows it.
        bucket.position.copy_(positions[:, -1:])
        return output.logits[:, -1, :].float(), prompt_ids

    def _forward_step(self, bucket: Bucket) -> torch.Tensor:
        """One decode step from the buffers: what a graph captures."""
        output = self.model(
            input_ids=bucket.token,
            attention_mask=bucket.mask,
            position_ids=bucket.position,
            past_key_values=bucket.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return output.logits[:, -1, :].float()

    def _step(self, bucket: Bucket) -> torch.Tensor:
        if bucket.graph is None:
            return self._forward_step(bucket)
        bucket.graph.replay()
        assert bucket.logits is not None
        return bucket.logits

    # --- capture ---------------------------------------------------------------------------

    def _capture_all(self) -> None:
        if self.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device, not {self.device}")
        with torch.cuda.device(self.device):  # the capture stream is the current device's
            pool = torch.cuda.graph_pool_handle()
            for rows in sorted(self.buckets, reverse=True):  # the largest first, one pool
                self._capture(self.buckets[rows], pool)
                self._check_replay(self.buckets[rows])
            torch.cuda.synchronize(self.device)

    def _capture(self, bucket: Bucket, pool: Any) -> None:
        # A one-token prompt per row allocates the cache and sets the buffers.
        self._prefill(bucket, [[self.pad_token_id]] * bucket.rows)
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(WARM_UP_STEPS):
                self._forward_step(bucket)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the worker's other threads may touch CUDA meanwhile.
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            logits = self._forward_step(bucket)
        bucket.graph, bucket.logits = graph, logits

    def _check_replay(self, bucket: Bucket) -> None:
        """One step replayed against the same step run eagerly, from the same prefill: a
        capture that recorded something else (a tensor it did not own, a value baked in)
        raises here, and the sampler falls back to eager `generate`. Not bit for bit: the
        kernels a capture records may use another cuBLAS workspace."""
        prompts = [[self.pad_token_id, self.pad_token_id]] * bucket.rows
        self._prefill(bucket, prompts)
        bucket.position.add_(1)
        bucket.mask[:, 0, 0, 2] = True
        stepped = self._forward_step(bucket).clone()
        self._prefill(bucket, prompts)
        bucket.position.add_(1)
        bucket.mask[:, 0, 0, 2] = True
        replayed = self._step(bucket)
        if not torch.allclose(replayed, stepped, rtol=0.02, atol=0.25):
            error = (replayed - stepped).abs().max().item()
            raise RuntimeError(f"a replay of the {bucket.rows}-row graph is off by {error:g}")
