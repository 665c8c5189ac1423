"""A sharded coordinator (coordinator.shards = 2) on real loopback gRPC: a lead and a range shard in this process,
islands pushing and pulling through the workers' own code path (ShardedUplink, ShardedPush, ShardedPuller)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from conftest import initial_parameters
from coordinator.app import serve
from coordinator.lifecycle import serve_shard
from coordinator.shard import SECRET_METADATA_KEY, shard_ranges
from dtrain import codec
from dtrain.config.load import load_config, replace
from dtrain.config.sections import ConfigError
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.proto import dtrain_pb2_grpc as pb_grpc
from dtrain.net.wire import BUSY_METADATA_KEY, chunk_message
from dtrain.train import fragments
from service_helpers import IdlePushes, call_failure, push_header, wait_for
from simulate_helpers import NO_FAKE_DEVICES
from workers.app import coordinator_link
from workers.client import CoordinatorClient, CoordinatorError
from workers.exchange import GlobalParams, ShardFrames
from workers.links import ShardedCoordinator

SECRET = "0123456789abcdef0123456789abcdef"


def _quiet(*_args, **_kwargs) -> None:
    return None


@pytest.fixture
def cfg(net_cfg, tmp_path):
    """tiny, 2 islands, the plain token-weighted mean (the same rule with and without shards), quantization blocks
    of 128 values: tiny's two shard ranges meet at value 12416 = 97 x 128, so each range's blocks are the
    unsharded θ's blocks and the merged θ can be compared bit for bit."""
    (tmp_path / "secret").write_text(SECRET)
    return replace(net_cfg, coordinator={"merge_rule": "mean", "shard_secret_file": str(tmp_path / "secret")},
                   codec={"block": 128})


class Sharded:
    """Range shard 1 and the lead (shard 0), both on 127.0.0.1:0 in this process."""

    def __init__(self, cfg, run_dir):
        theta, spec = initial_parameters(cfg)
        self.theta0, self.spec = theta, spec
        cfg = replace(cfg, coordinator={"shards": 2})
        self.ranges = shard_ranges(spec, 2)
        r = self.ranges[1]
        self.shard_server, self.shard, port = serve_shard(cfg, 1, run_dir, theta[r.start:r.end].copy(), spec,
                                                          port=0)
        self.shard_address = f"127.0.0.1:{port}"
        self.cfg = replace(cfg, coordinator={"shard_addresses": [self.shard_address]})
        self.server, self.service, lead_port = serve(self.cfg, run_dir, theta, spec, port=0, quiet=True)
        self.address = f"127.0.0.1:{lead_port}"

    def theta(self) -> np.ndarray:
        return np.concatenate([self.service.merger.theta, self.shard.merger.theta])

    def stop(self):
        self.server.stop(grace=None).wait()
        self.service.close()
        self.shard_server.stop(grace=None).wait()
        self.shard.close()


class Island:
    """One island's exchange parts, chosen as the worker's composition root chooses them
    (:func:`workers.app.coordinator_link`), with or without shards."""

    def __init__(self, cfg, address: str, name: str, n: int, ranges=()):
        self.client = CoordinatorClient(address, cfg)
        self.join = self.client.join(name, "cpu", 1)
        self.link = coordinator_link(cfg, self.client, n, (), ranges, (), _quiet)
        self.link.joined(self.join)
        self.puller, self.uplink = self.link.puller, self.link.uplink
        self.links = self.link.links if isinstance(self.link, ShardedCoordinator) else None

    def push(self, delta: np.ndarray, push_id: str, base: int, start: int) -> pb.PushDeltaResponse:
        header = push_header(self.join, push_id, base=base, start=start)
        frame, client = self.uplink.frame(delta, header)
        return client.push(header, frame)

    def close(self):
        self.link.close()
        self.client.close()


def _deltas(n: int, round_: int) -> list[np.ndarray]:
    rng = np.random.default_rng(100 + round_)
    return [(rng.normal(size=n) * 1e-3 * (i + 1)).astype(np.float32) for i in range(2)]


