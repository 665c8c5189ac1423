"""``python -m dtrain_cli.probe``: one grpc.health.v1 Check of a coordinator, for a Kubernetes exec probe.

The kubelet's built-in ``grpc`` probe speaks plaintext only, and a coordinator with ``security.server_cert`` serves
TLS on its one port, so the probe is this command instead: it dials the coordinator as a worker would (the
config's ``security.ca``, client certificate and ``server_name``), asks the standard health service (no token
needed), and exits 0 when the answer is SERVING, 1 otherwise (NOT_SERVING, no answer within ``--timeout``, a TLS
failure), with one line on stderr saying which. deploy/coordinator/deployment.yaml runs it for the coordinator's
startup, readiness and liveness probes.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dtrain.config.load import load_config
from dtrain.net.wire import channel_credentials, channel_options
from dtrain_cli.entry import Parser, run_main
from dtrain_cli.main import coordinator_address

PROG = "python -m dtrain_cli.probe"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG,
               description="exit 0 if the coordinator's grpc.health.v1 service says SERVING")
    p.add_argument("--config", required=True, help="the coordinator's TOML file (its [security] section is used)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override one config field (repeatable), as for dtrain")
    p.add_argument("--address", default=None, metavar="HOST:PORT", type=coordinator_address,
                   help="the coordinator to ask (default: 127.0.0.1:coordinator.port)")
    p.add_argument("--timeout", type=float, default=3.0, metavar="SECONDS", help="deadline of the Check call")
    return p


def check(address: str, credentials: grpc.ChannelCredentials | None, server_name: str, timeout: float) -> str:
    """The health service's answer for the whole server ('SERVING', 'NOT_SERVING', ...), or why there is none."""
    options = channel_options(1 << 20, server_name)
    channel = (grpc.secure_channel(address, credentials, options=options) if credentials is not None
               else grpc.insecure_channel(address, options=options))
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
    except grpc.RpcError as e:
        return f"no answer: {e.code().name}: {e.details()}"
    finally:
        channel.close()
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    """The probe's exit status: 0 SERVING, 1 anything else, 2 a bad flag or config (one line: dtrain_cli.entry)."""
    return run_main(PROG, lambda: _probe(argv))


def _probe(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    credentials = channel_credentials(cfg.security)
    address = args.address or f"127.0.0.1:{cfg.coordinator.port}"
    answer = check(address, credentials, cfg.security.server_name, args.timeout)
    if answer != "SERVING":
        print(f"{PROG}: coordinator at {address}: {answer}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
