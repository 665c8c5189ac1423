"""A real coordinator on 127.0.0.1:0, real gRPC clients: join, push, pull, merge, resume, and the bad cases."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from conftest import initial_parameters
from coordinator import admission
from coordinator.app import serve
from coordinator.records import PushInfo
from dtrain import codec
from dtrain.codec import params_digest
from dtrain.config.load import replace
from dtrain.errors import CheckpointError
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.proto import dtrain_pb2_grpc as pb_grpc
from dtrain.net.wire import auth_metadata, frame_chunks
from dtrain.runlog import read_events
from service_helpers import Running, delta_frame, join_island, push_header, tls_config
from workers.client import CoordinatorClient, CoordinatorError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def coordinator(net_cfg, tmp_path):
    running = Running(net_cfg, tmp_path / "coord")
    yield running
    running.stop()


# two_islands(address, cfg, names=("a", "b")) -> ((client, client), (join, join))
JoinTwo = Callable[..., tuple[tuple[CoordinatorClient, CoordinatorClient], tuple[pb.JoinResponse, pb.JoinResponse]]]


@pytest.fixture
def two_islands() -> Iterator[JoinTwo]:
    """``two_islands(address, cfg, names=("a", "b"))``: two clients of the coordinator at ``address``, joined as
    islands ``names`` (one CPU device each), as ((client, client), (join, join)); closed at the test's end."""
    opened: list[CoordinatorClient] = []

    def join_two(address: str, cfg, names: tuple[str, str] = ("a", "b")):
        clients = (CoordinatorClient(address, cfg), CoordinatorClient(address, cfg))
        opened.extend(clients)
        return clients, (join_island(clients[0], names[0]), join_island(clients[1], names[1]))

    yield join_two
    for c in opened:
        c.close()


def _snapshot(service) -> dict:
    with service.lock:
        return {"state": service.state.to_json(), "pending_sum": service.merger.pending_sum(),
                "w": service.merger.total_weight, "version": service.merger.version}


def _assert_unchanged(before: dict, service) -> None:
    after = _snapshot(service)
    assert after["state"] == before["state"]
    assert after["version"] == before["version"] and after["w"] == before["w"]
    assert np.array_equal(after["pending_sum"], before["pending_sum"])


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
    before = _snapshot(coordinator.service)
    with pytest.raises(CoordinatorError) as e:
        client.join("x", "cpu", 1)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "model.d_model: coordinator 32, island 64" in str(e.value)
    _assert_unchanged(before, coordinator.service)
    client.close()


def _raw_push(address: str, messages: list[pb.PushMessage], token: str | None = None):
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(address))
    return stub.PushDelta(iter(messages), timeout=10, metadata=auth_metadata(token))


def _frame_messages(join, frame: bytes, push_id: str, chunk: int = 4096, **overrides) -> list[pb.PushMessage]:
    _, chunks = frame_chunks(frame, chunk)
    h = push_header(join, push_id)
    h.total_bytes, h.frame_crc32, h.chunks = len(frame), zlib.crc32(frame), len(chunks)
    for k, v in overrides.items():
        setattr(h, k, v)
    return [pb.PushMessage(header=h)] + [pb.PushMessage(chunk=pb.Chunk(index=i, data=bytes(d), crc32=c))
                                         for i, (d, c) in enumerate(chunks)]


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
    msgs = _frame_messages(join, frame, f"bad-{case}")
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
        msgs = _frame_messages(join, junk, "bad-frame")
    elif case == "future_version":
        msgs[0].header.base_version = 7
    elif case == "wrong_tree":
        msgs[0].header.tree_digest = "0" * 16
    before = _snapshot(coordinator.service)
    with pytest.raises(grpc.RpcError) as e:
        _raw_push(coordinator.address, msgs)
    assert e.value.code() == code, e.value.details()
    assert match in e.value.details()
    _assert_unchanged(before, coordinator.service)
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
        before = _snapshot(running.service)
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
        _assert_unchanged(before, running.service)
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


