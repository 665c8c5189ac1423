"""``dtrain tokenize --ray``: a local Ray cluster (a head and a worker node on 127.0.0.1, listening on nothing else)
writes the store a serial run writes, byte for byte, and resumes an interrupted run; a missing Ray or an address
that does not answer is one line at once."""

from __future__ import annotations

import filecmp
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dtrain.data import tokenize as tokenize_module
from dtrain.data.corpus import DataError
from dtrain.data.documents import enumerate_sources
from dtrain.data.token_store import MANIFEST, TokenStore
from dtrain.data.tokenize import JOURNAL, tokenize
from dtrain.data.tokenize_ray import LocalRayCluster, RayExecutor
from dtrain.data.tokenizer import ByteTokenizer, HFTokenizer, train_bpe

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 64  # ids per stored chunk: many chunks, most of them spanning several tasks' files
TASK_BYTES = 700  # source bytes per encode task: many tasks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def local_cluster() -> Iterator[LocalRayCluster]:
    """A Ray cluster of two nodes on this machine (one CPU each)."""
    with LocalRayCluster(object_store_bytes=80_000_000) as local:
        local.add_node()
        yield local


@pytest.fixture
def cluster(local_cluster: LocalRayCluster) -> str:
    """That cluster's head's address."""
    return local_cluster.address


def _session(pid: int) -> int:
    try:
        return os.getsid(pid)
    except OSError:  # it ended meanwhile
        return -1


