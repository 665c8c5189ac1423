"""The coordinator process: its checks before anything starts, its gRPC server and its run from start to stop.

Owns what comes before the service (:func:`preflight`: free ports, the telemetry exporter, the token and TLS
files; θ_0 computed in a child process: :func:`initial_parameters_file`), the gRPC server around
:class:`coordinator.service.CoordinatorService` (:func:`serve`: its threads, options, handlers, the token
interceptor, the health service and the dashboard) and ``dtrain coordinator`` itself (:func:`run_coordinator`:
serve until the run is finished or a signal, then stop and summarize).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from coordinator import shard_plane
from coordinator.app import serve
from coordinator.data_plane import LoopServer
from coordinator.edge import CallerIdentity
from coordinator.init_params import UNFIT
from coordinator.memory import return_large_frees_to_the_os
from coordinator.preflight import IN_USE, preflight, shard_preflight
from coordinator.rounds_loop import AfterFinish
from coordinator.service import CoordinatorService
from coordinator.shard import RangeShard, read_secret, shard_ranges
from coordinator.status_view import source_tokens
from dtrain import codec
from dtrain.config.sections import Config, ConfigError
from dtrain.errors import DtrainError
from dtrain.models.stored import write_layout

log = logging.getLogger(__name__)


def initial_parameters_file(cfg: Config, out_dir: str | Path, spec_only: bool = False
                            ) -> tuple[Path | None, codec.Spec]:
    """θ_0 from the run's seed (or ``model.init_from``'s Hugging Face folder) as a file of raw float32 in
    ``out_dir`` (every island builds the same tree and checks its digest), and the tree's spec. ``spec_only``:
    just the spec (from shapes; no θ_0 is built).

    Computed in a child process (coordinator/init_params.py), so JAX and the model's temporary copies
    never enter the coordinator's memory, and θ_0 itself only as a file the merger links in."""
    import subprocess
    import sys
    import tempfile

    from dtrain.config.load import to_toml

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dtrain-init-") as tmp:
        (Path(tmp) / "config.toml").write_text(to_toml(cfg))
        done = subprocess.run([sys.executable, "-m", "coordinator.init_params", str(Path(tmp) / "config.toml"),
                               str(out), *(["--spec-only"] if spec_only else [])], capture_output=True, text=True)
    if done.returncode == UNFIT:  # model.init_from's folder does not fit the config: its one line
        raise ConfigError(done.stderr.strip().splitlines()[-1])
    if done.returncode != 0:
        raise DtrainError(f"computing θ_0 failed:\n{done.stderr[-2000:]}")
    return None if spec_only else out / "theta0.f32", json.loads((out / "spec.json").read_text())


