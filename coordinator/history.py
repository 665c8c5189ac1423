"""What the coordinator shows of a run's past (the Status RPC's rounds, evals and faults; the dashboard's charts): a
fold over its own events, so it shows exactly what ``events.jsonl`` records, and a resumed coordinator rebuilds it
by reading that file back (:meth:`RunHistory.replay`).

It also holds what the islands report that the state machine does not decide on (:class:`IslandView`: train loss,
utilization, device kind, bytes, last call) and which island evaluates which version (:meth:`RunHistory.assign_eval`).
None of it is checkpointed: it is a view, and the events are its record.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.edge import MAX_ISLAND_ID_LEN
from coordinator.series import HISTORY_FILE, RunSeries
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.wire import MAX_EVAL_REPORTS
from dtrain.runlog import fault_kind, printable, read_events

MAX_ROUNDS = 500  # RoundRecords kept for Status (the dashboard's bytes chart)
MAX_EVALS = 500  # EvalPoints kept
MAX_FAULTS = 100  # FaultRecords kept
MAX_DETAIL = 512  # characters of a FaultRecord's detail
EVAL_REASSIGN_S = 120.0  # an asked island that has not reported for this long: the next puller is asked instead
EVAL_CONFIRMATIONS = 2  # independent agreeing reports that make a version's eval loss a confirmed figure
EVAL_RTOL = 1e-2  # reports this close (relative) agree: the same θ and batches on other devices and meshes
EVAL_HOLD_S = 2 * EVAL_REASSIGN_S  # a lone report no second one came for in this long is recorded unconfirmed

_DETAIL_KEYS = ("reason", "error", "detail", "code", "method", "peer")


@dataclass
class IslandView:
    """An island's latest reports (heartbeats, Join) and its traffic, as Status shows them."""

    device_kind: str = ""
    train_loss: float | None = None
    utilization: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0
    last_seen: float = 0.0


def fault_detail(record: dict[str, Any]) -> str:
    """One line saying what a fault event recorded, escaped and at most :data:`MAX_DETAIL` characters (an event
    written before the coordinator bounded requests at its edge may hold anything: a replay keeps it small)."""
    if record["event"] == "device_quarantined":
        text = f"device {record.get('device')} ({record.get('probe')}, step {record.get('step')}): " \
               f"{record.get('detail', '')}"
    elif record["event"] == "coordinator_resumed":
        text = f"resumed at version {record.get('version')}"
    else:
        text = "; ".join(f"{k}={record[k]}" if k in ("code", "method", "peer") else str(record[k])
                         for k in _DETAIL_KEYS if record.get(k) not in (None, ""))
    return printable(text, MAX_DETAIL)


def island_of(record: dict[str, Any]) -> str:
    """The island an event names, as Status keeps it: escaped, at most an island id's length (see
    :func:`fault_detail`)."""
    return printable(str(record.get("island", "")), MAX_ISLAND_ID_LEN)


