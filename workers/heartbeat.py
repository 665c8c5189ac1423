"""The island's heartbeat thread: its lease with the coordinator, and what the coordinator says back.

:class:`Heartbeat` runs on a thread of its own (process 0 of the island only), one heartbeat every
``worker.heartbeat_s``, reporting the :class:`IslandStatus` the training loop keeps; :class:`LinkWatch` notices
a link that became slow from the round trips. What a reply asks for (stop, rejoin, send the push again) reaches
the training loop through the :class:`Mailbox`, which also carries the eval reports the loop hands the heartbeat
to send (:class:`Evaluator`: the global θs the coordinator asked the island to evaluate). The training loop
(:class:`workers.island.Worker`) owns the status and the :class:`Clock`; the heartbeat only reads them.
"""

from __future__ import annotations

import collections
import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from dtrain import codec
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.wire import MAX_EVAL_REPORTS
from dtrain.runlog import RunLog, json_number
from dtrain.train.prepare import Setup
from workers.chip_health import Evidence
from workers.client import CoordinatorClient, CoordinatorError, RunOverError
from workers.exchange import Downlink, EventLog, Exchange, GlobalParams
from workers.recovery import Rewind


class LinkWatch:
    """Notices a link to the coordinator that became slow, from heartbeat round trips: once ``warmup`` of them
    set a baseline (their median), ``streak`` round trips in a row above ``factor`` × baseline + ``margin_s``
    are a slow link, and one back under it a recovery. Slow round trips stay out of the baseline. A slow link
    is not a failure (the island keeps its lease); it is reported, since it will make the island's rounds late.
    Used by the heartbeat thread alone (:class:`Heartbeat` owns one)."""

    def __init__(self, window: int = 30, warmup: int = 5, streak: int = 3, factor: float = 3.0,
                 margin_s: float = 0.010):
        self.rtts: collections.deque[float] = collections.deque(maxlen=window)
        self.warmup, self.streak, self.factor, self.margin_s = warmup, streak, factor, margin_s
        self.over = 0
        self.slow = False

    def observe(self, rtt: float) -> tuple[str, dict[str, float]] | None:
        """Records one round trip; returns ("link_slow" | "link_recovered", fields) when the state changes."""
        if len(self.rtts) < self.warmup:
            self.rtts.append(rtt)
            return None
        baseline = statistics.median(self.rtts)
        limit = self.factor * baseline + self.margin_s
        fields = {"rtt_s": round(rtt, 4), "baseline_s": round(baseline, 4), "limit_s": round(limit, 4)}
        if rtt > limit:
            self.over += 1
            if self.over >= self.streak and not self.slow:
                self.slow = True
                return "link_slow", fields
            return None
        self.over = 0
        self.rtts.append(rtt)
        if self.slow:
            self.slow = False
            return "link_recovered", fields
        return None


@dataclass
class IslandStatus:
    """What the heartbeat reports. The training loop writes every field; the heartbeat thread only reads them.
    A field read together with another is one attribute, replaced whole (``held``, ``chunk_loss``,
    ``train_loss``), so the heartbeat never pairs one value with another's."""

    # (the global version the island's trajectory is based on, its params digest as verified on arrival, or ""):
    # one attribute, replaced whole, so the heartbeat never pairs one version with another's digest
    held: tuple[int, str]
    steps: int
    tokens: int
    steps_per_s: float = 0.0
    tokens_per_s: float = 0.0  # measured: auto rounds, round 1's rate (workers.pacing), kept; else every log line
    round_seconds: float = 0.0  # auto rounds: the round length the island took (0: not yet), reported to the end
    exchange: Exchange | None = None  # in flight: its push id is reported, and a lost push is sent again
    devices: int = 0  # the devices the island trains on (fewer after a quarantine)
    quarantined: tuple[Evidence, ...] = ()  # the quarantined devices' evidence (replaced whole, never mutated)
    # (the chunk's number, counting from 1; the latest chunk's per-step train losses: a device array, maybe still
    # computing, or None before the first chunk)
    chunk_loss: tuple[int, Any] = (0, None)
    # (a chunk's number, its mean train loss) as the training loop last read it (None: no chunk read yet)
    train_loss: tuple[int, float | None] = (0, None)

    def read_loss(self) -> float | None:
        """The mean train loss of the latest chunk, waiting for the devices (a host-device sync); the training
        loop's read, recorded in :attr:`train_loss` for the heartbeat."""
        number, losses = self.chunk_loss
        if losses is not None:
            self.train_loss = (number, float(np.mean(np.asarray(losses))))
        return self.train_loss[1]


