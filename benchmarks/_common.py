"""What the benchmarks share: a real ``dtrain coordinator`` child process on 127.0.0.1:0 and its memory and CPU
from /proc, the benchmark model (configs/small.toml with model overrides, sized by parameter count), fabricated
encoded deltas, threads released together, argument types, the progress log, and a run's end: a target's verdict,
a figure or n/a, and the closing (the --json file, the run folders, the targets line and the last line).

Imported by the scripts next to it (``from _common import ...``: a script's own folder is first on its import path).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import numpy as np

from dtrain.config.sections import CODEC_NAMES, Config
from dtrain.runlog import progress_line

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 300.0
MB = 1e6
FP32 = 4
MODELS = {"default": {"d_model": 512, "n_layers": 8, "n_heads": 8, "seq_len": 64},   # 25.5M params
          "full": {"d_model": 1024, "n_layers": 8, "n_heads": 8, "seq_len": 64}}     # 101.3M params
_T0 = time.perf_counter()


def log(msg: str) -> None:
    """A progress line on stderr, stamped with the seconds since the benchmark started."""
    print(progress_line(time.perf_counter() - _T0, msg), file=sys.stderr, flush=True)


# -- the end of a run ----------------------------------------------------------------------------


def met(ok: bool | None) -> str:
    """A target's verdict on the targets line: met, NOT met, or (None) not measured."""
    return "not measured" if ok is None else "met" if ok else "NOT met"


def fmt_or_na(x: float | None, spec: str, unit: str = "") -> str:
    """A figure formatted with ``spec``, ``unit`` appended; n/a for None (not measured)."""
    return "n/a" if x is None else f"{x:{spec}}{unit}"


