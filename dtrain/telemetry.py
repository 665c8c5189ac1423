"""OpenTelemetry for the coordinator and the islands: spans of rounds and exchanges, metrics of bytes, losses, faults.

One :class:`Telemetry` per process role, built from the ``[telemetry]`` config section. It owns LOCAL tracer and
meter providers (never the process-global ones: tests run many coordinators and islands in one process), with a
Resource naming the service (``PREFIX-coordinator`` or ``PREFIX-island``), the instance (``coordinator`` or the
island's name) and the run id. The exporters:

- ``none``: OpenTelemetry's no-op tracer and meter, and :meth:`Telemetry.span` is a null context: next to no cost.
- ``console``: spans (one JSON line each, as they end) and metrics (every ``export_interval_s``) on stderr.
- ``otlp``: OTLP over gRPC to a collector at ``otlp_endpoint`` (the optional extra ``dtrain[otlp]``, imported only
  then).
- ``memory``: spans in an InMemorySpanExporter, metrics in an InMemoryMetricReader; tests read them
  (:meth:`Telemetry.finished_spans`, :meth:`Telemetry.collect`).

Span and metric names are listed in docs/telemetry.md. Attributes are named ``dtrain.<name>``
(:meth:`Telemetry.span` takes them as keywords without the prefix).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.util.types import AttributeValue

from dtrain.config.ops import TelemetryConfig
from dtrain.errors import DtrainError
from dtrain.runlog import fault_kind

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricsData
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from dtrain.net.proto import dtrain_pb2 as pb

# Histogram bucket boundaries: compression ratios (raw fp32 bytes / frame bytes; int8 is about 4, fp32 about 1) and
# round latencies in seconds (a loopback round of a tiny model: tens of ms; a WAN round of a large one: minutes).
RATIO_BUCKETS = (1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0, 24.0, 32.0, 64.0)
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
OTLP_HINT = "pip install 'dtrain[otlp]'"


def attributes(values: Mapping[str, Any]) -> dict[str, AttributeValue]:
    """Keyword attributes as OpenTelemetry's: each name prefixed ``dtrain.``, None left out, sequences as tuples."""
    out: dict[str, AttributeValue] = {}
    for key, value in values.items():
        if value is None:
            continue
        out[f"dtrain.{key}"] = tuple(value) if isinstance(value, list | tuple) else value
    return out


def require_exporter(cfg: TelemetryConfig) -> None:
    """Raises DtrainError (one line) when the configured exporter's package is not installed: called before a
    process starts anything, so a missing extra is found at once."""
    if cfg.exporter != "otlp":
        return
    try:
        import opentelemetry.exporter.otlp.proto.grpc.metric_exporter  # noqa: F401
        import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # noqa: F401
    except ImportError:
        raise DtrainError(f'[telemetry] exporter = "otlp" needs the OTLP exporter, which is not installed: '
                          f"{OTLP_HINT}") from None