class Clock:
    """The island's training wall time, and the parts of it that were not inner steps (``utilization``). The
    training loop writes every field; the heartbeat thread only reads them (:meth:`utilization`)."""

    def __init__(self) -> None:
        self.blocked_s = 0.0  # waiting for a global θ
        self.eval_s = 0.0  # evaluating global θs the coordinator asked for while training
        self.active_s = 0.0  # training wall time of the finished _train calls
        self.train_since: float | None = None  # time.perf_counter() when the running _train call began

    def stop(self) -> None:
        """A ``_train`` call ended: its wall time is added to :attr:`active_s`."""
        if self.train_since is not None:
            self.active_s += time.perf_counter() - self.train_since
        self.train_since = None

    def exclude(self, seconds: float) -> None:
        """Leaves ``seconds`` of the running ``_train`` call out of the training wall time (the loop waited
        for programs still compiling from start-up: neither training nor a wait the run caused)."""
        if self.train_since is not None:
            self.train_since += seconds

    def utilization(self) -> float:
        """Fraction of the island's training wall time so far spent in inner steps: not blocked waiting for a
        global θ, nor evaluating one the coordinator asked for."""
        active = self.active_s
        if self.train_since is not None:
            active += time.perf_counter() - self.train_since
        if active <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - (self.blocked_s + self.eval_s) / active))


class Mailbox:
    """What the heartbeat thread tells the training loop (the coordinator's word: stop, a rewind after a rejoin,
    the island's id and the run's versions), and the eval reports the loop hands the heartbeat to send.

    Per field, who writes it (every other thread only reads it):

    - :attr:`stopping`: set by the heartbeat thread (the coordinator said stop, or the run was over at a
      rejoin), by the training loop (its run ends; on a process other than 0, from process 0's word) and by
      :func:`workers.app.run_worker` as the island ends; never cleared. Calls stop retrying once it is set;
      exchanges stop pulling.
    - :attr:`final_version`: the heartbeat thread, with the stop, or an exchange's thread, with a stop in a push's
      answer (both through :meth:`stop_told`); on a process other than 0 the training loop (process 0's value).
    - :attr:`island_id`, :attr:`total_versions`: whoever joins: the training loop (the first Join) or the heartbeat
      thread (a rejoin); on a process other than 0 the training loop (process 0's values).
    - the rewind (:meth:`post_rewind`, :meth:`take_rewind`; under a lock): posted by the heartbeat thread (a
      rejoin) and by the training loop (a push the coordinator dropped or rejected); taken by the training loop.
    - the eval reports (:meth:`report_eval`, :meth:`pending_evals`, :meth:`evals_answered`; under a lock): added
      by the training loop; removed by whoever sent them in an answered heartbeat (the heartbeat thread, or the
      training loop's final heartbeat once that thread has stopped).
    - :attr:`wake`: set by the training loop (an eval report is ready, or the island stops); waited on and
      cleared by the heartbeat thread.
    """

    def __init__(self) -> None:
        self.stopping = threading.Event()  # the island is done (the run is over, or it failed)
        self.final_version = 0  # the coordinator's version when it said the run is over
        self.island_id = ""
        self.total_versions = 0  # the version the run ends at, if the coordinator knows it ahead (0: it says stop)
        self.wake = threading.Event()  # set: send a heartbeat now (an eval report is ready, or the island stops)
        self._rewind: Rewind | None = None
        self._eval_reports: dict[int, float] = {}  # version -> eval loss, sent by heartbeats until one is answered
        self._lock = threading.Lock()

    def stop_told(self, version: int) -> None:
        """The coordinator told the island to stop (a heartbeat's STOP, or a push's answer: the island is
        quarantined), at its ``version``: the island stops once it holds that version."""
        with self._lock:
            self.final_version = max(self.final_version, version)
        self.stopping.set()

    def post_rewind(self, rewind: Rewind) -> None:
        """Hands the training loop a :class:`Rewind` (applied at its next chunk boundary). One from a Join replaces
        any other; one from a push reply does not replace one from a Join."""
        with self._lock:
            if rewind.joined or self._rewind is None or not self._rewind.joined:
                self._rewind = rewind

    def take_rewind(self) -> Rewind | None:
        """The rewind posted since the last take, if any: this process's (process 0's goes to the others through
        :func:`workers.recovery.agreed_rewind`)."""
        with self._lock:
            rewind, self._rewind = self._rewind, None
        return rewind

    def rewind_posted(self) -> bool:
        """Whether a rewind waits to be taken."""
        with self._lock:
            return self._rewind is not None

    def report_eval(self, version: int, loss: float) -> None:
        """An eval loss for the heartbeats to send (until one carrying it is answered)."""
        with self._lock:
            self._eval_reports[version] = loss

    def pending_evals(self) -> list[tuple[int, float]]:
        """The eval reports not yet carried by an answered heartbeat, as (version, loss): the oldest
        :data:`dtrain.net.wire.MAX_EVAL_REPORTS` (the coordinator refuses a heartbeat with more)."""
        with self._lock:
            return sorted(self._eval_reports.items())[:MAX_EVAL_REPORTS]

    def evals_answered(self, sent: list[tuple[int, float]]) -> None:
        """A heartbeat carrying ``sent`` was answered: those reports are delivered."""
        with self._lock:
            for version, _ in sent:
                self._eval_reports.pop(version, None)