def finish(out: dict[str, Any], json_path: str | None, work: Path, keep: bool, targets: str, last: str) -> None:
    """A benchmark's closing: ``out`` (every figure) to ``json_path`` (--json) as indented JSON, the run folders
    under ``work`` kept (--keep, said on stderr) or removed, then the targets line and the last line on stdout."""
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=2) + "\n")
    if keep:
        log(f"run folders kept under {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    print(targets)
    print(last)


# -- arguments and the model ----------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    """argparse type: positive integers separated by commas."""
    out = [int(x) for x in text.split(",") if x.strip()]
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return out


def codec_list(text: str) -> list[str]:
    """argparse type: codec names (``codec.up`` / ``codec.down`` values) separated by commas."""
    out = [x.strip() for x in text.split(",") if x.strip()]
    if not out or any(x not in CODEC_NAMES for x in out):
        raise argparse.ArgumentTypeError(f"{text!r}: codecs are {', '.join(CODEC_NAMES)}")
    return out


def param_count(text: str) -> int:
    """argparse type: a parameter count like 2000000, 500k or 2M."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgG]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a parameter count like 2000000, 500k or 2M, got {text!r}")
    return int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()])


def count_params(overrides: Sequence[str]) -> int:
    """The parameter count of configs/small.toml's model with ``overrides`` (model.FIELD=VALUE); each model counted
    once (choose_model's search asks for some twice)."""
    return _count_params(tuple(overrides))


@functools.cache
def _count_params(overrides: tuple[str, ...]) -> int:
    from dtrain.config.load import load_config
    from dtrain.models import model

    cfg = load_config(ROOT / "configs" / "small.toml", list(overrides))
    return model.param_count(model.build(cfg.model).abstract_params)


def model_overrides(fields: dict[str, int]) -> list[str]:
    """``model.FIELD=VALUE`` overrides for ``fields``."""
    return [f"model.{k}={v}" for k, v in fields.items()]


def choose_model(params: int | None = None, d_model: int | None = None, n_layers: int | None = None,
                 full: bool = False) -> tuple[dict[str, int], int]:
    """Model fields and the exact parameter count (from the abstract parameter tree): MODELS["default"]
    (or MODELS["full"]); with ``params``, about that many parameters (d_model searched in multiples of 32
    unless given; n_layers 8 from 8M up, else 2, unless given); ``d_model``/``n_layers`` override."""
    fields = dict(MODELS["full" if full else "default"])
    if params is not None:
        layers = n_layers or (8 if params >= 8_000_000 else 2)
        fields.update(n_layers=layers)
        if d_model:
            fields.update(d_model=d_model)
        else:  # the d_model (a multiple of 32) whose count is closest to the target; the count grows with d
            lo, hi = 1, 128  # d_model = 32·k
            while lo < hi:
                mid = (lo + hi) // 2
                if count_params(model_overrides({**fields, "d_model": 32 * mid})) < params:
                    lo = mid + 1
                else:
                    hi = mid
            cands = [k for k in (lo - 1, lo) if k >= 1]
            best = min(cands, key=lambda k: abs(count_params(model_overrides({**fields, "d_model": 32 * k}))
                                                 - params))
            fields.update(d_model=32 * best)
    else:
        if d_model:
            fields.update(d_model=d_model)
        if n_layers:
            fields.update(n_layers=n_layers)
    fields["n_heads"] = 8 if fields["d_model"] % 8 == 0 else (4 if fields["d_model"] % 4 == 0 else 1)
    return fields, count_params(model_overrides(fields))


def make_config(model_fields: dict[str, int], out_dir: Path, codec_up: str = "int8", islands: int = 1,
                checkpoint: bool = False, repeats: int = 1, extra: Sequence[str] = ()) -> Config:
    """The benchmark's config: configs/small.toml + the model + what the measurement needs, then ``extra``
    (later overrides win)."""
    from dtrain.config.load import load_config

    base = load_config(ROOT / "configs" / "small.toml")
    chunk = base.codec.chunk_bytes
    overrides = model_overrides(model_fields) + [
        f"run.out_dir={out_dir}", "coordinator.port=0", f"codec.up={codec_up}", f"outer.islands={islands}",
        "coordinator.grace_s=36000", "coordinator.lease_s=36000",  # no quorum close, no lease expiry: no heartbeats
        f"coordinator.checkpoint={'true' if checkpoint else 'false'}",
        f"coordinator.max_message_bytes={max(base.coordinator.max_message_bytes, chunk + (64 << 10))}",
        "outer.inner_steps=50", f"train.steps={50 * (repeats + 2)}",  # versions to spare: the run never stops
        "worker.rpc_deadline_s=3600", "worker.retry_total_s=0.001",  # a retry would spoil a timing: fail instead
        *extra]
    return load_config(ROOT / "configs" / "small.toml", overrides)


# -- processes --------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def reset_peak_rss(pid: int) -> bool:
    """Resets a process's VmHWM to its VmRSS now (``/proc/PID/clear_refs``, "5"), so a later VmHWM is the peak
    since this call; False where the kernel does not allow it (the peak then counts from the process's start)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def proc_mem(pid: int) -> dict[str, int]:
    """VmHWM (peak RSS) and VmRSS of a process, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def wait_for_file(path: Path, proc: subprocess.Popen, what: str, log_path: Path) -> dict[str, Any]:
    """The JSON ``proc`` writes to ``path`` once it listens; RuntimeError (with its log's tail) if it exits first
    or takes over START_TIMEOUT_S."""
    t0 = time.perf_counter()
    while not path.exists():
        if proc.poll() is not None:
            tail = log_path.read_text()[-3000:] if log_path.exists() else ""
            raise RuntimeError(f"{what} exited with status {proc.returncode} before listening; log tail:\n{tail}")
        if time.perf_counter() - t0 > START_TIMEOUT_S:
            raise RuntimeError(f"{what} did not start within {START_TIMEOUT_S:.0f}s; see {log_path}")
        time.sleep(0.05)
    return json.loads(path.read_text())


def stop_process(proc: subprocess.Popen, what: str) -> int:
    """SIGTERM (SIGKILL after 60 s); the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            log(f"{what} ignored SIGTERM for 60s: killing it")
            proc.kill()
            proc.wait()
    return proc.returncode


def child_env() -> dict[str, str]:
    """The environment of a benchmark's child process: ours, unbuffered output, JAX on the CPU."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}


class CoordinatorProcess:
    """``python -m dtrain_cli coordinator`` on 127.0.0.1:0 with a resolved config; peak RSS from /proc."""

    def __init__(self, cfg: Config, run_dir: Path):
        from dtrain.config.load import to_toml

        run_dir.mkdir(parents=True)
        self.run_dir = run_dir
        cfg_path = run_dir / "config.toml"
        cfg_path.write_text(to_toml(cfg))
        self.log_path = run_dir / "coordinator.log"
        self._log = open(self.log_path, "w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dtrain_cli", "coordinator", "--config", str(cfg_path), "--port", "0",
             "--run-dir", str(run_dir), "--quiet"],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT, env=child_env())
        try:
            info = wait_for_file(run_dir / "coordinator.json", self.proc, "the coordinator", self.log_path)
        except BaseException:
            self.proc.kill()
            self._log.close()
            raise
        self.start_s = time.perf_counter() - t0
        self.address = f"127.0.0.1:{info['port']}"
        self.mem_at_start = proc_mem(self.proc.pid)

    def stop(self) -> tuple[dict[str, int], dict[str, Any]]:
        """Reads the peak RSS, then SIGTERM; returns (memory, the coordinator's exit summary)."""
        mem = proc_mem(self.proc.pid)
        rc = stop_process(self.proc, "the coordinator")
        self._log.close()
        summary: dict[str, Any] = {}
        for line in reversed(self.log_path.read_text().splitlines()):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and "merge_s" in obj:
                summary = obj
                break
        if rc != 0:
            log(f"warning: the coordinator exited with status {rc}; see {self.log_path}")
        summary["exit_status"] = rc
        return mem, summary


TINY_MODEL = {"d_model": 8, "n_layers": 1, "n_heads": 1, "seq_len": 8}  # the runtime baseline's (nearly) no model


def runtime_baseline(work: Path) -> int:
    """The peak RSS (VmHWM, bytes) of a coordinator of a nearly empty model (:data:`TINY_MODEL`), run to its end in
    ``work``: what the Python + gRPC + numpy runtime takes by itself, the "net" figures' baseline; logged."""
    cp = CoordinatorProcess(make_config(TINY_MODEL, work), work / "coord-baseline")
    mem, _ = cp.stop()
    log(f"runtime baseline: a {count_params(model_overrides(TINY_MODEL)):,}-param coordinator peaks at "
        f"{mem['VmHWM'] / (1 << 20):,.0f} MiB")
    return mem["VmHWM"]


# -- threads and frames ---------------------------------------------------------------------------


def run_concurrently(n: int, fn: Callable[[int], Any]) -> list[tuple[float, float, Any]]:
    """Runs fn(0..n-1) in n threads released together; returns (start, end, result) each; re-raises errors."""
    barrier = threading.Barrier(n)
    out: list[Any] = [None] * n

    def run(i: int) -> None:
        barrier.wait()
        t0 = time.perf_counter()
        try:
            res, err = fn(i), None
        except BaseException as e:  # noqa: BLE001 - re-raised below
            res, err = None, e
        out[i] = (t0, time.perf_counter(), res, err)

    threads = [threading.Thread(target=run, args=(i,), name=f"bench-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (_, _, _, err) in enumerate(out):
        if err is not None:
            raise RuntimeError(f"thread {i}: {type(err).__name__}: {err}") from err
    return [(t0, t1, res) for t0, t1, res, _ in out]


def make_frames(codec_name: str, n_params: int, count: int, block: int, level: int) -> list[bytes]:
    """``count`` distinct fabricated deltas (normal × 1e-3), encoded as islands would (no error feedback state);
    ``codec_name`` is a ``codec.up`` value (sparse: the default config's chunk, bits and density)."""
    from dtrain import codec
    from dtrain.config.sections import CodecConfig

    k = CodecConfig(block=block)
    bits, blk = k.scheme(codec_name)
    frames = []
    for i in range(count):
        delta = np.random.default_rng(1000 + i).standard_normal(n_params, dtype=np.float32)
        delta *= np.float32(1e-3)
        frames.append(codec.encode(codec.quantize(delta, bits, blk, k.density), level))
        del delta
    return frames


# -- the transport's floor: a bare gRPC server --------------------------------------------------------

RAW_SERVICE = "dtrain.bench.Raw"


def raw_server_main(run_dir: str, max_message_bytes: int, workers: int = 16) -> int:
    """A bare Python gRPC server (run in its own process by :class:`RawServer`) with the coordinator's channel
    options and a pool of ``workers`` threads, doing nothing with what it moves: ``Push`` counts the bytes of a
    client stream and answers the count (8 bytes, little-endian); ``Pull`` answers a request of (total, piece)
    (two 8-byte little-endian ints) with ``total`` bytes in messages of ``piece`` bytes, built once.
    Writes ``raw.json`` (its port) into ``run_dir`` once it listens; stops on SIGTERM."""
    import grpc

    from dtrain.net.wire import channel_options

    def push(request_iterator: Any, context: Any) -> bytes:
        n = 0
        for chunk in request_iterator:
            n += len(chunk)
        return n.to_bytes(8, "little")

    pieces: dict[int, bytes] = {}

    def pull(request: bytes, context: Any) -> Any:
        total, piece = int.from_bytes(request[:8], "little"), int.from_bytes(request[8:16], "little")
        if not 0 < piece <= max_message_bytes:
            raise ValueError(f"piece {piece}: must be in [1, {max_message_bytes}]")
        data = pieces.get(piece)
        if data is None:  # built once per piece size, not per pull: the server's CPU is what the floor measures
            data = pieces[piece] = np.random.default_rng(piece).integers(0, 256, piece, np.uint8).tobytes()
        full, rem = divmod(total, piece)
        for _ in range(full):
            yield data
        if rem:
            yield data[:rem]

    handler = grpc.method_handlers_generic_handler(RAW_SERVICE, {
        "Push": grpc.stream_unary_rpc_method_handler(push, request_deserializer=None, response_serializer=None),
        "Pull": grpc.unary_stream_rpc_method_handler(pull, request_deserializer=None, response_serializer=None)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=channel_options(max_message_bytes))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    info = Path(run_dir) / "raw.json"
    info.with_suffix(".tmp").write_text(json.dumps({"port": port}))
    info.with_suffix(".tmp").replace(info)
    stop.wait()
    server.stop(grace=1.0).wait()
    return 0


class RawServer:
    """:func:`raw_server_main` in a child process on 127.0.0.1:0 (``python benchmarks/_common.py raw-server``):
    the ceiling of Python gRPC on loopback, with the coordinator's options, next to which a benchmark measures
    dtrain. ``channel()`` opens a client channel; ``push``/``pull`` move bytes; ``cpu_s()`` is the server's CPU."""

    def __init__(self, run_dir: Path, max_message_bytes: int, workers: int = 16):
        run_dir.mkdir(parents=True)
        self.run_dir, self.max_message_bytes = run_dir, max_message_bytes
        self.log_path = run_dir / "raw.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "raw-server", str(run_dir),
                                      str(max_message_bytes), str(workers)],
                                     stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT, env=child_env())
        try:
            self.port = wait_for_file(run_dir / "raw.json", self.proc, "the raw gRPC server", self.log_path)["port"]
        except BaseException:
            self.stop()
            raise

    def channel(self) -> Any:
        import grpc

        from dtrain.net.wire import channel_options

        return grpc.insecure_channel(f"127.0.0.1:{self.port}", channel_options(self.max_message_bytes))

    @staticmethod
    def push(channel: Any, chunks: Any, timeout: float = 3600) -> int:
        """Streams ``chunks`` (bytes) to the server; the byte count it received."""
        call = channel.stream_unary(f"/{RAW_SERVICE}/Push", request_serializer=None, response_deserializer=None)
        return int.from_bytes(call(iter(chunks), timeout=timeout), "little")

    @staticmethod
    def pull(channel: Any, total: int, piece: int, timeout: float = 3600) -> int:
        """Receives ``total`` bytes in messages of ``piece``; the byte count received."""
        call = channel.unary_stream(f"/{RAW_SERVICE}/Pull", request_serializer=None, response_deserializer=None)
        return sum(len(m) for m in call(total.to_bytes(8, "little") + piece.to_bytes(8, "little"), timeout=timeout))

    def cpu_s(self) -> float:
        return cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        stop_process(self.proc, "the raw gRPC server")
        self._log.close()


if __name__ == "__main__" and sys.argv[1:2] == ["raw-server"]:
    sys.exit(raw_server_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
