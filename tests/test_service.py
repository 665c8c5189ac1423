"""A real coordinator on 127.0.0.1:0, real gRPC clients: join, push, pull, merge, and the bad cases. Resuming from
a checkpoint is in test_service_resume.py, poisoned pushes in test_service_poison.py, chip health in
test_service_chips.py."""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time
import zlib
from pathlib import Path

import grpc
import numpy as np
import pytest

from conftest import initial_parameters
from coordinator.app import serve
from dtrain import codec
from dtrain.codec import params_digest
from dtrain.config.load import replace
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.proto import dtrain_pb2_grpc as pb_grpc
from dtrain.net.wire import auth_metadata
from dtrain.runlog import read_events
from service_helpers import (
    Running,
    assert_unchanged,
    delta_frame,
    frame_messages,
    join_island,
    push_header,
    raw_push,
    snapshot,
    tls_config,
)
from workers.client import CoordinatorClient, CoordinatorError

ROOT = Path(__file__).resolve().parent.parent


def test_join_push_merge_pull_gives_bit_identical_theta(coordinator, net_cfg, two_islands):
    clients, joins = two_islands(coordinator.address, net_cfg, names=("isl-0", "isl-1"))
    assert sorted(j.shard_index for j in joins) == [0, 1]
    n = joins[0].tree_size
    # Both islands start from a full pull of θ_0.
    full = clients[0].pull(joins[0].island_id, 0, full=True)
    theta0 = codec.dequantize(codec.decode(full[0].frame, expected_n=n))
    assert full[0].header.kind == pb.PULL_KIND_FULL and np.array_equal(theta0, coordinator.theta)
    r0 = clients[0].push(push_header(joins[0], "p0"), delta_frame(n, 0)[1])
    assert r0.status == pb.PUSH_STATUS_PENDING and r0.version == 0  # waits for the other live island
    r1 = clients[1].push(push_header(joins[1], "p1"), delta_frame(n, 1)[1])
    assert r1.status == pb.PUSH_STATUS_MERGED and r1.version == 1
    frames = clients[0].pull(joins[0].island_id, 0, full=True)  # no θ held: the full, lossless parameters
    assert frames[0].header.kind == pb.PULL_KIND_FULL and frames[0].header.version == 1
    chain = clients[0].pull(joins[0].island_id, 0)  # holding θ_0: the compressed update
    assert [f.header.kind for f in chain] == [pb.PULL_KIND_UPDATE] and chain[0].header.base_version == 0
    assert clients[1].pull(joins[1].island_id, 1) == []  # already current
    # An island holding θ_0 applies the compressed update and lands bit-identical with the coordinator.
    upd = coordinator.service.merger.updates_since(0)
    assert len(upd) == 1 and len(upd[0].frame) < len(frames[0].frame) / 3
    island_theta = theta0 + codec.dequantize(codec.decode(upd[0].frame, expected_n=n))
    assert params_digest(island_theta) == coordinator.service.merger.digest == upd[0].params_digest
    st = clients[0].status()
    assert st.version == 1 and st.tokens_merged == 2 * 640 and len(st.islands) == 2


