"""workers.rounds (the island's round planner) and the pieces of the island's exchange: the bounded pull and
the exchange thread, against fake coordinator clients (the real path: tests/test_simulate_processes.py)."""

from __future__ import annotations

import dataclasses
import random
import statistics
import threading
import time

import grpc
import numpy as np
import pytest

from dtrain.codec import params_digest
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.train.loop import chunks
from island_helpers import Events, FakeClient, N, full_pull, random_vec, update_pull
from workers.client import CoordinatorError
from workers.exchange import Exchange, GlobalParams, Puller, WorkerError
from workers.rounds import Action, Kind, RoundProgress, Schedule, next_action

TRAIN, WAIT, END_ROUND, END_RUN = Kind.TRAIN, Kind.WAIT, Kind.END_ROUND, Kind.END_RUN


def _schedule(H: int = 20, per_call: int = 10, total: int = 40, overlap: bool = True, tau: int = 5,
              round_seconds: float = 0.0) -> Schedule:
    return Schedule(inner_steps=H, steps_per_call=per_call, total_steps=total, overlap=overlap,
                    overlap_steps=tau if overlap else 0, round_seconds=round_seconds)


def _run(s: Schedule, exchange_chunks: int | None, limit: int = 1000) -> list[Action]:
    """Replays a step-round run: an exchange returns after ``exchange_chunks`` chunks (None: only when waited
    for). Returns every action, as the worker's loop would carry it out."""
    actions: list[Action] = []
    round_steps = steps = 0
    in_flight, chunks_since_push = False, 0
    while len(actions) < limit:
        a = next_action(s, RoundProgress(round_steps=round_steps, island_steps=steps, exchange_in_flight=in_flight))
        actions.append(a)
        if a.kind is END_RUN:
            return actions
        if a.kind is WAIT:
            in_flight = False
        elif a.kind is TRAIN:
            round_steps, steps, chunks_since_push = round_steps + a.steps, steps + a.steps, chunks_since_push + 1
            if in_flight and exchange_chunks is not None and chunks_since_push >= exchange_chunks:
                in_flight = False  # folded in at the chunk boundary, without waiting
        else:
            assert not in_flight, "a round ended with the previous exchange in flight"
            round_steps, in_flight, chunks_since_push = 0, True, 0
    raise AssertionError("the run did not end")


def _short(actions: list[Action]) -> list[object]:
    return [a.steps if a.kind is TRAIN else a.reason if a.kind is WAIT else a.kind.value for a in actions]


def test_step_rounds_without_overlap_wait_right_after_each_push_but_the_last():
    s = _schedule(overlap=False)
    assert _short(_run(s, exchange_chunks=None)) == [
        10, 10, "end_round", "no overlap", 10, 10, "end_round", "end_run"]


def test_step_rounds_with_overlap_stop_at_tau_and_wait_there_for_a_slow_exchange():
    s = _schedule(tau=5)
    assert _short(_run(s, exchange_chunks=None)) == [
        5, 10, 5, "end_round", 5, "overlap budget spent", 10, 5, "end_round", "end_run"]
    # An exchange that returns within the first chunk is folded in without waiting.
    assert _short(_run(s, exchange_chunks=1)) == [5, 10, 5, "end_round", 5, 10, 5, "end_round", "end_run"]


def test_a_round_shorter_than_tau_waits_at_its_end():
    s = _schedule(H=3, total=6, tau=5)
    assert _short(_run(s, exchange_chunks=None)) == [
        3, "end_round", 3, "round ended before the exchange", "end_round", "end_run"]


def test_overlap_with_a_zero_budget_waits_at_the_start_of_each_round():
    s = _schedule(tau=0)
    assert _short(_run(s, exchange_chunks=None)) == [
        10, 10, "end_round", "overlap budget spent", 10, 10, "end_round", "end_run"]


def test_the_last_round_is_cut_to_the_step_budget():
    s = _schedule(H=20, total=45, tau=5)
    assert _short(_run(s, exchange_chunks=1)) == [
        5, 10, 5, "end_round", 5, 10, 5, "end_round", 5, "end_round", "end_run"]


