"""The island's membership of the run: whether there is a run to join, the Join itself, and when it ends.

Before anything slow, :func:`run_over_already` asks whether the run is over. :class:`Membership` then joins (process
0; the island's other processes learn its reply), holds the start barrier, and answers, the same on every process
of the island (:mod:`workers.hosts`), whether the island stops and where a rewind sends it: the coordinator's
word reaches process 0 only, through its heartbeat thread and :class:`workers.heartbeat.Mailbox`.
:class:`RetryLines` says what a retried call waits for. :class:`IslandTelemetry` is the island's telemetry, started
at its first Join (named after the run the reply names).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import jax

from dtrain.config.ops import TelemetryConfig
from dtrain.config.sections import Config
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.runlog import RunLog
from dtrain.telemetry import Telemetry, island_counters
from dtrain.train.prepare import Setup
from workers.client import CoordinatorClient, CoordinatorError, cause
from workers.exchange import WorkerError
from workers.heartbeat import Mailbox
from workers.hosts import HostGroup
from workers.recovery import Rewind, agreed_rewind

# A call cut off by the coordinator going away (it stops serving once the run is finished and the islands hold the
# last version): the stop it sent rides on a heartbeat reply that may not be read yet.
COORDINATOR_GONE = frozenset({grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE})


class RetryLines:
    """The client's retry callback (``CoordinatorClient(on_retry=...)``): each retry is an event; a progress line
    says what the island waits for and how long it goes on waiting, at the first retry of a call and then every
    :attr:`RETRY_LINE_S` (a 10-minute outage is 20 lines, not one per backoff). Called on whichever thread's call
    retries (the training loop's, an exchange's); :attr:`last` is written there, and two threads retrying at
    once can only repeat or skip one line."""

    RETRY_LINE_S = 30.0  # a retried call's progress line: at its first retry, then at most this often

    def __init__(self, name: str, cfg: Config, log: RunLog):
        self.name, self.cfg, self.log = name, cfg, log
        self.last: tuple[str, float] = ("", float("-inf"))  # the last line's call and time.monotonic()

    def __call__(self, what: str, pause: float, left: float) -> None:
        """``what``: the call, the coordinator's address and why it failed; ``pause``: the backoff before the next
        try; ``left``: the seconds of retrying left."""
        self.log.event("retry", what=what, pause_s=pause, left_s=round(left, 3))
        now = time.monotonic()
        if what == self.last[0] and now - self.last[1] < self.RETRY_LINE_S:
            return
        self.last = (what, now)
        self.log.progress(f"{self.name}: {what}; retrying for {left:.0f}s more, then giving up "
                          f"(worker.retry_total_s={self.cfg.worker.retry_total_s:g})")


class IslandTelemetry:
    """The island's telemetry: disabled until the first Join, which starts it (its Resource names the run id the
    reply carries), with the island's byte counters and its events as fault counters. :attr:`now` is written by
    the first Join's thread (the training loop's; a rejoin's, on the heartbeat thread, finds it started) and read
    by the loop."""

    def __init__(self, cfg: TelemetryConfig, name: str, client: CoordinatorClient, log: RunLog):
        self.cfg, self.name, self.client, self.log = cfg, name, client, log
        self.now = Telemetry.disabled()

    def joined(self, reply: pb.JoinResponse) -> None:
        """At a Join: starts the telemetry, once (not with ``telemetry.exporter = "none"``)."""
        if self.now.enabled or self.cfg.exporter == "none":
            return
        self.now = Telemetry(self.cfg, "island", self.name, reply.run_id)
        island_counters(self.now, lambda: self.client.bytes_up, lambda: self.client.bytes_down)
        self.log.subscribe(self.now.on_event)

    def shutdown(self) -> None:
        """Flushes and stops it (idempotent: a finished run's was shut down already)."""
        self.now.shutdown()


class Membership:
    """The island's membership of the run, the same on every process of the island: process 0 joins and hears the
    coordinator's word; the other processes follow process 0's answers. Used by the training loop's thread;
    :meth:`join` also by the heartbeat thread (a rejoin). It keeps nothing of its own: what it writes (the island
    id, the run's total and final versions, the stop) is the :class:`Mailbox`'s, which says who writes what."""

    def __init__(self, cfg: Config, name: str, client: CoordinatorClient, hosts: HostGroup, mailbox: Mailbox,
                 log: RunLog, setup: Setup, tree: tuple[int, str], on_join: Callable[[pb.JoinResponse], None]):
        """``setup``: the island's (its inner loop's mesh names the devices); ``tree``: the parameter tree's
        (size, digest), checked against the coordinator's; ``on_join(reply)``: called at each Join before it is
        logged (the island's telemetry starts at the first)."""
        self.cfg, self.name, self.client, self.hosts, self.mailbox = cfg, name, client, hosts, mailbox
        self.log, self.setup, self.tree, self.on_join = log, setup, tree, on_join
        self.mesh_devices = setup.loop.mesh.devices.size  # the island's devices before any quarantine

    def join(self) -> pb.JoinResponse:
        """Joins the run (process 0): the island's id and the run's total versions go to the mailbox."""
        devices = self.mesh_devices  # the whole mesh: a quarantined device's evidence names its place in it
        hardware = {"gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}.get(jax.default_backend(), "cpu")
        device_kind = str(getattr(next(iter(self.setup.loop.mesh.devices.flat)), "device_kind", ""))
        resp = self.client.join(self.name, hardware, devices, device_kind=device_kind)
        n, digest = self.tree
        if resp.tree_digest != digest or resp.tree_size != n:
            raise WorkerError(f"the coordinator's parameter tree ({resp.tree_size} values, {resp.tree_digest}) "
                              f"differs from this island's ({n}, {digest})")
        self.mailbox.island_id = resp.island_id
        self.mailbox.total_versions = resp.total_versions
        self.on_join(resp)
        self._joined(resp)
        return resp

    def _joined(self, resp: pb.JoinResponse) -> None:
        """The ``joined`` event, on every process of the island."""
        self.log.event("joined", island_id=resp.island_id, shard=resp.shard_index, cursor=resp.cursor,
                       version=resp.version, run_id=resp.run_id, total_versions=resp.total_versions)

    def join_island(self) -> pb.JoinResponse:
        """Process 0 joins (:meth:`join`); every process learns the reply (island id, shard, cursor, version)."""
        if self.hosts.alone:
            return self.join()
        sent = self.hosts.lead(lambda: self.join().SerializeToString().hex())  # JSON carries the message as hex
        reply = pb.JoinResponse.FromString(bytes.fromhex(sent))
        if not self.hosts.leader:
            self.mailbox.island_id, self.mailbox.total_versions = reply.island_id, reply.total_versions
            self._joined(reply)
        return reply

    def stopped(self) -> bool:
        """Whether the island stops (the coordinator said so, or it failed): process 0's answer on every process,
        which also learns the run's final and total versions from it."""
        box = self.mailbox
        if self.hosts.alone:
            return box.stopping.is_set()
        stop, final_version, total_versions = self.hosts.agree(
            [box.stopping.is_set(), box.final_version, box.total_versions])
        if not self.hosts.leader:  # process 0's heartbeat thread owns its own values
            box.final_version, box.total_versions = final_version, total_versions
            if stop:
                box.stopping.set()
        return bool(stop)

    def stopped_after(self, error: CoordinatorError) -> bool:
        """:meth:`stopped`, once a call failed. If the coordinator went away (:data:`COORDINATOR_GONE`), its stop
        may be in a heartbeat reply the heartbeat thread has not handled yet (the coordinator stops serving as soon
        as the islands hold the last version): process 0 gives it two heartbeat periods before the island decides
        the failure is an error. Seen as `dtrain worker: error: CANCELLED` at the end of about one run in ten on a
        loaded machine."""
        if error.code in COORDINATOR_GONE and self.hosts.leader:
            self.mailbox.stopping.wait(2 * self.cfg.worker.heartbeat_s)
        return self.stopped()

    def take_rewind(self) -> Rewind | None:
        """The rewind posted since the last take (process 0's, on every process), if any."""
        return agreed_rewind(self.hosts, self.mailbox.take_rewind())

    def final_wait_over(self, version: int) -> str:
        """Whether the island's wait for the run's last version ends, holding θ ``version``, the same on every
        process: "end" (the run's last version is here, or the coordinator stopped the run and the island holds
        its final version), "rewind" (the coordinator handed it more data), or "" (wait on)."""
        total = self.mailbox.total_versions
        if self.hosts.agree(bool(total) and version >= total):
            return "end"
        if self.stopped():
            return "end" if self.hosts.agree(version >= self.mailbox.final_version) else ""
        return "rewind" if self.hosts.agree(self.mailbox.rewind_posted()) else ""

    def await_peers(self) -> None:
        """Start barrier (process 0): wait (up to worker.start_wait_s) until outer.islands islands have joined, so
        that the first round starts together instead of the first island idling through the others' start-up. An
        island that restarts mid-run finds them all joined already and goes straight on."""
        want, limit = self.cfg.outer.islands, self.cfg.worker.start_wait_s
        t0 = time.perf_counter()
        while limit > 0 and not self.mailbox.stopping.is_set():
            joined = len(self.client.status().islands)  # live, lost, stopped or quarantined: each has shown up
            if joined >= want:
                break
            if time.perf_counter() - t0 > limit:
                self.log.event("start_wait_timeout", joined=joined, islands=want, waited_s=limit)
                break
            time.sleep(0.1)
        self.log.event("start_barrier", waited_s=round(time.perf_counter() - t0, 3))


def run_over_already(client: CoordinatorClient, cfg: Config, run_dir: Path,
                     say: Callable[[str], None] = lambda line: None) -> str:
    """Why an island has nothing to train, asked before any slow start-up: the coordinator says the run is
    over (one Status call, no retries), or it does not answer and the island's own summary.json records that
    it finished the run (same model and codecs). '' otherwise: then Join decides (and retries). ``say``: told
    when the coordinator does not answer and the island goes on building (a worker would otherwise be silent
    for its whole compile)."""
    try:
        status = client.status(budget_s=0.0)
    except CoordinatorError as e:
        status = None
        say(f"the coordinator at {client.address} does not answer yet ({cause(e.code, e.details)}); building "
            f"the island meanwhile, then joining (retried for up to {cfg.worker.retry_total_s:g}s)")
    if status is not None:
        over = status.run_over or f"the run is over: {status.version} versions merged"
        return f"{over} (coordinator at {client.address})" if status.stopped else ""
    try:
        done = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return ""
    total = done.get("total_versions") if isinstance(done, dict) else None
    if isinstance(total, int) and total > 0 and done.get("version") == total \
            and done.get("fingerprint") == cfg.fingerprint():
        return (f"this island finished the run (version {total} of {total}, {run_dir / 'summary.json'}) and "
                f"the coordinator at {client.address} does not answer: the run is over (remove summary.json to "
                f"start a new run in this folder)")
    return ""


def report_run_over(log: RunLog, name: str, reason: str) -> dict[str, Any]:
    """One event, one progress line, and what :func:`workers.app.run_worker` returns for a run that is over."""
    log.event("run_over", reason=reason)
    log.progress(f"{name}: {reason}: nothing to do")
    log.close()
    return {"island": name, "run_over": reason}
