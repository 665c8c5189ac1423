"""OpenTelemetry and grpc.health.v1: a real coordinator on 127.0.0.1:0 with the in-memory exporter, driven by the
real client, then its spans and metrics read back; the health service with token auth on; the config's checks;
the OTLP exporter against a collector on loopback."""

from __future__ import annotations

import sys
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import TINY
from coordinator.app import serve
from dtrain.config.load import load_config, replace
from dtrain.config.sections import ConfigError
from dtrain.errors import DtrainError
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.proto import dtrain_pb2_grpc as pb_grpc
from dtrain.net.wire import auth_metadata
from dtrain.runlog import FAULT_EVENTS, read_events
from dtrain.telemetry import Telemetry
from service_helpers import Running, delta_frame, push_header
from workers.client import CoordinatorClient

ROOT = Path(__file__).resolve().parent.parent


def _cfg(tmp_path: Path, *extra: str) -> Any:
    return load_config(ROOT / "configs" / "tiny.toml", [
        f"run.out_dir={tmp_path}", "coordinator.port=0", "coordinator.grace_s=60", "coordinator.lease_s=30",
        "outer.islands=2", "train.steps=40", "outer.inner_steps=10", "worker.heartbeat_s=0.5",
        "codec.chunk_bytes=4096", "coordinator.max_message_bytes=65536", "worker.retry_total_s=1",
        "telemetry.exporter=memory", *extra])


def _push(client: CoordinatorClient, join: pb.JoinResponse, push_id: str, seed: int, start: int = 0,
          base: int = 0) -> pb.PushDeltaResponse:
    """A real push through the client: 10 steps x batch 8 = 80 sequences from ``start``, an int8 frame of noise."""
    _, frame = delta_frame(join.tree_size, seed)
    return client.push(push_header(join, push_id, base=base, start=start), frame)


def _attrs(span: Any) -> dict[str, Any]:
    return dict(span.attributes or {})


def _one(points: list[Any]) -> Any:
    assert len(points) == 1, points
    return points[0]