def test_the_run_ends_only_at_a_round_start_on_the_last_version():
    s = _schedule(round_seconds=1.5)
    assert next_action(s, RoundProgress(0, 7, final_version=True)) == Action(END_RUN)
    assert next_action(s, RoundProgress(5, 7, final_version=True)) == Action(TRAIN, 10)  # the round goes on
    assert next_action(_schedule(), RoundProgress(0, 3, final_version=True)) == Action(END_RUN)


def test_wall_time_rounds():
    s = _schedule(round_seconds=1.5, tau=5, total=10)
    # A round takes at least one chunk, and the step budget does not apply.
    assert next_action(s, RoundProgress(0, 500, since_arrival_s=9.0)) == Action(TRAIN, 5)
    assert next_action(s, RoundProgress(5, 505, since_arrival_s=1.0)) == Action(TRAIN, 10)
    assert next_action(s, RoundProgress(15, 515, since_arrival_s=1.5)) == Action(END_ROUND)
    # With the exchange in flight the deadline is not known yet: train up to τ, then wait.
    assert next_action(s, RoundProgress(3, 3, exchange_in_flight=True, since_arrival_s=9.0)) == Action(TRAIN, 2)
    assert (next_action(s, RoundProgress(5, 5, exchange_in_flight=True, since_arrival_s=9.0))
            == Action(WAIT, reason="overlap budget spent"))
    assert (next_action(_schedule(round_seconds=1.5, overlap=False), RoundProgress(0, 9, exchange_in_flight=True))
            == Action(WAIT, reason="no overlap"))


@pytest.mark.parametrize("H, per_call, tau, total", [
    (20, 10, 5, 60), (20, 10, 0, 60), (25, 10, 5, 100), (20, 7, 5, 40), (10, 10, 10, 30), (5, 10, 5, 20)])
def test_step_round_chunk_lengths_are_the_chunks_of_one_round_split_at_tau(H, per_call, tau, total):
    # The set the worker compiled before the planner existed, for runs whose rounds are all H steps.
    assert _schedule(H, per_call, total, tau=tau).chunk_lengths() == set(chunks(H, per_call, (tau,) if tau else ()))


def test_chunk_lengths_cover_a_short_last_round_and_wall_time_rounds():
    assert _schedule(H=20, per_call=10, total=63, tau=5).chunk_lengths() == {3, 5, 10}
    assert _schedule(H=20, per_call=10, total=8, tau=5).chunk_lengths() == {3, 5}
    fit = {1, 2, 4, 8, 10}  # wall-time rounds: the lengths a measured step time cuts a round's end into
    assert _schedule(round_seconds=1.0, per_call=10, tau=5).chunk_lengths() == {5, 10} | fit
    assert _schedule(round_seconds=1.0, per_call=10, tau=0).chunk_lengths() == fit
    assert _schedule(round_seconds=1.0, per_call=10, tau=15).chunk_lengths() == {10, 5} | fit
    assert _schedule(round_seconds=1.0, per_call=10, overlap=False).chunk_lengths() == fit
    assert _schedule(round_seconds=-1.0, per_call=10, tau=5).chunk_lengths() == {5, 10} | fit  # auto
    # the first chunk (compiled before the Join): the first of a round, whatever the kind of rounds
    assert [_schedule(round_seconds=r, per_call=10, tau=t).first_length() for r in (1.0, -1.0) for t in (5, 0)] \
        == [5, 10, 5, 10]
    assert _schedule(H=20, per_call=10, total=8, tau=0).first_length() == 8


