"""An embedding on its way from a worker to a client: float32, little-endian, base64, which
is also what OpenAI's `encoding_format: "base64"` returns. An embedder's answer for an item
is this text, so an embedding travels through the batches' results as a completion does;
the web process hands it over as is (base64) or as floats.

Django- and model-free: workers encode, web processes decode.
"""

from __future__ import annotations

import base64
import math
from array import array
from collections.abc import Sequence

# OpenAI's bound on `dimensions`; a model's own length may be lower (the worker refuses more).
MAX_DIMENSIONS = 65536


def normalized(vector: Sequence[float]) -> list[float]:
    """`vector` scaled to length 1 (a zero vector stays zero)."""
    norm = math.sqrt(math.fsum(x * x for x in vector))
    return [x / norm for x in vector] if norm else [0.0] * len(vector)


def shortened(vector: Sequence[float], dimensions: int | None) -> list[float]:
    """The first `dimensions` values, normalized again (OpenAI's `dimensions`); None: all."""
    if dimensions is None or dimensions >= len(vector):
        return list(vector)
    return normalized(vector[:dimensions])


def encode(vector: Sequence[float]) -> str:
    values = array("f", vector)
    if values.itemsize != 4:  # pragma: no cover - every platform Python runs on
        raise RuntimeError("float32 is not 4 bytes here")
    if array("H", [1]).tobytes() != b"\x01\x00":  # big-endian host: little-endian on the wire
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")


def decode(text: str) -> list[float]:
    values = array("f")
    values.frombytes(base64.b64decode(text))
    if array("H", [1]).tobytes() != b"\x01\x00":
        values.byteswap()
    return values.tolist()