class Telemetry:
    """Spans and metrics of one process (the coordinator, or one island), exported as ``cfg.exporter`` says.

    ``role``: "coordinator" or "island"; ``instance``: the island's name (or "coordinator"); ``run_id``: the
    coordinator's run id. Call :meth:`shutdown` when the process stops: it flushes what is not exported yet."""

    def __init__(self, cfg: TelemetryConfig, role: str, instance: str, run_id: str):
        self.exporter = cfg.exporter
        self.enabled = cfg.exporter != "none"
        self.spans_memory: InMemorySpanExporter | None = None
        self.metrics_memory: InMemoryMetricReader | None = None
        self._tracer_provider: TracerProvider | None = None
        self._meter_provider: MeterProvider | None = None
        self._final: MetricsData | None = None  # memory: the metrics as they were at shutdown
        self._shutdown_lock = threading.Lock()
        self._closed = False
        self._timeout_ms = cfg.otlp_timeout_s * 1000
        if not self.enabled:
            self.tracer: trace.Tracer = trace.NoOpTracer()
            self.meter: metrics.Meter = metrics.NoOpMeter("dtrain")
        else:
            require_exporter(cfg)
            self._build(cfg, role, instance, run_id)
        self.faults = self.meter.create_counter("dtrain.faults", unit="{fault}",
                                                description="faults recorded, by event kind (dtrain.kind)")
        self.compression_ratio = self.meter.create_histogram(
            "dtrain.compression_ratio", unit="1", explicit_bucket_boundaries_advisory=RATIO_BUCKETS,
            description="raw fp32 bytes / frame bytes of each frame (dtrain.direction: up = a push, down = an update)")

    @classmethod
    def disabled(cls) -> Telemetry:
        """A Telemetry that records nothing (exporter "none")."""
        return cls(TelemetryConfig(), "", "", "")

    def _build(self, cfg: TelemetryConfig, role: str, instance: str, run_id: str) -> None:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import (
            ConsoleMetricExporter,
            InMemoryMetricReader,
            MetricExporter,
            MetricReader,
            PeriodicExportingMetricReader,
        )
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SimpleSpanProcessor,
            SpanProcessor,
        )
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        # Resource.create also merges OTEL_RESOURCE_ATTRIBUTES from the environment, as collectors expect.
        resource = Resource.create({"service.name": f"{cfg.service_name}-{role}", "service.instance.id": instance,
                                    "dtrain.run_id": run_id})
        interval_ms = cfg.export_interval_s * 1000
        processor: SpanProcessor
        reader: MetricReader
        if cfg.exporter == "memory":
            self.spans_memory = InMemorySpanExporter()
            processor = SimpleSpanProcessor(self.spans_memory)  # synchronous: a test sees a span as it ends
            reader = self.metrics_memory = InMemoryMetricReader()
        else:
            metric_exporter: MetricExporter
            if cfg.exporter == "console":
                span_exporter: Any = ConsoleSpanExporter(
                    out=sys.stderr, formatter=lambda span: span.to_json(indent=None) + os.linesep)
                metric_exporter = ConsoleMetricExporter(
                    out=sys.stderr, formatter=lambda data: data.to_json(indent=None) + os.linesep)
            else:
                from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

                span_exporter = OTLPSpanExporter(endpoint=cfg.otlp_endpoint, timeout=cfg.otlp_timeout_s)
                metric_exporter = OTLPMetricExporter(endpoint=cfg.otlp_endpoint, timeout=cfg.otlp_timeout_s)
            # Batched: a span's end costs a queue append; export happens on the processor's thread.
            processor = BatchSpanProcessor(span_exporter, export_timeout_millis=cfg.otlp_timeout_s * 1000)
            reader = PeriodicExportingMetricReader(metric_exporter, export_interval_millis=interval_ms,
                                                   export_timeout_millis=cfg.otlp_timeout_s * 1000)
        self._tracer_provider = TracerProvider(resource=resource)
        self._tracer_provider.add_span_processor(processor)
        self._meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
        self.tracer = self._tracer_provider.get_tracer("dtrain")
        self.meter = self._meter_provider.get_meter("dtrain")

    # -- spans ------------------------------------------------------------------------------------------

    def span(self, name: str, /, parent: trace.Span | None = None,
             **attrs: Any) -> contextlib.AbstractContextManager[trace.Span]:
        """A span around a ``with`` block, child of ``parent`` (else of the thread's current span); an exception
        leaving the block is recorded on it. Off: a null context yielding a non-recording span."""
        if not self.enabled:
            return contextlib.nullcontext(trace.INVALID_SPAN)
        context = trace.set_span_in_context(parent) if parent is not None else None
        return self.tracer.start_as_current_span(name, context=context, attributes=attributes(attrs))

    def start_span(self, name: str, /, parent: trace.Span | None = None, **attrs: Any) -> trace.Span:
        """A span started now and ended by :meth:`end` (one that outlives a block: a round, an exchange)."""
        if not self.enabled:
            return trace.INVALID_SPAN
        context = trace.set_span_in_context(parent) if parent is not None else None
        return self.tracer.start_span(name, context=context, attributes=attributes(attrs))

    @staticmethod
    def annotate(span: trace.Span, **attrs: Any) -> None:
        """Sets attributes on a span (named as :meth:`span` names them)."""
        if span.is_recording():
            span.set_attributes(attributes(attrs))

    @staticmethod
    def end(span: trace.Span, **attrs: Any) -> None:
        """Ends a span with more attributes; a span already ended is left as it is."""
        if span.is_recording():
            span.set_attributes(attributes(attrs))
            span.end()

    @contextlib.contextmanager
    def ending(self, span: trace.Span) -> Iterator[trace.Span]:
        """Ends ``span`` (one from :meth:`start_span`) when the block ends; an exception leaving the block is
        recorded on it first."""
        try:
            yield span
        except BaseException as e:
            if span.is_recording():
                span.record_exception(e)
                span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(e).__name__}: {e}"))
            raise
        finally:
            self.end(span)

    # -- metrics ----------------------------------------------------------------------------------------

    def record_ratio(self, raw_bytes: int, frame_bytes: int, direction: str) -> None:
        """One frame's compression ratio (raw fp32 bytes / frame bytes)."""
        if frame_bytes > 0:
            self.compression_ratio.record(raw_bytes / frame_bytes, attributes(dict(direction=direction)))

    def observe(self, name: str, unit: str, description: str,
                read: Callable[[], Iterable[tuple[float, Mapping[str, Any]]]], counter: bool = False) -> None:
        """An observable gauge (or, ``counter``, a monotonic observable counter) whose value(s) ``read`` returns
        when the metrics are collected: (value, attributes) pairs, the attributes named as :meth:`span` takes."""
        def callback(_options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(value, attributes(attrs)) for value, attrs in read()]

        if counter:
            self.meter.create_observable_counter(name, [callback], unit=unit, description=description)
        else:
            self.meter.create_observable_gauge(name, [callback], unit=unit, description=description)

    def on_event(self, record: Mapping[str, Any]) -> None:
        """A RunLog listener (``RunLog.subscribe``): counts each fault event in ``dtrain.faults`` by its kind."""
        kind = fault_kind(record)
        if kind:
            self.faults.add(1, attributes(dict(kind=kind, island=record.get("island"))))

    # -- the in-memory exporter (tests) -------------------------------------------------------------------

    def finished_spans(self) -> Sequence[ReadableSpan]:
        """Memory exporter: the spans ended so far, in the order they ended."""
        if self.spans_memory is None:
            raise ValueError(f'finished_spans() needs [telemetry] exporter = "memory", not {self.exporter!r}')
        return self.spans_memory.get_finished_spans()

    def collect(self) -> dict[str, list[Any]]:
        """Memory exporter: every metric's data points now (after :meth:`shutdown`: as they were then), by name."""
        if self.metrics_memory is None:
            raise ValueError(f'collect() needs [telemetry] exporter = "memory", not {self.exporter!r}')
        data = self._final if self._closed else self.metrics_memory.get_metrics_data()
        out: dict[str, list[Any]] = {}
        for rm in data.resource_metrics if data is not None else ():
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    out.setdefault(metric.name, []).extend(metric.data.data_points)
        return out

    def shutdown(self) -> None:
        """Flushes and stops the exporters (at most ``otlp_timeout_s`` each). Idempotent."""
        with self._shutdown_lock:
            if self._closed:
                return
            self._closed = True
        if self.metrics_memory is not None:
            self._final = self.metrics_memory.get_metrics_data()
        if self._tracer_provider is not None:
            self._tracer_provider.shutdown()
        if self._meter_provider is not None:
            self._meter_provider.shutdown(timeout_millis=self._timeout_ms)