class RunHistory:
    """The fold (see the module docstring). :meth:`observe` takes each event as the coordinator logs it. The past is
    kept as the Status messages' own records (never changed once made), so Status lists them as they are."""

    def __init__(self, run_dir: Path | None = None, replay: bool = False) -> None:
        """``run_dir``: where the per-version series is kept (:data:`coordinator.series.HISTORY_FILE`); None:
        nowhere (a finished run's replay). ``replay``: first fold the events already there (:meth:`replay`)."""
        self.series = RunSeries(Path(run_dir) / HISTORY_FILE if run_dir is not None else None)
        self.rounds: deque[pb.RoundRecord] = deque(maxlen=MAX_ROUNDS)
        self.evals: deque[pb.EvalPoint] = deque(maxlen=MAX_EVALS)
        self.faults: deque[pb.FaultRecord] = deque(maxlen=MAX_FAULTS)
        self.tokens_at: dict[int, int] = {0: 0}  # version -> tokens merged into it (cumulative)
        self.evaluated: set[int] = set()
        self.islands: dict[str, IslandView] = {}
        self._asked: dict[int, dict[str, float]] = {}  # version -> {island asked to evaluate it: when}
        self._reports: dict[int, dict[str, float]] = {}  # version not settled -> {island: the loss it reported}
        self._held_since: dict[int, float] = {}  # version not settled -> when its first report came
        self._disputed: set[int] = set()  # versions whose reports disagreed: a third island is asked
        self._pulled: dict[int, set[str]] = {}  # eval version not asked yet -> the islands that pulled it
        self.evals_asked: Counter[str] = Counter()  # island -> evals asked of it (this coordinator process)
        if replay and run_dir is not None:
            self.replay(Path(run_dir))

    def replay(self, run_dir: Path) -> None:
        """Folds the events a previous coordinator of this run wrote (a resume; ``dtrain dashboard``): torn lines
        are skipped; the islands' train losses come back from the series' file."""
        path = Path(run_dir) / "events.jsonl"
        self.series.load_losses(Path(run_dir))
        keep, self.series.path = self.series.path, None  # not rewritten while it is read back
        try:
            if path.exists():
                for record in read_events(run_dir, skip_torn=True):
                    self.observe(record)
        finally:
            self.series.path = keep

    def observe(self, record: dict[str, Any]) -> None:
        kind = record.get("event")
        t = float(record.get("t", 0.0))
        if kind == "round_merged":
            pushes = record.get("pushes", [])
            version = int(record["version"])
            tokens = sum(int(p.get("tokens", 0)) for p in pushes)
            self.tokens_at[version] = self.tokens_merged_at(version - 1) + tokens
            self.rounds.append(pb.RoundRecord(
                version=version, t=t, pushes=len(pushes), tokens=tokens,
                bytes_in=sum(int(p.get("bytes", 0)) for p in pushes), merge_s=float(record.get("merge_s", 0.0)),
                max_staleness=max((float(p.get("staleness", 0)) for p in pushes), default=0.0)))
        elif kind == "coordinator_resumed":  # merges logged after the restored checkpoint were rolled back
            version = int(record.get("version", 0))
            self.tokens_at = {v: n for v, n in self.tokens_at.items() if v <= version}
            while self.rounds and self.rounds[-1].version > version:
                self.rounds.pop()
        elif kind == "eval":
            version = int(record["version"])
            self.evaluated.add(version)
            by = [printable(str(i), MAX_ISLAND_ID_LEN) for i in record.get("confirmed_by", [])][:EVAL_CONFIRMATIONS]
            self.evals.append(pb.EvalPoint(version=version, tokens=int(record.get("tokens", 0)),
                                           loss=float(record["loss"]), island_id=island_of(record), t=t,
                                           confirmed=bool(record.get("confirmed", False)), confirmed_by=by))
        fault = fault_kind(record)
        if fault:
            self.faults.append(pb.FaultRecord(t=t, kind=fault, island_id=island_of(record),
                                              detail=fault_detail(record)))
        losses = {i: v.train_loss for i, v in self.islands.items() if v.train_loss is not None}
        self.series.observe(record, self.tokens_merged_at(int(record["version"])) if kind == "round_merged" else 0,
                            losses)

    def _tokens_before(self, version: int) -> int:
        earlier = [v for v in self.tokens_at if v < version]
        return self.tokens_at[max(earlier)] if earlier else 0

    def tokens_merged_at(self, version: int) -> int:
        """Tokens merged into ``version`` (0 for θ_0), as the round_merged events recorded them."""
        return self.tokens_at[version] if version in self.tokens_at else self._tokens_before(version)

    def island(self, island_id: str) -> IslandView:
        return self.islands.setdefault(island_id, IslandView())

    # -- evaluation -------------------------------------------------------------------------------

    def assign_eval(self, island_id: str, version: int, final: bool, every: int, now: float,
                    live: Collection[str] = ()) -> bool:
        """Whether the island that is about to hold ``version`` (a pull) should evaluate it: a version on the
        ``every`` grid (θ_0 included; 0: none) or the run's final one, not settled yet (:meth:`eval_report`), and
        asked of fewer islands still expected to answer (asked less than EVAL_REASSIGN_S ago, or answered) than it
        needs: :data:`EVAL_CONFIRMATIONS` (fewer when fewer islands are ``live``), one more once two disagreed.

        An eval is time an island does not train, so first asks are spread: the puller is passed over while a
        ``live`` island that has not pulled this version yet has been asked fewer evals; it will be asked when
        it pulls. (Were it never to pull this version, it would be asked for a later one: the grid point is
        then missing from the eval curve, never evaluated twice.)"""
        if version in self.evaluated or not (final or (every > 0 and version % every == 0)):
            return False
        asked = self._asked.setdefault(version, {})
        reports = self._reports.get(version, {})
        if island_id in reports:
            return False
        if island_id not in asked:
            expected = [i for i, t in asked.items() if i in reports or now - t < EVAL_REASSIGN_S]
            needed = EVAL_CONFIRMATIONS + (version in self._disputed)
            if len(expected) >= min(needed, max(len(live), 1)):
                return False
            if not asked and not final:
                pulled = self._pulled.setdefault(version, set())
                pulled.add(island_id)
                mine = self.evals_asked[island_id]
                if any(self.evals_asked[i] < mine for i in live if i not in pulled):
                    return False
            self.evals_asked[island_id] += 1
        for v in [v for v in self._pulled if v <= version]:  # asked now, or passed over by a newer version
            del self._pulled[v]
        asked[island_id] = now
        return True

    def eval_report(self, island_id: str, version: int, loss: float, now: float,
                    live: Collection[str] = ()) -> list[dict[str, Any]]:
        """The events an island's eval report makes (the caller logs them; the fold records them): none for a
        retried report, one never asked for or of a settled version. The caller has checked its values
        (:func:`check_eval_reports`). The rule (docs/faults.md): a version's figure is the run's on the word of
        two islands whose independent reports agree within :data:`EVAL_RTOL` (an ``eval`` event with
        ``confirmed`` true, ``confirmed_by`` naming them); reports that disagree are an ``eval_disagreement``
        fault naming every reporter and its loss, and a third island is asked; a lone report is held while
        another ``live`` island could check it, else recorded with ``confirmed`` false (:meth:`settle_evals`)."""
        asked = self._asked.get(version, {})
        reports = self._reports.setdefault(version, {})
        if version in self.evaluated or island_id not in asked or island_id in reports:
            return []
        reports[island_id] = loss
        self._held_since.setdefault(version, now)
        agree = [i for i, x in reports.items() if i != island_id and math.isclose(x, loss, rel_tol=EVAL_RTOL)]
        if agree:
            return [self._settle(version, [agree[0], island_id])]
        if len(reports) > 1:
            self._disputed.add(version)
            return [{"event": "eval_disagreement", "version": version, "island": island_id,
                     "reports": {i: x for i, x in reports.items()},
                     "reason": f"eval of v{version}: " + ", ".join(f"{i} reported {x:.6g}" for i, x in
                                                                  reports.items()) +
                               f" (more than {EVAL_RTOL:g} apart): no figure recorded until two agree"}]
        return []

    def settle_evals(self, now: float, live: Collection[str]) -> list[dict[str, Any]]:
        """The ``eval`` events (``confirmed`` false) of lone reports that no other island can check any more: no
        other island is ``live`` nor asked less than EVAL_REASSIGN_S ago (one that finished the run may still
        report), or held :data:`EVAL_HOLD_S` with no second report."""
        out = []
        for version, reports in list(self._reports.items()):
            if len(reports) == 1 and version not in self.evaluated and version not in self._disputed:
                (only,) = reports
                asked = [i for i, t in self._asked.get(version, {}).items() if now - t < EVAL_REASSIGN_S]
                if not [i for i in (*live, *asked) if i != only] or now - self._held_since[version] >= EVAL_HOLD_S:
                    out.append(self._settle(version, [only]))
        return out

    def _settle(self, version: int, islands: list[str]) -> dict[str, Any]:
        """A version's ``eval`` event, on the word of ``islands`` (two agreeing: confirmed; one: not)."""
        losses = [self._reports[version][i] for i in islands]
        self.evaluated.add(version)  # the fold adds it too (a replay); here so that nothing settles it twice
        for table in (self._asked, self._reports, self._held_since):
            table.pop(version, None)
        self._disputed.discard(version)
        confirmed = len(islands) >= EVAL_CONFIRMATIONS
        return {"event": "eval", "version": version, "loss": statistics.median(losses), "island": islands[0],
                "confirmed": confirmed, "confirmed_by": islands if confirmed else [],
                "tokens": self.tokens_merged_at(version)}


def eval_progress(event: dict[str, Any]) -> str:
    """The progress line of an event :meth:`RunHistory.eval_report` made."""
    if event["event"] == "eval_disagreement":
        return f"v{event['version']}: eval reports disagree: {event['reason']}"
    by = (f"confirmed by {' and '.join(event['confirmed_by'])}" if event["confirmed"]
          else f"UNCONFIRMED: {event['island']}'s word alone")
    return f"v{event['version']}: global eval loss {event['loss']:.4f} ({event['tokens']:,} tokens; {by})"


def check_eval_reports(reports: Iterable[tuple[int, float]], version: int) -> str:
    """'' if every (version, loss) an island reported can be true, else what is wrong with the first that cannot:
    a version the coordinator has not produced, a loss that is not a finite number >= 0, or too many."""
    reports = list(reports)
    if len(reports) > MAX_EVAL_REPORTS:
        return f"evals: {len(reports)} reports in one heartbeat, at most {MAX_EVAL_REPORTS}"
    for v, loss in reports:
        if v > version:
            return f"evals: version {v} is newer than the coordinator's latest, {version}"
        if not (math.isfinite(loss) and loss >= 0):
            return f"evals: version {v}: loss {loss} is not a finite number >= 0"
    return ""