def _two_rounds(cfg, address: str, n: int, ranges=()) -> tuple[GlobalParams, list[int]]:
    """Two islands push two rounds of the same deltas; returns island 0's pulled θ and the pushes' statuses."""
    islands = [Island(cfg, address, f"isl-{i}", n, ranges) for i in range(2)]
    statuses = []
    try:
        g = islands[0].puller.pull(islands[0].join.island_id, None)
        assert g.version == 0
        for rnd in range(2):
            for i, (isl, delta) in enumerate(zip(islands, _deltas(n, rnd), strict=True)):
                statuses.append(isl.push(delta, f"p{rnd}-{i}", base=rnd, start=80 * rnd).status)
            g = islands[0].puller.pull(islands[0].join.island_id, g, wait_s=10)
        assert g.version == 2
        return g, statuses
    finally:
        for isl in islands:
            isl.close()


def test_two_shards_merge_bit_identical_to_one(cfg, tmp_path):
    """The same pushes into one coordinator and into a lead with one range shard: the same θ, bit for bit, on the
    coordinators and on the island that pulled it; each range's state lives on its own shard."""
    from coordinator.app import serve as serve_one

    theta0, spec = initial_parameters(cfg)
    n = theta0.size
    server, one, port = serve_one(cfg, tmp_path / "one", theta0, spec, port=0, quiet=True)
    try:
        g1, st1 = _two_rounds(cfg, f"127.0.0.1:{port}", n)
        theta_one, digest_one = one.merger.theta, one.params_digest
    finally:
        server.stop(grace=None).wait()
        one.close()
    run = Sharded(cfg, tmp_path / "two")
    try:
        g2, st2 = _two_rounds(run.cfg, run.address, n, run.ranges)
        assert st1 == st2 and set(st2) <= {pb.PUSH_STATUS_PENDING, pb.PUSH_STATUS_MERGED}
        r0, r1 = run.ranges
        assert run.service.merger.n == r0.size and run.shard.merger.n == r1.size  # each shard: its range only
        assert run.service.merger.version == run.shard.merger.version == 2
        np.testing.assert_array_equal(run.theta(), theta_one)
        assert not np.array_equal(theta_one, theta0)
        np.testing.assert_array_equal(g2.vec, g1.vec)
        np.testing.assert_array_equal(g2.vec, theta_one)
        assert g2.digest == run.service.params_digest == fragments.joined_digest(
            fragments.range_digests(theta_one, run.ranges))
        assert g1.digest == digest_one
        assert run.shard.held == {} and run.service.merger.pending == []
        assert (tmp_path / "two" / "coordinator-shard-1" / "2").is_dir()  # the range shard's own checkpoint
    finally:
        run.stop()


def test_a_resumed_lead_puts_every_shard_at_its_version(cfg, tmp_path):
    """The lead dies after the shards committed v2 but before its own checkpoint of v2 (removed here): it resumes
    from v1 and restores the range shard to v1 too (the shard's own checkpoint, checked by the digest the lead
    recorded), and the run goes on from there on both shards."""
    import shutil

    from dtrain.checkpoint import Checkpointer

    run = Sharded(cfg, tmp_path)
    n = run.theta0.size
    try:
        _two_rounds(run.cfg, run.address, n, run.ranges)
        assert run.shard.merger.version == 2
        v2 = run.service.params_digest
        # a part the shard holds (its push's lead part lost with the lead) stays held, unclaimed, across the resume
        stray = Island(run.cfg, run.address, "isl-0", n, run.ranges)
        header = push_header(stray.join, "stray")
        header.shard = 1
        r1 = run.ranges[1]
        stray.links.others[0].push(header, codec.encode(codec.quantize(np.full(r1.size, 1e-3, np.float32), 8, 128)))
        stray.close()
        run.server.stop(grace=None).wait()
        run.service.close()
        shutil.rmtree(tmp_path / "coordinator" / "2")
        ckpt = Checkpointer(tmp_path / "coordinator", keep=2, async_save=False)
        meta = ckpt.restore_files(1)[2]
        ckpt.close()
        run.server, run.service, port = serve(run.cfg, tmp_path, None, run.spec, port=0, quiet=True, resume=True)
        run.address = f"127.0.0.1:{port}"
        assert run.service.merger.version == run.shard.merger.version == 1
        assert list(run.shard.held) == ["stray"] and not run.shard.held["stray"].claimed
        assert run.shard.merger.digest == meta["shard_digests"][1]
        assert run.service.params_digest == fragments.joined_digest(meta["shard_digests"]) != v2
        assert run.service.params_digest == fragments.joined_digest(fragments.range_digests(run.theta(), run.ranges))
        islands = [Island(run.cfg, run.address, f"isl-{i}", n, run.ranges) for i in range(2)]
        g = islands[0].puller.pull(islands[0].join.island_id, None)
        assert g.version == 1 and g.digest == run.service.params_digest
        for i, (isl, delta) in enumerate(zip(islands, _deltas(n, 1), strict=True)):
            assert isl.push(delta, f"again-{i}", base=1, start=80).status in (pb.PUSH_STATUS_PENDING,
                                                                                pb.PUSH_STATUS_MERGED)
        g = islands[0].puller.pull(islands[0].join.island_id, g, wait_s=10)
        assert g.version == run.service.merger.version == run.shard.merger.version == 2
        np.testing.assert_array_equal(g.vec, run.theta())
        for isl in islands:
            isl.close()
    finally:
        run.stop()


