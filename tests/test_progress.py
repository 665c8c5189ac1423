"""Progress output (RunLog.status through the CLI's plain and live handlers, fmt_progress, the simulate driver's
RunWatch, EventTail) and the island's side of the observability fields: train events and heartbeat
train_loss/utilization, the Join's device kind, and evaluation on request (an island asked to evaluate a version
reports exactly that θ's eval loss)."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest

from conftest import TINY, initial_parameters
from coordinator.app import serve
from dtrain import codec
from dtrain.audit import AuditParams, audit
from dtrain.config.load import load_config
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.runlog import EventTail, RunLog, expected_end, fmt_progress, read_events
from dtrain_cli.logs import PlainHandler, cli_logging, make_handler
from dtrain_cli.run_watch import RunWatch
from island_helpers import Events, FakeClient, N, full_pull, random_vec, update_pull
from service_helpers import Running
from workers.app import run_worker
from workers.client import CoordinatorClient, PulledFrame
from workers.exchange import Puller


def test_fmt_progress_shows_version_of_total_or_the_data_cursor_loss_and_rate():
    line = fmt_progress("island-0", step=40, version=2, total=5, loss=3.14159, tokens_per_s=12_345)
    assert line == "island-0: step 40 v2/5 train loss 3.1416 tok/s 12.3k"
    line = fmt_progress("island-0", step=40, version=2, data=(320, 480), loss=3.5, eval_loss=3.25)
    assert line == "island-0: step 40 v2 data 320/480 train loss 3.5000 eval loss 3.2500"
    assert fmt_progress("simulate", version=1, total="~3") == "simulate: v1/~3"
    assert fmt_progress("train", step=10, steps=60, loss=3.2) == "train: step 10/60 train loss 3.2000"


def test_plain_status_lines_are_progress_lines_at_most_one_per_every_s(tmp_path):
    out = io.StringIO()
    log = RunLog(tmp_path)
    with cli_logging(out, live=False):
        log.status("a", "a: v1/3 train loss 2.0000", done=1, total=3)
        log.status("a", "a: v2/3 train loss 1.5000", done=2, total=3)  # every_s=0: printed too
        log.status("b", "b: first", every_s=60)
        log.status("b", "b: second", every_s=60)  # within 60 s of the first: not printed
        log.close()  # the status lines' ends: no line
    lines = out.getvalue().splitlines()
    assert [line.split("] ", 1)[1] for line in lines] == ["a: v1/3 train loss 2.0000", "a: v2/3 train loss 1.5000",
                                                           "b: first"]
    assert all(line.startswith("[") and "s] " in line for line in lines)


def test_live_status_lines_are_drawn_by_rich_with_the_progress_lines_above(tmp_path):
    out = io.StringIO()
    log = RunLog(tmp_path)
    with cli_logging(out, live=True):
        log.status("a", "a: step 10 v1/4 train loss 2.5000", done=1, total=4)
        log.progress("a line that stays")
        log.status("a", "a: step 20 v2/4 train loss 2.2500", done=2, total=4)
        log.close()
        assert out.getvalue().endswith("\x1b[?25h")  # its live lines stopped with it (the cursor shown again)
    text = out.getvalue()
    assert "a: step 20 v2/4 train loss 2.2500" in text and "a line that stays" in text
    assert "\x1b[" in text  # terminal control sequences: redrawn in place
    quiet = io.StringIO()
    log = RunLog(tmp_path, quiet=True)
    with cli_logging(quiet, live=True):
        log.status("a", "nothing")
        log.progress("nothing either")
    log.close()
    assert quiet.getvalue() == ""


def test_events_and_lines_name_an_island_by_its_name_with_its_shard_and_id_beside(tmp_path):
    """The coordinator's RunLog names islands (dtrain.runlog.IslandNames): a known id in ``island`` becomes the name,
    with the shard it trains now and the id; lists and pushes name islands; a known id in a text becomes the name;
    push ids (the id and a suffix), unknown ids (what a client sent) and a record forgotten since stay right."""
    records = {"island-1-0": ("island-1", 2), "island-1-0.1": ("other", 3), "a-0": ("a", 0)}
    out = io.StringIO()
    log = RunLog(tmp_path)
    log.name_islands(lambda: dict(records))
    with cli_logging(out, live=False):
        log.event("island_lost", island="island-1-0", reason="lease of island-1-0 expired; island-1-0.1 stays")
        log.event("island_joined", island="a-0", name="a", shard=0, reason="joined as a-0: free shard 0")
        log.event("push_refused", island="island-9-9", push_id="island-1-0-4f2a", reason="push island-1-0-4f2a")
        log.event("round_merged", version=1, pushes=[{"island": "a-0", "push_id": "a-0-1"}], islands=["a-0", "x"])
        del records["a-0"]  # forgotten: its name is kept
        log.event("eval", version=1, island="a-0", confirmed_by=["a-0", "island-1-0"])
        log.progress("v1: quarantined push a-0-77 from a-0: lost island-1-0.")
    log.close()
    lost, joined, refused, merged, ev = read_events(tmp_path)
    assert (lost["island"], lost["shard"], lost["island_id"]) == ("island-1", 2, "island-1-0")
    assert lost["reason"] == "lease of island-1 expired; other stays"
    assert (joined["island"], joined["shard"], joined["island_id"], joined["name"]) == ("a", 0, "a-0", "a")
    assert joined["reason"] == "joined as a: free shard 0"
    assert (refused["island"], refused["push_id"]) == ("island-9-9", "island-1-0-4f2a") and "island_id" not in refused
    assert refused["reason"] == "push island-1-0-4f2a"
    assert merged["pushes"] == [{"island": "a", "push_id": "a-0-1"}] and merged["islands"] == ["a", "x"]
    assert (ev["island"], ev["island_id"], ev["confirmed_by"]) == ("a", "a-0", ["a", "island-1"])
    assert out.getvalue().splitlines()[-1].endswith("] v1: quarantined push a-0-77 from a: lost island-1.")


def test_an_event_tail_returns_new_events_and_waits_for_a_line_to_end(tmp_path):
    tail = EventTail(tmp_path)
    assert tail.read() == []  # no file yet
    path = tmp_path / "events.jsonl"
    path.write_text('{"event": "a"}\n{"event": "b", "x"')
    assert [e["event"] for e in tail.read()] == ["a"]
    with open(path, "a") as f:
        f.write(': 1}\n{"torn\n{"event": "c"}\n')
    assert [e["event"] for e in tail.read()] == ["b", "c"]  # b completed; the torn line skipped
    assert tail.read() == []


def test_the_simulate_driver_says_what_it_waits_for_then_version_and_losses():
    w = RunWatch(islands=2, expected_versions=3, shard_end=480)
    assert w.line(running=2) == ("simulate: compiling: waiting for 2 islands to join; "
                                 "2/2 worker processes running")
    w.coordinator([{"event": "island_joined", "name": "island-0", "island": "island-0-0"}])
    w.island("island-0", [{"event": "joined", "total_versions": 0}])
    assert w.line(running=2) == ("simulate: 1/2 islands joined, waiting for 1 more island (island-1) (compiling); "
                                 "2/2 worker processes running")
    # the first steps, from the island's own events, before any round is merged
    w.island("island-0", [{"event": "train", "step": 10, "loss": 4.25}])
    assert w.line(running=2) == ("simulate: 1/2 islands joined, waiting for 1 more island (island-1) (compiling); "
                                 "island-0 step 10 loss 4.2500; 2/2 worker processes running")
    w.coordinator([{"event": "island_joined", "name": "island-1", "island": "island-1-1"}])
    assert w.line(running=2) == "simulate: 2/2 islands joined, training the first round: island-0 step 10 loss 4.2500"
    w.coordinator([{"event": "round_merged", "version": 1, "t": 100.0,
                    "pushes": [{"shard": 0, "start": 0, "end": 160}, {"shard": 1, "start": 0, "end": 160}]},
                   {"event": "eval", "version": 1, "loss": 3.5, "tokens": 10240}])
    w.island("island-0", [{"event": "train", "step": 20, "loss": 4.0}])
    w.island("island-1", [{"event": "train", "step": 20, "loss": 3.0}])
    # one merge: no pace yet, so no ETA
    assert w.line(running=2) == "simulate: v1/~3 data 320/960 train loss 3.5000 eval loss 3.5000 (v1) 2/2 workers"
    assert w.known_total == 3
    w.island("island-1", [{"event": "joined", "total_versions": 6}])  # wall-time rounds: the coordinator knows
    assert w.line(running=1).startswith("simulate: v1/6 ")
    # a version 4 s after the first: 4 more to go at 4 s each
    w.coordinator([{"event": "round_merged", "version": 2, "t": 104.0, "pushes": []}])
    assert w.eta_s() == 16.0 and w.line(running=2).endswith(" ETA 16s; 2/2 workers")
    w.coordinator([{"event": "round_merged", "version": 2, "t": 104.0, "pushes": []}])
    assert w.eta_s() == 16.0  # the same version again (a resume): the pace is from the first merge to the latest
    # shard 1 split in segments: a piece at its end merged before the middle counts its own sequences only
    w.coordinator([{"event": "round_merged", "version": 2, "pushes": [{"shard": 1, "start": 320, "end": 480},
                                                                      {"shard": 0, "start": 160, "end": 320}]}])
    assert w.merged_sequences() == 640 and "data 640/960" in w.line(running=2)


def test_the_expected_end_moves_with_the_pace_when_an_island_is_lost():
    """The driver's "v4/~N": the plan before a merge; then the data left at the latest versions' pace."""
    assert expected_end(0, 960, [], 6) == 6 and expected_end(3, 0, [160], 6) == 3
    assert expected_end(2, 640, [160, 160], 6) == 6 and expected_end(2, 641, [160, 160], 6) == 7
    assert expected_end(4, 320, [0, 0], 6) == 6  # versions that merged nothing set no pace
    w = RunWatch(islands=2, expected_versions=6, shard_end=480)  # 2 x 80 sequences a version: 6 versions
    assert w.known_total == 6
    w.coordinator([{"event": "round_merged", "version": 1, "t": 1.0,
                    "pushes": [{"shard": 0, "start": 0, "end": 80}, {"shard": 1, "start": 0, "end": 80}]}])
    assert w.known_total == 6
    for v in range(2, 7):  # island-1 lost: island-0 alone, 80 a version
        w.coordinator([{"event": "round_merged", "version": v, "t": float(v),
                        "pushes": [{"shard": 0, "start": 80 * (v - 1), "end": 80 * v}]}])
    assert w.merged_sequences() == 560 and w.known_total == 6 + 5  # 400 left at 80 a version
    assert w.line(running=1).startswith("simulate: v6/~11 data 560/960 ")


# --- the island -------------------------------------------------------------------------------------------


def test_a_pull_that_asks_for_an_eval_hands_over_exactly_the_pulled_theta():
    a, b = random_vec(0), random_vec(1)
    asked = update_pull(4, 5, b - a, a + (b - a))
    asked.header.evaluate = True
    client = FakeClient([[full_pull(4, a)], [asked], [PulledFrame(pb.PullHeader(kind=pb.PULL_KIND_CURRENT, version=5,
                                                                            evaluate=True), b"")], []])
    puller = Puller(client, N, 1 << 20, Events())
    g4 = puller.pull("a-0", None)
    assert puller.take_eval_requests() == []  # not asked
    g5 = puller.pull("a-0", g4)
    (req,) = puller.take_eval_requests()
    assert req.version == 5 and np.array_equal(req.vec, g5.vec) and puller.take_eval_requests() == []
    assert puller.pull("a-0", g5) is g5  # CURRENT, asked to evaluate the θ the island holds
    (req,) = puller.take_eval_requests()
    assert req is g5


@pytest.mark.slow  # ~15 s alone (a whole island compiles and trains), ~40 s on a busy 2-core machine
def test_an_island_reports_train_loss_utilization_device_kind_and_the_evals_it_was_asked_for(tmp_path):
    """One in-process island against an in-process coordinator that asks for an eval of every version: each
    `eval` event's loss equals evaluating that version's θ directly; the heartbeats carried train loss and
    utilization (the coordinator's Status), the Join the device kind; train events every run.log_every steps."""
    cfg = load_config(TINY, [f"run.out_dir={tmp_path}", "coordinator.port=0", "coordinator.checkpoint=false",
                             "outer.islands=1", "train.steps=40", "outer.inner_steps=20", "run.log_every=10",
                             "coordinator.eval_every=1", "worker.heartbeat_s=0.2", "worker.start_wait_s=0"])
    theta0, spec = initial_parameters(cfg)
    server, service, port = serve(cfg, tmp_path / "coordinator", theta0.copy(), spec, port=0, quiet=True)
    try:
        summary = run_worker(cfg, f"127.0.0.1:{port}", "isl", tmp_path / "isl", quiet=True)
        status = service.status_message()
        theta_final = service.merger.theta.copy()
    finally:
        server.stop(grace=None).wait()
        service.close()
    from dtrain.train.prepare import prepare

    setup = prepare(cfg, 1)

    def direct(theta: np.ndarray) -> float:
        return setup.loop.evaluate(setup.loop.place_params(codec.unflatten(spec, theta)), setup.eval_batches)

    evals = {e["version"]: e for e in read_events(tmp_path / "coordinator") if e["event"] == "eval"}
    assert sorted(evals) == [0, 1, 2] and summary["version"] == 2
    assert math.isclose(evals[0]["loss"], direct(theta0), rel_tol=1e-6)
    assert math.isclose(evals[2]["loss"], direct(theta_final), rel_tol=1e-6)
    assert math.isclose(evals[2]["loss"], summary["final_eval_loss"], rel_tol=1e-6)
    island_events = read_events(tmp_path / "isl")
    trains = [e for e in island_events if e["event"] == "train"]
    assert [e["step"] // 10 for e in trains] == [1, 2, 3, 4]  # one per run.log_every steps, at a chunk's end
    assert all(math.isfinite(e["loss"]) and 0 <= e["utilization"] <= 1 for e in trains)
    assert [e["version"] for e in island_events if e["event"] == "evaluated"] == [0, 1, 2]
    (isl,) = status.islands
    assert isl.HasField("train_loss") and math.isfinite(isl.train_loss) and 0 < isl.utilization <= 1
    assert isl.device_kind == "cpu"
    assert [p.version for p in status.evals] == [0, 1, 2]
    # One island: nothing to check its evals against, so each is recorded unconfirmed; its honest pushes, with no
    # merged norm to check them either, lie under the honest ceiling (merged as they are); every token once.
    assert [p.confirmed for p in status.evals] == [False] * 3 and not status.eval_confirmed
    events = read_events(tmp_path / "coordinator")
    received = [e for e in events if e["event"] == "push_received"]
    assert len(received) == 2 and not any("clipped" in e["reason"] for e in received)
    a = audit(events, {"isl": island_events}, AuditParams.from_config(cfg))
    assert (a.lost_tokens, a.doubled_tokens, a.gaps, a.overlaps) == (0, 0, (), ()), a
    assert json.loads((tmp_path / "isl" / "summary.json").read_text())["eval_s"] >= 0


def test_the_clients_heartbeat_carries_train_loss_utilization_and_eval_reports(net_cfg, tmp_path):
    """The wire path on a real coordinator: the Join's device kind, a heartbeat's train loss and utilization in
    its Status, and a pull that asks for θ_0's eval answered by an EvalReport that becomes an `eval` event."""
    coord = Running(net_cfg, tmp_path / "coord")
    client = CoordinatorClient(coord.address, net_cfg)
    try:
        joined = client.join("isl", "cpu", 1, device_kind="TPU v5 lite")
        (frame,) = client.pull(joined.island_id, 0, full=True)
        assert frame.header.version == 0 and frame.header.evaluate  # θ_0 is on the eval grid
        client.heartbeat(island_id=joined.island_id, version=0, train_loss=2.5, utilization=0.75,
                         evals=[(0, 4.25)])
        client.heartbeat(island_id=joined.island_id, version=0)  # no train loss: it stays as reported
        st = client.status()
    finally:
        client.close()
        coord.stop()
    (isl,) = st.islands
    assert (isl.device_kind, isl.train_loss, isl.utilization) == ("TPU v5 lite", 2.5, 0.0)
    assert [(p.version, p.loss) for p in st.evals] == [(0, 4.25)]
    (ev,) = [e for e in read_events(tmp_path / "coord") if e["event"] == "eval"]
    assert (ev["version"], ev["loss"], ev["island"], ev["island_id"]) == (0, 4.25, "isl", joined.island_id)


def test_an_island_runs_quietly_without_a_terminal():
    assert isinstance(make_handler(io.StringIO()), PlainHandler)  # a StringIO is no terminal: plain lines
