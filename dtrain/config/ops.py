"""The config's operational sections: chip health, security and telemetry (``[health]``, ``[security]``,
``[telemetry]``), each a frozen dataclass with its fields' help as ``dtrain.config.sections``' are."""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.config.field import setting as _f


@dataclass(frozen=True)
class HealthConfig:
    enabled: bool = _f(False, "island workers run the per-device inner step and the chip-health probes, and "
                       "quarantine a device found faulty (workers/chip_health.py)")
    known_answer_every: int = _f(100, "inner steps between known-answer probes on every device (also run at start "
                                 "and after a chunk raised; 0: only then); the replay, every replay_every steps, "
                                 "sees a device computing wrong too")
    stats: bool = _f(True, "compare the devices' micro-batch gradient norms from the per-device step (robust "
                     "z-score); a device flagged on two consecutive checks is quarantined")
    z_max: float = _f(6.0, "stats: a device whose gradient norm is more than this many robust deviations from "
                      "the median is an outlier")
    replay_every: int = _f(50, "inner steps between deterministic replays: a row of one device's micro-batch (each "
                           "device's in turn) recomputed on every healthy device, whose bit-exact digests must "
                           "agree; a device outside a strict majority is quarantined (one due mid-chunk runs at the "
                           "chunk's end: 50 finds a silent fault within 50 steps with chunks of 10 or 25; 0: off)")
    min_devices: int = _f(1, "the fewest healthy devices an island trains on; below it the island drains")


@dataclass(frozen=True)
class SecurityConfig:
    token_env: str = _f("DTRAIN_TOKEN", "environment variable with the bearer token ('' or unset: no auth)")
    ca: str = _f("", "PEM CA bundle: workers verify the coordinator with it; with client_auth, the "
                 "coordinator verifies workers")
    server_cert: str = _f("", "coordinator TLS certificate (PEM); empty: plaintext (loopback/testing only)")
    server_key: str = _f("", "coordinator TLS private key (PEM)")
    client_cert: str = _f("", "worker certificate for mutual TLS (PEM)")
    client_key: str = _f("", "worker private key for mutual TLS (PEM)")
    client_auth: bool = _f(False, "mutual TLS: the coordinator requires a client certificate signed by ca")
    server_name: str = _f("", "TLS name to expect on the coordinator's certificate (empty: the host)")
    identity: str = _f("auto", "who an island is: 'shared' (one token or certificate for a single trusted team: any "
                       "holder may act as any island), 'token' (each island its own token, listed hashed in "
                       "island_tokens) or 'cert' (mutual TLS: the island's client certificate, its URI SAN or CN); "
                       "with token or cert, an island name is bound to the identity that first joined with it; "
                       "'auto': 'token' when island_tokens is set, else 'shared'",
                       choices=("auto", "shared", "token", "cert"))
    island_tokens: str = _f("", "identity 'token', the coordinator: file of 'NAME sha256:HEX' lines, one per island "
                            "(`dtrain admin issue-token NAME` makes one); a token acts only as its NAME")
    bindings: tuple[str, ...] = _f((), "identity token or cert: NAME=IDENTITY pins, the operator's re-binding "
                                   "(IDENTITY: token:NAME, uri:URI or cn:CN); a pin overrides the binding a name "
                                   "got at its first Join")
    insecure: bool = _f(False, "the coordinator: serve beyond loopback (coordinator.host or the dashboard's not "
                        "127.0.0.0/8, ::1 or localhost) with no token and no mutual TLS, to anyone who reaches the "
                        "port (dtrain coordinator --insecure); without it such a coordinator refuses to start")

    def __post_init__(self) -> None:
        # 'auto' (the default) resolves here, once: per-island identity whenever the islands' tokens are given.
        if self.identity == "auto":
            object.__setattr__(self, "identity", "token" if self.island_tokens else "shared")


@dataclass(frozen=True)
class TelemetryConfig:
    exporter: str = _f("none", "where OpenTelemetry spans and metrics go: none (off), console (stderr), otlp (a "
                       "collector over gRPC; needs pip install 'dtrain[otlp]'), memory (kept in the process, for "
                       "tests)", choices=("none", "console", "otlp", "memory"))
    otlp_endpoint: str = _f("http://127.0.0.1:4317", "otlp: the collector's OTLP/gRPC endpoint, http://HOST:PORT "
                            "(plaintext) or https://HOST:PORT (TLS)")
    otlp_timeout_s: float = _f(5.0, "otlp: seconds one export may take, retries included (also bounds the "
                               "flush at shutdown)")
    export_interval_s: float = _f(10.0, "console and otlp: seconds between metric exports")
    service_name: str = _f("dtrain", "prefix of the OpenTelemetry service.name: PREFIX-coordinator, PREFIX-island")

