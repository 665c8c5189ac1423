"""The island's recovery: rewinds, the NaN/Inf guard's rollbacks, chip quarantine and the remesh after it.

Two things move an island off its trajectory. The coordinator can set where it trains next (a :class:`Rewind`:
after a rejoin, or for a push it dropped or rejected). Or the island finds its own state not to be trusted (a
:class:`Recovery`: the NaN/Inf guard fired, or chip health quarantined a device). :class:`Guard` notices the
second kind and owns the chip-health side (quarantine, the mesh of healthy devices); :class:`Rewinder` carries
either out: the island goes on from the newest global θ, discarding what it trained since its last accepted push,
on the healthy devices' mesh after a quarantine. Everything here runs on the training loop's thread
(:class:`workers.island.Worker`); the heartbeat thread only posts rewinds, through its mailbox
(:class:`workers.heartbeat.Mailbox`).
"""

from __future__ import annotations

import dataclasses
import os
import platform
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dtrain import codec
from dtrain.checkpoint import Checkpointer
from dtrain.config.sections import Config
from dtrain.health.faults import DeviceFault
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.runlog import RunLog, read_events
from dtrain.steps.inner import make_mesh
from dtrain.train.diloco import Island
from dtrain.train.loop import InnerLoop
from dtrain.train.prepare import Setup
from workers.chip_health import ChipHealth, Evidence
from workers.exchange import Exchange, GlobalParams, WorkerError
from workers.hosts import HostGroup

MAX_ROLLBACKS = 3  # NaN-guard rollbacks in a row (no push in between) before the island gives up: it diverges


@dataclass(frozen=True)
class Rewind:
    """Where the island trains next, set by the coordinator: after a (re)join (its shard and cursor) or after a
    push it dropped or rejected (the cursor its range started at). The island discards what it trained since its
    last accepted push and goes on from here on the newest global θ: no range is merged twice or left out."""

    shard: int
    cursor: int
    reason: str
    joined: bool = False  # from a Join (authoritative: replaces any other); else from a push reply
    segment_start: int = 0  # from a Join: the segment of the shard the island now trains, [start, end) (end 0:
    segment_end: int = 0  # the shard's end); a push reply's rewind stays in the island's segment


@dataclass(frozen=True)
class Recovery:
    """The island's own state is not to be trusted (a device was quarantined, or the NaN/Inf guard fired): it goes
    back to its last good state, its last push (optimizer moments from that push's checkpoint, θ the newest
    global one, plus with ``outer.fragments`` > 1 the other fragments' progress not exchanged yet at that push,
    its data cursor where that push ended), on a mesh of its healthy devices if ``remesh``."""

    reason: str
    remesh: bool = False


def in_segment(island: Island, shard: int, position: int) -> bool:
    """Whether sequence ``position`` of ``shard`` lies in the segment the island trains now: a push reply's rewind
    applies only then (a push from a segment the island has left, at a rejoin, is not its to train again)."""
    start, end = island.segment
    return shard == island.index and start <= position and (not end or position < end)


def agreed_rewind(hosts: HostGroup, rewind: Rewind | None) -> Rewind | None:
    """Process 0's rewind (the coordinator's word reaches process 0 only) on every process of the island."""
    if hosts.alone:
        return rewind
    shared = hosts.agree(dataclasses.asdict(rewind) if rewind is not None else None)
    return Rewind(**shared) if shared is not None else None


def step_counter(island: Island) -> int:
    """The state's inner-step counter; the island's step where a failed computation took the state with it
    (a real device failure after dispatch: the donated buffers are gone)."""
    try:
        return int(island.state.step)
    except Exception:  # noqa: BLE001 - any runtime error reading a lost buffer
        return island.steps