def test_coordinator_resumes_from_its_checkpoint(net_cfg, tmp_path, two_islands):
    run_dir = tmp_path / "resume"
    first = Running(net_cfg, run_dir)
    (c0, c1), (j0, j1) = two_islands(first.address, net_cfg)
    n = j0.tree_size
    c0.push(push_header(j0, "a1"), delta_frame(n, 7)[1])
    c1.push(push_header(j1, "b1"), delta_frame(n, 8)[1])
    digest, version = first.service.merger.digest, first.service.merger.version
    theta = first.service.merger.theta.copy()
    momentum = first.service.merger.momentum.copy()
    first.stop()  # waits for the async checkpoint
    second = Running(net_cfg, run_dir, resume=True)
    try:
        m = second.service.merger
        assert (m.version, m.digest) == (version, digest) == (1, digest)
        assert np.array_equal(m.theta, theta) and np.array_equal(m.momentum, momentum)
        client = CoordinatorClient(second.address, net_cfg)
        again = join_island(client, "a")
        assert again.island_id == j0.island_id and again.shard_index == j0.shard_index and again.cursor == 80
        # A push already merged before the restart is recognised as a duplicate.
        assert client.push(push_header(j0, "a1"), delta_frame(n, 7)[1]).status == pb.PUSH_STATUS_DUPLICATE
        client.close()
    finally:
        second.stop()
    # The checkpoint holds θ as a hard link to the version file: no copy was made. A θ that no longer matches
    # the digest recorded with it is refused, naming the problem, before anything is served.
    ckpt_theta = run_dir / "coordinator" / "1" / "state" / "theta.bin"
    assert ckpt_theta.stat().st_nlink >= 1 and ckpt_theta.stat().st_size == 4 * n
    raw = bytearray(ckpt_theta.read_bytes())
    raw[100] ^= 0x01
    ckpt_theta.unlink()  # write a new inode: the state folder's link keeps the intact bytes
    ckpt_theta.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="theta.bin: CRC-32 .* differs from the recorded"):
        Running(net_cfg, run_dir, resume=True)
    manifest_path = run_dir / "coordinator" / "1" / "state" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["theta"]["crc32"] = zlib.crc32(bytes(raw))  # a CRC forged to match: θ's digest still refuses it
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="θ digest .* differs from the recorded"):
        Running(net_cfg, run_dir, resume=True)
    ckpt_theta.write_bytes(bytes(raw[:-4]))  # and one value short: refused on its size
    with pytest.raises(CheckpointError, match="missing or not"):
        Running(net_cfg, run_dir, resume=True)
    ckpt_theta.write_bytes(bytes(raw))
    wider = replace(net_cfg, model={"d_model": 2 * net_cfg.model.d_model})  # another model's run folder
    with pytest.raises(CheckpointError, match="holds .* parameters, this config's model has"):
        Running(wider, run_dir, resume=True)


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


def _three_versions(cfg, run_dir: Path, two_islands: JoinTwo) -> dict:
    """A coordinator run to version 3 (checkpoints 2 and 3 kept); returns θ and momentum at version 2."""
    first = Running(cfg, run_dir)
    (c0, c1), (j0, j1) = two_islands(first.address, cfg)
    n = j0.tree_size
    at_v2 = {}
    for v in range(3):
        c0.push(push_header(j0, f"a{v}", base=v, start=80 * v), delta_frame(n, 20 + v)[1])
        c1.push(push_header(j1, f"b{v}", base=v, start=80 * v), delta_frame(n, 30 + v)[1])
        if v == 1:
            m = first.service.merger
            at_v2 = {"theta": m.theta.copy(), "momentum": m.momentum.copy(), "digest": m.digest}
    assert first.service.merger.version == 3
    first.stop()
    assert sorted(int(p.name) for p in (run_dir / "coordinator").iterdir() if p.name.isdigit()) == [2, 3]
    return at_v2


def _rewrite(path: Path, data: bytes) -> None:
    path.unlink()  # a new inode: the other links to the file (the merger's state folder) keep their bytes
    path.write_bytes(data)


def _poke_momentum(step_dir: Path) -> None:
    """One momentum value set to -1949 (the issue's case: a plausible float where ~0.005 was)."""
    path = step_dir / "state" / "momentum.bin"
    values = np.fromfile(path, "<f4")
    values[10] = -1949.0
    _rewrite(path, values.tobytes())