def _listening(sessions: set[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket listened on by this process or one of ``sessions``' processes."""
    import psutil  # Ray's own dependency

    pids = {os.getpid()} | {p.pid for p in psutil.process_iter() if _session(p.pid) in sessions}
    return [(c.laddr.ip, c.laddr.port, c.pid) for c in psutil.net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.pid in pids]


def _corpus(root: Path) -> Path:
    """Files of every size (a few larger than a task), jsonl and text."""
    root.mkdir()
    rng = np.random.default_rng(7)
    words = ["data", "ray", "chunk", "token", "store", "ünïcode", "🙂", "of", "the", "a"]
    for i in range(30):
        docs = [" ".join(rng.choice(words, int(rng.integers(1, 60)))) for _ in range(int(rng.integers(1, 12)))]
        if i % 3:
            (root / f"{i:02d}.txt").write_text("\n".join(docs))
        else:
            (root / f"{i:02d}.jsonl").write_text("".join(f'{{"text": "{d}"}}\n' for d in docs))
    return root


def _same_store(a: Path, b: Path) -> None:
    """Two stores hold the same ids, document ends and manifest, and their files are the same bytes."""
    sa, sb = TokenStore.open(a), TokenStore.open(b)
    assert sa.manifest == sb.manifest and sa.manifest.tokens > 10 * CHUNK
    assert np.array_equal(sa.read(0, len(sa)), sb.read(0, len(sb)))
    assert np.array_equal(sa.doc_ends(), sb.doc_ends())
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert MANIFEST in {str(f) for f in files} and JOURNAL not in {str(f) for f in files}
    assert all(filecmp.cmp(a / f, b / f, shallow=False) for f in files)


@pytest.mark.slow
def test_a_ray_cluster_writes_the_serial_store_byte_for_byte(tmp_path: Path, cluster: str) -> None:
    root = _corpus(tmp_path / "c")
    bpe = train_bpe(enumerate_sources([root]), 300)
    serial, _ = tokenize([root], tmp_path / "serial", bpe, workers=1, chunk_tokens=CHUNK)
    seen: list[tuple[int, ...]] = []
    on_ray, stats = tokenize([root], tmp_path / "ray", bpe, executor=RayExecutor(cluster, task_bytes=TASK_BYTES),
                             chunk_tokens=CHUNK, progress=lambda *a: seen.append(a))
    assert on_ray == serial and stats.files == 30
    _same_store(tmp_path / "serial", tmp_path / "ray")
    assert seen[-1][0] == seen[-1][1] and seen[-1][2:] == (serial.documents, serial.tokens, 30, 30)
    # the byte tokenizer (uint16 ids of a 256 vocabulary, raw bytes) too
    tokenize([root], tmp_path / "serial-bytes", ByteTokenizer(), workers=1, chunk_tokens=CHUNK)
    tokenize([root], tmp_path / "ray-bytes", ByteTokenizer(), executor=RayExecutor(cluster, task_bytes=TASK_BYTES),
             chunk_tokens=CHUNK)
    _same_store(tmp_path / "serial-bytes", tmp_path / "ray-bytes")


@pytest.mark.slow
def test_the_cluster_and_its_driver_listen_on_loopback_only(tmp_path: Path, local_cluster: LocalRayCluster) -> None:
    """Both nodes are named 127.0.0.1, and after a run (workers on both nodes, this process joined as the driver)
    nothing the cluster started, nor the driver, listens on any other address."""
    import ray

    root = _corpus(tmp_path / "c")
    tokenize([root], tmp_path / "s", ByteTokenizer(), chunk_tokens=CHUNK,
             executor=RayExecutor(local_cluster.address, task_bytes=TASK_BYTES))
    alive = [n for n in ray.nodes() if n["Alive"]]
    assert len(alive) == 2 and {n["NodeManagerAddress"] for n in alive} == {"127.0.0.1"}
    listening = _listening({node.pid for node in local_cluster.nodes})
    names = {pid: _name(pid) for *_, pid in listening}
    assert {"gcs_server", "raylet"} <= set(names.values()) and len(names) >= 6, names  # and agents, workers, us
    assert os.getpid() in names  # the driver's own server
    assert {ip for ip, *_ in listening} <= {"127.0.0.1", "::ffff:127.0.0.1"}, listening


def _name(pid: int) -> str:
    import psutil

    try:
        return str(psutil.Process(pid).name())
    except psutil.Error:
        return "?"


@pytest.mark.slow
def test_an_interrupted_ray_run_resumes_to_the_serial_store(tmp_path: Path, cluster: str) -> None:
    """Stopped after a commit that falls inside a chunk, a second Ray run reads that chunk's committed head back
    from the store and goes on; a skipped bad file is counted the same way."""
    root = _corpus(tmp_path / "c")
    (root / "15.jsonl").write_text('{"text": oops}\n')  # a bad file, skipped
    serial, _ = tokenize([root], tmp_path / "serial", ByteTokenizer(), workers=1, chunk_tokens=CHUNK,
                         skip_bad=True)
    commits: list[tokenize_module.Journal] = []

    def stop(journal: tokenize_module.Journal) -> None:
        commits.append(journal)
        if journal.files_done >= 17:
            raise KeyboardInterrupt

    executor = RayExecutor(cluster, task_bytes=TASK_BYTES)
    with pytest.raises(KeyboardInterrupt):
        tokenize([root], tmp_path / "ray", ByteTokenizer(), executor=executor, chunk_tokens=CHUNK, skip_bad=True,
                 commit_every_s=0, on_commit=stop)
    assert commits[-1].tokens % CHUNK and len(commits[-1].skipped) == 1
    manifest, stats = tokenize([root], tmp_path / "ray", ByteTokenizer(), executor=executor, chunk_tokens=CHUNK,
                               skip_bad=True)
    assert manifest == serial and stats.resumed_files == commits[-1].files_done and len(stats.skipped) == 1
    _same_store(tmp_path / "serial", tmp_path / "ray")


def test_ray_that_is_missing_or_does_not_answer_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = _free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(DataError, match=rf"--ray 127.0.0.1:{port}: the Ray cluster's head did not answer"):
        RayExecutor(f"127.0.0.1:{port}").connect()
    with pytest.raises(DataError, match="not an address"):
        RayExecutor("nowhere").connect()
    assert time.monotonic() - t0 < 30  # not a retry loop of minutes (a loose bound: a shared machine)
    (tmp_path / "a.txt").write_text("some text")
    cli = subprocess.run([sys.executable, "-m", "dtrain_cli", "tokenize", str(tmp_path / "a.txt"), "--tokenizer",
                          "bytes", "--out", str(tmp_path / "s"), "--ray", f"127.0.0.1:{port}"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert cli.returncode == 1 and cli.stderr.strip().splitlines() == [
        f"dtrain tokenize: error: --ray 127.0.0.1:{port}: the Ray cluster's head did not answer (Connection "
        "refused): start it with `ray start --head`, or check the address"]
    assert not (tmp_path / "s").exists()  # refused before anything was written
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(DataError, match=r"--ray needs Ray, which is not installed here: pip install 'dtrain\[ray\]'"):
        RayExecutor(f"127.0.0.1:{port}").connect()


def test_hf_tokenizer_spec_round_trips_for_workers(tmp_path: Path) -> None:
    """What a Ray task is sent: the tokenizer's spec; the encoder it builds gives the driver's ids."""
    root = _corpus(tmp_path / "c")
    bpe = train_bpe(enumerate_sources([root]), 280)
    files = enumerate_sources([root])[:3]
    sent = tokenize_module.encode_files(bpe.spec(), [(str(f.path), f.kind, f.size) for f in files], "text")
    here = [tokenize_module._encode_file(bpe, f, "text") for f in files]
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(sent, here, strict=True))
    assert isinstance(bpe, HFTokenizer)
