"""GGUF files converted once: a `.gguf` model's tokenizer and weights, saved as transformers
writes them (tokenizer.json, safetensors) the first time a worker loads it, and read from there
after. Reading a GGUF file converts its vocabulary to a fast tokenizer and dequantizes its
weights in Python: the packaged SmolLM2 takes about 40 s on a 2-core CPU, its saved copy 1-2 s.

SAMPLING_MODEL_CACHE names the folder (default: ~/.cache/sampling-service/gguf, or under
XDG_CACHE_HOME); `off` turns the cache off. A copy is kept per GGUF file (its path, size and
modification time), transformers version and, for the weights, dtype: a changed file or
library converts again. A copy is written to a temporary folder and renamed into place, so two
workers that convert at once never read half a copy; a copy that fails to load is removed and
the GGUF file read again. A folder that cannot be written only costs the time it would save.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from config.env import env_str

log = logging.getLogger(__name__)

OFF = "off"


def cache_root() -> Path | None:
    """SAMPLING_MODEL_CACHE's folder; None when it is `off`."""
    configured = env_str("SAMPLING_MODEL_CACHE", "").strip()
    if configured.lower() == OFF:
        return None
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sampling-service" / "gguf"


def copy_folder(gguf: Path, part: str) -> Path | None:
    """Where the converted `part` ("tokenizer", or a dtype's weights) of `gguf` is kept."""
    import transformers

    root = cache_root()
    if root is None:
        return None
    stat = gguf.stat()
    identity = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:20]
    return root / f"{gguf.stem}-{digest}" / part


def load_converted(
    gguf: Path, part: str, convert: Callable[[], Any], load_copy: Callable[[Path], Any]
) -> Any:
    """`part` of `gguf`: from its saved copy when there is one (`load_copy(folder)`), else
    `convert()` (reading the GGUF file), saved for the next load."""
    folder = copy_folder(gguf, part)
    if folder is None:
        return convert()
    if folder.is_dir():
        try:
            return load_copy(folder)
        except Exception:  # noqa: BLE001 - a damaged copy: converted again below
            log.warning("the saved copy %s did not load: converting %s again", folder, gguf)
            shutil.rmtree(folder, ignore_errors=True)
    converted = convert()
    _save(converted, folder)
    return converted


def _save(converted: Any, folder: Path) -> None:
    """`converted.save_pretrained` into `folder`, through a temporary folder beside it."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    except OSError as exc:
        log.warning("GGUF conversions are not kept (%s): every load converts again", exc)
        return
    try:
        _save_plain(converted, staging)
        staging.rename(folder)  # atomic; another worker's copy may have landed first
    except Exception as exc:  # noqa: BLE001 - a copy not kept must not fail the load
        if not folder.is_dir():
            log.warning("GGUF conversion not kept in %s: %s", folder, exc)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _save_plain(converted: Any, folder: Path) -> None:
    """save_pretrained, for a GGUF model too: transformers marks one loaded from GGUF as
    quantized and refuses to save it, though its weights were dequantized as they loaded."""
    quantizer = getattr(converted, "hf_quantizer", None)
    config: Any = getattr(converted, "config", None)
    quantization = getattr(config, "quantization_config", None)
    if quantizer is not None:
        converted.hf_quantizer = None
    if quantization is not None:
        del config.quantization_config
    try:
        converted.save_pretrained(folder)
    finally:
        if quantizer is not None:
            converted.hf_quantizer = quantizer
        if quantization is not None:
            config.quantization_config = quantization