def test_range_shard_refuses_hostile_input(cfg, tmp_path):
    """A frame of the wrong length, a header naming another shard, a Prepare/Commit without the lead's secret, and
    a push whose part never reached the range shard: each refused, nothing held, nothing committed anywhere."""
    # the lead waits coordinator.stream_idle_s for a push's missing part (set when it starts): 2 s, not 30
    run = Sharded(replace(cfg, coordinator={"stream_idle_s": 2.0}), tmp_path)
    n = run.theta0.size
    r0, r1 = run.ranges
    try:
        isl = Island(run.cfg, run.address, "isl-0", n, run.ranges)
        shard_client = CoordinatorClient(run.shard_address, run.cfg)
        delta = np.full(n, 1e-3, np.float32)
        # the lead's range (the wrong length for shard 1)
        header = push_header(isl.join, "wrong-len")
        header.shard = 1
        with pytest.raises(CoordinatorError) as e:
            shard_client.push(header, codec.encode(codec.quantize(delta[r0.start:r0.end], 8, 128)))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "n=" in str(e.value)
        # the right length, but a header naming shard 0
        header = push_header(isl.join, "wrong-shard")
        with pytest.raises(CoordinatorError) as e:
            shard_client.push(header, codec.encode(codec.quantize(delta[r1.start:r1.end], 8, 128)))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "shard 0" in str(e.value)
        assert run.shard.held == {}
        # the lead's Shard service calls, made by someone without the secret
        channel = grpc.insecure_channel(run.shard_address)
        stub = pb_grpc.ShardStub(channel)
        for metadata in ((), ((SECRET_METADATA_KEY, "not-the-secret-at-all"),)):
            with pytest.raises(grpc.RpcError) as rpc:
                stub.Prepare(pb.PrepareRequest(version=1, merges=[pb.MergeEntry(push_id="x", weight=1, scale=1)]),
                             metadata=metadata, timeout=10)
            assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as rpc:
                stub.Commit(pb.CommitRequest(version=1), metadata=metadata, timeout=10)
            assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # with the secret, a Prepare naming a part the shard does not hold is refused too
        with pytest.raises(grpc.RpcError) as rpc:
            stub.Prepare(pb.PrepareRequest(version=1, merges=[pb.MergeEntry(push_id="x", weight=1, scale=1)]),
                         metadata=((SECRET_METADATA_KEY, SECRET),), timeout=10)
        assert rpc.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no part held" in rpc.value.details()
        # a Restore to a version the shard has no checkpoint of, or to θ_0 under another digest: refused, unchanged
        for version, digest, words in ((7, "x", "no checkpoint"), (0, "f" * 32, "not the same run")):
            with pytest.raises(grpc.RpcError) as rpc:
                stub.Restore(pb.RestoreRequest(version=version, params_digest=digest),
                             metadata=((SECRET_METADATA_KEY, SECRET),), timeout=10)
            assert rpc.value.code() == grpc.StatusCode.FAILED_PRECONDITION and words in rpc.value.details()
        assert run.shard.merger.version == 0
        channel.close()
        # a push whose part for shard 1 never arrives: the lead waits coordinator.stream_idle_s, then refuses it
        frame = isl.uplink.frame(delta, push_header(isl.join, "half"))[0]
        assert isinstance(frame, ShardFrames)
        header = push_header(isl.join, "half")
        with pytest.raises(CoordinatorError) as e:
            isl.client.push(header, frame.frames[0])
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "coordinator shard 1" in str(e.value)
        with run.service.lock:
            assert run.service.merger.pending == [] and run.service.state.version == 0
            assert run.service.counters.pushes_refused >= 1
        assert run.shard.merger.version == 0 and run.service.merger.version == 0
        np.testing.assert_array_equal(run.theta(), run.theta0)
        # and the island's whole push then goes through (the one live island: merged at once), every shard at v1
        resp = isl.push(delta, "whole", base=0, start=0)
        assert resp.status == pb.PUSH_STATUS_MERGED and resp.merged_version == 1
        assert run.shard.merger.version == run.service.merger.version == 1 and run.shard.held == {}
        shard_client.close()
        isl.close()
    finally:
        run.stop()