def initial_parameters(cfg: Config) -> tuple[np.ndarray, codec.Spec]:
    """θ_0 as an array (tests and tools; the service itself uses :func:`initial_parameters_file`)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="dtrain-theta0-") as tmp:
        path, spec = initial_parameters_file(cfg, tmp)
        assert path is not None
        return np.fromfile(path, "<f4").astype(np.float32), spec


def run_coordinator(cfg: Config, run_dir: str | Path, port: int | None = None, resume: bool = False,
                    quiet: bool = False, after_finish: AfterFinish = "exit") -> dict[str, Any]:
    """``dtrain coordinator``: serves until the run is finished (``CoordinatorState.finished``: the last version
    is merged and the live islands have it, or its linger has passed) or SIGTERM / Ctrl-C; writes
    RUN_DIR/coordinator.json with the bound address as soon as it listens.

    ``port``: the gRPC port (None: ``coordinator.port``; 0: any free one); ``resume``: from RUN_DIR's newest good
    checkpoint (θ_0 is not computed then); ``quiet``: no progress lines. ``after_finish="serve"`` (a
    Deployment's, which would restart an exited coordinator, resume the finished run and end it again, forever):
    a finished run says so (``run_finished`` event, one progress line) and keeps serving until SIGTERM / Ctrl-C.
    Returns the run's summary (version, tokens_merged, bytes_in, bytes_out, merge_s, deltas_dropped,
    params_digest), also its ``coordinator_stopped`` event; raises DtrainError if the service failed."""
    return_large_frees_to_the_os()
    checked = preflight(cfg, port)  # before θ_0's work
    init_dir = Path(run_dir) / "spool" / "init"
    theta0, spec = initial_parameters_file(cfg, init_dir, spec_only=resume)  # resuming: θ is in the checkpoint
    write_layout(cfg, run_dir, spec)  # what `dtrain export` reads θ's files with
    try:
        server, service, bound = serve(cfg, run_dir, theta0, spec, port=port, resume=resume, quiet=quiet,
                                       after_finish=after_finish, checked=checked)
    finally:
        shutil.rmtree(init_dir, ignore_errors=True)  # the merger holds its own link to θ_0
    _write_address(cfg, Path(run_dir), service, bound)
    reason = _wait_for_the_end(service, after_finish)
    if service.loop.fatal:
        server.stop(grace=1.0).wait()
        service.close()
        raise DtrainError(f"coordinator failed: {service.loop.fatal} (restart it with `dtrain coordinator --resume`)")
    server.stop(grace=2.0).wait()
    with service.lock:
        st, n = service.state, service.counters
        summary = {"version": st.version, "tokens_merged": st.tokens_merged, "bytes_in": n.bytes_in,
                   "bytes_out": n.bytes_out, "merge_s": n.merge_s, "deltas_dropped": st.deltas_dropped,
                   "params_digest": service.params_digest,
                   **({"source_tokens": tokens} if (tokens := source_tokens(st, service.opts)) else {})}
    service.log.event("coordinator_stopped", reason=reason, run_over=service.loop.stop_requested is None, **summary)
    service.close()
    return summary


def _write_address(cfg: Config, run_dir: Path, service: CoordinatorService, bound: int) -> None:
    """RUN_DIR/coordinator.json: where the coordinator listens (and its dashboard), written atomically."""
    info = run_dir / "coordinator.json"
    tmp = info.with_suffix(".tmp")
    dash = service.dashboard
    tmp.write_text(json.dumps({"host": cfg.coordinator.host, "port": bound, "run_id": service.run_id,
                               "dashboard_port": dash.port if dash else None, "dashboard": dash.url if dash else None}))
    tmp.replace(info)


def _wait_for_the_end(service: CoordinatorService, after_finish: AfterFinish) -> str:
    """Waits until the service may stop (SIGTERM and SIGINT ask it to), and says why; with
    ``after_finish="serve"`` a finished run is announced and served until a signal."""
    import signal

    loop = service.loop
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: loop.request_stop(f"{signal.Signals(signum).name} received"))
    reason = loop.wait_finished()
    if after_finish == "serve" and loop.fatal is None and loop.stop_requested is None:
        with service.lock:
            version = service.state.version
        service.log.event("run_finished", reason=reason, version=version)
        service.log.progress(f"run finished: {reason}; serving its final θ (version {version}), Status, health "
                             f"and the dashboard until SIGTERM (--after-finish=serve); nothing is left to train: the "
                             f"Deployment may be scaled to 0 (kubectl -n dtrain scale deployment dtrain-coordinator "
                             f"--replicas=0)")
        reason = loop.wait_stop_requested()
    return reason


def serve_shard(cfg: Config, index: int, run_dir: str | Path, theta: np.ndarray | Path, spec: codec.Spec,
                port: int | None = None) -> tuple[LoopServer, RangeShard, int]:
    """Starts range shard ``index`` (>= 1) of a sharded coordinator (``coordinator.shards``): the Coordinator
    service's PushDelta and PullGlobal for its range (the islands' token, as the lead's) and the Shard service for
    the lead (its secret), on the lead's event-loop data plane (``coordinator/shard_plane.py``); ``theta``: θ_0's
    values of its range. Returns (server, shard, bound port)."""
    c = cfg.coordinator
    address = f"{c.host}:{c.port if port is None else port}"
    token, creds, island_tokens = shard_preflight(cfg, port)
    shard = RangeShard(cfg, index, run_dir, theta, spec, read_secret(cfg),
                       identity=CallerIdentity(cfg.security.identity, island_tokens))
    own = island_tokens.name_of if island_tokens is not None else None
    server, bound = shard_plane.serve(shard, address, creds, token, own)
    if bound == 0:
        shard.close()
        raise DtrainError(f"cannot listen on {address}: gRPC could not bind it; if {IN_USE}")
    log.info("coordinator shard %d of %d listening on %s:%d (values %d..%d)", index, c.shards, c.host, bound,
             shard.range.start, shard.range.end)
    return server, shard, bound


def run_shard(cfg: Config, index: int, run_dir: str | Path, port: int | None = None) -> dict[str, Any]:
    """``dtrain coordinator --shard I`` (I >= 1): serves range shard I of a sharded coordinator until SIGTERM or
    Ctrl-C (it ends nothing itself: the lead runs the run); writes RUN_DIR/coordinator-shard-I.json with its bound
    address once it listens. θ_0 is computed from the run's seed as the lead's is, and its range taken. Returns
    its version and its range's digest."""
    import signal
    import threading

    return_large_frees_to_the_os()
    if not 1 <= index < cfg.coordinator.shards:
        raise ConfigError(f"--shard {index}: must be in 0..{cfg.coordinator.shards - 1} (coordinator.shards = "
                          f"{cfg.coordinator.shards}; 0 is the lead)")
    shard_preflight(cfg, port)  # before θ_0's work
    out = Path(run_dir)
    init_dir = out / f"shard-{index}" / "init"
    theta0, spec = initial_parameters_file(cfg, init_dir)
    assert theta0 is not None
    try:
        r = shard_ranges(spec, cfg.coordinator.shards)[index]
        theta = np.array(np.memmap(theta0, "<f4", mode="r")[r.start:r.end], np.float32)
    finally:
        shutil.rmtree(init_dir, ignore_errors=True)
    server, shard, bound = serve_shard(cfg, index, out, theta, spec, port)
    info = out / f"coordinator-shard-{index}.json"
    tmp = info.with_suffix(".tmp")
    tmp.write_text(json.dumps({"host": cfg.coordinator.host, "port": bound, "shard": index,
                               "shards": cfg.coordinator.shards, "values": [r.start, r.end]}))
    tmp.replace(info)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _signum, _frame: stop.set())
    stop.wait()
    server.stop(grace=2.0).wait()
    with shard.lock:
        summary = {"shard": index, "version": shard.merger.version, "params_digest": shard.merger.digest}
    shard.close()
    return summary
