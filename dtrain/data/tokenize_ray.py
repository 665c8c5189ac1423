"""Tokenizing on a Ray cluster (``dtrain tokenize --ray ADDRESS``): an executor for
:func:`dtrain.data.tokenize.tokenize`.

The files are cut into ranges of about :data:`TASK_BYTES` (whole files, in store order). An **encode** task per range
runs the one encoder (:func:`dtrain.data.tokenize.encode_files`) on a node of the cluster and keeps the ids there,
in Ray's object store; the driver is sent only each file's counts. Once the counts of the ranges before it are known,
so is where a range's ids go, and a **place** task writes them into the store: range ``r`` owns the stored chunks
that *start* inside its ids (the first range also the chunk a resumed run stopped in), so every chunk is written
whole by exactly one task, however the ranges fall, and no two tasks touch the same chunk. A place task fetches
the ranges its chunks span (its own and, for its last chunk, the head of the next ones) from the object store of
whichever node holds them, never through the driver; the document ends are placed the same way.

The driver grows the arrays ahead of the place tasks (:meth:`~dtrain.data.token_store.StoreWriter.reserve`) and,
once every range up to a file is placed, hands the file to :func:`~dtrain.data.tokenize.tokenize` as
:class:`~dtrain.data.tokenize.Placed`: its loop then counts it, reads its ids back for the digest (one sequential
read of the store, the only part that does not spread), writes the journal, and shows progress over the whole
cluster. The store is the one a serial run writes, byte for byte; a killed run resumes from the journal as
always. The store's folder and the sources must be at the same path on every node (a shared filesystem).

Ray is imported only here, when an executor connects: ``pip install 'dtrain[ray]'``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dtrain.data.documents import SourceFile
from dtrain.data.token_store import DOC_ENDS, TOKENS, DataError, StoreWriter, writable_array
from dtrain.data.tokenize import Encoded, Placed, encode_files
from dtrain.data.tokenizer import Tokenizer

TASK_BYTES = 64 << 20  # source bytes per encode task (whole files: a bigger file is a task of its own)
CONNECT_TIMEOUT_S = 5.0  # the address must answer a TCP connect within this
WINDOW_PER_CPU = 2  # encode tasks in flight per CPU of the cluster (their ids wait in the object store)
CANCEL_WAIT_S = 60.0  # a run that stops waits this long for its cancelled tasks to end
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's local-only mode (see _local_only)
# `ray start` joining a node to a local-only cluster. In that mode the command refuses a second node; outside it,
# it names a node given as 127.0.0.1 by this machine's interface address and binds every interface. This runs it
# with the refusal lifted and the node's address kept; every process it starts inherits the mode from the
# environment. (Ray 2.x's private names: with a Ray that lacks them the node fails to start, its log's tail in the
# DataError.)
_JOIN_LOCAL_ONLY = (
    "import sys\n"
    "from ray._private import ray_constants, services\n"
    "ray_constants.ENABLE_RAY_CLUSTER = True\n"
    "services.get_node_ip_address = lambda address=None: '127.0.0.1'\n"
    "from ray.scripts.scripts import main\n"
    "sys.argv[0] = 'ray'\n"
    "sys.exit(main())\n")

log = logging.getLogger(__name__)


def _ceil(n: int, chunk: int) -> int:
    return -(-n // chunk) * chunk


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _local_only() -> None:
    """Ray's local-only mode in this process, a driver of a cluster whose head is on this machine's loopback:
    Ray then uses a 127.0.0.1 address as it is. Outside it Ray replaces 127.0.0.1 by this machine's interface
    address, where a head that listens on loopback only (:class:`LocalRayCluster`'s) is not found."""
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


@dataclass
class _Range:
    """One encode task's files and, once its counts are back, where its ids and document ends go."""

    files: list[SourceFile]
    meta: Any = None  # the ObjectRef of its counts
    data: Any = None  # the ObjectRef of its (ids, lengths), in the object store of the node that encoded it
    start: int = 0  # its first id's position in the store
    doc_start: int = 0
    counts: list[tuple[int, int, str]] = field(default_factory=list)  # (tokens, documents, error) per file

    @property
    def stop(self) -> int:
        return self.start + sum(t for t, _, _ in self.counts)

    @property
    def doc_stop(self) -> int:
        return self.doc_start + sum(d for _, d, _ in self.counts)


def _encode_range(spec: tuple[str, str, int], files: list[tuple[str, str, int]],
                  field_name: str) -> tuple[list[tuple[int, int, str]], tuple[np.ndarray, np.ndarray]]:
    """An encode task: the range's counts per file (for the driver) and its ids and lengths (kept on the node)."""
    encoded: list[Encoded] = encode_files(spec, files, field_name)
    counts = [(int(ids.size), int(lengths.size), error) for ids, lengths, error in encoded]
    good = [(ids, lengths) for ids, lengths, error in encoded if not error]
    dtype = good[0][0].dtype if good else np.dtype(np.uint8)
    ids = np.concatenate([g[0] for g in good]) if good else np.zeros(0, dtype)
    lengths = np.concatenate([g[1] for g in good]) if good else np.zeros(0, np.int64)
    return counts, (ids, lengths)


def _place(path: str, span: tuple[int, int], doc_span: tuple[int, int], resumed: tuple[int, int],
           pieces: list[tuple[int, int, Any]]) -> None:
    """A place task: writes ids ``span`` and document ends ``doc_span`` of the store at ``path`` (whole chunks,
    the last one short only at the store's end) from ``pieces``, each (first id's position, first document's
    index, the ObjectRef of a range's ids and lengths). Below ``resumed`` (ids, documents) the store holds what
    an interrupted run committed: that part of a chunk is read from it."""
    import ray

    datas = ray.get([ref for _, _, ref in pieces])
    for (lo, hi), (at, name, which) in [(span, (resumed[0], TOKENS, 0)), (doc_span, (resumed[1], DOC_ENDS, 1))]:
        if hi <= lo:
            continue
        array = writable_array(path, name)
        parts = [np.asarray(array[lo:at].read().result())] if lo < at else []
        pos = max(lo, at)
        for (start, doc_start, _), (ids, lengths) in zip(pieces, datas, strict=True):
            if which == 0:
                values, first = ids, start
            else:
                values, first = start + np.cumsum(lengths, dtype=np.uint64), doc_start
            a, b = max(pos, first), min(hi, first + values.size)
            if a < b and a == pos:
                parts.append(values[a - first:b - first])
                pos = b
        if pos != hi:
            raise DataError(f"token store {path}: placing [{lo}, {hi}) of {name.rstrip('/')} found ids up to {pos} "
                            "only (a bug: please report it)")
        data = np.concatenate(parts).astype(array.dtype.numpy_dtype, copy=False)
        array[lo:hi].write(data).result()


class RayExecutor:
    """Encodes and places a run's files on the Ray cluster at ``address`` (``HOST:PORT`` of its head, ``auto``,
    or ``ray://HOST:PORT``); see the module's docstring. ``task_bytes``: source bytes per encode task."""

    def __init__(self, address: str, task_bytes: int = TASK_BYTES):
        self.address, self.task_bytes = address, task_bytes

    def connect(self) -> Any:
        """Imports Ray and joins the cluster (DataError in one line: Ray not installed, or the address not
        answering within :data:`CONNECT_TIMEOUT_S`); returns the ray module."""
        try:
            import ray
        except ImportError:
            raise DataError("--ray needs Ray, which is not installed here: pip install 'dtrain[ray]'") from None
        if self.address != "auto":
            parsed = urllib.parse.urlparse(self.address if "://" in self.address else f"tcp://{self.address}")
            try:
                host, port = parsed.hostname, parsed.port
            except ValueError:
                host, port = None, None
            if not host or not port:
                raise DataError(f"--ray {self.address}: not an address (HOST:PORT of the cluster's head, "
                                "ray://HOST:PORT, or auto)")
            try:
                socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
            except OSError as e:
                raise DataError(f"--ray {self.address}: the Ray cluster's head did not answer "
                                f"({e.strerror or e}): start it with `ray start --head`, or check the "
                                "address") from None
            if _loopback(host):
                _local_only()
        if not ray.is_initialized():
            ray.init(address=self.address, logging_level=logging.WARNING, log_to_driver=False,
                     configure_logging=False)
        return ray

    def __call__(self, files: Sequence[SourceFile], tokenizer: Tokenizer, field_name: str,
                 writer: StoreWriter) -> Generator[Encoded | Placed, None, None]:
        if not files:
            return
        ray = self.connect()
        tasks: list[Any] = []  # every task sent, so that none outlives the run (it would write behind a resume)
        try:
            yield from self._run(ray, files, tokenizer, field_name, writer, tasks)
        except ray.exceptions.RayError as e:
            raise DataError(f"a Ray task failed ({str(e).strip().splitlines()[-1]}); what was committed is kept: "
                            "run the same command again to continue") from None
        finally:
            pending = ray.wait(tasks, num_returns=len(tasks), timeout=0)[1] if tasks else []
            for task in pending:
                ray.cancel(task)
            if pending:  # a cancelled place task stops between its chunk writes (each atomic): wait for them to end
                ray.wait(pending, num_returns=len(pending), timeout=CANCEL_WAIT_S)

    def _ranges(self, files: Sequence[SourceFile]) -> list[_Range]:
        ranges: list[_Range] = []
        size = self.task_bytes
        for source in files:
            if size >= self.task_bytes:
                ranges.append(_Range([]))
                size = 0
            ranges[-1].files.append(source)
            size += source.size
        return ranges

    def _run(self, ray: Any, files: Sequence[SourceFile], tokenizer: Tokenizer, field_name: str,
             writer: StoreWriter, tasks: list[Any]) -> Generator[Placed, None, None]:
        encode = ray.remote(num_cpus=1)(_encode_range).options(num_returns=2)
        place = ray.remote(num_cpus=1)(_place)
        ranges = self._ranges(files)
        spec = ray.put(tokenizer.spec())
        window = max(1, WINDOW_PER_CPU * int(ray.cluster_resources().get("CPU", 1)))
        resumed = (writer.tokens, writer.documents)
        chunk, path = writer.chunk, str(writer.path.resolve())
        log.info("tokenizing on the Ray cluster at %s: %d tasks over %d files, %s CPUs", self.address, len(ranges),
                 len(files), window // WINDOW_PER_CPU)
        submitted = known = placed = released = 0  # ranges sent; with counts back; placed; data let go (prefixes)
        placing: list[Any] = []  # the place task of each range from `placed` on, in order
        while placed < len(ranges):
            # More encoding while fewer than `window` await their counts, and the unplaced stay bounded (unless
            # the next place task waits on ranges not yet sent: its chunk spans many small ranges).
            while submitted < len(ranges) and submitted - known < window and (
                    submitted - placed < 4 * window or not placing):
                r = ranges[submitted]
                r.meta, r.data = encode.remote(spec, [(str(f.path.resolve()), f.kind, f.size) for f in r.files],
                                               field_name)
                tasks.append(r.meta)
                submitted += 1
            waiting = ([ranges[known].meta] if known < submitted else []) + placing[:1]
            if waiting:
                ray.wait(waiting, num_returns=1)
            while known < submitted and ray.wait([ranges[known].meta], timeout=0)[0]:
                r = ranges[known]
                r.counts = ray.get(r.meta)
                r.start = ranges[known - 1].stop if known else resumed[0]
                r.doc_start = ranges[known - 1].doc_stop if known else resumed[1]
                known += 1
            while placed + len(placing) < known:  # place each range whose chunks' ids are all known
                task = self._place_task(ranges, placed + len(placing), known, resumed, chunk)
                if task is None:
                    break
                span, doc_span, pieces = task
                writer.reserve(span[1], doc_span[1])
                placing.append(place.remote(path, span, doc_span, resumed, pieces))
                tasks.append(placing[-1])
                # No later place task reads a range that ends inside this one's spans: the driver lets it go
                # (the task holds its own reference to what it reads).
                while released < known and ranges[released].stop <= span[1] \
                        and ranges[released].doc_stop <= doc_span[1]:
                    ranges[released].data = None
                    released += 1
            while placing and ray.wait(placing[:1], timeout=0)[0]:
                ray.get(placing.pop(0))
                placed += 1
                for tokens, documents, error in ranges[placed - 1].counts:
                    yield Placed(0 if error else tokens, 0 if error else documents, error)

    @staticmethod
    def _place_task(ranges: list[_Range], index: int, known: int, resumed: tuple[int, int],
                    chunk: int) -> tuple[tuple[int, int], tuple[int, int], list[tuple[int, int, Any]]] | None:
        """Range ``index``'s place task (its id span, document span and the pieces they draw on), or None while
        the ranges after it whose ids its last chunk holds are not all known."""
        r, last = ranges[index], ranges[known - 1]
        everything = known == len(ranges)
        lo = (resumed[0] // chunk * chunk) if index == 0 else _ceil(r.start, chunk)
        doc_lo = (resumed[1] // chunk * chunk) if index == 0 else _ceil(r.doc_start, chunk)
        hi, doc_hi = max(lo, _ceil(r.stop, chunk)), max(doc_lo, _ceil(r.doc_stop, chunk))
        if everything:
            hi, doc_hi = min(hi, last.stop), min(doc_hi, last.doc_stop)
        elif last.stop < hi or last.doc_stop < doc_hi:
            return None
        pieces = [(q.start, q.doc_start, q.data) for q in ranges[index:known]
                  if (q.start < hi and q.stop > max(lo, resumed[0]))
                  or (q.doc_start < doc_hi and q.doc_stop > max(doc_lo, resumed[1]))]
        return (lo, hi), (doc_lo, doc_hi), pieces


class LocalRayCluster:
    """A Ray cluster on this machine, for trying ``--ray`` and for the tests and benchmarks: a head node, then
    :meth:`add_node` for more, each ``ray start --block`` with ``cpus`` CPUs, stopped by :meth:`stop` through
    its own process (``ray stop`` would stop every Ray process of the machine). Its :attr:`address` is
    ``127.0.0.1:PORT``, and every process of it (and of a driver joined by :class:`RayExecutor`) listens on
    127.0.0.1 only: the nodes run in Ray's local-only mode (:data:`LOCAL_ONLY_ENV`), named 127.0.0.1, and join
    through :data:`_JOIN_LOCAL_ONLY`."""

    def __init__(self, cpus: int = 1, object_store_bytes: int = 200_000_000, timeout_s: float = 120.0):
        self.cpus, self.object_store_bytes, self.timeout_s = cpus, object_store_bytes, timeout_s
        self.temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths live under it
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: list[subprocess.Popen[bytes]] = []
        try:
            self._start(["--head", f"--port={self.port}", "--include-dashboard=false"])
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                    break
                except OSError:
                    self._check(deadline)
                    time.sleep(0.2)
        except BaseException:
            self.stop()
            raise

    def _start(self, args: list[str]) -> None:
        log_file = open(self.temp / f"node-{len(self.nodes)}.log", "wb")
        ray = [shutil.which("ray") or "ray"] if not self.nodes else [sys.executable, "-c", _JOIN_LOCAL_ONLY]
        self.nodes.append(subprocess.Popen(
            [*ray, "start", *args, f"--num-cpus={self.cpus}", "--block",
             "--disable-usage-stats", "--node-ip-address=127.0.0.1", f"--temp-dir={self.temp}",
             f"--object-store-memory={self.object_store_bytes}"], stdout=log_file, stderr=subprocess.STDOUT,
            start_new_session=True, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", LOCAL_ONLY_ENV: "0"}))
        log_file.close()

    def _check(self, deadline: float) -> None:
        for i, node in enumerate(self.nodes):
            if node.poll() is not None or time.monotonic() > deadline:
                text = (self.temp / f"node-{i}.log").read_text(errors="replace")[-2000:]
                raise DataError(f"a local Ray node did not start (exit {node.poll()}): {text}")

    def add_node(self) -> None:
        """Starts one more node and waits until the cluster has it (Ray is joined from here to see it)."""
        import ray

        self._start([f"--address={self.address}"])
        _local_only()
        if not ray.is_initialized():
            ray.init(address=self.address, log_to_driver=False, configure_logging=False)
        deadline = time.monotonic() + self.timeout_s
        while sum(bool(n["Alive"]) for n in ray.nodes()) < len(self.nodes):
            self._check(deadline)
            time.sleep(0.2)

    def stop(self) -> None:
        """Leaves the cluster (if joined) and stops its nodes, the newest first; removes its temporary folder."""
        try:
            import ray

            ray.shutdown()
        except ImportError:
            pass
        for node in reversed(self.nodes):
            node.send_signal(signal.SIGTERM)
        for node in reversed(self.nodes):
            try:
                node.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)  # its own session: only what this cluster started
                node.wait()
        self.nodes = []
        shutil.rmtree(self.temp, ignore_errors=True)

    def __enter__(self) -> LocalRayCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