def test_round_spans_and_metrics_match_what_the_coordinator_received(tmp_path, monkeypatch):
    monkeypatch.delenv("DTRAIN_TOKEN", raising=False)
    cfg = _cfg(tmp_path)
    running = Running(cfg, tmp_path / "coord")
    service = running.service
    try:
        clients = [CoordinatorClient(running.address, cfg) for _ in range(2)]
        joins = [c.join(f"isl-{i}", "cpu", 1) for i, c in enumerate(clients)]
        assert _push(clients[0], joins[0], "p0", 0).status == pb.PUSH_STATUS_PENDING
        assert _push(clients[1], joins[1], "p1", 1).status == pb.PUSH_STATUS_MERGED
        clients[0].pull(joins[0].island_id, 0)  # the update, down
        # A second round, pushed from v1: two more pushes, a second version.
        assert _push(clients[0], joins[0], "p2", 2, start=80, base=1).status == pb.PUSH_STATUS_PENDING
        assert _push(clients[1], joins[1], "p3", 3, start=80, base=1).status == pb.PUSH_STATUS_MERGED
        tel = service.telemetry
        spans = tel.finished_spans()
        rounds = sorted((s for s in spans if s.name == "dtrain.round"), key=lambda s: _attrs(s)["dtrain.version"])
        assert [_attrs(r)["dtrain.version"] for r in rounds] == [1, 2]
        by_id = {j.island_id: j for j in joins}
        pushes = {1: ("p0", "p1"), 2: ("p2", "p3")}
        received = {e["push_id"]: e for e in read_events(tmp_path / "coord") if e["event"] == "push_received"}
        for r in rounds:
            a = _attrs(r)
            version = a["dtrain.version"]
            assert a["dtrain.pushes"] == 2 and a["dtrain.tokens"] == 2 * 640 and a["dtrain.merged"] is True
            assert a["dtrain.islands"] == tuple(sorted(by_id))
            children = [s for s in spans if s.parent is not None and s.parent.span_id == r.context.span_id]
            assert all(c.context.trace_id == r.context.trace_id for c in children)
            names = sorted(c.name for c in children)
            assert names == sorted(["dtrain.quorum_wait", "dtrain.receive", "dtrain.receive", "dtrain.validate",
                                    "dtrain.validate", "dtrain.merge", "dtrain.checkpoint"])
            for c in children:
                assert _attrs(c)["dtrain.version"] == version
                assert r.start_time <= c.start_time and c.end_time <= r.end_time
            for c in children:
                if c.name in ("dtrain.receive", "dtrain.validate"):
                    ca = _attrs(c)
                    assert ca["dtrain.push_id"] in pushes[version]
                    assert ca["dtrain.island"] == received[ca["dtrain.push_id"]]["island_id"]
                    if c.name == "dtrain.receive":
                        assert ca["dtrain.bytes"] == received[ca["dtrain.push_id"]]["bytes"]
            wait = next(c for c in children if c.name == "dtrain.quorum_wait")
            merge = next(c for c in children if c.name == "dtrain.merge")
            assert wait.end_time <= merge.start_time and "dtrain.reason" in _attrs(wait)

        metrics = tel.collect()
        bytes_up = _one(metrics["dtrain.bytes_up"]).value
        assert bytes_up == service.counters.bytes_in == sum(e["bytes"] for e in received.values())
        assert _one(metrics["dtrain.bytes_down"]).value == service.counters.bytes_out > 0
        assert _one(metrics["dtrain.tokens"]).value == service.state.tokens_merged == 4 * 640
        assert _one(metrics["dtrain.version"]).value == 2
        # Compression ratio: one point per push (up) and per merged update (down), each raw fp32 / frame bytes.
        raw = 4 * service.merger.n
        ratios = {p.attributes["dtrain.direction"]: p for p in metrics["dtrain.compression_ratio"]}
        up = ratios["up"]
        assert up.count == 4 and up.sum == pytest.approx(sum(raw / e["bytes"] for e in received.values()), rel=1e-12)
        assert 3.5 < up.min <= up.max < 6.0  # int8: about 4x, and zstd takes a little off Gaussian bytes
        merged = [e for e in read_events(tmp_path / "coord") if e["event"] == "round_merged"]
        down = ratios["down"]
        assert down.count == 2 and down.sum == pytest.approx(sum(raw / e["update_bytes"] for e in merged), rel=1e-12)
        duration = _one(metrics["dtrain.round.duration"])
        assert duration.count == 2
        assert duration.sum == pytest.approx(sum((r.end_time - r.start_time) / 1e9 for r in rounds), rel=1e-9)
        # Per-island gauges from the Status message, one point per island.
        rates = metrics["dtrain.island.step_rate"]
        assert sorted(p.attributes["dtrain.island"] for p in rates) == sorted(by_id)
        assert sorted(p.attributes["dtrain.name"] for p in metrics["dtrain.island.devices"]) == ["isl-0", "isl-1"]
        assert all(p.value == 0 for p in metrics["dtrain.island.quarantined"])
        resource = rounds[0].resource.attributes
        assert resource["service.name"] == "dtrain-coordinator" and resource["dtrain.run_id"] == service.run_id
        for c in clients:
            c.close()
    finally:
        running.stop()
    assert tel.collect()["dtrain.bytes_up"][0].value == service.counters.bytes_in  # kept at shutdown


def test_faults_are_counted_by_kind_from_the_events(tmp_path):
    tel = Telemetry(_cfg(tmp_path).telemetry, "coordinator", "coordinator", "run")
    from dtrain.runlog import RunLog

    log = RunLog(tmp_path / "log", quiet=True)
    log.subscribe(tel.on_event)
    log.event("island_lost", island="i-1", reason="lease")
    log.event("push_refused", island="i-2", push_id="x")
    log.event("push_refused", island="i-2", push_id="y")
    log.event("push_received", island="i-1", push_id="z", status="drop")
    log.event("push_received", island="i-1", push_id="w", status="accept")  # not a fault
    log.event("push_quarantined", island="i-2", push_id="v")
    log.event("merge_rejected", island="i-1", push_id="u")
    log.event("round_merged", version=1)  # not a fault
    log.close()
    counts = {(p.attributes["dtrain.kind"], p.attributes["dtrain.island"]): p.value
              for p in tel.collect()["dtrain.faults"]}
    assert counts == {("island_lost", "i-1"): 1, ("push_refused", "i-2"): 2, ("delta_dropped", "i-1"): 1,
                      ("delta_rejected", "i-2"): 1, ("delta_rejected", "i-1"): 1}
    assert {"island_lost", "device_quarantined", "auth_failed", "request_invalid"} <= set(FAULT_EVENTS.values())
    tel.shutdown()