class Evaluator:
    """Evaluates the global θs the coordinator asked for (PullHeader.evaluate) on the held-out split, with the
    island's final-eval function, each version once. The training loop's: it alone uses it; the losses go to the
    heartbeat through the :class:`Mailbox`, and the time spent to the :class:`Clock` (both say who writes what)."""

    def __init__(self, setup: Setup, spec: codec.Spec, downlink: Downlink, mailbox: Mailbox, clock: Clock,
                 log: RunLog):
        self.setup, self.spec, self.downlink, self.mailbox, self.clock, self.log = \
            setup, spec, downlink, mailbox, clock, log
        self._evaluated: dict[int, float] = {}  # every version evaluated by this process

    def requested(self) -> None:
        """Evaluates each global θ asked for since the last call and hands the losses to the heartbeat (woken to
        send them at once)."""
        requests = self.downlink.eval_requests()
        for g in requests:
            loss = self.loss(g)
            if math.isfinite(loss):  # the coordinator refuses a non-finite eval report
                self.mailbox.report_eval(g.version, loss)
        if requests:
            self.mailbox.wake.set()

    def loss(self, g: GlobalParams) -> float:
        """The held-out eval loss of global θ ``g`` (computed once per version)."""
        if g.version in self._evaluated:
            return self._evaluated[g.version]
        loop = self.setup.loop
        t0 = time.perf_counter()
        loss = loop.evaluate(loop.place_params(codec.unflatten(self.spec, g.vec)), self.setup.eval_batches)
        seconds = time.perf_counter() - t0
        if 0 < self.mailbox.total_versions <= g.version:
            # the run's last θ: its eval is the run's end (every island evaluates it for its summary), and no
            # step trained from now on is merged: not training time
            self.clock.exclude(seconds)
        elif self.clock.train_since is not None:  # not inner steps: utilization leaves it out
            self.clock.eval_s += seconds
        self._evaluated[g.version] = loss
        self.log.event("evaluated", version=g.version, eval_loss=json_number(loss), seconds=round(seconds, 4))
        return loss


def finite_or_none(x: float | None) -> float | None:
    """A heartbeat's train loss: None (not sent) unless finite (a diverging chunk's loss is the NaN guard's)."""
    return x if x is not None and math.isfinite(x) else None


def chip_report(quarantined: tuple[Evidence, ...], devices: int) -> dict[str, Any]:
    """A heartbeat's chip-health fields: the whole report every time (the coordinator keeps each device's first
    evidence; ``bad_devices`` must name the same devices as the evidence)."""
    return {"bad_devices": [str(e["device"]) for e in quarantined], "quarantined": quarantined, "devices": devices}


