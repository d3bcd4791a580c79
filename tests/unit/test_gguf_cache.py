"""The GGUF conversion cache's rules, on stand-ins for transformers' objects: converted once,
read from its copy after, converted again when the copy is damaged, the file changed or the
cache is off, and a cache that cannot be written costs only time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from workers.samplers import gguf_cache


class Converted:
    """What transformers' from_pretrained returns, as far as the cache uses it."""

    def __init__(self, text: str) -> None:
        self.text = text

    def save_pretrained(self, folder: Path) -> None:
        Path(folder, "weights.txt").write_text(self.text)


class Loads:
    """Counts conversions (reads of the GGUF file) and reads of a copy."""

    def __init__(self, text: str = "weights") -> None:
        self.text = text
        self.converted = 0
        self.copied = 0

    def convert(self) -> Converted:
        self.converted += 1
        return Converted(self.text)

    def load_copy(self, folder: Path) -> Converted:
        self.copied += 1
        return Converted(Path(folder, "weights.txt").read_text())

    def __call__(self, gguf: Path, part: str = "float32") -> str:
        loaded = gguf_cache.load_converted(gguf, part, self.convert, self.load_copy)
        return str(loaded.text)


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("SAMPLING_MODEL_CACHE", str(folder))
    return folder


def test_a_file_is_converted_once_and_read_from_its_copy_after(gguf: Path, cache: Path) -> None:
    loads = Loads()
    assert [loads(gguf), loads(gguf), loads(gguf)] == ["weights"] * 3
    assert (loads.converted, loads.copied) == (1, 2)
    assert [path.name for path in cache.glob("*/*")] == ["float32"]
    assert not list(cache.glob("*/.*"))  # no staging folder left behind


def test_each_part_and_dtype_has_its_own_copy(gguf: Path, cache: Path) -> None:
    loads = Loads()
    for part in ("tokenizer", "float32", "bfloat16", "float32"):
        loads(gguf, part)
    assert (loads.converted, loads.copied) == (3, 1)


def test_a_changed_file_is_converted_again(gguf: Path, cache: Path) -> None:
    loads = Loads()
    loads(gguf)
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    loads(gguf)
    assert loads.converted == 2


def test_a_damaged_copy_is_converted_again_and_replaced(gguf: Path, cache: Path) -> None:
    Loads()(gguf)
    (copy,) = cache.glob("*/float32")
    (copy / "weights.txt").unlink()  # half a copy: its load raises
    loads = Loads("fresh")
    assert loads(gguf) == "fresh"
    assert (copy / "weights.txt").read_text() == "fresh"
    assert loads(gguf) == "fresh"
    assert (loads.converted, loads.copied) == (1, 2)  # the damaged copy's read, then the new


def test_the_cache_off_converts_every_time(
    gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SAMPLING_MODEL_CACHE", "off")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    loads = Loads()
    loads(gguf)
    loads(gguf)
    assert loads.converted == 2
    assert not (tmp_path / "home").exists()


def test_the_default_folder_is_the_user_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SAMPLING_MODEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert gguf_cache.cache_root() == tmp_path / "sampling-service" / "gguf"


def test_a_cache_that_cannot_be_written_only_costs_time(
    gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("SAMPLING_MODEL_CACHE", str(blocker / "cache"))
    loads = Loads()
    assert [loads(gguf), loads(gguf)] == ["weights", "weights"]
    assert loads.converted == 2
    assert "not kept" in caplog.text


def test_a_copy_that_landed_first_is_kept(gguf: Path, cache: Path) -> None:
    """Two workers converted at once: the second's rename fails, the first's copy stays."""
    first = Loads("first")
    first(gguf)
    (copy,) = cache.glob("*/float32")
    second = Loads("second")
    converted = second.convert()
    gguf_cache._save(converted, copy)
    assert (copy / "weights.txt").read_text() == "first"
    assert not list(cache.glob("*/.*"))


def test_a_copy_that_cannot_be_saved_only_costs_time(
    gguf: Path, cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A conversion that refuses to be saved (transformers' own check, a full disk) is still
    the load's result, and leaves no staging folder."""

    class Unsaveable(Converted):
        def save_pretrained(self, folder: Path) -> None:
            Path(folder, "weights.txt").write_text("half")
            raise ValueError("not serializable")

    loaded = gguf_cache.load_converted(gguf, "float32", lambda: Unsaveable("w"), Loads().load_copy)
    assert loaded.text == "w"
    assert "not kept" in caplog.text
    assert [path.name for path in cache.glob("*/*")] == []