def test_range_shard_takes_the_islands_token_only(cfg, tmp_path, monkeypatch):
    """With token auth a range shard refuses a push under a wrong token (UNAUTHENTICATED) and holds nothing; the
    island's own token gets its part held."""
    monkeypatch.setenv("DTRAIN_TOKEN", "the-right-token-0123456789")
    run = Sharded(cfg, tmp_path)
    r1 = run.ranges[1]
    try:
        isl = Island(run.cfg, run.address, "isl-0", run.theta0.size, run.ranges)
        frame = codec.encode(codec.quantize(np.full(r1.size, 1e-3, np.float32), 8, 128))
        monkeypatch.setenv("DTRAIN_TOKEN", "a-wrong-token-0123456789")
        wrong = CoordinatorClient(run.shard_address, run.cfg)
        header = push_header(isl.join, "wrong-token")
        header.shard = 1
        with pytest.raises(CoordinatorError) as e:
            wrong.push(header, frame)
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED and run.shard.held == {}
        wrong.close()
        isl.links.others[0].push(header, frame)
        assert list(run.shard.held) == ["wrong-token"]
        isl.close()
    finally:
        run.stop()


def test_range_shard_bounds_push_streams_per_peer_and_island_and_cancels_idle_ones(cfg, tmp_path):
    """The lead's bounds on open push streams hold on a range shard too: a stream that sends nothing (or only its
    header) for coordinator.stream_idle_s is cancelled, an island over max_streams_per_island and a peer over
    max_streams_per_peer are refused RESOURCE_EXHAUSTED and marked busy; nothing is held."""
    cfg = replace(cfg, coordinator={"stream_idle_s": 1.0, "max_streams_per_peer": 3, "max_streams_per_island": 1})
    run = Sharded(cfg, tmp_path)
    idle = IdlePushes(run.shard_address, token=None)
    try:
        isl = Island(run.cfg, run.address, "isl-0", run.theta0.size, run.ranges)
        header = push_header(isl.join, "held-open")
        header.shard = 1
        r1 = run.ranges[1]  # a header for a real part of the range: its size, CRC and chunk count filled in
        chunks = isl.links.others[0]._chunked(header, codec.encode(codec.quantize(np.full(r1.size, 1e-3, np.float32),
                                                                                 8, 128)))
        data = (chunk_message(0, *chunks[0]),)  # an island's stream is counted for it once its data arrives
        first = idle.open(header=header, first=data)[0]
        wait_for(lambda: run.shard.push_streams.counts()[2] == {isl.join.island_id: 1}, "the island's stream")
        island_over = call_failure(idle.open(header=header, first=data)[0])
        assert island_over.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "shard 1" in island_over.details() and "max_streams_per_island=1" in island_over.details()
        assert (BUSY_METADATA_KEY, "1") in tuple(island_over.trailing_metadata())
        idle.open(2)  # no header: counted for the peer only
        wait_for(lambda: run.shard.push_streams.counts()[0] == 3, "three streams from this peer")
        peer_over = call_failure(idle.open()[0])
        assert peer_over.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_streams_per_peer=3" in peer_over.details()
        # and every stream left idle is cancelled after stream_idle_s, the one with a header too
        assert call_failure(first).code() == grpc.StatusCode.CANCELLED
        wait_for(lambda: run.shard.push_streams.counts()[0] == 0, "the idle streams to be cancelled")
        assert run.shard.held == {}
        isl.close()
    finally:
        idle.close()
        run.stop()