class Guard:
    """The island's checks on its own state: the NaN/Inf guard (with its rollbacks) and chip health ([health]
    enabled: :class:`workers.chip_health.ChipHealth`, with its quarantines and the mesh of the healthy devices).

    Owned by the training loop's thread: it alone reads and writes every field. What the heartbeat reports of it
    (the quarantined devices' evidence, the mesh's size) the loop copies into the island's status."""

    def __init__(self, cfg: Config, setup: Setup, health: ChipHealth | None, fault: DeviceFault | None,
                 log: RunLog, name: str):
        """``setup``: its ``loop`` is replaced by a remesh; ``fault``: the injected device fault the rebuilt
        inner loop keeps (testing only)."""
        self.cfg, self.setup, self.health, self.fault, self.log, self.name = cfg, setup, health, fault, log, name
        self.rollbacks = 0  # NaN-guard rollbacks since the last push
        self.nan_rollbacks = 0  # all of them
        self._finite: list[Any] = []  # the NaN/Inf guard's per-step flags not looked at yet (device arrays)
        self._unread: Any = None  # with chip health: the flags of the chunk whose check is pending (overlap)
        self.drained = ""  # why the island stopped training early (too few healthy devices), if it did

    def evidence(self) -> tuple[Evidence, ...]:
        """The quarantined devices' evidence, in the order found (none without chip health)."""
        return tuple(self.health.quarantined.values()) if self.health is not None else ()

    def shortfall_reason(self) -> str:
        """Why the island cannot train on its healthy devices ('' if it can)."""
        if self.health is None or not self.health.too_few():
            return ""
        return (f"{len(self.health.healthy_ids)} healthy device(s) left, fewer than [health] "
                f"min_devices={self.cfg.health.min_devices}")

    def start(self) -> None:
        """The known answer on every device before anything compiles; a device that fails it is quarantined and
        the island starts on the others."""
        if self.health is None:
            return
        found = self.health.start(0)
        self.quarantined(found)
        shortfall = self.shortfall_reason()
        if shortfall:
            raise WorkerError(f"{shortfall}: this island cannot train (see the device_quarantined events in "
                              f"{self.log.dir / 'events.jsonl'})")
        if found:  # the first compile is then the healthy mesh's
            self.log.event("remeshed", **self.remesh(), cursor=0, version=0, restored="start")

    def quarantined(self, found: list[Evidence]) -> None:
        """Logs each device just quarantined."""
        assert self.health is not None
        for ev in found:
            self.log.event("device_quarantined", **ev, healthy=len(self.health.healthy_ids))
            self.log.progress(f"{self.name}: device {ev['device']} quarantined ({ev['probe']}, step {ev['step']}): "
                              f"{ev['detail']}")

    def watch(self, finite: Any) -> None:
        """Keeps a chunk's per-step finite flags (a device array) for the next look (:meth:`tripped`)."""
        self._finite.append(finite)

    def tripped(self) -> bool:
        """The NaN/Inf guard: was any step since the last look not finite (loss or gradient, any device)?"""
        flags, self._finite = self._finite, []
        return not all(bool(np.all(np.asarray(f))) for f in flags)

    def forget(self) -> None:
        """Drops the flags not looked at yet, and chip health's pending check: their steps were discarded (a
        recovery), unread."""
        self._finite.clear()
        self._unread = None
        if self.health is not None:
            self.health.drop()

    def next_first(self, island: Island) -> int:
        """The inner step the island's next chunk starts at: known from chip health's pending check, else read
        from the state (a host sync, when nothing is pending: at a round's start, after a recovery)."""
        after = self.health.next_step if self.health is not None else None
        return after if after is not None else int(island.state.step)

    def settle(self, island: Island) -> Recovery | None:
        """Before a push: chip health's pending check read (the round's last chunk), then the NaN/Inf guard over
        the round; a :class:`Recovery` if either found something (the round is not pushed)."""
        if self.health is not None:
            cleared = len(self.health.cleared)
            found = self.health.flush(island.state.params)
            self._unread = None
            self._log_cleared(cleared)
            if found:
                return self.quarantine_recovery(found, "a probe found it")
        return self.nan_recovery(island) if self.tripped() else None

    def _log_cleared(self, since: int) -> None:
        assert self.health is not None
        for ev in self.health.cleared[since:]:
            self.log.event("device_suspect_cleared", **ev)

    def pushed(self) -> None:
        """A round was pushed: the rollbacks in a row start again."""
        self.rollbacks = 0

    def nan_recovery(self, island: Island) -> Recovery:
        """The guard fired: a rollback to the last push, or a :class:`WorkerError` after too many in a row."""
        self.rollbacks += 1
        self.nan_rollbacks += 1
        self.log.event("nan_guard", step=island.steps, cursor=island.cursor, rollbacks=self.rollbacks)
        if self.rollbacks > MAX_ROLLBACKS:
            raise WorkerError(f"training diverges: a non-finite loss or gradient again after {MAX_ROLLBACKS} "
                              f"rollbacks to the last push (island step {island.steps}); lower [train] lr or "
                              f"grad_clip, or check the data")
        return Recovery(f"NaN/Inf guard: a non-finite loss or gradient before island step {island.steps}")

    def quarantine_recovery(self, found: list[Evidence], how: str) -> Recovery:
        """Devices were quarantined (``how``: what found them): back to the last push on the others, or drained
        (:attr:`drained` set) when too few are left."""
        self.quarantined(found)
        devices = [ev["device"] for ev in found]
        self.drained = self.shortfall_reason()
        return Recovery(f"device(s) {devices} quarantined ({how})", remesh=True)

    def diagnose(self, error: Exception, first: int, n: int) -> Recovery | None:
        """A chunk of ``n`` steps from step ``first`` raised ``error``: which device failed? The known answer on
        each, now (at the chunk's last step: a dead chip stays dead). None: not a device's failure, or one gone
        again (an intermittent one): the error stands."""
        assert self.health is not None
        self.health.drop()  # the pending check's chunk went with the state: the recovery discards it
        self._unread = None
        found = self.health.diagnose(first + n - 1)
        if not found:
            return None
        self.log.event("chunk_failed", step=first, steps=n, error=f"{type(error).__name__}: {error}")
        return self.quarantine_recovery(found, "its computation raised")

    def check_chunk(self, island: Island, first: int, n: int, cursor: int, metrics: dict[str, Any]
                    ) -> Recovery | None:
        """Chip health's look at a chunk of ``n`` steps from step ``first`` and data ``cursor`` just dispatched,
        overlapped (:meth:`workers.chip_health.ChipHealth.overlap`): its probes are dispatched behind it, and what
        is read now (a host sync) is the chunk before it, which has run, with that chunk's NaN/Inf flags; a
        :class:`Recovery` if either found something. :meth:`settle` reads the last chunk before a push."""
        assert self.health is not None
        batch = self.cfg.train.batch_size
        cleared = len(self.health.cleared)
        before, self._unread = self._unread, metrics["finite"]
        found = self.health.overlap(first, metrics, island.state.params, island.stream.batches(cursor, n, batch))
        self._log_cleared(cleared)
        if found:
            return self.quarantine_recovery(found, "a probe found it")
        if before is not None and not bool(np.all(np.asarray(before))):
            return self.nan_recovery(island)
        return None

    def report_drained(self, island: Island, version: int) -> None:
        """The island stops training: too few healthy devices (:attr:`drained` says so)."""
        assert self.health is not None
        self.log.event("drained", reason=self.drained, devices=len(self.health.healthy_ids), shard=island.index,
                       cursor=island.cursor, version=version)
        self.log.progress(f"{self.name}: drained: {self.drained}; the coordinator reroutes shard {island.index}")

    def remesh(self) -> dict[str, Any]:
        """Rebuilds the inner loop on the healthy devices, with the same global batch (the quarantined devices'
        rows go to the others: :func:`dtrain.steps.inner.rows_per_device`); the caller compiles it before it trains."""
        assert self.health is not None
        old = self.setup.loop
        healthy = set(self.health.healthy_ids)
        mesh = make_mesh(self.cfg, [d for d in old.mesh.devices.flat if d.id in healthy], remesh=True)
        loop = self.setup.loop = InnerLoop(self.cfg, old.model, mesh, per_device=True, fault=self.fault)
        self.health.rebind(mesh)
        return {"devices": mesh.devices.size, "device_ids": [int(d.id) for d in mesh.devices.flat],
                "rows_per_device": list(loop.rows), "from_devices": old.mesh.devices.size,
                "fsdp": mesh.shape["fsdp"]}


