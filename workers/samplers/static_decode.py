"""The decode loop of the transformers sampler on a static KV cache, each step replayed as a
CUDA graph that never waits for Python: the GPU path.

Why: `generate` in eager mode runs a decode step as hundreds of small kernels launched one by
one from Python, and reads every step's tokens back to the host. On a GPU the step then costs
the launches and the round trip, not the arithmetic, at any batch size. A CUDA graph launches
the whole step at once, but it needs every tensor the step touches at a fixed address and of
a fixed shape, and no host synchronisation inside the step.

How:
- Batch-size buckets (`GRAPH_BATCH_SIZES`): a call of n rows runs in the smallest bucket of at
  least n rows. The rows past n are filler (one pad token that attends to itself, ended at
  once), and their outputs are dropped. Rows never mix in a transformer.
- Each bucket has a transformers `StaticCache` of `capacity` positions and static buffers: each
  row's input token, position, settings, new tokens and whether it ended, and the 4D mask.
- A step is one function of those buffers (`_forward_and_choose`): the forward, then each
  row's token chosen on the device (argmax, or a draw from its seed and the step:
  workers.samplers.draws), recorded, and the ends of sequence and max tokens noted. It is
  captured whole, so a replay is a whole step.
- Attention over what the call holds (workers.samplers.attention): grouped-query attention
  without copied KV heads, over the narrowest width of `DECODE_WIDTHS` (or the capacity) that
  holds the call's prompt and new tokens. Each bucket has a graph per width, greedy and
  sampled; the prefill attends over the prompt alone.
- The host reads the new tokens in chunks that double from 1 to `CHUNK_STEPS` steps, copied
  while the next chunk runs (`_decode`). Stop strings, streams and the finish reasons are
  decided there, step by step as before (`RowEnds.observe_steps`), so streamed text and whole
  answers do not change. A call of 32 steps reads from the device 7 times.
- Capture: at start, for each bucket from the largest down, and each width and kind, one
  prefill, an eager step on a side stream (cuBLAS and the allocator settle), then the capture
  and a replay checked against the same step run eagerly. The graphs share one memory pool:
  they never run at the same time, and each keeps its own output alive.
- Only for models whose layers all attend to the whole context, with SDPA: anything else
  raises at construction, and the sampler stays eager.
- Without `graphs` the same steps run eagerly: the static-cache path on a CPU, and the
  reference the graphs are compared with.

Works with the transformers versions whose StaticCache counts its own positions (5.17 to
5.23); the cache is rewound to position 0 at the start of every call.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from workers.samplers.attention import grouped_attention_on
from workers.samplers.base import MAX_BATCH
from workers.samplers.draws import chosen_tokens
from workers.samplers.rows import RowEnds, RowSampling

log = logging.getLogger(__name__)

# The batch sizes a graph is captured for: a call pads its rows to the next one. Each bucket
# has its own cache, so their sum (221 rows) sets the cache's memory.
GRAPH_BATCH_SIZES: tuple[int, ...] = (1, 8, 16, 32, 64, MAX_BATCH)
# The cache widths a step attends over, with the capacity itself: a call takes the narrowest
# that holds its prompt and new tokens.
DECODE_WIDTHS: tuple[int, ...] = (64, 128, 256)
# The longest prompt, in tokens, a call on the static path takes (a longer one runs the call
# through eager `generate`): SAMPLING_CUDA_GRAPH_PROMPT_TOKENS's default.
DEFAULT_PROMPT_TOKENS = 512
# The most steps replayed between two reads of the new tokens (the chunks grow 1, 2, 4...).
CHUNK_STEPS = 8
# Eager steps run before a capture, on a side stream, as PyTorch's CUDA graph notes advise.
WARM_UP_STEPS = 2
# A capture's one-token prefill and its warm-up steps, and the check's two-token prefill and
# step, must fit the cache.
MIN_CAPACITY = 1 + WARM_UP_STEPS + 1


def bucket_for(rows: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds `rows` rows (or positions), or None when none does."""
    return min((size for size in buckets if size >= rows), default=None)