class RoundSpans:
    """The coordinator's round spans, keyed by the version each round produces. A round's span starts with its
    first accepted push, with a ``dtrain.quorum_wait`` child that ends when the round is ready to merge; the
    round's span ends after its checkpoint (:meth:`close`), its length recorded in ``dtrain.round.duration``.
    Called from the push threads and the merge; thread-safe."""

    def __init__(self, telemetry: Telemetry):
        self.telemetry = telemetry
        self._open: dict[int, tuple[trace.Span, trace.Span]] = {}
        self._lock = threading.Lock()
        self.duration = telemetry.meter.create_histogram(
            "dtrain.round.duration", unit="s", explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
            description="a round's latency: its first accepted push to its version checkpointed")

    def open(self, version: int) -> trace.Span:
        """The span of the round producing ``version``, started now if it is not open yet."""
        if not self.telemetry.enabled:
            return trace.INVALID_SPAN
        with self._lock:
            if version not in self._open:
                span = self.telemetry.start_span("dtrain.round", version=version)
                self._open[version] = span, self.telemetry.start_span("dtrain.quorum_wait", parent=span,
                                                                      version=version)
            return self._open[version][0]

    def ready(self, version: int, reason: str) -> trace.Span:
        """The round producing ``version`` merges now: its quorum wait ends (with ``reason``); returns its span."""
        span = self.open(version)
        with self._lock:
            opened = self._open.get(version)
        if opened is not None:
            self.telemetry.end(opened[1], reason=reason)
        return span

    def close(self, version: int, **attrs: Any) -> None:
        """The round producing ``version`` is merged and checkpointed: its span ends with ``attrs``."""
        with self._lock:
            spans = self._open.pop(version, None)
        if spans is None:
            return
        span = spans[0]
        start = getattr(span, "start_time", None)  # an SDK span's start, in ns
        self.telemetry.end(span, merged=True, **attrs)
        end = getattr(span, "end_time", None)
        if isinstance(start, int) and isinstance(end, int):
            self.duration.record((end - start) / 1e9)

    def close_all(self) -> None:
        """At shutdown: the rounds still open end unmerged."""
        with self._lock:
            spans, self._open = list(self._open.values()), {}
        for span, wait in spans:
            self.telemetry.end(wait)
            self.telemetry.end(span, merged=False)


