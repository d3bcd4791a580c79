"""What a batch is made of, and what its callers get back: an item as a pending list holds it
(one codec: `item_of` writes it, `parse_item` reads it), a request's ticket, a sealed batch,
and the batches' ids."""

from __future__ import annotations

import itertools
import os
import secrets
from dataclasses import dataclass, field, replace
from typing import Any

from batching.generation import SampleRequest

# The mark at the end of a streaming item's head.
STREAMING = "!"
STREAMING_BYTES = STREAMING.encode()
# Between an item's expiry and its request's whole deadline. A web process writes the
# deadline only while every live worker reads it (batching.registry.LiveWorkers).
DEADLINE_MARK = "~"
DEADLINE_MARK_BYTES = DEADLINE_MARK.encode()


@dataclass(frozen=True)
class Ticket:
    """A request's place in a batch, or its refusal by admission control."""

    batch_id: str
    index: int
    opened: bool
    rejected: bool = False
    predicted_ms: int = 0
    counted: int = 0  # the rate counter after this request (0: none was raised)
    cached: bytes | None = None  # the answer from the response cache (no batch joined)
    lane: int = 0  # the lane (tier priority) of the batch joined


@dataclass(frozen=True)
class Joined:
    """A request's items appended in one call (BatchAggregator.append_items): a ticket per
    item, and its rate counter after the request's raise (0: none raised); or `limited`, the
    request refused by its key's limit (nothing appended), with the counter it found."""

    tickets: list[Ticket]
    counted: int = 0
    limited: bool = False

    @staticmethod
    def of_reply(reply: list[Any], lane: int) -> Joined:
        """The tickets of append_items.lua's reply (four values an item after two)."""
        counted = int(reply[0])
        fields = [iter(reply[2:])] * 4
        tickets = []
        for bid, at, opener, cached in zip(*fields, strict=True):
            ticket = Ticket(bid.decode(), int(at), bool(opener), counted=counted, lane=lane)
            tickets.append(replace(ticket, cached=cached) if cached else ticket)
        return Joined(tickets, counted)


@dataclass(frozen=True)
class Item:
    expires_at_ms: int  # when its request's deadline passes, by the Redis node's clock
    prompt: str  # a /sample request's prompt ("" for a request with its own settings)
    request: SampleRequest | None = None  # the prompt and settings of an API request
    key_id: int = 0  # the API key it was sent with (0: anonymous), charged its tokens
    cache: str = ""  # the digest its answer is cached under (batching.cache), "" for none
    stream: bool = False  # its request streams: its new text is published as it is sampled
    # Its request's whole deadline (ms), counted from its arrival: the arrival is
    # `expires_at_ms - request_deadline_ms`. 0: not carried (see item_of).
    request_deadline_ms: int = 0

    def arrived_at_ms(self, policy_deadline_ms: int) -> int:
        """When its request arrived, by the Redis node's clock; an older web process's item
        says nothing of its deadline, and the policy's (`policy_deadline_ms`) stands in."""
        return self.expires_at_ms - (self.request_deadline_ms or policy_deadline_ms)


@dataclass(frozen=True)
class SealedBatch:
    now_ms: int
    opened_at_ms: int  # -1: no record of its opening (sealed already, or expired)
    items: list[Item]
    # Batches of the shard due for a hand-over, taken by this seal: the sealer sends their
    # tasks again.
    handovers: list[str] = field(default_factory=list)
    # The batch sealed, whose members wait for these items' answers: the task's own, or the
    # batch of a higher lane it chose ("": none, every batch of the shard sealed already).
    batch_id: str = ""
    lane: int = -1
    # Backfill items the seal took into the places left (raw: batching.backfill reads them),
    # and how many the shard's lane still holds.
    backfill: list[bytes] = field(default_factory=list)
    backfill_left: int = 0

    @staticmethod
    def of_reply(raw: list[Any]) -> SealedBatch:
        """What seal.lua replied."""
        handed = int(raw[4])
        backfilled, left = int(raw[5 + handed]), int(raw[6 + handed])
        end = len(raw) - backfilled
        return SealedBatch(
            int(raw[0]),
            int(raw[1]),
            [parse_item(item) for item in raw[7 + handed : end]],
            [due.decode() for due in raw[5 : 5 + handed]],
            raw[2].decode(),
            int(raw[3]),
            list(raw[end:]),
            left,
        )

    @property
    def sealed_before(self) -> bool:
        """Nothing to answer: the task's batch was sealed by an earlier task (a duplicate sent
        by a hand-over), or it expired, and the shard had no other batch waiting, nor any
        backfill item."""
        return not self.batch_id and not self.items and not self.backfill


def item_of(
    expires_at_ms: int,
    prompt: str | SampleRequest,
    key_id: int = 0,
    cache: str = "",
    stream: bool = False,
    deadline_ms: int = 0,
) -> str:
    """An item as a pending list holds it: when it expires (Redis ms), then DEADLINE_MARK and
    its request's whole deadline (ms; left out when 0), and for a keyed request "/<key id>",
    and for a request whose answer is to be cached "/<key id>/<digest>", and for a streaming
    request STREAMING; then a space and the bare prompt of a /sample request (the queue's
    settings), or a colon and a request's JSON. (The head starts with the expiry's digits:
    batching/lua/seal.lua reads them.)"""
    expires_at_ms, deadline_ms = int(expires_at_ms), int(deadline_ms)
    expiry = f"{expires_at_ms}{DEADLINE_MARK}{deadline_ms}" if deadline_ms else str(expires_at_ms)
    head = f"{expiry}/{key_id}" if key_id or cache else expiry
    if cache:
        head += f"/{cache}"
    if stream:
        head += STREAMING
    if isinstance(prompt, str):
        return f"{head} {prompt}"
    return f"{head}:{prompt.to_json()}"


def parse_item(raw: bytes) -> Item:
    """The item that `item_of` wrote."""
    space, colon = raw.find(b" "), raw.find(b":")
    sample = colon < 0 or 0 <= space < colon  # the head is followed by one of the two
    end = space if sample else colon
    head = raw[:end]
    stream = head.endswith(STREAMING_BYTES)
    expiry, _, rest = (head[:-1] if stream else head).partition(b"/")
    expires, _, whole = expiry.partition(DEADLINE_MARK_BYTES)
    key, _, digest = rest.partition(b"/")
    key_id, cache = int(key) if key else 0, digest.decode()
    deadline_ms = int(whole) if whole else 0
    if sample:
        prompt = raw[space + 1 :].decode("utf-8")
        return Item(int(expires), prompt, None, key_id, cache, stream, deadline_ms)
    request = SampleRequest.from_json(raw[colon + 1 :])
    return Item(int(expires), "", request, key_id, cache, stream, deadline_ms)


class BatchIds:
    """Unique batch ids without uuid4's os.urandom call per request (~4% of a /sample's CPU):
    96 random bits per process, then a counter. Drawn again in a forked child, which would
    otherwise repeat its parent's ids."""

    def __init__(self) -> None:
        self._pid = -1
        self._prefix = ""
        self._count = itertools.count()

    def next(self) -> str:
        if os.getpid() != self._pid:
            self._pid, self._prefix = os.getpid(), secrets.token_hex(12)
            self._count = itertools.count()
        return f"{self._prefix}{next(self._count):x}"
