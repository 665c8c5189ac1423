"""The end of an island's run: draining, the final wait, the final heartbeat, eval and summary.

Once the island's data is done (or too few healthy devices are left to train), :class:`RunEnd` finishes the
exchange in flight, waits for the run's last version unless the coordinator hands the island more data (a
rewind), then sends the final heartbeat, evaluates the final θ and writes the island's summary. All of it runs on
the training loop's thread (:class:`workers.island.Worker`, the process's main thread), after the heartbeat thread
has stopped for the final heartbeat. :mod:`workers.app` builds it, by keyword, from the parts it uses and the few
config values it reads, never the :class:`~workers.island.Worker` itself: what only the loop can do (fold in an
exchange, count a blocked wait) it is handed per call. It closes nothing but the island's log (the run's end
records its last status lines there); the rest is closed where it was opened (:mod:`workers.app`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dtrain.codec import params_digest
from dtrain.runlog import RunLog
from dtrain.telemetry import Telemetry
from dtrain.train.diloco import Island
from dtrain.train.prepare import Setup
from workers.client import CoordinatorClient, CoordinatorError
from workers.exchange import Downlink, GlobalParams, Pending, Uplink
from workers.heartbeat import Clock, Evaluator, IslandStatus, Mailbox, chip_report, final_heartbeat, finite_or_none
from workers.hosts import HostGroup
from workers.links import Traffic
from workers.membership import Membership
from workers.recovery import Guard

FINAL_PULL_WAIT_S = 1.0  # after its data: shorter polls, so a shard handed over (a rewind) starts promptly

FoldIn = Callable[[Pending], GlobalParams]  # the training loop's: finishes an exchange in flight, returns its θ'


@dataclass(kw_only=True)
class RunEnd:
    """How an island's run ends (:meth:`drain`, :meth:`final_wait`, :meth:`finish`), built by
    :func:`workers.app.build_worker`; used on the training loop's thread only."""

    name: str  # the island's name
    hosts: HostGroup  # the island's processes (process 0 talks to the coordinator)
    client: CoordinatorClient  # the final heartbeat; its retries and full pulls count in the summary
    traffic: Traffic  # the bytes to and from every coordinator process (workers.links)
    mailbox: Mailbox  # the coordinator's word (island id, final and total versions) and the evals to report
    membership: Membership  # whether the final wait is over, and whether a failed call means the run stopped
    downlink: Downlink  # the final wait's pulls
    evaluator: Evaluator  # the evals the coordinator asks for, and the final θ's
    guard: Guard  # drained or not, the NaN rollbacks and the quarantined devices' evidence
    uplink: Uplink  # the pushes' compression ratio
    clock: Clock  # utilization and the time not spent training
    setup: Setup  # its inner loop's mesh (rebuilt on the healthy devices by a remesh) says the devices in use
    log: RunLog  # the island's events, summary and progress lines; closed when the island ends
    patience_s: float  # the final wait gives up after this long without a new version (coordinator.grace_s + 2
    #                    lease periods: a sync round's longest wait for a quorum, then a lost island's lease)
    overlap: bool  # worker.overlap, as the summary says
    fingerprint: str  # the run's config fingerprint (Config.fingerprint), as the summary says

    def drain(self, island: Island, anchor: GlobalParams, pending: Pending | None, finish: FoldIn) -> GlobalParams:
        """Too few healthy devices: the island stops training. The exchange in flight is finished (``finish``:
        the loop's wait for it, without folding it in; a push the coordinator took stays merged); the progress
        since it is dropped. The island then stops heartbeating (no final heartbeat either): its lease runs out
        and the coordinator hands its shard, from the merged cursor, to the next island that needs data."""
        if pending is not None:
            anchor = finish(pending)
        self.guard.report_drained(island, anchor.version)
        return anchor

    def final_wait(self, anchor: GlobalParams, pending: Pending | None, status: IslandStatus,
                   fold_in: FoldIn) -> tuple[GlobalParams, bool]:
        """After the island's data: folds in the exchange still in flight (``fold_in``: the loop's), then waits for
        the run's last version (the coordinator says stop, or the known end version arrives); returns (θ, False).
        Returns (θ, True) as soon as the coordinator hands it more data (a rewind: its push was dropped or
        rejected, or it takes over a lost island's shard)."""
        if pending is not None:
            try:
                anchor = fold_in(pending)
            except CoordinatorError as e:
                if not self.membership.stopped_after(e):
                    raise
                self._final_pull_failed(anchor, e)
                return anchor, False
        # Other islands may still push (async mode, a slower island, a shard taken over): wait for the run's
        # last version, so every island ends on the same θ; give up if no new version arrives for a sync
        # round's grace (the longest a round waits for a quorum) plus two lease periods (a lost island's lease).
        last_progress = time.perf_counter()
        while True:
            self.evaluator.requested()
            over = self.membership.final_wait_over(anchor.version)
            if over:
                return anchor, over == "rewind"
            try:
                g_new = self.downlink.pull(anchor, wait_s=FINAL_PULL_WAIT_S)
            except CoordinatorError as e:
                if not self.membership.stopped_after(e):
                    raise
                # The run is over and the coordinator stopped serving before this island had the last version (its
                # linger_s ran out, or a pull was in flight as it stopped): it ends on the version it holds.
                if anchor.version < self.mailbox.final_version:
                    self._final_pull_failed(anchor, e)
                break
            if g_new.version > anchor.version:
                anchor, last_progress = g_new, time.perf_counter()
                self.evaluator.requested()  # first: the heartbeat that reports the new version carries its eval
                status.held = (anchor.version, anchor.digest)
            elif self.hosts.agree(time.perf_counter() - last_progress > self.patience_s):
                self.log.event("final_wait_timeout", version=anchor.version,
                               final_version=self.mailbox.final_version)
                break
        return anchor, False

    def _final_pull_failed(self, anchor: GlobalParams, error: CoordinatorError) -> None:
        """The island ends on ``anchor``: the coordinator stopped serving before it had the run's final version."""
        self.log.event("final_pull_failed", version=anchor.version, final_version=self.mailbox.final_version,
                       error=str(error))

    def finish(self, island: Island, g: GlobalParams, status: IslandStatus, rounds: int, t_start: float,
               final_wait: float, telemetry: Telemetry, extra: dict[str, Any]) -> dict[str, Any]:
        """The final heartbeat, eval and summary (``t_start``: when the loop's run began; ``telemetry``: the
        island's, shut down here; ``extra``: more of the summary, the pacing's: :mod:`workers.pacing`); closes
        the log; returns the summary."""
        final_digest = g.digest or params_digest(g.vec)  # verified on arrival, unless it came another way
        final_eval = float("nan")
        if not self.guard.drained:  # a drained island lets its lease run out (its shard is then rerouted)
            self.evaluator.requested()  # the final version's eval, if asked, goes with the final heartbeat
            if self.hosts.leader:  # best effort, one try: tell the coordinator this island holds the final version
                final_heartbeat(self.client, self.mailbox, self.log.event, dict(
                    version=g.version, steps=island.steps, tokens=island.tokens, params_digest=final_digest,
                    train_loss=finite_or_none(status.read_loss()), utilization=self.clock.utilization(),
                    **chip_report(self.guard.evidence(), self.setup.loop.mesh.devices.size)))
            final_eval = self.evaluator.loss(g)
        summary = {**self._summary(island, g, rounds, final_eval, final_digest, final_wait, t_start), **extra}
        self.log.event("island_finished", **summary)
        self.log.write_summary(summary)
        if not self.guard.drained:
            self.log.progress(f"{self.name}: done v{g.version}, eval loss {final_eval:.4f}, "
                              f"utilization {summary['utilization']:.3f}")
        telemetry.shutdown()
        self.log.close()
        return summary

    def _summary(self, island: Island, g: GlobalParams, rounds: int, final_eval: float, final_digest: str,
                 final_wait: float, t_start: float) -> dict[str, Any]:
        """The island's summary (summary.json, the ``island_finished`` event, what the loop's run returns)."""
        clock, guard = self.clock, self.guard
        return {
            "island": self.name, "shard": island.index, "steps": island.steps,
            "tokens": island.tokens, "cursor": island.cursor, "rounds": rounds, "version": g.version,
            "final_eval_loss": final_eval, "params_digest": final_digest,
            "bytes_up": self.traffic.bytes_up, "bytes_down": self.traffic.bytes_down,
            "bytes_down_full": self.client.bytes_down_full,
            "compression_ratio": self.uplink.compression_ratio, "utilization": clock.utilization(),
            "blocked_s": clock.blocked_s, "eval_s": clock.eval_s, "final_wait_s": final_wait,
            "active_s": clock.active_s, "wall_s": time.perf_counter() - t_start, "retries": self.client.retries,
            "data_wait_s": sum(sh.stream.wait_s for sh in self.setup.shards),
            "overlap": self.overlap,
            "total_versions": self.mailbox.final_version or self.mailbox.total_versions,
            "fingerprint": self.fingerprint, "devices": self.setup.loop.mesh.devices.size,
            "nan_rollbacks": guard.nan_rollbacks, "quarantined": list(guard.evidence()),
            **({"drained": guard.drained} if guard.drained else {}),
        }