def test_config_refuses_what_shards_do_not_support(tmp_path):
    base = ["coordinator.shards=2", f"coordinator.shard_secret_file={tmp_path / 's'}"]
    assert load_config("configs/tiny.toml", base).coordinator.shards == 2
    for extra, words in ((["outer.fragments=2"], "fragments"), (["coordinator.mode=async"], "sync"),
                         (["coordinator.merge_rule=screened_mean"], "screened_mean"),
                         (["coordinator.shard_addresses=['a:1','b:2']"], "shard_addresses")):
        with pytest.raises(ConfigError, match=words):
            load_config("configs/tiny.toml", base + extra)
    with pytest.raises(ConfigError, match="shard_secret_file"):
        load_config("configs/tiny.toml", ["coordinator.shards=2"])
    with pytest.raises(ConfigError, match="shards"):
        load_config("configs/tiny.toml", ["coordinator.shards=0"])


# -- real processes ---------------------------------------------------------------------------------------------


@pytest.mark.slow  # the kill test below runs the same and more
def test_simulate_with_two_coordinator_shards_runs_to_the_end_with_an_exact_audit(tmp_path):
    """`dtrain simulate --coordinator-shards 2`: a lead, a range shard and two worker processes; every version is
    committed on both shards, the islands end bit-identical with the coordinator's θ (the joined digest), every
    token is merged exactly once."""
    import json

    from dtrain.runlog import read_events
    from dtrain_cli.simulate import run_simulation

    cfg = load_config("tiny", [f"run.out_dir={tmp_path}", "outer.islands=2", "train.steps=40",
                               "outer.inner_steps=10", "worker.heartbeat_s=0.5", "coordinator.grace_s=60"])
    s = run_simulation(cfg, 2, quiet=True, env=NO_FAKE_DEVICES, timeout_s=300,
                       coordinator_shards=2)
    assert s["rounds"] == cfg.rounds == 4
    assert s["bit_identical_final_params"]
    audit = s["audit"]
    assert audit["lost_tokens"] == audit["doubled_tokens"] == 0 and audit["gaps"] == audit["overlaps"] == []
    assert audit["merged_ranges"] == 2 * 4 and audit["coverage"] == {"0": [[0, 320]], "1": [[0, 320]]}
    assert s["final_eval_loss"] < 4.5 and s["goodput"] == 1.0
    run = tmp_path / "tiny"
    (stopped,) = [e for e in read_events(run) if e.get("event") == "coordinator_stopped"]
    island = json.loads((run / "islands" / "island-0" / "summary.json").read_text())
    assert stopped["version"] == 4 and island["params_digest"] == stopped["params_digest"]
    shard = json.loads((run / "shard-1.log").read_text().strip().splitlines()[-1])  # its exit summary
    assert shard["shard"] == 1 and shard["version"] == 4
    assert not [e for e in read_events(run) if e.get("event") == "digest_mismatch"]


@pytest.mark.slow  # ~30 s of worker processes; in process: test_a_resumed_lead_puts_every_shard_at_its_version
def test_a_killed_shard_is_a_failed_coordinator_resumed_with_nothing_lost_or_doubled(tmp_path):
    """`--coordinator-shards 2 --fault kill-coordinator@v2+2s,shard=1`: the range shard is SIGKILLed after v2; the
    lead fails at its next step (or is killed), the shard starts again and the lead resumes, restoring every shard
    to its checkpoint's version; the islands push again what was lost, and the run ends with every token merged
    exactly once and the islands bit-identical."""
    from dtrain.runlog import read_events
    from dtrain_cli.fault_spec import parse_fault
    from dtrain_cli.simulate import run_simulation

    cfg = load_config("tiny", [f"run.out_dir={tmp_path}", "outer.islands=2", "train.steps=40",
                               "outer.inner_steps=10", "worker.heartbeat_s=0.5", "coordinator.grace_s=60"])
    fault = parse_fault("kill-coordinator@v2+2s,shard=1", 2)
    assert fault.shard == 1 and fault.duration_s == 2
    s = run_simulation(cfg, 2, quiet=True, env=NO_FAKE_DEVICES, timeout_s=400,
                       coordinator_shards=2, faults=[fault])
    assert s["rounds"] == 4 and s["bit_identical_final_params"]
    audit = s["audit"]
    assert audit["lost_tokens"] == audit["doubled_tokens"] == 0 and audit["gaps"] == audit["overlaps"] == []
    assert audit["coverage"] == {"0": [[0, 320]], "1": [[0, 320]]}
    assert audit["steps_merged"] == 80 <= audit["steps_executed"]  # what the failed coordinator lost, trained again
    events = read_events(tmp_path / "tiny")
    restored = [e["version"] for e in events if e.get("event") == "shards_restored"]
    assert restored[0] == 0 and len(restored) == 2 and restored[1] >= 2  # the new run, then the resume
    assert [e["version"] for e in events if e.get("event") == "coordinator_resumed"] == [restored[1]]
    driver = read_events(tmp_path / "tiny" / "driver")
    assert [e["fault_kind"] for e in driver if e.get("event") == "fault_injected"] == ["kill-coordinator"]
    assert [e["action"] for e in driver if e.get("event") == "fault_recovered"] == [
        "every shard restarted from the checkpoints"]