class Heartbeat:
    """The island's heartbeat thread (process 0 only): one heartbeat every ``period_s``, one try each (no
    backoff: the next tick is the retry, so a coordinator that comes back hears from the island within a
    heartbeat, well inside its lease). A run of failures is one event, and its end another.

    It reads the :class:`IslandStatus` and ``utilization()`` (:meth:`Clock.utilization`: both the training
    loop's), and owns what only it writes: its :class:`LinkWatch`, its failure streak and the train loss it
    last read itself. Everything it tells the training loop goes through the :class:`Mailbox` (a stop, a
    rejoin's rewind, eval reports answered; ``rejoin()``, a Join on this thread, sets the mailbox's island id
    and total versions), and a push the coordinator lost is sent again through its
    :class:`workers.exchange.Exchange` (``repush``)."""

    def __init__(self, client: CoordinatorClient, status: IslandStatus, mailbox: Mailbox, period_s: float,
                 log: EventLog, rejoin: Callable[[], pb.JoinResponse], utilization: Callable[[], float]):
        self.client, self.status, self.mailbox, self.period_s = client, status, mailbox, period_s
        self.log, self.rejoin, self.utilization = log, rejoin, utilization
        self.link = LinkWatch()
        self._failing_since: float | None = None  # when the current run of failed heartbeats began
        self._loss: tuple[int, float | None] = (0, None)  # (chunk number, mean train loss) as this thread read it
        self.thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        """Starts the thread (process 0 only: the other processes of the island do not talk to the coordinator)."""
        self.thread.start()

    def stop(self) -> None:
        """Stops the island's heartbeats (sets the mailbox's stop) and waits a little for the thread to end."""
        self.mailbox.stopping.set()
        self.mailbox.wake.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)

    def _run(self) -> None:
        """The thread: a heartbeat each tick (or when woken) until the island stops."""
        box = self.mailbox
        while not box.stopping.is_set():
            box.wake.wait(self.period_s)  # a tick, or woken early (an eval report is ready)
            box.wake.clear()
            if box.stopping.is_set():
                break
            exchange = self.status.exchange
            resp = self._beat(exchange)
            if resp is not None:
                self._answer(resp, exchange)

    def train_loss(self) -> float | None:
        """The mean train loss of the latest chunk already computed (the heartbeat never waits for the devices):
        the latest chunk's if ready, else the newest one read by this thread or the training loop."""
        number, losses = self.status.chunk_loss
        if losses is not None and losses.is_ready():
            self._loss = (number, float(np.mean(np.asarray(losses))))  # note: a host-device sync (ready: no wait)
        return max(self._loss, self.status.train_loss, key=lambda read: read[0])[1]

    def _beat(self, exchange: Exchange | None) -> pb.HeartbeatResponse | None:
        """One heartbeat; its reply, or None if it failed (reported once per run of failures)."""
        status, evals = self.status, self.mailbox.pending_evals()
        version, digest = status.held
        try:
            t0 = time.perf_counter()
            resp = self.client.heartbeat(0.0, island_id=self.mailbox.island_id, version=version,
                                         params_digest=digest,
                                         steps=status.steps, tokens=status.tokens, steps_per_s=status.steps_per_s,
                                         pending_push_id=exchange.push_id if exchange is not None else "",
                                         train_loss=finite_or_none(self.train_loss()),
                                         utilization=self.utilization(), evals=evals,
                                         tokens_per_s=status.tokens_per_s, round_seconds=status.round_seconds,
                                         **chip_report(status.quarantined, status.devices))
            self.mailbox.evals_answered(evals)
            change = self.link.observe(time.perf_counter() - t0)
            if change is not None:
                self.log(change[0], **change[1])
        except CoordinatorError as e:
            if self._failing_since is None:
                self._failing_since = time.perf_counter()
                self.log("heartbeat_failed", error=str(e))
            return None
        if self._failing_since is not None:
            self.log("heartbeat_restored", after_s=round(time.perf_counter() - self._failing_since, 3))
            self._failing_since = None
        return resp

    def _answer(self, resp: pb.HeartbeatResponse, exchange: Exchange | None) -> None:
        """Does what the coordinator's reply asks: stop, rejoin, or send the push in flight again."""
        if resp.action == pb.ACTION_STOP:
            self.log("stop_requested", reason=resp.reason, version=resp.version)
            self.mailbox.stop_told(resp.version)
        elif resp.action == pb.ACTION_REJOIN:
            self.log("rejoin", reason=resp.reason)
            try:
                joined = self.rejoin()
                self.mailbox.post_rewind(Rewind(joined.shard_index, joined.cursor, resp.reason, joined=True,
                                                segment_start=joined.segment_start, segment_end=joined.cursor_end))
            except RunOverError as e:
                self.log("stop_requested", reason=str(e))
                self.mailbox.stopping.set()
            except CoordinatorError as e:
                self.log("rejoin_failed", error=str(e))
        if resp.push_unknown and exchange is not None:
            exchange.repush.set()


def final_heartbeat(client: CoordinatorClient, mailbox: Mailbox, log: EventLog, report: dict[str, Any]) -> None:
    """The island's last heartbeat, sent by the training loop once the heartbeat thread has stopped: best
    effort, one try, telling the coordinator it holds the final version. ``report``: the heartbeat's fields
    other than the island id and the eval reports (the pending ones go with it)."""
    evals = mailbox.pending_evals()
    try:
        client.heartbeat(budget_s=0.0, island_id=mailbox.island_id, evals=evals, **report)
        mailbox.evals_answered(evals)
    except CoordinatorError as e:
        log("heartbeat_failed", error=str(e))