def test_a_wall_time_round_with_a_measured_step_time_ends_on_its_deadline():
    # 0.1 s a step, 2 s rounds: after the overlap budget (τ = 5, cut 4 + 1), chunks fitted to the time left
    s = dataclasses.replace(_schedule(round_seconds=2.0, per_call=10, tau=5), step_s=0.1)
    assert next_action(s, RoundProgress(0, 0, since_arrival_s=0.0)) == Action(TRAIN, 4)
    assert next_action(s, RoundProgress(4, 4, since_arrival_s=0.4)) == Action(TRAIN, 1)
    assert next_action(s, RoundProgress(5, 5, since_arrival_s=0.5)) == Action(TRAIN, 10)
    assert next_action(s, RoundProgress(15, 15, since_arrival_s=1.5)) == Action(TRAIN, 4)  # 5 steps left
    assert next_action(s, RoundProgress(19, 19, since_arrival_s=1.9)) == Action(TRAIN, 1)
    assert next_action(s, RoundProgress(20, 20, since_arrival_s=1.96)) == Action(END_ROUND)  # < half a step left
    # a slow island (1 s a step, chunks of 10): its round is not 10 steps past the deadline
    slow = dataclasses.replace(s, step_s=1.0)
    assert next_action(slow, RoundProgress(5, 5, since_arrival_s=0.1)) == Action(TRAIN, 2)
    # auto, not resolved yet: the round goes on whatever the time
    auto = dataclasses.replace(s, round_seconds=-1.0)
    assert next_action(auto, RoundProgress(30, 30, since_arrival_s=99.0)) == Action(TRAIN, 10)