def test_kill_shard_fault_grammar():
    from dtrain_cli.fault_spec import parse_fault

    assert parse_fault("kill-coordinator@v3+3s", 2).shard == 0
    with pytest.raises(ConfigError, match="duration"):
        parse_fault("kill-coordinator@v3,shard=1", 2)
    with pytest.raises(ConfigError, match="shard=-1"):
        parse_fault("kill-coordinator@v3+1s,shard=-1", 2)
    with pytest.raises(ConfigError, match="unknown option"):
        parse_fault("kill:island-0@v3+1s,shard=1", 2)


def test_a_range_shards_parked_calls_hold_no_thread_and_a_sharded_round_completes(cfg, tmp_path):
    """Waiting costs no thread on a range shard either (issue 36, item 3): with far more long-polling pulls, idle
    push streams and the lead's Claims waiting for parts that never come parked on the shard than it has data and
    control threads, the process's thread count does not grow with them, a real sharded round completes (its own
    Claims answered), and the parked pulls wake on the new version with the range's update."""
    import asyncio
    import threading

    from coordinator.handlers import control_threads, server_threads, work_threads
    from test_data_plane import PARKED, Parked

    cfg = replace(cfg, coordinator={"workers": 4, "max_pulls_per_peer": 4 * PARKED,
                                    "max_pulls_per_island": 2 * PARKED, "max_streams_per_peer": 4 * PARKED,
                                    "stream_idle_s": 60.0, "checkpoint": False})
    assert work_threads(cfg) == 4 and 3 * PARKED > server_threads(cfg) + control_threads(cfg)
    run = Sharded(cfg, tmp_path)
    parked = Parked(run.shard_address)
    islands = []
    try:
        islands = [Island(run.cfg, run.address, f"isl-{i}", run.theta0.size, run.ranges) for i in range(2)]
        g = islands[0].puller.pull(islands[0].join.island_id, None)
        before = threading.active_count()
        parked.park(islands[0].join.island_id, PARKED)

        async def claims() -> list[asyncio.Future]:
            stub = pb_grpc.ShardStub(parked.channel)
            return [asyncio.ensure_future(stub.Claim(pb.ClaimRequest(push_id=f"never-{k}", island_id="nobody",
                                                                     wait_s=60),
                                                     metadata=((SECRET_METADATA_KEY, SECRET),), timeout=90))
                    for k in range(PARKED)]
        waiting = parked._run(claims())
        wait_for(lambda: run.shard.pulls.counts()[1].get(islands[0].join.island_id) == PARKED
                 and run.shard.push_streams.counts()[0] == PARKED, f"{PARKED} pulls and {PARKED} pushes parked")
        assert threading.active_count() <= before + server_threads(cfg), (before, threading.active_count())
        for i, (isl, delta) in enumerate(zip(islands, _deltas(run.theta0.size, 0), strict=True)):
            assert isl.push(delta, f"p0-{i}", base=0, start=0).status in (pb.PUSH_STATUS_PENDING,
                                                                          pb.PUSH_STATUS_MERGED)
        g = islands[0].puller.pull(islands[0].join.island_id, g, wait_s=10)
        assert g.version == run.service.merger.version == run.shard.merger.version == 1
        np.testing.assert_array_equal(g.vec, run.theta())
        for messages in parked.pulled():  # woke on the shard's commit: its range's update, not a timeout's current
            assert messages[0].header.kind == pb.PULL_KIND_UPDATE and messages[0].header.version == 1
        assert not any(f.done() for f in waiting)  # still awaiting their parts, on no thread
        assert run.shard.push_streams.counts()[0] == PARKED
        assert threading.active_count() <= before + server_threads(cfg) + control_threads(cfg)
    finally:
        for isl in islands:
            isl.close()
        parked.close()
        run.stop()