def status_gauges(telemetry: Telemetry, status: Callable[[], pb.StatusResponse]) -> None:
    """The coordinator's metrics read from its Status message (``status``, called once per collection: every
    instrument's callback shares one call): bytes, tokens, version, the global eval loss, and per island its step
    rate, tokens, train loss, utilization, devices and quarantined devices (attributes ``dtrain.island`` and
    ``dtrain.name``)."""
    if not telemetry.enabled:
        return
    latest: dict[str, Any] = {}
    lock = threading.Lock()

    def current() -> pb.StatusResponse:
        # The callbacks of one collection run one after another, within a few ms: one Status for all of them.
        with lock:
            now = time.monotonic()
            if "message" not in latest or now - latest["at"] > 0.5:
                latest["message"], latest["at"] = status(), now
            message: pb.StatusResponse = latest["message"]
            return message

    def total(read: Callable[[pb.StatusResponse], float]) -> Callable[[], list[tuple[float, dict[str, Any]]]]:
        return lambda: [(read(current()), {})]

    def per_island(read: Callable[[Any], float | None]) -> Callable[[], list[tuple[float, dict[str, Any]]]]:
        def values() -> list[tuple[float, dict[str, Any]]]:
            out = []
            for isl in current().islands:
                value = read(isl)
                if value is not None:
                    out.append((value, {"island": isl.island_id, "name": isl.name}))
            return out
        return values

    t = telemetry
    t.observe("dtrain.bytes_up", "By", "frame bytes received from the islands (pushes)",
              total(lambda s: s.bytes_in), counter=True)
    t.observe("dtrain.bytes_down", "By", "frame bytes sent to the islands (pulls)",
              total(lambda s: s.bytes_out), counter=True)
    t.observe("dtrain.tokens", "{token}", "tokens merged into the global θ", total(lambda s: s.tokens_merged),
              counter=True)
    t.observe("dtrain.version", "{version}", "the global θ's version", total(lambda s: s.version))

    def eval_loss() -> list[tuple[float, dict[str, Any]]]:
        s = current()
        return [(s.eval_loss, {})] if s.HasField("eval_loss") else []

    t.observe("dtrain.eval_loss", "1", "the global θ's latest eval loss (nats per token)", eval_loss)
    t.observe("dtrain.island.step_rate", "{step}/s", "an island's inner steps per second",
              per_island(lambda i: i.steps_per_s))
    t.observe("dtrain.island.tokens", "{token}", "tokens an island reported trained", per_island(lambda i: i.tokens))
    t.observe("dtrain.island.train_loss", "1", "an island's latest train loss (nats per token)",
              per_island(lambda i: i.train_loss if i.HasField("train_loss") else None))
    t.observe("dtrain.island.utilization", "1", "the fraction of an island's time spent computing",
              per_island(lambda i: i.utilization))
    t.observe("dtrain.island.devices", "{device}", "the devices an island trains on", per_island(lambda i: i.devices))
    t.observe("dtrain.island.quarantined", "{device}", "an island's quarantined devices (chips)",
              per_island(lambda i: len(i.quarantined)))


def island_counters(telemetry: Telemetry, bytes_up: Callable[[], int], bytes_down: Callable[[], int]) -> None:
    """An island's byte counters: frame bytes it sent (``bytes_up``) and received (``bytes_down``)."""
    if not telemetry.enabled:
        return
    telemetry.observe("dtrain.bytes_up", "By", "frame bytes this island sent (pushes)",
                      lambda: [(bytes_up(), {})], counter=True)
    telemetry.observe("dtrain.bytes_down", "By", "frame bytes this island received (pulls)",
                      lambda: [(bytes_down(), {})], counter=True)