def _truncate_theta(step_dir: Path) -> None:
    path = step_dir / "state" / "theta.bin"
    _rewrite(path, path.read_bytes()[: path.stat().st_size // 2])


# How the latest checkpoint (3) is damaged, and a word its skip reason must contain.
DAMAGE = {
    "momentum_value": (_poke_momentum, "momentum.bin: CRC-32"),
    "metadata_garbled": (lambda d: (d / "meta" / "metadata").write_text('{"state": [1, 2'), "cannot be restored"),
    "metadata_missing": (lambda d: (d / "meta" / "metadata").unlink(), "cannot be restored"),
    "manifest_garbled": (lambda d: (d / "state" / "manifest.json").write_text("[]"), "manifest.json"),
    "theta_truncated": (_truncate_theta, "theta.bin: missing or not"),
    "no_commit_marker": (lambda d: (d / "commit_success.txt").unlink(), "incomplete (no commit_success.txt"),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_resume_falls_back_to_the_newest_good_checkpoint(net_cfg, tmp_path, damage, two_islands):
    """A bad latest checkpoint is skipped, named in a checkpoint_skipped event and set aside; the run resumes
    from the one before, exactly, and goes on (the next merge saves the skipped step's number again)."""
    from dtrain.runlog import read_events

    run_dir = tmp_path / "run"
    at_v2 = _three_versions(net_cfg, run_dir, two_islands)
    harm, words = DAMAGE[damage]
    harm(run_dir / "coordinator" / "3")
    second = Running(net_cfg, run_dir, resume=True)
    try:
        m = second.service.merger
        assert (m.version, m.digest) == (2, at_v2["digest"])
        assert np.array_equal(m.theta, at_v2["theta"]) and np.array_equal(m.momentum, at_v2["momentum"])
        skipped = [e for e in read_events(run_dir) if e["event"] == "checkpoint_skipped"]
        assert len(skipped) == 1 and skipped[0]["step"] == 3 and words in skipped[0]["reason"], skipped
        assert Path(skipped[0]["moved_to"]).parent == run_dir / "coordinator.skipped"
        assert not (run_dir / "coordinator" / "3").exists()
        (c0, c1), (j0, j1) = two_islands(second.address, net_cfg)
        n = j0.tree_size
        c0.push(push_header(j0, "a-again", base=2, start=160), delta_frame(n, 40)[1])
        c1.push(push_header(j1, "b-again", base=2, start=160), delta_frame(n, 41)[1])
        assert second.service.merger.version == 3
    finally:
        second.stop()
    assert (run_dir / "coordinator" / "3" / "commit_success.txt").is_file()  # version 3 saved afresh


def test_a_crash_mid_checkpoint_restores_the_last_complete_one(net_cfg, tmp_path, two_islands):
    """Orbax writes a step into a temporary folder and renames it when complete: a crash mid-save leaves that
    folder, which a resume ignores (nothing is skipped: it never was a checkpoint)."""
    from dtrain.runlog import read_events

    run_dir = tmp_path / "run"
    _three_versions(net_cfg, run_dir, two_islands)
    ckpt = run_dir / "coordinator"
    partial = ckpt / "4.orbax-checkpoint-tmp-1700000000000000"
    shutil.copytree(ckpt / "3", partial)
    (partial / "commit_success.txt").unlink()
    (partial / "state" / "momentum.bin").write_bytes(b"\0" * 64)  # half written
    second = Running(net_cfg, run_dir, resume=True)
    try:
        assert second.service.merger.version == 3
        assert not [e for e in read_events(run_dir) if e["event"] == "checkpoint_skipped"]
    finally:
        second.stop()


def test_resume_without_a_good_checkpoint_names_each_and_why(net_cfg, tmp_path, two_islands):
    run_dir = tmp_path / "run"
    _three_versions(net_cfg, run_dir, two_islands)
    _poke_momentum(run_dir / "coordinator" / "3")
    (run_dir / "coordinator" / "2" / "meta" / "metadata").write_text("not json")
    with pytest.raises(CheckpointError) as e:
        Running(net_cfg, run_dir, resume=True)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--resume: no good coordinator checkpoint in ")
    assert "checkpoint 3: " in msg and "momentum.bin: CRC-32" in msg
    assert "checkpoint 2: " in msg and "cannot be restored" in msg
    assert sorted(p.name for p in (run_dir / "coordinator").iterdir()) == ["2", "3"]  # nothing set aside


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


# -- deltas cannot poison θ, over the wire ---------------------------------------------------------------------


def _poison_frame(n: int) -> bytes:
    """The issue's poisoned delta: an int8 frame of 3e38 values (valid: every scale and code is in range)."""
    return codec.encode(codec.quantize(np.full(n, 3e38, np.float32), 8, 1024))


def test_a_poisoned_push_with_inflated_tokens_is_refused_and_theta_stays_finite(coordinator, net_cfg, tmp_path,
                                                                                two_islands):
    (c0, c1), (j0, j1) = two_islands(coordinator.address, net_cfg)
    n = j0.tree_size
    before = _snapshot(coordinator.service)
    with pytest.raises(grpc.RpcError) as e:  # cursor range [0, 80) holds 80 x seq_len 32 = 2560 tokens
        _raw_push(coordinator.address, _frame_messages(j0, _poison_frame(n), "poison", tokens=10 ** 9))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tokens=1000000000 exceed its cursor range [0, 80) = 80 sequences x seq_len 32 = 2560 tokens" in \
        e.value.details()
    _assert_unchanged(before, coordinator.service)
    assert coordinator.service.counters.pushes_refused == 1
    # The round goes on with honest pushes: θ moves by them alone and stays finite.
    d0, f0 = delta_frame(n, 40)
    d1, f1 = delta_frame(n, 41)
    assert c0.push(push_header(j0, "a1"), f0).status == pb.PUSH_STATUS_PENDING
    assert c1.push(push_header(j1, "b1"), f1).status == pb.PUSH_STATUS_MERGED
    theta = coordinator.service.merger.theta
    assert np.isfinite(theta).all() and np.abs(theta - coordinator.theta).max() < 0.01
    events = read_events(tmp_path / "coord")
    refused = [ev for ev in events if ev["event"] == "push_refused"]
    assert len(refused) == 1 and refused[0]["push_id"] == "poison" and "tokens=1000000000" in refused[0]["reason"]


def test_a_poisoned_push_with_honest_tokens_is_quarantined_and_the_round_goes_on(coordinator, net_cfg, tmp_path,
                                                                                 two_islands):
    """Its norm is far over coordinator.norm_max_ratio x ||θ||: rejected in the first round already; the island is
    told in the push reply and its heartbeats; the round does not wait for it."""
    (c0, c1), (j0, j1) = two_islands(coordinator.address, net_cfg)
    n = j0.tree_size
    r = c0.push(push_header(j0, "poison"), _poison_frame(n))
    assert r.status == pb.PUSH_STATUS_REJECTED and r.reason.startswith("quarantined: push poison has L2 norm")
    assert "more than norm_max_ratio 10 x the L2 norm of θ" in r.reason
    hb = c0.heartbeat(island_id=j0.island_id, version=0)
    assert "your push poison was rejected: quarantined" in hb.reason
    assert c1.push(push_header(j1, "b1"), delta_frame(n, 42)[1]).status == pb.PUSH_STATUS_MERGED
    service = coordinator.service
    assert service.state.version == 1 and service.state.deltas_rejected == 1 and service.state.tokens_merged == 640
    assert np.isfinite(service.merger.theta).all() and np.abs(service.merger.theta - coordinator.theta).max() < 0.01
    assert [ev["push_id"] for ev in read_events(tmp_path / "coord") if ev["event"] == "push_quarantined"] == \
        ["poison"]


def test_a_lone_first_push_of_9_5_theta_moves_theta_no_further_than_an_honest_one_could(net_cfg, tmp_path):
    """The issue's attack: the first island to join pushes 9.5 x ||θ|| (under norm_max_ratio's 10 x) before any
    other has pushed (async: merged on its own, no merged norm to check it against). It is clipped to the honest
    ceiling, so the real merger's outer step moves θ at most outer.lr x (1 + momentum) x that ceiling (Nesterov's
    first step), not to ||θ|| 10.3 -> 131 as before."""
    cfg = replace(net_cfg, coordinator={"mode": "async"}, outer={"islands": 4})
    running = Running(cfg, tmp_path / "coord")
    try:
        client = CoordinatorClient(running.address, cfg)
        join = join_island(client, "first")
        theta0 = running.theta.astype(np.float64)
        delta = (9.5 * np.linalg.norm(theta0) / np.sqrt(theta0.size)) * np.where(
            np.random.default_rng(3).random(theta0.size) < 0.5, -1.0, 1.0).astype(np.float32)
        r = client.push(push_header(join, "lone"), codec.encode(codec.quantize(delta, 8, cfg.codec.block)))
        assert r.status == pb.PUSH_STATUS_MERGED and "clipped to the honest ceiling" in r.reason
        service = running.service
        ceiling = admission.honest_ceiling(service.opts, PushInfo(
            "lone", join.island_id, 0, 640, 10, 0, 80, join.shard_index), float(np.linalg.norm(theta0)))
        moved = np.linalg.norm(service.merger.theta.astype(np.float64) - theta0)
        assert 0 < moved <= cfg.outer.lr * (1 + cfg.outer.momentum) * ceiling * 1.001
        assert np.linalg.norm(service.merger.theta) < 4 * np.linalg.norm(theta0)  # was 12.7 x
        (received,) = [e for e in read_events(tmp_path / "coord") if e["event"] == "push_received"]
        assert "unchecked" in received["reason"]
        client.close()
    finally:
        running.stop()


def test_a_throttled_push_says_how_long_and_the_island_sends_it_again_once_the_backoff_is_over(net_cfg, tmp_path,
                                                                                                two_islands):
    """After a rejected push its island's next push is refused before its payload streams in, with the seconds
    of backoff left in the refusal's trailing metadata (the client's CoordinatorError.retry_after_s, not the
    message's words). The island's exchange waits them out and sends the same push once more, which the
    coordinator then judges and merges: one refusal per push, every token merged once. The coordinator's clock
    is the test's, and the exchange's waits move it: what is counted is pushes and events, not time."""
    from workers.exchange import Exchange, GlobalParams, Puller

    now = [1000.0]
    running = Running(net_cfg, tmp_path / "coord", clock=lambda: now[0])
    try:
        (c0, c1), (j0, j1) = two_islands(running.address, net_cfg)
        n = j0.tree_size
        assert c0.push(push_header(j0, "poison"), _poison_frame(n)).status == pb.PUSH_STATUS_REJECTED
        now[0] += 0.25  # of coordinator.reject_backoff_s 1
        with pytest.raises(CoordinatorError) as refused:
            c0.push(push_header(j0, "a0"), delta_frame(n, 40)[1])
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION and refused.value.retry_after_s == 0.75

        waits: list[float | None] = []

        class CoordinatorTime(threading.Event):  # the exchange's stop event: its waits pass the coordinator's time
            def wait(self, timeout: float | None = None) -> bool:
                waits.append(timeout)
                now[0] += timeout or 0.0
                return False

        island_events: list[tuple[str, dict]] = []
        ex = Exchange(c0, Puller(c0, n, 1 << 24, lambda kind, **f: island_events.append((kind, f))), delta_frame(
                          n, 41)[1], push_header(j0, "a1"), GlobalParams(running.theta.copy(), 0), 0,
                      CoordinatorTime(), lambda kind, **f: island_events.append((kind, f)))
        future = ex.start()
        for _ in range(300):  # the resent push is pending in the round: the other island's push completes it
            if ex.response is not None:
                break
            time.sleep(0.1)
        assert ex.response is not None and ex.response.status == pb.PUSH_STATUS_PENDING
        assert c1.push(push_header(j1, "b1"), delta_frame(n, 42)[1]).status == pb.PUSH_STATUS_MERGED
        assert future.result(timeout=30).version == 1
        assert waits == [0.75]  # sent again only once the backoff was over, and judged then
        assert [k for k, _ in island_events] == ["push_throttled", "push_sent"]
        assert island_events[0][1]["wait_s"] == 0.75 and island_events[0][1]["push_id"] == "a1"
        service = running.service
        assert service.state.version == 1 and service.state.tokens_merged == 1280
        assert service.state.deltas_rejected == 1 and service.counters.pushes_refused == 2
        events = read_events(tmp_path / "coord")
        assert [(e["push_id"], e.get("retry_after_s")) for e in events if e["event"] == "push_refused"] == \
            [("a0", 0.75), ("a1", 0.75)]
        assert [e["status"] for e in events if e["event"] == "push_received" and e["push_id"] == "a1"] == ["accept"]
    finally:
        running.stop()


def test_a_reversed_push_in_a_round_of_four_is_rejected_by_the_direction_screen(net_cfg, tmp_path):
    """The default merge (auto: screened_mean) over the wire: three islands push correlated honest deltas, the
    fourth −1 x one (within every norm bound). When the round closes its cosine with the round's coordinate median
    is negative: rejected (push_quarantined by the round screen, its island told why), and θ moves by the mean of
    the honest three; the merged pushes' cosines are in round_merged."""
    cfg = replace(net_cfg, outer={"islands": 4, "lr": 1.0, "momentum": 0.0}, codec={"down": "fp32"})
    running = Running(cfg, tmp_path / "coord")
    clients = [CoordinatorClient(running.address, cfg) for _ in range(4)]
    try:
        joins = [join_island(c, name) for c, name in zip(clients, "abcd", strict=True)]
        n = joins[0].tree_size
        rng = np.random.default_rng(60)
        common = rng.normal(size=n).astype(np.float32) * 1e-3
        deltas = [common + rng.normal(size=n).astype(np.float32) * 5e-4 for _ in range(3)]
        deltas.append(-1.0 * deltas[0])
        for i, (c, j, d) in enumerate(zip(clients, joins, deltas, strict=True)):
            c.push(push_header(j, f"p{i}"), codec.encode(codec.quantize(d, 8, 1024)))
        service = running.service
        assert service.state.version == 1 and service.state.deltas_rejected == 1
        events = read_events(tmp_path / "coord")
        (quarantined,) = [e for e in events if e["event"] == "push_quarantined"]
        assert quarantined["push_id"] == "p3" and quarantined["by"] == "round_screen"
        assert "points away from the others: cosine -" in quarantined["reason"]
        assert "with the coordinate median of the 4 pushes of its round" in quarantined["reason"]
        assert "your push p3 was rejected: quarantined" in clients[3].heartbeat(island_id=joins[3].island_id,
                                                                                version=1).reason
        (merged,) = [e for e in events if e["event"] == "round_merged"]
        assert sorted(p["push_id"] for p in merged["pushes"]) == ["p0", "p1", "p2"]
        assert all(p["cosine"] > 0.5 for p in merged["pushes"])
        honest = np.mean([codec.dequantize(codec.quantize(d, 8, 1024)) for d in deltas[:3]], axis=0)
        np.testing.assert_allclose(running.theta - service.merger.theta, honest, atol=1e-6)
    finally:
        for c in clients:
            c.close()
        running.stop()


def test_a_merge_that_would_be_non_finite_is_not_committed_and_the_run_goes_on(net_cfg, tmp_path, two_islands):
    """With the norm screens off and the mean merge (the last guard is the one under test), the poisoned push is
    accepted (with the most tokens its range allows: 2560); the outer step (lr 1) finds its update non-finite
    (-(Δ + 0.9·m) = -1.9 x 0.8 x 3e38), commits nothing, rejects the push (the largest) and merges the round
    without it. Not fatal."""
    cfg = replace(net_cfg, coordinator={"norm_max_ratio": 0.0, "norm_z_max": 0.0, "round_norm_ratio": 0.0,
                                        "merge_rule": "mean"}, outer={"lr": 1.0})
    running = Running(cfg, tmp_path / "coord")
    try:
        (c0, c1), (j0, j1) = two_islands(running.address, cfg)
        n = j0.tree_size
        d1, f1 = delta_frame(n, 43)
        assert c1.push(push_header(j1, "b1"), f1).status == pb.PUSH_STATUS_PENDING
        r = c0.push(push_header(j0, "poison", tokens=2560), _poison_frame(n))  # completes the round: rejected
        assert r.status == pb.PUSH_STATUS_REJECTED and "the outer step for version 1 makes update[" in r.reason
        assert "blamed: push poison" in r.reason and r.version == 1
        service = running.service
        assert service.loop.fatal is None and service.state.version == 1 and service.state.deltas_rejected == 1
        assert service.state.tokens_merged == 640 and np.isfinite(service.merger.theta).all()
        assert "your push poison was rejected" in c0.heartbeat(island_id=j0.island_id, version=1).reason
        assert list((tmp_path / "coord" / "spool" / "state").glob("*.tmp")) == []
        events = read_events(tmp_path / "coord")
        assert [ev["push_id"] for ev in events if ev["event"] == "merge_rejected"] == ["poison"]
        merged = [ev for ev in events if ev["event"] == "round_merged"]
        assert len(merged) == 1 and [p["push_id"] for p in merged[0]["pushes"]] == ["b1"]
    finally:
        running.stop()


@pytest.mark.parametrize("up,bad", [("fp32", np.nan), ("fp32", np.inf), ("int8", np.nan), ("int4", np.inf),
                                    ("e3m0", np.nan)])
def test_a_nan_or_inf_delta_is_refused_at_validation_in_every_codec(net_cfg, tmp_path, up, bad):
    cfg = replace(net_cfg, codec={"up": up})
    running = Running(cfg, tmp_path / "coord")
    try:
        client = CoordinatorClient(running.address, cfg)
        join = join_island(client, "a")
        n, bits = join.tree_size, codec.CODEC_BITS[up]
        q = codec.quantize(np.ones(n, np.float32), bits, 1024)
        if bits == 32:  # the value itself
            payload = q.payload.copy().view("<f4")
            payload[5] = bad
            q = codec.QuantizedVec(bits, q.block, n, q.scales, payload.view(np.uint8))
        else:  # a block's scale (quantized codes are always finite)
            scales = q.scales.copy()
            scales[1] = bad
            q = codec.QuantizedVec(bits, q.block, n, scales, q.payload)
        before = _snapshot(running.service)
        with pytest.raises(grpc.RpcError) as e:
            _raw_push(running.address, _frame_messages(join, codec.encode(q), "nan"))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        want = "non-finite value at index 5" if bits == 32 else f"invalid scale {np.float32(bad)!r} for block 1"
        assert "push nan: bad frame" in e.value.details() and want in e.value.details(), e.value.details()
        _assert_unchanged(before, running.service)
        client.close()
    finally:
        running.stop()


# -- chip health: quarantined devices in heartbeats, Status and `dtrain status` ---------------------------------

# As workers/chip_health.py writes them (non-finite numbers by name; an event's extra keys, such as healthy, ignored).
_KNOWN_ANSWER = {"device": 3, "index": 3, "probe": "known_answer", "step": 50, "value": 7.0, "expected": 8.0,
                 "mismatches": 2, "detail": "known answer 7.0 != 8.0 (2 entries wrong)"}
_NON_FINITE = {"device": 0, "index": 0, "probe": "finite", "step": 61, "value": "nan",
               "detail": "micro-batch loss or gradient not finite", "healthy": 6}


def test_the_client_converts_chips_evidence_dicts():
    from dtrain.net.wire import MAX_EVIDENCE_DETAIL
    from workers.client import evidence_message

    m = evidence_message(_NON_FINITE)
    assert (m.device, m.index, m.probe, m.step, m.detail) == (0, 0, "finite", 61, _NON_FINITE["detail"])
    assert m.HasField("value") and np.isnan(m.value)
    assert not any(m.HasField(f) for f in ("expected", "z", "median", "mismatches"))  # not measured: unset
    r = evidence_message({"device": 9, "index": 1, "probe": "replay", "step": 7, "value": "inf", "expected": 0.0,
                          "z": "-inf", "mismatches": None, "detail": "x" * 5000})
    assert (r.value, r.expected, r.z) == (np.inf, 0.0, -np.inf) and r.HasField("expected")
    assert not r.HasField("mismatches") and len(r.detail) == MAX_EVIDENCE_DETAIL and r.detail.endswith("...")
    k = evidence_message(_KNOWN_ANSWER)
    assert (k.value, k.expected, k.mismatches) == (7.0, 8.0, 2) and not k.HasField("z")
    with pytest.raises(ValueError, match="no 'step'"):
        evidence_message({"device": 1, "index": 1, "probe": "stats"})


def test_quarantined_devices_reach_status_once_with_their_evidence(coordinator, net_cfg, tmp_path):
    client = CoordinatorClient(coordinator.address, net_cfg)
    join = client.join("a", "cpu", 8)
    for steps in (60, 70, 80):  # every heartbeat repeats the whole report
        client.heartbeat(island_id=join.island_id, version=0, steps=steps, bad_devices=["0", "3"],
                         quarantined=[_KNOWN_ANSWER, _NON_FINITE], devices=6)
    (isl,) = client.status().islands
    assert isl.devices == 6 and [e.device for e in isl.quarantined] == [3, 0]
    ka, nf = isl.quarantined
    assert (ka.index, ka.probe, ka.step, ka.value, ka.expected, ka.mismatches, ka.detail) == (
        3, "known_answer", 50, 7.0, 8.0, 2, _KNOWN_ANSWER["detail"])
    assert not ka.HasField("z") and not ka.HasField("median")
    assert (nf.index, nf.probe, nf.step) == (0, "finite", 61) and np.isnan(nf.value) and not nf.HasField("expected")
    with coordinator.service.lock:
        state = coordinator.service.state.status(coordinator.service.clock())
    (rec,) = state["islands"]
    assert rec["bad_devices"] == ["0", "3"] and rec["devices"] == 6
    assert rec["quarantined"][1] == {"device": 0, "index": 0, "probe": "finite", "step": 61, "value": "nan",
                                     "detail": _NON_FINITE["detail"]}
    events = [e for e in read_events(tmp_path / "coord") if e["event"] == "device_quarantined"]
    assert [(e["island"], e["island_id"], e["device"], e["probe"], e["healthy"]) for e in events] == [
        ("a", join.island_id, 3, "known_answer", 6), ("a", join.island_id, 0, "finite", 6)]
    assert events[1]["value"] == "nan" and events[0]["mismatches"] == 2
    client.close()


@pytest.mark.parametrize("case, match", [
    ("more_than_joined", "quarantined: 9 devices reported, a's mesh holds 8"),
    ("duplicate_device", "quarantined[1]: device 3 is named twice"),
    ("unknown_probe", "quarantined[0].probe: 'vibes' is not one of"),
    ("long_detail", "quarantined[0].detail: 600 characters, at most 512"),
    ("too_many_devices", "devices=9: must be an integer from 0"),
])
def test_a_bad_chip_health_report_is_refused_and_changes_nothing(coordinator, net_cfg, case, match):
    client = CoordinatorClient(coordinator.address, net_cfg)
    join = client.join("a", "cpu", 8)
    client.heartbeat(island_id=join.island_id, version=0, quarantined=[_KNOWN_ANSWER], devices=7)
    evidence = [pb.DeviceEvidence(device=3, index=3, probe="known_answer", step=5)]
    devices = 6
    if case == "more_than_joined":
        evidence = [pb.DeviceEvidence(device=d, index=d, probe="stats", step=5) for d in range(9)]
    elif case == "duplicate_device":
        evidence.append(pb.DeviceEvidence(device=3, index=4, probe="replay", step=5))
    elif case == "unknown_probe":
        evidence[0].probe = "vibes"
    elif case == "long_detail":  # the client shortens a long detail: sent raw here
        evidence[0].detail = "x" * 600
    elif case == "too_many_devices":
        devices = 9
    before = _snapshot(coordinator.service)
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(coordinator.address))
    with pytest.raises(grpc.RpcError) as e:
        stub.Heartbeat(pb.HeartbeatRequest(island_id=join.island_id, version=0, steps=9, quarantined=evidence,
                                           devices=devices), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in e.value.details(), e.value.details()
    _assert_unchanged(before, coordinator.service)
    (isl,) = client.status().islands
    assert [q.device for q in isl.quarantined] == [3] and isl.devices == 7
    client.close()


def test_dtrain_status_names_the_quarantined_device(coordinator, net_cfg, capsys):
    from dtrain_cli.main import main

    client = CoordinatorClient(coordinator.address, net_cfg)
    join = client.join("a", "cpu", 8)
    client.heartbeat(island_id=join.island_id, version=0, quarantined=[_NON_FINITE], devices=7)
    client.close()
    capsys.readouterr()
    rc = main(["status", "--coordinator", coordinator.address, "--json"])
    out = json.loads(capsys.readouterr().out)
    (isl,) = out["islands"]
    assert rc == 0 and isl["devices"] == 7
    # Device 0 at mesh index 0: printed although 0 is the proto default; unset measures are null.
    assert isl["quarantined"] == [{"device": 0, "index": 0, "probe": "finite", "step": 61, "value": "nan",
                                   "expected": None, "z": None, "median": None, "mismatches": None,
                                   "detail": _NON_FINITE["detail"]}]
    rc = main(["status", "--coordinator", coordinator.address])  # the table: its island row counts the device
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("island "))
    row = next(line for line in lines if line.startswith(isl["name"] + " "))
    cells = dict(zip(re.split(r"\s{2,}", header.strip()), re.split(r"\s{2,}", row.strip()), strict=True))
    assert rc == 0 and cells["devices"].split()[0] == "7" and cells["quar."] == "1", cells


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
        msgs = _frame_messages(joins[0], delta_frame(n, 6)[1], "garbled")
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
