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

import copy  # noqa: E402
import importlib.util  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from dtrain.config.load import load_config  # noqa: E402
from dtrain.config.sections import Config, ModelConfig  # noqa: E402

if TYPE_CHECKING:
    from collections.abc import Iterator

    from dtrain.codec import Spec
    from fake_island import Island
    from service_helpers import JoinTwo, Running
    from workers.client import CoordinatorClient

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO_ROOT / "configs"
TINY = CONFIG_DIR / "tiny.toml"



def load_benchmark(name: str) -> ModuleType:
    """benchmarks/NAME.py as the module ``NAME_bench``, registered in sys.modules (its dataclasses look their module
    up there), loaded with benchmarks/ on the import path, as a script's own folder is (it imports its neighbour
    benchmarks/_common.py)."""
    folder = str(REPO_ROOT / "benchmarks")
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(f"{name}_bench", REPO_ROOT / "benchmarks" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(folder)


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


_SESSION_CACHE: Path | None = None


def pytest_configure(config: pytest.Config) -> None:
    """JAX's persistent compilation cache for this pytest process, in a fresh folder per session (removed at its
    end): many tests build the same program through a jit of their own (the tiny model's step, a probe, an
    eval), and JAX compiles each such jit again; with the cache the second and later load it. Only programs that
    took a second or more to compile are written (JAX's default). The worker processes tests start are not
    affected (JAX's settings are this process's): they keep their own caches (see ``compile_cache`` below)."""
    global _SESSION_CACHE
    import jax

    _SESSION_CACHE = Path(tempfile.mkdtemp(prefix="dtrain-test-jax-cache-"))
    jax.config.update("jax_compilation_cache_dir", str(_SESSION_CACHE))


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SESSION_CACHE is not None:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


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


@pytest.fixture(scope="module")
def island() -> Island:
    """configs/tiny.toml on the 8 fake CPU devices (tests/fake_island.py), built once per test module: its loops
    and probes compile once for all of the module's tests."""
    from fake_island import Island  # imports JAX and builds the model: only the modules that ask for it

    isl = Island()
    assert len(isl.ids) == 8
    return isl


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One JAX persistent compilation cache for the session's worker processes, as the override
    ``worker.compile_cache=FOLDER``: a process whose programs an earlier test's process compiled (the same config,
    the same devices) loads them instead of compiling them, seconds of a process test each. Only for tests that do
    not count cache hits or misses (tests/test_startup.py and the restart in tests/test_simulate_processes.py keep
    their own fresh caches) and whose timing is not tuned to a start-up that compiles (test_faults_runs.py's lost-shard
    test, whose kills are timed by versions, keeps its run's own)."""
    return f"worker.compile_cache={tmp_path_factory.mktemp('compile-cache')}"


@pytest.fixture(scope="session")
def text_bytes() -> bytes:
    return make_text(120_000)


@pytest.fixture
def text_corpus(tmp_path: Path, text_bytes: bytes) -> Path:
    """A 120 kB deterministic text file (byte-level corpus) in tmp_path."""
    path = tmp_path / "corpus.txt"
    path.write_bytes(text_bytes)
    return path


# θ_0 per (model, seed), shared by the whole session. The coordinator computes θ_0 in a child process
# (coordinator/init_params.py: it imports JAX and builds the model, seconds per call); the service tests start
# a coordinator per test, all from the same few configs. test_init_params.py checks the real child path on its own,
# against the model built in this process, and that its spec-only answer is the full one's spec.
_THETA0: dict[tuple[ModelConfig, int], tuple[np.ndarray, Spec]] = {}


def _theta0(cfg: Config) -> tuple[np.ndarray, Spec]:
    key = (cfg.model, cfg.run.seed)  # the only inputs of coordinator/init_params.py
    if key not in _THETA0:
        from coordinator.lifecycle import initial_parameters as computed_in_a_child

        _THETA0[key] = computed_in_a_child(cfg)
    return _THETA0[key]


def initial_parameters(cfg: Config) -> tuple[np.ndarray, Spec]:
    """``coordinator.lifecycle.initial_parameters(cfg)``, computed once per (``cfg.model``, ``cfg.run.seed``) in
    this session. Every caller gets its own copy of θ_0 and of the spec."""
    theta, spec = _theta0(cfg)
    return theta.copy(), copy.deepcopy(spec)


def initial_spec(cfg: Config) -> Spec:
    """The spec of ``cfg``'s parameter tree, as ``initial_parameters_file(..., spec_only=True)`` gives it (what
    a resuming coordinator starts from), from the same shared computation."""
    return copy.deepcopy(_theta0(cfg)[1])


# -- a real in-process coordinator's fixtures (tests/service_helpers.py has the helpers) ------------------------

@pytest.fixture
def net_cfg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Config:
    """configs/tiny.toml for a coordinator on 127.0.0.1:0 and two islands: 40 steps, rounds of 10, small chunks."""
    monkeypatch.delenv("DTRAIN_TOKEN", raising=False)
    return load_config(TINY, [
        f"run.out_dir={tmp_path}", "coordinator.port=0", "coordinator.grace_s=60", "coordinator.lease_s=30",
        "outer.islands=2", "train.steps=40", "outer.inner_steps=10", "worker.heartbeat_s=0.5",
        "codec.chunk_bytes=4096", "coordinator.max_message_bytes=65536", "worker.retry_total_s=1"])


@pytest.fixture
def coordinator(net_cfg: Config, tmp_path: Path) -> Iterator[Running]:
    """A coordinator on 127.0.0.1:0 in this process, with ``net_cfg``; stopped at the test's end."""
    from service_helpers import Running  # it imports this module: only when a test asks for it

    running = Running(net_cfg, tmp_path / "coord")
    yield running
    running.stop()


@pytest.fixture
def two_islands() -> Iterator[JoinTwo]:
    """``two_islands(address, cfg, names=("a", "b"))``: two clients of the coordinator at ``address``, joined as
    islands ``names`` (one CPU device each), as ((client, client), (join, join)); closed at the test's end."""
    from service_helpers import join_island
    from workers.client import CoordinatorClient

    opened: list[CoordinatorClient] = []

    def join_two(address: str, cfg, names: tuple[str, str] = ("a", "b")):
        clients = (CoordinatorClient(address, cfg), CoordinatorClient(address, cfg))
        opened.extend(clients)
        return clients, (join_island(clients[0], names[0]), join_island(clients[1], names[1]))

    yield join_two
    for c in opened:
        c.close()


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A test CA, a server certificate for localhost/127.0.0.1, a client certificate, and a rogue CA and client
    (mutual TLS must refuse them), made with openssl once per module."""
    d = tmp_path_factory.mktemp("certs")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=dtrain-test-ca", cwd=d)
    for name, ext in (("server", "subjectAltName=DNS:localhost,IP:127.0.0.1"), ("client", "")):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)
        extfile = d / f"{name}.ext"
        extfile.write_text((ext or "basicConstraints=CA:FALSE") + "\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", str(extfile), cwd=d)
    # A second, untrusted CA and client: mutual TLS must refuse it.
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "rogue.key", "-out", "rogue.pem",
             "-days", "2", "-subj", "/CN=rogue", cwd=d)
    return d
