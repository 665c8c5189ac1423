"""Shared fixtures. JAX runs on the CPU, split into 8 fake devices.

The environment is set here, at import time, before any test module (or
dtrain module) imports JAX: XLA reads XLA_FLAGS once, when the backend starts.
"""

from __future__ import annotations

import os

_DEVICES_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _DEVICES_FLAG).strip()
os.environ["JAX_PLATFORMS"] = "cpu"

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from dtrain.config import Config, load_config  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO_ROOT / "configs"
TINY = CONFIG_DIR / "tiny.toml"

_WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
          "they you were her she there been one all we their has would when if so no will what can out more up "
          "model train step loss data island round merge delta token batch shard window cursor epoch").split()


def make_text(n_bytes: int, seed: int = 0) -> bytes:
    """Deterministic pseudo-English: words from a small list, sentences, newlines. Learnable, not random."""
    rng = np.random.default_rng(seed)
    out: list[str] = []
    size = 0
    while size < n_bytes:
        n = int(rng.integers(4, 12))
        words = [_WORDS[int(i)] for i in rng.zipf(1.3, size=n) % len(_WORDS)]
        sentence = " ".join(words).capitalize() + (".\n" if rng.random() < 0.3 else ". ")
        out.append(sentence)
        size += len(sentence)
    return "".join(out).encode()[:n_bytes]


def tiny_overrides(out_dir: Path | str, *extra: str) -> list[str]:
    return [f"run.out_dir={out_dir}", *extra]


@pytest.fixture
def tmp_out(tmp_path: Path) -> list[str]:
    """``--set`` overrides that put runs under this test's tmp_path (never under the repo's runs/)."""
    return tiny_overrides(tmp_path / "runs")


@pytest.fixture
def tiny_cfg(tmp_out: list[str]) -> Config:
    """configs/tiny.toml with its runs under tmp_path."""
    return load_config(TINY, tmp_out)


@pytest.fixture(scope="session")
def text_bytes() -> bytes:
    return make_text(120_000)


@pytest.fixture
def text_corpus(tmp_path: Path, text_bytes: bytes) -> Path:
    """A 120 kB deterministic text file (byte-level corpus) in tmp_path."""
    path = tmp_path / "corpus.txt"
    path.write_bytes(text_bytes)
    return path