def test_telemetry_off_records_nothing_and_costs_little(tmp_path):
    tel = Telemetry.disabled()
    assert not tel.enabled
    with pytest.raises(ValueError, match='exporter = "memory"'):
        tel.finished_spans()
    t0 = time.perf_counter()
    for _ in range(10_000):
        with tel.span("dtrain.receive", island="i", push_id="p"):
            pass
        tel.end(tel.start_span("dtrain.exchange", island="i"), version=1)
    per_call = (time.perf_counter() - t0) / 10_000
    assert per_call < 20e-6, f"{per_call * 1e6:.1f} µs per disabled span pair"
    tel.shutdown()


def _health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=5).status


def test_health_answers_without_a_token_and_goes_not_serving_when_stopping(tmp_path, monkeypatch):
    monkeypatch.setenv("DTRAIN_TOKEN", "s3cret-token")
    cfg = _cfg(tmp_path, "telemetry.exporter=none")
    running = Running(cfg, tmp_path / "coord")
    try:
        serving = health_pb2.HealthCheckResponse.SERVING
        assert _health(running.address) == serving
        assert _health(running.address, "dtrain.v1.Coordinator") == serving
        with grpc.insecure_channel(running.address) as channel:  # Watch: the first answer is the status now
            stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=5)
            assert next(iter(stream)).status == serving
            stream.cancel()
            # Any other method without the token is still refused.
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.CoordinatorStub(channel).Status(pb.StatusRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert pb_grpc.CoordinatorStub(channel).Status(pb.StatusRequest(), timeout=5,
                                                           metadata=auth_metadata("s3cret-token")).version == 0
            # The health service's List is not among the open methods.
            with pytest.raises(grpc.RpcError) as e:
                channel.unary_unary("/grpc.health.v1.Health/List",
                                    request_serializer=health_pb2.HealthListRequest.SerializeToString,
                                    response_deserializer=health_pb2.HealthListResponse.FromString)(
                    health_pb2.HealthListRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        running.service.loop.request_stop("test: stop")
        deadline = time.monotonic() + 5
        while _health(running.address) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline, "the health service still says SERVING after a stop request"
            time.sleep(0.02)
        assert _health(running.address, "dtrain.v1.Coordinator") == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        running.stop()


def test_health_stays_serving_while_islands_lack_the_last_version_then_not_serving(tmp_path, monkeypatch):
    """The run's last version merged, the coordinator lingers for the islands' last pulls: a readiness probe must
    keep routing to it (SERVING); once every island holds that version it is finished (NOT_SERVING)."""
    monkeypatch.delenv("DTRAIN_TOKEN", raising=False)
    cfg = replace(_cfg(tmp_path), train={"steps": 10})  # one version
    running = Running(cfg, tmp_path / "coord")
    try:
        clients = [CoordinatorClient(running.address, cfg) for _ in range(2)]
        joins = [c.join(f"isl-{i}", "cpu", 1) for i, c in enumerate(clients)]
        assert _health(running.address) == health_pb2.HealthCheckResponse.SERVING
        _push(clients[0], joins[0], "p0", 0)
        _push(clients[1], joins[1], "p1", 1)
        assert clients[0].status().stopped  # the run is over ...
        time.sleep(0.2)
        assert _health(running.address) == health_pb2.HealthCheckResponse.SERVING  # ... the islands lack v1
        for c, j in zip(clients, joins, strict=True):
            c.heartbeat(island_id=j.island_id, version=1)
        deadline = time.monotonic() + 5
        while _health(running.address) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline, "still SERVING after every island holds the last version"
            time.sleep(0.02)
        for c in clients:
            c.close()
    finally:
        running.stop()


@pytest.mark.parametrize(("override", "message"), [
    ("telemetry.exporter=jaeger", "[telemetry] exporter: must be one of 'none', 'console', 'otlp', 'memory', "
                                  "got 'jaeger'"),
    ("telemetry.export_interval_s=0", "[telemetry] export_interval_s: must be a finite number > 0, got 0"),
    ("telemetry.otlp_timeout_s=-1", "[telemetry] otlp_timeout_s: must be a finite number > 0, got -1"),
    ("telemetry.service_name=' '", "[telemetry] service_name: must not be empty"),
])
def test_bad_telemetry_config_is_refused_naming_the_field(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [override])
    assert message in str(e.value)


@pytest.mark.parametrize("endpoint", ["127.0.0.1:4317", "grpc://collector:4317", "http://collector", ""])
def test_an_otlp_endpoint_without_scheme_or_port_is_refused(endpoint):
    with pytest.raises(ConfigError, match=r"\[telemetry\] otlp_endpoint: must be http://HOST:PORT or "
                                          r"https://HOST:PORT, got"):
        load_config(TINY, ["telemetry.exporter=otlp", f"telemetry.otlp_endpoint={endpoint}"])


def test_otlp_without_the_extra_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    cfg = load_config(TINY, ["telemetry.exporter=otlp"])
    with pytest.raises(DtrainError) as e:
        Telemetry(cfg.telemetry, "island", "a", "run")
    assert str(e.value) == ('[telemetry] exporter = "otlp" needs the OTLP exporter, which is not installed: '
                            "pip install 'dtrain[otlp]'")
    with pytest.raises(DtrainError, match=r"pip install 'dtrain\[otlp\]'"):  # the coordinator: before it writes
        serve(_cfg(tmp_path, "telemetry.exporter=otlp"), tmp_path / "coord", None, [], port=0, quiet=True)
    assert not (tmp_path / "coord").exists()
    from dtrain_cli.main import main

    rc = main(["coordinator", "--config", str(TINY), "--set", "telemetry.exporter=otlp", "--set",
               f"run.out_dir={tmp_path}", "--port", "0"])  # refused before θ_0 is computed
    assert rc == 1
    assert capsys.readouterr().err.strip().endswith("pip install 'dtrain[otlp]'")


def test_otlp_exports_spans_and_metrics_to_a_collector_on_loopback(tmp_path):
    """A collector on 127.0.0.1 (OTLP's gRPC services, recording what they get): the spans and the metrics arrive,
    with the Resource; then, the collector gone, shutdown gives up within its timeout."""
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    got: dict[str, list[Any]] = {"spans": [], "metrics": []}

    class Traces(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 - the proto's name
            got["spans"].append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
        def Export(self, request, context):  # noqa: N802 - the proto's name
            got["metrics"].append(request)
            return metrics_service_pb2.ExportMetricsServiceResponse()

    collector = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), collector)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), collector)
    port = collector.add_insecure_port("127.0.0.1:0")
    collector.start()
    try:
        cfg = load_config(TINY, ["telemetry.exporter=otlp", f"telemetry.otlp_endpoint=http://127.0.0.1:{port}",
                                 "telemetry.otlp_timeout_s=2", "telemetry.export_interval_s=60"])
        tel = Telemetry(cfg.telemetry, "island", "island-7", "run-42")
        with tel.span("dtrain.exchange", island="i-1", base_version=3):
            pass
        tel.faults.add(1)
        t0 = time.monotonic()
        tel.shutdown()  # flushes both
        assert time.monotonic() - t0 < 5
    finally:
        collector.stop(grace=None).wait()
    spans = [s for r in got["spans"] for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert [s.name for s in spans] == ["dtrain.exchange"]
    resource = {a.key: a.value.string_value for a in got["spans"][0].resource_spans[0].resource.attributes}
    assert resource["service.name"] == "dtrain-island" and resource["service.instance.id"] == "island-7"
    assert resource["dtrain.run_id"] == "run-42"
    names = {m.name for r in got["metrics"] for rm in r.resource_metrics for sm in rm.scope_metrics
             for m in sm.metrics}
    assert "dtrain.faults" in names
    # Nothing listens any more: a shutdown's flush gives up within otlp_timeout_s rather than hanging.
    tel = Telemetry(cfg.telemetry, "island", "island-7", "run-42")
    with tel.span("dtrain.exchange"):
        pass
    t0 = time.monotonic()
    done = threading.Event()
    threading.Thread(target=lambda: (tel.shutdown(), done.set()), daemon=True).start()
    assert done.wait(timeout=15), "shutdown hung with the collector gone"
    assert time.monotonic() - t0 < 15


@pytest.mark.slow
def test_an_islands_exchanges_are_spans_with_push_pull_and_fold_in(tmp_path, monkeypatch):
    """One island in this process (tiny model, two rounds) against an in-process coordinator, both with the
    in-memory exporter: one exchange span per round, with its push, pull(s) and fold-in, and the island's byte
    counters equal to what its client sent and received. About 25 s on 2 cores (the island compiles)."""
    from workers.app import open_worker

    monkeypatch.delenv("DTRAIN_TOKEN", raising=False)
    # coordinator.checkpoint=false: orbax's async checkpointing bears one checkpoint manager at work per process
    cfg = _cfg(tmp_path, "outer.islands=1", "train.steps=20", "train.warmup_steps=2", "coordinator.checkpoint=false",
               "worker.start_wait_s=0", "worker.retry_total_s=20")
    running = Running(cfg, tmp_path / "coord")
    try:
        with open_worker(cfg, running.address, "island-a", tmp_path / "island-a", quiet=True) as worker:
            summary = worker.run()
    finally:
        running.stop()
    assert summary["version"] == 2
    tel = worker.telemetry
    spans = tel.finished_spans()
    exchanges = sorted((s for s in spans if s.name == "dtrain.exchange"),
                       key=lambda s: _attrs(s)["dtrain.base_version"])
    assert [(_attrs(e)["dtrain.base_version"], _attrs(e)["dtrain.version"]) for e in exchanges] == [(0, 1), (1, 2)]
    sent = {e["push_id"]: e for e in read_events(tmp_path / "island-a") if e["event"] == "push_sent"}
    for e in exchanges:
        a = _attrs(e)
        assert a["dtrain.island"] == worker.mailbox.island_id and a["dtrain.name"] == "island-a"
        assert a["dtrain.bytes"] == sent[a["dtrain.push_id"]]["bytes"]
        children = [s for s in spans if s.parent is not None and s.parent.span_id == e.context.span_id]
        names = [c.name for c in sorted(children, key=lambda s: s.start_time)]
        assert names[0] == "dtrain.push" and names[-1] == "dtrain.fold_in" and "dtrain.pull" in names
        assert set(names[1:-1]) == {"dtrain.pull"}
        push = _attrs(next(c for c in children if c.name == "dtrain.push"))
        assert push["dtrain.push_id"] == a["dtrain.push_id"] and push["dtrain.status"] in ("PUSH_STATUS_MERGED",
                                                                                         "PUSH_STATUS_PENDING")
        fold = _attrs(next(c for c in children if c.name == "dtrain.fold_in"))
        assert fold["dtrain.base_version"] == a["dtrain.base_version"] and fold["dtrain.version"] == a["dtrain.version"]
        assert all(c.end_time <= e.end_time for c in children)
    metrics = tel.collect()  # as they were at the island's shutdown
    assert _one(metrics["dtrain.bytes_up"]).value == summary["bytes_up"] == sum(e["bytes"] for e in sent.values())
    assert _one(metrics["dtrain.bytes_down"]).value == summary["bytes_down"]
    ratio = _one(metrics["dtrain.compression_ratio"])
    assert ratio.count == 2 and ratio.sum == pytest.approx(sum(4 * worker.uplink.n / e["bytes"] for e in sent.values()))
    assert exchanges[0].resource.attributes["service.instance.id"] == "island-a"
    assert exchanges[0].resource.attributes["dtrain.run_id"] == running.service.run_id