def test_pull_of_the_current_version_sends_no_frame(coordinator, net_cfg, two_islands):
    (c0, c1), (j0, j1) = two_islands(coordinator.address, net_cfg)
    n = j0.tree_size
    c0.push(push_header(j0, "a1"), delta_frame(n, 2)[1])
    c1.push(push_header(j1, "b1"), delta_frame(n, 3)[1])
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(coordinator.address))
    msgs = list(stub.PullGlobal(pb.PullRequest(island_id=j0.island_id, have_version=1, wait_s=0.2), timeout=10))
    assert len(msgs) == 1 and msgs[0].header.kind == pb.PULL_KIND_CURRENT and msgs[0].header.version == 1
    with pytest.raises(grpc.RpcError) as e:  # a version from the future is a bad request
        list(stub.PullGlobal(pb.PullRequest(island_id=j0.island_id, have_version=5), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ahead" in e.value.details()


def test_retried_push_is_applied_exactly_once(coordinator, net_cfg, two_islands):
    (c0, c1), (j0, j1) = two_islands(coordinator.address, net_cfg)
    n = j0.tree_size
    frame = delta_frame(n, 4)[1]
    assert c0.push(push_header(j0, "same-id"), frame).status == pb.PUSH_STATUS_PENDING
    again = c0.push(push_header(j0, "same-id"), frame)
    assert again.status == pb.PUSH_STATUS_DUPLICATE
    c1.push(push_header(j1, "other"), delta_frame(n, 5)[1])
    after_merge = c0.push(push_header(j0, "same-id"), frame)
    assert after_merge.status == pb.PUSH_STATUS_DUPLICATE
    st = c0.status()
    assert st.version == 1 and st.tokens_merged == 2 * 640


def test_mismatched_fingerprint_is_refused_naming_the_field(coordinator, net_cfg):
    other = replace(net_cfg, model={"d_model": 64})
    client = CoordinatorClient(coordinator.address, other)
    before = snapshot(coordinator.service)
    with pytest.raises(CoordinatorError) as e:
        client.join("x", "cpu", 1)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "model.d_model: coordinator 32, island 64" in str(e.value)
    assert_unchanged(before, coordinator.service)
    client.close()


@pytest.mark.parametrize("case,code,match", [
    ("truncated", grpc.StatusCode.INVALID_ARGUMENT, "truncated"),
    ("garbled", grpc.StatusCode.INVALID_ARGUMENT, "CRC32 mismatch"),
    ("oversized_chunk", grpc.StatusCode.RESOURCE_EXHAUSTED, "over the limit"),
    ("oversized_total", grpc.StatusCode.RESOURCE_EXHAUSTED, "total_bytes"),
    ("no_header", grpc.StatusCode.INVALID_ARGUMENT, "must start with a PushHeader"),
    ("bad_frame", grpc.StatusCode.INVALID_ARGUMENT, "bad frame"),
    ("future_version", grpc.StatusCode.INVALID_ARGUMENT, "base_version"),
    ("wrong_tree", grpc.StatusCode.FAILED_PRECONDITION, "tree_digest"),
])
def test_bad_pushes_are_rejected_and_change_nothing(coordinator, net_cfg, case, code, match):
    client = CoordinatorClient(coordinator.address, net_cfg)
    join = join_island(client, "a")
    n = join.tree_size
    frame = delta_frame(n, 6)[1]
    msgs = frame_messages(join, frame, f"bad-{case}")
    if case == "truncated":
        msgs = msgs[:-1]
    elif case == "garbled":
        data = bytearray(msgs[2].chunk.data)
        data[10] ^= 0xFF
        msgs[2].chunk.data = bytes(data)
    elif case == "oversized_chunk":
        big = frame[:8192]
        msgs = [msgs[0], pb.PushMessage(chunk=pb.Chunk(index=0, data=big, crc32=zlib.crc32(big)))]
    elif case == "oversized_total":
        msgs[0].header.total_bytes = 10 ** 12
    elif case == "no_header":
        msgs = msgs[1:]
    elif case == "bad_frame":  # well-formed chunks around a frame that is not a valid codec frame
        junk = b"\x00" * len(frame)
        msgs = frame_messages(join, junk, "bad-frame")
    elif case == "future_version":
        msgs[0].header.base_version = 7
    elif case == "wrong_tree":
        msgs[0].header.tree_digest = "0" * 16
    before = snapshot(coordinator.service)
    with pytest.raises(grpc.RpcError) as e:
        raw_push(coordinator.address, msgs)
    assert e.value.code() == code, e.value.details()
    assert match in e.value.details()
    assert_unchanged(before, coordinator.service)
    # The same island can still push a good delta afterwards (it is the only live island: it merges at once).
    good = client.push(push_header(join, "good"), frame)
    assert good.status == pb.PUSH_STATUS_MERGED and good.version == 1
    client.close()


def test_wrong_or_missing_token_is_unauthenticated(net_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("DTRAIN_TOKEN", "s3cret-token")
    running = Running(net_cfg, tmp_path / "auth")
    try:
        ok = CoordinatorClient(running.address, net_cfg)
        assert ok.join("a", "cpu", 1).island_id
        before = snapshot(running.service)
        for token in ("wrong-token", None):
            stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(running.address))
            with pytest.raises(grpc.RpcError) as e:
                stub.Join(pb.JoinRequest(island="b", hardware="cpu", devices=1), timeout=5,
                          metadata=auth_metadata(token))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as e:
                list(stub.PullGlobal(pb.PullRequest(island_id="a-0", have_version=0), timeout=5,
                                     metadata=auth_metadata(token)))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert_unchanged(before, running.service)
        ok.close()
    finally:
        running.stop()


def test_tls_and_mutual_tls(net_cfg, tmp_path, certs):
    # TLS: a worker that trusts the CA gets in; one speaking plaintext does not.
    server_cfg = tls_config(net_cfg, certs, client_auth=False, client=None)
    running = Running(server_cfg, tmp_path / "tls")
    try:
        client = CoordinatorClient(running.address, server_cfg)
        assert client.join("a", "cpu", 1).island_id
        client.close()
        plain = CoordinatorClient(running.address, replace(net_cfg, worker={"retry_total_s": 0.5}))
        with pytest.raises(CoordinatorError):
            plain.join("b", "cpu", 1)
        plain.close()
    finally:
        running.stop()
    # Mutual TLS: a client certificate signed by the CA is required.
    mtls_cfg = tls_config(net_cfg, certs, client_auth=True, client=None)
    running = Running(mtls_cfg, tmp_path / "mtls")
    try:
        good = CoordinatorClient(running.address, tls_config(net_cfg, certs, client_auth=True, client="client"))
        assert good.join("a", "cpu", 1).island_id
        good.close()
        for who in (None, "rogue"):
            cfg = replace(tls_config(net_cfg, certs, client_auth=True, client=who), worker={"retry_total_s": 0.5})
            bad = CoordinatorClient(running.address, cfg)
            with pytest.raises(CoordinatorError):
                bad.join("b", "cpu", 1)
            bad.close()
        assert set(running.service.state.islands) == {next(iter(running.service.state.islands))}
    finally:
        running.stop()


def test_pull_long_poll_returns_when_a_new_version_merges(coordinator, net_cfg, two_islands):
    import threading

    (c0, c1), (j0, j1) = two_islands(coordinator.address, net_cfg)
    n = j0.tree_size
    theta0 = codec.dequantize(codec.decode(c0.pull(j0.island_id, 0, full=True)[0].frame, expected_n=n))
    c0.push(push_header(j0, "a1"), delta_frame(n, 9)[1])
    got: list = []
    waiter = threading.Thread(target=lambda: got.extend(c0.pull(j0.island_id, 0, wait_s=20)))
    waiter.start()  # holds "version 0" (the latest) and waits for a newer one
    waiter.join(timeout=0.5)
    assert waiter.is_alive() and not got
    c1.push(push_header(j1, "b1"), delta_frame(n, 10)[1])
    waiter.join(timeout=15)
    assert not waiter.is_alive()
    assert [f.header.kind for f in got] == [pb.PULL_KIND_UPDATE] and got[0].header.version == 1
    theta1 = theta0 + codec.dequantize(codec.decode(got[0].frame, expected_n=n))
    assert params_digest(theta1) == coordinator.service.merger.digest


def test_a_failed_outer_step_stops_the_coordinator_from_accepting_pushes(coordinator, net_cfg, monkeypatch,
                                                                         two_islands):
    """A failed outer step (a full disk) is not retried in place: the coordinator turns fatal (run_coordinator
    then exits; --resume restarts it) and refuses pushes."""
    def full_disk():
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(coordinator.service.merger, "prepare", full_disk)
    (c0, c1), (j0, j1) = two_islands(coordinator.address, net_cfg)
    n = j0.tree_size
    assert c0.push(push_header(j0, "a1"), delta_frame(n, 1)[1]).status == pb.PUSH_STATUS_PENDING
    with pytest.raises(CoordinatorError):  # the push that completes the round hits the failing step
        c1.push(push_header(j1, "b1"), delta_frame(n, 2)[1])
    assert "No space left on device" in coordinator.service.loop.fatal and coordinator.service.state.version == 0
    with pytest.raises(CoordinatorError, match="UNAVAILABLE.*coordinator failed"):
        c0.push(push_header(j0, "a2", base=0), delta_frame(n, 3)[1])


def test_the_service_finishes_when_every_island_holds_the_last_version(net_cfg, tmp_path, two_islands):
    """The state machine's finished() decision, reached through the ticker: the heartbeats that report the last
    version notify it, and wait_finished() returns without polling (well before the 10 s linger)."""
    import time

    running = Running(replace(net_cfg, train={"steps": 10}), tmp_path / "finish")  # a run of one version
    try:
        (c0, c1), (j0, j1) = two_islands(running.address, net_cfg)
        n = j0.tree_size
        c0.push(push_header(j0, "a1"), delta_frame(n, 11)[1])
        assert c1.push(push_header(j1, "b1"), delta_frame(n, 12)[1]).status == pb.PUSH_STATUS_MERGED
        assert running.service.loop.finished is None  # over, but neither island holds version 1 yet
        for c, j in ((c0, j0), (c1, j1)):
            assert c.heartbeat(island_id=j.island_id, version=1).action == pb.ACTION_STOP
        t0 = time.monotonic()
        over = "the run is over (1 versions) and every live island holds version 1"
        assert running.service.loop.wait_finished() == over
        assert time.monotonic() - t0 < 5.0
        running.service.loop.request_stop("ignored: already finished")
        assert running.service.loop.wait_finished().startswith("the run is over")
    finally:
        running.stop()


def test_a_second_coordinator_on_a_used_port_fails_clearly(net_cfg, tmp_path, monkeypatch, capsys):
    """SO_REUSEPORT is off: a second coordinator on the first one's port is refused with one line naming the
    address, by the check before anything starts and, were that check raced, by gRPC's own bind."""
    import coordinator.preflight as preflight
    from dtrain.errors import DtrainError
    from dtrain_cli.main import main

    first = Running(net_cfg, tmp_path / "first")
    try:
        theta, spec = initial_parameters(net_cfg)
        with pytest.raises(DtrainError, match=f"cannot listen on 127.0.0.1:{first.port}: the address is already "
                                              f"in use .*--port or coordinator.port"):
            serve(net_cfg, tmp_path / "second", theta, spec, port=first.port, quiet=True)
        assert not (tmp_path / "second").exists()  # refused before anything was written
        monkeypatch.setattr(preflight, "check_address_free", lambda host, port: None)
        with pytest.raises(DtrainError, match=f"cannot listen on 127.0.0.1:{first.port}: gRPC could not bind it"):
            serve(net_cfg, tmp_path / "third", theta, spec, port=first.port, quiet=True)
        monkeypatch.undo()
        rc = main(["coordinator", "--config", str(ROOT / "configs" / "tiny.toml"), "--port", str(first.port),
                   "--run-dir", str(tmp_path / "cli"), "--quiet"])
        err = capsys.readouterr().err
        assert rc == 1 and err.count("\n") == 1 and "Traceback" not in err
        assert err.startswith(f"dtrain coordinator: error: cannot listen on 127.0.0.1:{first.port}: the address is")
        # The first coordinator still serves, alone.
        client = CoordinatorClient(first.address, net_cfg)
        assert client.status().run_id == first.service.run_id
        client.close()
    finally:
        first.stop()


def test_after_the_run_a_join_is_refused_as_over_and_a_worker_exits_at_once(net_cfg, tmp_path, capsys, two_islands):
    """A Join after the run is over is refused, marked so the island's client raises RunOverError; a worker
    started then returns at once without training, and `dtrain worker` prints one line and exits 0."""
    import time

    from dtrain_cli.main import main
    from workers.app import run_worker
    from workers.client import RunOverError

    cfg = replace(net_cfg, train={"steps": 10})  # a run of one version
    running = Running(cfg, tmp_path / "over")
    try:
        (c0, c1), (j0, j1) = two_islands(running.address, cfg)
        c0.push(push_header(j0, "a1"), delta_frame(j0.tree_size, 1)[1])
        c1.push(push_header(j1, "b1"), delta_frame(j0.tree_size, 2)[1])
        over = "the run is over: all 2 shards' data (80 sequences each) merged, in 1 versions"
        with pytest.raises(RunOverError, match=re.escape(f"FAILED_PRECONDITION: {over}: nothing left to train")):
            join_island(c0, "a")  # a restarted island
        with pytest.raises(RunOverError, match="the run is over"):
            join_island(c0, "late-newcomer")
        t0 = time.monotonic()
        out = run_worker(cfg, running.address, "a", tmp_path / "island-a", quiet=True)
        assert out == {"island": "a", "run_over": f"{over} (coordinator at {running.address})"}
        assert time.monotonic() - t0 < 5.0
        rc = main(["worker", "--config", str(ROOT / "configs" / "tiny.toml"), "--coordinator", running.address,
                   "--island", "b", "--run-dir", str(tmp_path / "island-b"), "--quiet"])
        printed = capsys.readouterr().out
        assert rc == 0 and printed == f"dtrain worker: {over} (coordinator at {running.address}): nothing to do\n"
    finally:
        running.stop()


def test_a_quarantined_island_stops_at_once_and_costs_its_header(net_cfg, tmp_path):
    """A real worker whose every push the coordinator rejects (norm_max_ratio tiny): its second rejection in a row
    quarantines it (coordinator.max_rejections 2), and the reply to that push tells it so: the island stops at
    once, with the reason (a ``stop_requested`` event by the push), and pushes nothing more, long before its next
    heartbeat (10 s away) would have told it. Before, it trained its range again and pushed, refused, every round
    until that heartbeat. A hostile island that pushes anyway is refused before its payload is read (no bytes in),
    the refusal marked stopped with the coordinator's version."""
    from workers.app import run_worker

    cfg = replace(net_cfg, outer={"islands": 1}, worker={"heartbeat_s": 10.0},
                  coordinator={"norm_max_ratio": 1e-9, "max_rejections": 2, "reject_backoff_s": 0.0})
    running = Running(cfg, tmp_path / "coord")
    try:
        out = run_worker(cfg, running.address, "a", tmp_path / "island-a", quiet=True)
        events = read_events(tmp_path / "island-a")
        sent = [e for e in events if e["event"] == "push_sent"]
        assert [e["status"] for e in sent] == ["PUSH_STATUS_REJECTED"] * 2, sent
        (stop,) = [e for e in events if e["event"] == "stop_requested"]
        assert stop["by"] == "push" and stop["version"] == 0
        assert stop["reason"].startswith("quarantined: 2 pushes in a row rejected (coordinator.max_rejections 2)")
        assert out["version"] == 0 and out["island"] == "a" and "island_id" not in out  # its name, one
        (joined,) = [e for e in events if e["event"] == "joined"]  # the coordinator's id for it, on the wire
        counters = running.service.counters
        assert counters.pushes_refused == 0  # no push after the quarantine
        (q,) = [e for e in read_events(tmp_path / "coord") if e["event"] == "island_quarantined"]
        assert (q["island"], q["island_id"]) == ("a", joined["island_id"]) and q["reason"] == stop["reason"]
        # pushing anyway: refused before the payload streams in, marked stopped
        client = CoordinatorClient(running.address, cfg)
        bytes_in = counters.bytes_in
        h = pb.PushHeader(island_id=joined["island_id"], base_version=0, push_id="again", tokens=640, inner_steps=10,
                          cursor_start=0, cursor_end=80, tree_digest=running.service.tree_digest, shard_index=0)
        with pytest.raises(CoordinatorError) as refused:
            client.push(h, delta_frame(running.service.merger.n, 1)[1])
        client.close()
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION and refused.value.stopped_at == 0
        assert f"a is quarantined ({stop['reason']})" in refused.value.message
        assert counters.bytes_in == bytes_in and counters.pushes_refused == 1
    finally:
        running.stop()


def test_an_unreachable_coordinator_is_named_with_the_time_left(net_cfg, tmp_path):
    """Retries name the address and how long they go on; giving up names both, in one line."""
    import socket
    import time

    from workers.app import run_worker

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    retries: list[tuple[str, float, float]] = []
    client = CoordinatorClient(address, replace(net_cfg, worker={"retry_total_s": 1.0, "retry_initial_s": 0.1}),
                               on_retry=lambda what, pause, left: retries.append((what, pause, left)))
    t0 = time.monotonic()
    with pytest.raises(CoordinatorError) as e:
        join_island(client, "a")
    assert time.monotonic() - t0 >= 1.0  # it kept trying for its budget (no upper bound: a loaded host is slower)
    msg = str(e.value)
    # gRPC's code and what it means, not its raw debug text ("failed to connect to all addresses; last error: ...")
    assert msg == (f"UNAVAILABLE: join: gave up on the coordinator at {address} after trying for 1s "
                   f"(worker.retry_total_s): connection refused: nothing listens there; is it running? check the "
                   f"address (--coordinator) and the coordinator's log")
    assert retries and all(what == f"join: the coordinator at {address} is unavailable (UNAVAILABLE, connection "
                                   f"refused: nothing listens there)" for what, _, _ in retries)
    assert all(0 < left <= 1.0 for _, _, left in retries) and retries[-1][2] < retries[0][2]
    client.close()
    # An island that is done (its give_up event set: the run is over) does not wait for a coordinator that left.
    done = threading.Event()
    done.set()
    client = CoordinatorClient(address, net_cfg, give_up=done)  # retry_total_s 600 s: not waited for
    t0 = time.monotonic()
    with pytest.raises(CoordinatorError, match=f"the coordinator at {address} is unavailable .* and the island is "
                                               f"done: not retried"):
        client.pull("a-0", 3, wait_s=1.0)
    assert time.monotonic() - t0 < 5.0 and client.retries == 0
    client.close()
    # A worker restarted after it finished the run, its coordinator gone: its own summary.json says so.
    island_dir = tmp_path / "island-a"
    island_dir.mkdir()
    summary = {"version": 4, "total_versions": 4, "fingerprint": net_cfg.fingerprint()}
    (island_dir / "summary.json").write_text(json.dumps(summary))
    t0 = time.monotonic()
    out = run_worker(net_cfg, address, "a", island_dir, quiet=True)
    assert time.monotonic() - t0 < 5.0 and out["run_over"].startswith("this island finished the run (version 4 of 4")
    assert f"the coordinator at {address} does not answer" in out["run_over"]
    (island_dir / "summary.json").write_text(json.dumps({**summary, "version": 3}))  # it had not: Join retries
    with pytest.raises(CoordinatorError, match=f"join: gave up on the coordinator at {address} after trying"):
        run_worker(net_cfg, address, "a", island_dir, quiet=True)


def test_at_most_max_receiving_pushes_stream_in_at_once_and_a_refused_one_frees_its_place(net_cfg, tmp_path,
                                                                                          two_islands):
    """coordinator.max_receiving=1: a garbled push is refused and gives its place back; two pushes sent at once
    are received one after the other (the second waits, held by flow control), both accepted, one merge."""
    cfg = dataclasses.replace(net_cfg, coordinator=dataclasses.replace(net_cfg.coordinator, max_receiving=1))
    running = Running(cfg, tmp_path / "coord")
    try:
        clients, joins = two_islands(running.address, cfg, names=("isl-0", "isl-1"))
        n = joins[0].tree_size
        stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(running.address))
        msgs = frame_messages(joins[0], delta_frame(n, 6)[1], "garbled")
        data = bytearray(msgs[2].chunk.data)
        data[10] ^= 0xFF
        msgs[2].chunk.data = bytes(data)
        with pytest.raises(grpc.RpcError) as e:
            stub.PushDelta(iter(msgs), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "CRC32 mismatch" in e.value.details()
        results: list = [None, None]

        def push(i: int) -> None:
            results[i] = clients[i].push(push_header(joins[i], f"p{i}"), delta_frame(n, i)[1])

        threads = [threading.Thread(target=push, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert {r.status for r in results} <= {pb.PUSH_STATUS_PENDING, pb.PUSH_STATUS_MERGED}
        st = clients[0].status()
        assert st.version == 1 and st.tokens_merged == 2 * 640
        receiving = running.service.plane.receiving  # the server's event loop's (coordinator/data_plane.py)
        assert receiving is not None and not receiving.locked()  # every place given back
    finally:
        running.stop()


def test_pulls_stream_in_half_the_islands_share_and_the_heap_is_trimmed_when_streams_end(net_cfg, tmp_path):
    """coordinator.stream_budget_bytes = 128 KiB for 2 islands: each island's share is 64 KiB, so a pull's frame
    goes in 32 KiB chunks (codec.chunk_bytes is 64 KiB here) that the island takes whole, bit for bit. Once the
    frame streams are over, none is counted as streaming and the free heap went back to the OS (glibc)."""
    cfg = replace(net_cfg, codec={"chunk_bytes": 65536},
                  coordinator={"stream_budget_bytes": 131072, "max_message_bytes": 1 << 20})
    running = Running(cfg, tmp_path / "coord")
    try:
        client = CoordinatorClient(running.address, cfg)
        join = join_island(client, "isl-0")
        stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(running.address))
        messages = list(stub.PullGlobal(pb.PullRequest(island_id=join.island_id, have_version=0, full=True),
                                        timeout=10))
        header, chunks = messages[0].header, [m.chunk for m in messages[1:]]
        assert header.kind == pb.PULL_KIND_FULL and header.total_bytes > 3 * 32768
        assert header.chunks == len(chunks) == -(-header.total_bytes // 32768)
        assert all(len(c.data) == 32768 for c in chunks[:-1]) and 0 < len(chunks[-1].data) <= 32768
        frame = b"".join(c.data for c in chunks)
        assert zlib.crc32(frame) == header.frame_crc32
        theta = codec.dequantize(codec.decode(frame, expected_n=join.tree_size))
        assert np.array_equal(theta, running.theta)
        (pulled,) = client.pull(join.island_id, 0, full=True)  # the client's own receiver takes such chunks
        assert pulled.frame == frame
        r = client.push(push_header(join, "p0"), delta_frame(join.tree_size, 0)[1])
        assert r.status == pb.PUSH_STATUS_MERGED  # the only live island: its push closes the round
        streams = running.service.streams
        deadline = time.monotonic() + 10
        while streams.active and time.monotonic() < deadline:  # a pull's handler ends just after its last chunk
            time.sleep(0.01)
        assert streams.active == 0
        assert streams.trims >= 1  # glibc here (Debian): malloc_trim ran when the first stream ended
        client.close()
    finally:
        running.stop()