def tokens_trained(events: Iterable[Mapping[str, Any]], run_id: str) -> int:
    """The tokens an island's earlier processes of run ``run_id`` trained, from its own ``events``
    (``RUN_DIR/islands/NAME/events.jsonl``): the highest ``tokens`` of a ``trained`` or ``train`` event logged after
    a ``joined`` event of that run; 0 for a first start (or a folder of another run). A restarted island counts on
    from there, so its events' ``tokens`` only grow: what its killed process trained after its last push counts,
    as a rewound range does, although that range is trained again (the tokens merged are the audit's)."""
    tokens, this_run = 0, False
    for e in events:
        kind = e.get("event")
        if kind == "joined":
            this_run = e.get("run_id") == run_id
        elif this_run and kind in ("trained", "train") and isinstance(e.get("tokens"), int):
            tokens = max(tokens, e["tokens"])
    return tokens


class Rewinder:
    """Carries out a :class:`Rewind` or a :class:`Recovery` on the training loop's thread (its only user): the
    island goes to the rewind's shard and cursor on the newest global θ, or back to its last push's state (on
    the healthy devices' mesh after a quarantine). With ``outer.fragments`` > 1 it also keeps, for the island's
    last two pushes, the progress not exchanged yet at that push (:meth:`keep_progress`): a rewind or a recovery
    to where one of them ended keeps that progress on the newest θ, so only the range trained since is
    discarded."""

    def __init__(self, cfg: Config, setup: Setup, spec: codec.Spec, guard: Guard, hosts: HostGroup,
                 log: RunLog, name: str, pull: Callable[[GlobalParams], GlobalParams],
                 precompile: Callable[[], None]):
        """``pull(have)``: the newest global θ on every process; ``precompile()``: compiles the (rebuilt) inner
        loop before it trains."""
        self.cfg, self.setup, self.spec, self.guard, self.hosts = cfg, setup, spec, guard, hosts
        self.log, self.name, self.pull, self.precompile = log, name, pull, precompile
        self._progress: dict[tuple[int, int], np.ndarray] = {}  # (shard, cursor) of a push -> its unsent progress

    def keep_progress(self, shard: int, cursor: int, unsent: np.ndarray) -> None:
        """At a push whose range ends at ``cursor`` of ``shard``: θ_local − θ_anchor with the pushed fragment's
        values zeroed (``dtrain.train.fragments.unsent``), the other fragments' progress since their own last exchange.
        The last two pushes' are kept (a rewind goes back at most to the start of the push in flight)."""
        self._progress[(shard, cursor)] = unsent
        while len(self._progress) > 2:
            del self._progress[next(iter(self._progress))]

    @property
    def loop(self) -> InnerLoop:
        """The island's inner loop (a remesh replaces it)."""
        return self.setup.loop

    def state_from(self, vec: np.ndarray, ckpt: Checkpointer) -> Any:
        """A train state on the island's mesh: θ the flat ``vec``, the optimizer moments from the island's last
        checkpoint (saved at its last push) when there is one of this run, else fresh ones."""
        params = codec.unflatten(self.spec, vec)  # on the host: placed (copied) once, below
        ckpt.wait()  # a save still being written is the last push's
        if ckpt.latest_step() is not None:
            # into this mesh's shardings (a remeshed island's too), from the state's shapes: no fresh state is
            # initialized only to be replaced
            _, restored, meta = ckpt.restore(self.loop.abstract_state())
            if meta.get("fingerprint") == self.cfg.fingerprint():
                self.log.event("island_restored", step=meta.get("steps"))
                return restored.replace(params=self.loop.place_params(params))  # optimizer moments; θ from the pull
        return self.loop.init_state(params)

    def start_island(self, joined: pb.JoinResponse, g: GlobalParams, ckpt: Checkpointer) -> Island:
        """The island on its shard from the coordinator's cursor (``joined``), θ from ``g``, the optimizer moments
        from its last checkpoint (:meth:`state_from`)."""
        island = Island(index=joined.shard_index, state=self.state_from(g.vec, ckpt),
                        stream=self.setup.shards[joined.shard_index].stream, cursor=int(joined.cursor),
                        segment=(int(joined.segment_start), int(joined.cursor_end)))
        island.steps = island.cursor // self.cfg.train.batch_size  # a rejoining island goes on where its data ends
        # a restarted island's count goes on from what its earlier processes of this run trained
        island.tokens = tokens_trained(read_events(self.log.dir, skip_torn=True, missing_ok=True), joined.run_id)
        self.log.event("island_started", name=self.name, shard=joined.shard_index, cursor=island.cursor,
                       segment=list(island.segment), tokens=island.tokens,
                       version=g.version, devices=len(self.loop.mesh.devices.flat), host=platform.node(),
                       cpus=sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None)
        self.log.progress(f"{self.name}: shard {joined.shard_index}, cursor {island.cursor}, v{g.version}")
        return island

    def checkpoint(self, island: Island, version: int, ckpt: Checkpointer) -> None:
        """Saves the island's state as it pushes θ based on ``version``: what :meth:`state_from` restores."""
        ckpt.save(island.steps, island.state, {"steps": island.steps, "cursor": island.cursor,
                                               "tokens": island.tokens, "version": version,
                                               "fingerprint": self.cfg.fingerprint()})

    def apply(self, island: Island, anchor: GlobalParams, rewind: Rewind, start: int, recovery: Recovery | None,
              last_exchange: Exchange | None, ckpt: Checkpointer) -> tuple[GlobalParams, bool]:
        """Moves the island to ``rewind``'s shard and cursor on the newest θ, discarding what it trained since
        ``start`` (the cursor its unpushed progress began at); returns (θ_anchor, whether it moved). The caller
        has finished the exchange in flight: if the coordinator accepted its push (``last_exchange``), the
        rewind starts after that push's range; if the island stands where the coordinator says, nothing is
        discarded. With a ``recovery`` the island's state is replaced whatever the cursor: θ the newest (plus the
        kept progress, as for a rewind), the optimizer moments from the last push's checkpoint, on the healthy
        devices' mesh if it remeshes."""
        executed_step = step_counter(island) if recovery is not None else 0  # before the mesh goes
        remeshed = self.guard.remesh() if recovery is not None and recovery.remesh else {}
        if last_exchange is not None:  # its push, taken after the cursor was named, moved the cursor
            rewind = dataclasses.replace(rewind, cursor=last_exchange.accepted_range_end(rewind.shard,
                                                                                         rewind.cursor))
        agreed = agreed_rewind(self.hosts, rewind)  # process 0 alone knows its last exchange's reply
        assert agreed is not None
        rewind = agreed
        if rewind.joined:  # the segment the coordinator assigned: the island trains to its end
            island.segment = (rewind.segment_start, rewind.segment_end)
        # ``start`` is then the last push's end: the island's progress since that push is what it has not pushed
        if recovery is None and rewind.shard == island.index and rewind.cursor == start:
            self.log.event("rewind_kept", shard=island.index, cursor=start, reason=rewind.reason)
            return anchor, False
        latest = self.pull(anchor)  # the newest θ: the retrained range is pushed against it
        # fragments: the progress not exchanged when the range began stays, on the newest θ (as a fold-in). At a
        # recovery too: it was taken at a push, from the state the guard had cleared for that push (chip health's
        # check and the NaN/Inf guard are read before every push), as the pushed fragment was; what the recovery
        # distrusts is what was trained after that push, and that is discarded.
        kept = self._progress.get((rewind.shard, rewind.cursor))
        vec = latest.vec if kept is None else latest.vec + kept
        if recovery is None:
            island.state = island.state.replace(params=self.loop.place_params(codec.unflatten(self.spec, vec)))
        else:
            if remeshed:
                self.precompile()
            # The step counter goes on (a fault tied to device time does not replay with the retrained range)
            step = jax.device_put(jnp.asarray(executed_step, jnp.int32), self.loop.state_sharding.step)
            island.state = self.state_from(vec, ckpt).replace(step=step)
            self.guard.forget()
        self._report(island, rewind, start, recovery, latest, remeshed, kept is not None)
        # The island now stands at the rewind's cursor with that progress on the newest θ: a rewind there again (its
        # next push refused too) keeps it again; nothing else it kept holds any more
        self._progress = {(rewind.shard, rewind.cursor): kept} if kept is not None else {}
        batch = self.cfg.train.batch_size
        island.index, island.stream = rewind.shard, self.setup.shards[rewind.shard].stream
        island.cursor, island.steps = rewind.cursor, rewind.cursor // batch
        return latest, True

    def _report(self, island: Island, rewind: Rewind, start: int, recovery: Recovery | None,
                latest: GlobalParams, remeshed: dict[str, Any], kept: bool = False) -> None:
        """The ``rewound`` (and ``remeshed``) events and progress lines, before the island moves."""
        batch = self.cfg.train.batch_size
        discarded = (island.cursor - start) // batch  # unpushed progress, thrown away
        # Steps trained again: a dropped or rejected range, and the progress after it, on the same shard.
        again = (island.cursor - rewind.cursor) // batch if rewind.shard == island.index else 0
        self.log.event("rewound", from_shard=island.index, from_cursor=island.cursor, to_shard=rewind.shard,
                       to_cursor=rewind.cursor, discarded_steps=discarded, retrained_steps=max(again, 0),
                       version=latest.version, restored=recovery is not None,
                       reason=rewind.reason if recovery is None else recovery.reason,
                       **({"kept_unsent": True} if kept else {}))
        if remeshed:
            self.log.event("remeshed", **remeshed, cursor=rewind.cursor, version=latest.version,
                           restored="last push")
            self.log.progress(f"{self.name}: remeshed on {remeshed['devices']} devices "
                              f"(rows per device {remeshed['rows_per_device']})")
        self.log.progress(f"{self.name}: rewound to shard {rewind.shard} cursor {rewind.cursor} "
                          f"({discarded} steps discarded): {rewind.reason}")