def decode_widths(capacity: int) -> list[int]:
    """The widths a cache of `capacity` positions is attended over: DECODE_WIDTHS below it,
    and the capacity."""
    return sorted({width for width in DECODE_WIDTHS if width < capacity} | {capacity})


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


def prefill_mask(valid: torch.Tensor) -> torch.Tensor:
    """The prefill's 4D boolean attention mask over the prompt's own positions, [rows, 1,
    length, length]: a real token attends to the real tokens at or before it; a pad position
    to itself alone (its output is never read, but it must not be NaN: it fills the cache)."""
    length = valid.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=valid.device).tril()
    itself = torch.eye(length, dtype=torch.bool, device=valid.device)
    return ((causal & valid[:, None, :]) | itself)[:, None]


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


def chunk_sizes() -> Iterator[int]:
    """1, 2, 4... up to CHUNK_STEPS, then CHUNK_STEPS for ever."""
    size = 1
    while True:
        yield size
        size = min(size * 2, CHUNK_STEPS)


@dataclass
class Bucket:
    """One batch size's cache, its step's buffers and (once captured) graphs."""

    rows: int
    cache: Any
    capacity: int
    device: torch.device

    def __post_init__(self) -> None:
        rows, device, long = self.rows, self.device, torch.long
        self.token = torch.zeros((rows, 1), dtype=long, device=device)  # the step's input
        self.position = torch.zeros((rows, 1), dtype=long, device=device)
        # Which cache positions a step attends to; one spare column for the last step's.
        self.mask = torch.zeros((rows, 1, 1, self.capacity + 1), dtype=torch.bool, device=device)
        self.step = torch.zeros(1, dtype=long, device=device)  # new tokens so far
        self.column = torch.zeros(1, dtype=long, device=device)  # the next input's cache slot
        self.new_tokens = torch.zeros((rows, self.capacity), dtype=long, device=device)
        self.ended = torch.zeros(rows, dtype=torch.bool, device=device)
        self.limits = torch.ones(rows, dtype=long, device=device)  # each row's max tokens
        self.greedy = torch.ones(rows, dtype=torch.bool, device=device)
        self.temperature = torch.ones((rows, 1), dtype=torch.float32, device=device)
        self.top_p = torch.ones((rows, 1), dtype=torch.float32, device=device)
        self.keys = torch.zeros((rows, 1), dtype=long, device=device)

    counters: list[torch.Tensor] = field(default_factory=list)
    # (width, sampled) -> (the graph, its logits output: [rows, vocabulary], float32)
    graphs: dict[tuple[int, bool], tuple[Any, torch.Tensor]] = field(default_factory=dict)

    def load(self, sampling: RowSampling, limits: list[int]) -> None:
        """The call's rows' settings; filler rows greedy, ended after one token."""
        count = len(limits)
        for buffer, value, rows in (
            (self.greedy, True, sampling.greedy),
            (self.temperature, 1.0, sampling.temperature),
            (self.top_p, 1.0, sampling.top_p),
            (self.keys, 0, sampling.keys),
            (self.limits, 1, torch.tensor(limits, device=self.device)),
        ):
            buffer.fill_(value)
            buffer[:count] = rows


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
        eos_ids: frozenset[int] = frozenset(),
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
        self.widths = decode_widths(capacity)
        self.device = next(model.parameters()).device
        self.graphs = graphs
        self.host_reads = 0  # copies of new tokens to the host: a test counts them per call
        started = time.perf_counter()
        self.buckets: dict[int, Bucket] = {}
        # Every tensor here is made and used under inference mode (an inference tensor may
        # not be changed in place outside it).
        with torch.inference_mode():
            # No end of sequence at all: a token id no vocabulary has.
            self.eos = torch.tensor(sorted(eos_ids) or [-1], dtype=torch.long, device=self.device)
            for rows in sorted(set(buckets), reverse=True):
                cache = StaticCache(config=model.config, max_cache_len=capacity)
                kinds = {type(layer).__name__ for layer in cache.layers}
                if any(type(layer) is not StaticLayer for layer in cache.layers):
                    raise ValueError(f"the static path needs full-attention layers, not {kinds}")
                self.buckets[rows] = Bucket(rows, cache, capacity, self.device)
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
        sampling: RowSampling,
        ends: RowEnds,
        max_new_tokens: int,
    ) -> list[list[int]]:
        """Each prompt's new tokens: up to `max_new_tokens`, fewer once every row has ended
        (`ends` then says where each row ended; the tokens past a row's end are filler)."""
        rows = len(prompts)
        length = max(len(prompt) for prompt in prompts)
        size = bucket_for(rows, list(self.buckets))
        if size is None or not self.fits(rows, length, max_new_tokens):
            raise ValueError(
                f"{rows} prompts of up to {length} tokens with {max_new_tokens} new tokens do "
                f"not fit buckets of {self.max_rows} rows and {self.capacity} positions"
            )
        bucket = self.buckets[size]
        width = bucket_for(length + max_new_tokens - 1, self.widths)
        assert width is not None  # the capacity holds every call that fits
        bucket.load(sampling, [settings.max_tokens for settings in ends.settings])
        with grouped_attention_on(self.model):
            logits = self._prefill(bucket, prompts)
            self._choose(bucket, logits, sampling.sampled)
            return self._decode(bucket, rows, width, sampling.sampled, ends, max_new_tokens)

    def _decode(
        self,
        bucket: Bucket,
        rows: int,
        width: int,
        sampled: bool,
        ends: RowEnds,
        max_new_tokens: int,
    ) -> list[list[int]]:
        """Replays steps in growing chunks; while one chunk runs, the host reads the one
        before and notes the rows' ends. Stops once every row has ended (the chunk then
        running is wasted) or at `max_new_tokens`."""
        tokens: list[list[int]] = [[] for _ in range(rows)]
        pending: deque[tuple[int, Any]] = deque()
        launched, copied, sizes = 1, 0, chunk_sizes()
        while True:
            if copied < launched:
                pending.append((copied, self._copy(bucket.new_tokens[:rows, copied:launched])))
                copied = launched
            if launched < max_new_tokens:
                count = min(next(sizes), max_new_tokens - launched)
                for _ in range(count):
                    self._step(bucket, width, sampled)
                launched += count
            first, handle = pending.popleft()
            for row, new in zip(tokens, self._read(handle), strict=True):
                row.extend(new)
            if ends.observe_steps(tokens, first + 1) or len(tokens[0]) == max_new_tokens:
                return tokens

    def _copy(self, tokens: torch.Tensor) -> Any:
        """Starts copying `tokens` to the host; `_read` waits for it."""
        if self.device.type != "cuda":
            return tokens.clone()
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done

    def _read(self, handle: Any) -> list[list[int]]:
        """The copied tokens, once there: the call's only waits for the device."""
        self.host_reads += 1
        if isinstance(handle, torch.Tensor):
            return handle.tolist()
        host, done = handle
        done.synchronize()
        return host.tolist()

    # --- the step ---------------------------------------------------------------------------

    def _prefill(self, bucket: Bucket, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Rewinds the bucket's cache, runs the prompts through it and sets the buffers for the
        first step; returns the logits of each row's last prompt token."""
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
            attention_mask=prefill_mask(real),
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
        bucket.step.zero_()
        bucket.column.fill_(length)
        bucket.ended.zero_()
        return output.logits[:, -1, :].float()

    def _choose(self, bucket: Bucket, logits: torch.Tensor, sampled: bool) -> None:
        """Each row's next token from `logits`, on the device: recorded, fed to the next step,
        and the rows at their end of sequence or max tokens noted (an ended row's later
        tokens are pad tokens)."""
        if sampled:
            tokens = chosen_tokens(
                logits, bucket.greedy, bucket.temperature, bucket.top_p, bucket.keys, bucket.step
            )
        else:
            tokens = logits.argmax(dim=-1)
        tokens = tokens.masked_fill(bucket.ended, self.pad_token_id)
        bucket.new_tokens.index_copy_(1, bucket.step, tokens[:, None])
        bucket.step.add_(1)
        at_end = (tokens[:, None] == self.eos).any(dim=-1) | (bucket.step >= bucket.limits)
        bucket.ended.logical_or_(at_end)
        bucket.token.copy_(tokens[:, None])
        bucket.position.add_(1)
        bucket.mask.index_fill_(3, bucket.column, True)
        bucket.column.add_(1)

    def _forward(self, bucket: Bucket, width: int) -> torch.Tensor:
        output = self.model(
            input_ids=bucket.token,
            attention_mask=bucket.mask[..., :width],
            position_ids=bucket.position,
            past_key_values=bucket.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return output.logits[:, -1, :].float()

    def _forward_and_choose(self, bucket: Bucket, width: int, sampled: bool) -> torch.Tensor:
        """One decode step from the buffers: what a graph captures."""
        logits = self._forward(bucket, width)
        self._choose(bucket, logits, sampled)
        return logits

    def _step(self, bucket: Bucket, width: int, sampled: bool) -> torch.Tensor:
        captured = bucket.graphs.get((width, sampled))
        if captured is None:
            return self._forward_and_choose(bucket, width, sampled)
        graph, logits = captured
        graph.replay()
        return logits

    # --- capture ---------------------------------------------------------------------------

    def _capture_all(self) -> None:
        if self.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device, not {self.device}")
        with torch.cuda.device(self.device), grouped_attention_on(self.model):
            pool = torch.cuda.graph_pool_handle()  # the capture stream is the current device's
            for sampled in (False, True):
                try:
                    for rows in sorted(self.buckets, reverse=True):  # the largest first
                        for width in reversed(self.widths):
                            self._capture(self.buckets[rows], width, sampled, pool)
                            self._check_replay(self.buckets[rows], width, sampled)
                except RuntimeError as exc:
                    if not sampled:
                        raise
                    # Greedy calls keep their graphs; a sampled call's steps run eagerly.
                    for bucket in self.buckets.values():
                        bucket.graphs = {
                            kind: g for kind, g in bucket.graphs.items() if not kind[1]
                        }
                    log.warning("the sampled steps' CUDA graphs failed (%s): they run eagerly", exc)
            torch.cuda.synchronize(self.device)

    def _capture(self, bucket: Bucket, width: int, sampled: bool, pool: Any) -> None:
        # A one-token prompt per row allocates the cache and sets the buffers.
        self._prefill(bucket, [[self.pad_token_id]] * bucket.rows)
        bucket.greedy.fill_(not sampled)
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(WARM_UP_STEPS):
                self._forward_and_choose(bucket, width, sampled)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the worker's other threads may touch CUDA meanwhile.
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            logits = self._forward_and_choose(bucket, width, sampled)
        bucket.graphs[(width, sampled)] = (graph, logits)

    def _check_replay(self, bucket: Bucket, width: int, sampled: bool) -> None:
        """One step replayed against the same step run eagerly, from the same prefill: a
        capture that recorded something else (a tensor it did not own, a value baked in)
        raises here, and the sampler falls back to eager `generate`. Not bit for bit: the
        kernels a capture records may use another cuBLAS workspace."""
        prompts = [[self.pad_token_id, self.pad_token_id]] * bucket.rows
        self._prefill(bucket, prompts)
        self._choose(bucket, self._forward(bucket, width), sampled)  # a first step, eagerly
        stepped = self._forward_and_choose(bucket, width, sampled).clone()
        self._prefill(bucket, prompts)
        self._choose(bucket, self._forward(bucket, width), sampled)
        replayed = self._step(bucket, width, sampled)
        if not torch.allclose(replayed, stepped, rtol=0.02, atol=0.25):
            error = (replayed - stepped).abs().max().item()
            raise RuntimeError(
                f"a replay of the {bucket.rows}-row, {width}-wide graph is off by {error:g}"
            )