def test_every_chunk_a_run_trains_was_compiled():
    rng = random.Random(0)
    for _ in range(200):
        s = _schedule(H=rng.randint(1, 30), per_call=rng.randint(1, 12), total=rng.randint(1, 120),
                      overlap=rng.random() < 0.7, tau=rng.randint(0, 12))
        timing = rng.choice([None, 1, 2, 3])
        actions = _run(s, exchange_chunks=timing)
        trained = [a.steps for a in actions if a.kind is TRAIN]
        assert sum(trained) == s.total_steps and all(0 < n <= s.steps_per_call for n in trained)
        assert set(trained) == s.chunk_lengths(), (s, timing)
        assert trained[0] == s.first_length()  # compiled before the Join; the others on a thread meanwhile
        pushes = sum(a.kind is END_ROUND for a in actions)
        assert pushes == -(-s.total_steps // s.inner_steps)  # one push per round: ceil(steps / H)


# --- the pull -------------------------------------------------------------------------------------


def test_auto_rounds_give_every_island_the_slowest_islands_overlap_time_in_compiled_lengths():
    from conftest import TINY
    from dtrain.config.load import load_config
    from workers.pacing import overlap_seconds

    cfg = load_config(TINY, ["outer.inner_steps=4", "worker.max_overlap_steps=5"])
    tau_s = overlap_seconds(cfg, 2.0)  # 5 of the slowest island's 4 steps in a 2 s round
    assert tau_s == pytest.approx(2.5)
    fast = dataclasses.replace(_schedule(round_seconds=-1.0, per_call=10, tau=5), step_s=0.1)
    fast = fast.overlap_for(2.0, tau_s)
    assert (fast.round_seconds, fast.overlap_steps) == (2.0, 25)  # 2.5 s of 0.1 s steps, not 5 steps (0.5 s)
    slow = dataclasses.replace(_schedule(round_seconds=-1.0, per_call=10, tau=5), step_s=1.0).overlap_for(2.0, tau_s)
    assert slow.overlap_steps == 5  # never fewer than τ
    off = dataclasses.replace(_schedule(round_seconds=-1.0, overlap=False), step_s=0.1).overlap_for(2.0, tau_s)
    assert off.overlap_steps == 0
    # With the exchange in flight, the chunks are still fitted lengths (all compiled before the Join): 10, 10, 4, 1.
    taken, n = [], 0
    while (a := next_action(fast, RoundProgress(n, n, exchange_in_flight=True))).kind is TRAIN:
        taken.append(a.steps)
        n += a.steps
    assert taken == [10, 10, 4, 1] and set(taken) <= fast.chunk_lengths()
    assert a == Action(WAIT, reason="overlap budget spent")


def test_a_digest_mismatch_is_answered_by_one_full_pull():
    theta = random_vec(0)
    client = FakeClient([[full_pull(4, theta, digest="0" * 16)], [full_pull(4, theta)]])
    events = Events()
    g = Puller(client, N, 1 << 20, events).pull("a-0", None)
    assert g.version == 4 and np.array_equal(g.vec, theta) and g.arrived > 0
    assert client.pulls == [("a-0", 0, 0.0, True), ("a-0", 0, 0.0, True)]
    assert events == [("digest_mismatch", {"version": 4})]


def test_a_repeated_digest_mismatch_fails_naming_the_version_and_both_digests():
    theta = random_vec(0)
    client = FakeClient([[full_pull(4, theta, digest="0" * 16)]] * 5)
    events = Events()
    have = GlobalParams(random_vec(1), 3)
    with pytest.raises(WorkerError, match=rf"v4 decodes to params digest {params_digest(theta)}, the "
                                          rf"coordinator's θ has {'0' * 16}, again after a full re-pull"):
        Puller(client, N, 1 << 20, events).pull("a-0", have, wait_s=5.0)
    assert client.pulls == [("a-0", 3, 5.0, False), ("a-0", 0, 0.0, True)]  # bounded: one full re-pull
    assert [e[0] for e in events] == ["digest_mismatch", "digest_mismatch"]


def test_updates_apply_in_a_chain_and_a_broken_chain_is_answered_by_one_full_pull():
    v3, d = random_vec(0), random_vec(1)
    have = GlobalParams(v3.copy(), 3)
    g = Puller(FakeClient([[update_pull(3, 4, d, v3 + d)]]), N, 1 << 20, Events()).pull("a-0", have)
    assert g.version == 4 and np.array_equal(g.vec, v3 + d)
    client = FakeClient([[update_pull(2, 4, d, v3 + d)], [full_pull(4, v3 + d)]])
    g = Puller(client, N, 1 << 20, Events()).pull("a-0", have)
    assert g.version == 4 and [p[3] for p in client.pulls] == [False, True]
    client = FakeClient([[update_pull(2, 4, d, v3 + d)]] * 3)
    with pytest.raises(WorkerError, match="the update to v4 applies to v2, the island holds no θ"):
        Puller(client, N, 1 << 20, Events()).pull("a-0", have)
    assert len(client.pulls) == 2


def test_a_current_island_keeps_its_params():
    have = GlobalParams(random_vec(0), 3, arrived=1.0)
    assert Puller(FakeClient([[]]), N, 1 << 20, Events()).pull("a-0", have) is have and have.arrived == 1.0
    with pytest.raises(WorkerError, match="no parameters for a full pull"):
        Puller(FakeClient([[]]), N, 1 << 20, Events()).pull("a-0", None)


# --- the exchange ---------------------------------------------------------------------------------


def _exchange(client: FakeClient, events: Events, stop: threading.Event | None = None,
              total_versions: int = 0) -> Exchange:
    header = pb.PushHeader(island_id="a-0", base_version=3, push_id="a-0-p1", tokens=640)
    return Exchange(client, Puller(client, N, 1 << 20, events), b"frame", header, GlobalParams(random_vec(0), 3),
                    total_versions, stop or threading.Event(), events)


def test_the_exchange_pushes_then_pulls_until_a_newer_version_and_returns_it_through_its_future():
    theta = random_vec(5)
    client = FakeClient([[], [], [full_pull(4, theta)]])  # two long polls with nothing new, then θ_4
    events = Events()
    ex = _exchange(client, events)
    ex.repush.set()  # the heartbeat heard that the coordinator lost the push
    g = ex.start().result(timeout=10)
    assert g.version == 4 and np.array_equal(g.vec, theta)
    assert client.pushes == ["a-0-p1", "a-0-p1"] and [p[1] for p in client.pulls] == [3, 3, 3]
    assert events == [("push_sent", {"push_id": "a-0-p1", "base_version": 3, "status": "PUSH_STATUS_PENDING",
                                     "bytes": 5, "tokens": 640, "reason": "round open", "shard": 0, "start": 0,
                                     "end": 0, "cursor": 0}),
                      ("push_resent", {"push_id": "a-0-p1", "status": "PUSH_STATUS_PENDING", "reason": "round open",
                                       "cursor": 0})]


def test_the_exchange_stops_with_the_run_and_hands_errors_to_the_future():
    stop = threading.Event()
    stop.set()
    ex = _exchange(FakeClient([]), Events(), stop=stop)
    assert ex.start().result(timeout=10) is ex.base  # nothing newer: the loop sees the stop and ends
    error = CoordinatorError(grpc.StatusCode.UNAVAILABLE, "gone")
    ex = _exchange(FakeClient([], push_error=error), Events())
    assert ex.start().exception(timeout=10) is error


def test_an_exchange_whose_push_is_dropped_or_refused_returns_the_newest_theta_at_once():
    """No version waits for a push the coordinator did not take: the exchange does not wait for one (the
    island rewinds and trains the range again); a refusal is answered as REJECTED at the range's start."""
    for push_error, status in [(None, pb.PUSH_STATUS_DROPPED),
                               (CoordinatorError(grpc.StatusCode.INVALID_ARGUMENT, "bad frame"), None)]:
        client = FakeClient([[full_pull(3, random_vec(7))]], push_error=push_error)
        if status is not None:
            client.status = status
        events = Events()
        ex = _exchange(client, events)
        g = ex.start().result(timeout=10)
        assert g.version == 3 and len(client.pulls) == 1 and client.pulls[0][2] == 0.0  # one pull, no long poll
        assert ex.response is not None
        assert ex.response.status == (status or pb.PUSH_STATUS_REJECTED)
        if push_error is not None:
            assert ("push_refused", {"push_id": "a-0-p1", "code": "INVALID_ARGUMENT", "error": "bad frame"}) in events


class _Throttling(FakeClient):
    """Refuses its first ``refusals`` pushes as a throttled island's (with 0.7 s of backoff left); records each
    push and each wait of the exchange in ``calls``, in order."""

    def __init__(self, answers: list, refusals: int):
        super().__init__(answers)
        self.refusals, self.calls = refusals, []

    def push(self, header: pb.PushHeader, frame: bytes) -> pb.PushDeltaResponse:
        self.calls.append("push")
        if self.refusals:
            self.refusals -= 1
            raise CoordinatorError(grpc.StatusCode.FAILED_PRECONDITION, "a-0 is throttled for 0.7s more",
                                   retry_after_s=0.7)
        return super().push(header, frame)


class _CountedWaits(threading.Event):
    """A stop event whose waits are recorded in ``calls`` and return at once (set after ``stop_after`` waits)."""

    def __init__(self, calls: list, stop_after: int = -1):
        super().__init__()
        self.calls, self.stop_after = calls, stop_after

    def wait(self, timeout: float | None = None) -> bool:
        self.calls.append(f"wait {timeout}")
        if len([c for c in self.calls if c.startswith("wait")]) == self.stop_after:
            self.set()
        return self.is_set()


def test_a_throttled_push_waits_the_backoff_out_then_is_sent_again_under_its_id():
    """A push refused because its island is throttled (the refusal names the seconds left) is not answered as
    rejected (no rewind: its payload was never read): the exchange waits the backoff, one ``push_throttled`` event
    saying how long, and sends the same push again only then; it is taken like any other."""
    from workers.exchange import MAX_THROTTLED_WAITS

    client = _Throttling([[full_pull(4, random_vec(5))]], refusals=2)
    events = Events()
    ex = _exchange(client, events, stop=_CountedWaits(client.calls))
    assert ex.start().result(timeout=10).version == 4
    assert client.calls == ["push", "wait 0.7", "push", "wait 0.7", "push"]  # never sent again before the wait
    assert client.pushes == ["a-0-p1"] and ex.response is not None and ex.response.status == pb.PUSH_STATUS_PENDING
    assert [e[0] for e in events] == ["push_throttled", "push_throttled", "push_sent"]
    assert events[0][1] == {"push_id": "a-0-p1", "wait_s": 0.7, "start": 0, "end": 0,
                            "error": "a-0 is throttled for 0.7s more"}
    # The run stopping during the wait ends it: the push is not sent again, and is answered as refused.
    client = _Throttling([], refusals=1)
    events = Events()
    ex = _exchange(client, events, stop=_CountedWaits(client.calls, stop_after=1))
    assert ex.start().result(timeout=10) is ex.base
    assert client.calls == ["push", "wait 0.7"] and ex.response is not None
    assert ex.response.status == pb.PUSH_STATUS_REJECTED and [e[0] for e in events] == ["push_throttled",
                                                                                        "push_refused", "push_sent"]
    # A coordinator that keeps refusing is not waited on for ever: after MAX_THROTTLED_WAITS the refusal stands.
    client = _Throttling([[full_pull(3, random_vec(7))]], refusals=MAX_THROTTLED_WAITS + 1)
    ex = _exchange(client, Events(), stop=_CountedWaits(client.calls))
    ex.start().result(timeout=10)
    assert client.calls.count("push") == MAX_THROTTLED_WAITS + 1 and client.calls.count("wait 0.7") == \
        MAX_THROTTLED_WAITS
    assert ex.response is not None and ex.response.status == pb.PUSH_STATUS_REJECTED


def test_a_late_push_waits_for_the_version_it_goes_into():
    """A push based on v3 that the coordinator takes into v6 (a hung island's late delta): θ_5 does not end the
    exchange, θ_6 does; the island's next push then belongs to the round after it."""
    client = FakeClient([[full_pull(5, random_vec(5))], [full_pull(6, random_vec(6))]])
    client.merged_version = 6
    ex = _exchange(client, Events())
    g = ex.start().result(timeout=10)
    assert g.version == 6 and len(client.pulls) == 2
    ex.header = pb.PushHeader(push_id="a-0-p1", shard_index=1, cursor_start=80, cursor_end=160)
    # A cursor named before this push arrived ([80, 160) of shard 1, taken into v6) moves past its range.
    assert [ex.accepted_range_end(1, c) for c in (80, 120, 160)] == [160, 160, 160]
    assert ex.accepted_range_end(0, 80) == 80 and ex.accepted_range_end(1, 40) == 40
    ex.response = pb.PushDeltaResponse(status=pb.PUSH_STATUS_DROPPED, merged_version=6)
    assert ex.accepted_range_end(1, 80) == 80  # not taken: the cursor stays where the coordinator said


def test_an_exchange_pushed_on_the_runs_last_version_ends_after_one_pull():
    client = FakeClient([[], [full_pull(4, random_vec(6))]])  # no version follows the last one
    ex = _exchange(client, Events(), total_versions=3)  # the push is based on v3, the last version
    assert ex.start().result(timeout=10) is ex.base and len(client.pulls) == 1


def test_link_watch_reports_a_slow_link_after_a_streak_and_its_recovery():
    from workers.heartbeat import LinkWatch

    w = LinkWatch(warmup=5, streak=3, factor=3.0, margin_s=0.010)
    assert [w.observe(0.002) for _ in range(5)] == [None] * 5  # baseline 2 ms: the limit is 16 ms
    assert w.observe(0.100) is None and w.observe(0.015) is None  # one slow trip, then a normal one: no streak
    assert [w.observe(0.100) for _ in range(2)] == [None, None]
    kind, fields = w.observe(0.100)  # the third in a row
    assert kind == "link_slow" and fields == {"rtt_s": 0.1, "baseline_s": 0.002, "limit_s": 0.016}
    assert w.observe(0.100) is None  # reported once
    assert statistics.median(w.rtts) == 0.002  # slow trips stay out of the baseline
    kind, _ = w.observe(0.003)
    assert kind == "link_recovered" and w.observe(0.003) is None


class _Losses:
    """A chunk's per-step losses as a device array shows them: ready or still computing."""

    def __init__(self, values: list[float], ready: bool = True):
        self.values, self.ready = np.asarray(values, np.float32), ready

    def is_ready(self) -> bool:
        return self.ready

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        return self.values


def test_the_heartbeat_reports_the_newest_train_loss_read_and_writes_no_shared_state():
    """The heartbeat never waits for the devices: it reports the latest chunk's mean loss once computed, else the
    newest one read so far, by itself or by the training loop; it keeps its own read to itself (the status is
    the training loop's alone)."""
    from workers.heartbeat import Heartbeat, IslandStatus, Mailbox

    status = IslandStatus(held=(0, ""), steps=0, tokens=0)
    beat = Heartbeat(None, status, Mailbox(), 1.0, Events(), rejoin=lambda: pb.JoinResponse(),
                     utilization=lambda: 0.0)
    assert beat.train_loss() is None  # no chunk yet
    status.chunk_loss = (1, _Losses([1.0, 3.0]))
    assert beat.train_loss() == 2.0 and status.train_loss == (0, None)  # its read stays its own
    status.chunk_loss = (2, _Losses([4.0], ready=False))
    assert beat.train_loss() == 2.0  # still computing: the newest read, its own
    assert status.read_loss() == 4.0 and status.train_loss == (2, 4.0)  # the training loop waits for it
    status.chunk_loss = (3, _Losses([5.0], ready=False))
    assert beat.train_loss() == 4.0  # the training loop's read is the newer one


def test_a_rewind_from_a_join_is_not_replaced_by_one_from_a_push_reply():
    from workers.heartbeat import Mailbox
    from workers.recovery import Rewind

    box = Mailbox()
    assert box.take_rewind() is None and not box.rewind_posted()
    box.post_rewind(Rewind(0, 80, "push dropped"))
    box.post_rewind(Rewind(1, 0, "rejoined", joined=True))  # a Join's replaces a push reply's
    box.post_rewind(Rewind(0, 160, "push rejected"))  # a push reply's does not replace a Join's
    assert box.rewind_posted() and box.take_rewind() == Rewind(1, 0, "rejoined", joined=True)
    assert box.take_rewind() is None  # taken once
    box.post_rewind(Rewind(0, 80, "push dropped"))
    box.post_rewind(Rewind(0, 160, "push rejected"))  # the later push reply's wins
    assert box.take_rewind() == Rewind(0, 160, "push rejected")


def test_a_call_cut_off_by_the_coordinator_going_away_waits_for_the_stop_in_flight():
    """The coordinator stops serving as soon as the islands hold the last version; its stop reaches an island in a
    heartbeat reply, which the heartbeat thread may not have handled when the island's own pull is cut off
    (CANCELLED). The island then waits for that stop (two heartbeat periods at most) instead of failing; any other
    refusal, or a stop that never comes, is an error."""
    from conftest import TINY
    from dtrain.config.load import load_config
    from workers.heartbeat import Mailbox
    from workers.hosts import HostGroup
    from workers.membership import Membership

    member = Membership.__new__(Membership)  # only what stopped_after reads: no model, no coordinator
    member.cfg = load_config(TINY, ["worker.heartbeat_s=0.5"])
    member.hosts = HostGroup.single()
    member.mailbox = Mailbox()
    class Stopping(threading.Event):
        waits = 0

        def wait(self, timeout: float | None = None) -> bool:
            self.waits += 1
            return super().wait(timeout)

    member.mailbox.stopping = stopping = Stopping()
    cancelled = CoordinatorError(grpc.StatusCode.CANCELLED, "CANCELLED")
    timer = threading.Timer(0.1, stopping.set)  # the heartbeat thread reads the STOP reply
    timer.start()
    try:
        assert member.stopped_after(cancelled)
    finally:
        timer.cancel()
    stopping.clear()
    assert not member.stopped_after(cancelled)  # no stop within two heartbeats: the failure stands
    assert stopping.waits == 2
    refused = CoordinatorError(grpc.StatusCode.INVALID_ARGUMENT, "bad request")
    assert not member.stopped_after(refused) and stopping.waits == 2  # not the coordinator going away: no wait


def test_the_clock_leaves_start_up_waits_out_and_counts_blocked_and_eval_time_against_utilization():
    from workers.heartbeat import Clock

    clock = Clock()
    clock.train_since = time.perf_counter() - 10.0  # a _train call 10 s in
    clock.exclude(4.0)  # of which 4 s waiting for start-up compiles: not training time
    clock.blocked_s, clock.eval_s = 0.6, 0.6
    clock.stop()
    assert clock.train_since is None and 5.9 < clock.active_s < 6.5
    assert clock.utilization() == pytest.approx(1 - 1.2 / clock.active_s)
    clock.exclude(1.0)  # outside a _train call: nothing to leave out
    assert 5.9 < clock.active_s < 6.5


def test_a_pulled_round_length_is_kept_and_a_hostile_one_refused():
    """``PullHeader.round_seconds``: the length of the round starting from the version pulled (auto rounds) is kept
    with θ; a negative, non-finite or over-a-day length is refused like a digest mismatch, naming it."""
    theta = random_vec(0)
    paced = full_pull(4, theta)
    paced.header.round_seconds = 3.5
    assert Puller(FakeClient([[paced]]), N, 1 << 20, Events()).pull("a-0", None).round_seconds == 3.5
    for bad in (-1.0, float("nan"), float("inf"), 1e6):
        frame = full_pull(4, theta)
        frame.header.round_seconds = bad
        with pytest.raises(WorkerError, match=r"v4 came with round_seconds=.*must be in \[0, 86400\]"):
            Puller(FakeClient([[frame]] * 2), N, 1 << 20, Events()).pull("a-0", None)


def test_a_restarted_islands_token_count_goes_on_from_its_own_events_of_this_run():
    from workers.recovery import tokens_trained

    killed = [{"event": "joined", "run_id": "r1"}, {"event": "trained", "tokens": 5120},
              {"event": "train", "tokens": 10240}, {"event": "trained", "tokens": 10240}]
    assert tokens_trained(killed, "r1") == 10240
    # a folder first used by another run: that run's count is not this one's
    other = [{"event": "joined", "run_id": "r0"}, {"event": "trained", "tokens": 99_999}]
    assert tokens_trained(other + killed, "r1") == 10240
    assert tokens_trained(killed + other, "r1") == 10240
    assert tokens_trained([], "r1") == 0 and tokens_trained(other, "r1") == 0
    # an event without tokens (a worker of before this count) is skipped
    assert tokens_trained([{"event": "joined", "run_id": "r1"}, {"event": "trained", "executed": 10}], "r1") == 0


def test_pushes_are_encoded_at_codec_up_zstd_level_and_decode_the_same():
    """codec.up_zstd_level sets the zstd level of the island's pushes (not codec.zstd_level, the coordinator's
    update frames'): by default (0) int8 pushes are stored without zstd (a larger frame, no decompression for the
    coordinator), codec.zstd_level for the codecs zstd compresses by far more; 3 compresses int8 too; both decode
    to the same values."""
    from dtrain import codec
    from dtrain.config.sections import CodecConfig
    from workers.exchange import Uplink

    delta = np.random.default_rng(3).normal(size=50_000).astype(np.float32) * 1e-3
    header = pb.PushHeader(push_id="p", fragment=0)
    frames = {}
    for level in (0, 3):
        k = CodecConfig(up="int8", error_feedback=False, up_zstd_level=level)
        assert k.zstd_level == 3 and k.push_level() == (level or codec.STORED)  # not the update frames' level
        frames[level], _ = Uplink(k, delta.size, [], client=None, log=Events()).frame(delta, header)
    assert CodecConfig().up_zstd_level == 0 and CodecConfig().push_level() == codec.STORED  # int8, the default
    for up in ("int4", "e3m0", "sparse", "fp32"):  # raw codes would cost 8-48% more bytes: zstd_level
        assert CodecConfig(up=up).push_level() == 3 and CodecConfig(up=up, up_zstd_level=-2).push_level() == -2
    stored = codec.FrameValidator(delta.size, 8, 1024, out=lambda _: None)
    stored.feed(frames[0][:codec.HEADER_SIZE])
    assert stored.header is not None and stored.header.stored  # no zstd: the body is the codes as they are
    assert len(frames[0]) > 1.05 * len(frames[3])  # the WAN bytes the skipped decompression costs
    values = [codec.dequantize(codec.decode(f, expected_n=delta.size)) for f in frames.values()]
    np.testing.assert_array_equal(values[0], values[1])
