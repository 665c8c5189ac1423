"""``dtrain`` command line: parse arguments, call a library function.

It sits above the three packages: ``train``, ``simulate`` and ``config`` call ``dtrain``; ``coordinator``,
``worker`` and ``status`` call ``coordinator`` and ``workers``, which the library itself never imports.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from dtrain.config import Config, ConfigError, load_config, reference_markdown, to_toml
from dtrain.errors import DtrainError


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="TOML file, or a name from configs/ (tiny, small, ...)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override one config field (repeatable), e.g. --set train.lr=3e-4")
    p.add_argument("--host-devices", type=int, default=0, metavar="N",
                   help="on CPU: split the host into N fake JAX devices (sets XLA_FLAGS before JAX starts)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dtrain", description="multi-datacenter asynchronous training on JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="one island: the plain baseline, with orbax checkpoints")
    _common(p)
    p.add_argument("--resume", action="store_true", help="continue runs/NAME from its latest checkpoint")
    p = sub.add_parser("simulate", help="N islands with DiLoCo outer steps: a coordinator and N worker "
                       "processes on loopback (or --inprocess)")
    _common(p)
    p.add_argument("--islands", type=int, default=None, help="number of islands (default: outer.islands)")
    p.add_argument("--inprocess", action="store_true", help="all islands in this process, no network")
    p.add_argument("--no-pin", action="store_true", help="do not give each worker process its own share of "
                   "the CPUs (Linux; by default they are pinned, as islands own their hardware)")
    p.add_argument("--fault", dest="faults", action="append", default=[], metavar="SPEC",
                   help="inject a fault (repeatable): KIND[:ISLAND]@(vN|Ns)[+Ds][,delay=MS] with KIND one of kill, "
                   "hang, kill-coordinator, cut, slow, nan, poison, inflate, truncate, e.g. kill:island-1@v3+10s; "
                   "or a device fault inside an island, KIND:ISLAND@stepN,device=ID[,factor=F][,bit=B][,rate=R]"
                   "[,prob=P][,seed=S][,until=STEP] with KIND one of device-scale, device-bitflip, device-dead, e.g. "
                   "device-bitflip:island-1@step120,device=3,bit=30 (see dtrain_cli/faults.py)")
    p = sub.add_parser("coordinator", help="serve the coordinator (merges the islands' deltas)")
    _common(p)
    p.add_argument("--port", type=int, default=None, help="port to bind (default: coordinator.port; 0: any)")
    p.add_argument("--run-dir", default=None, help="events, checkpoints (default: runs/NAME)")
    p.add_argument("--resume", nargs="?", const="always", default=None, choices=("always", "auto"),
                   help="restore the latest coordinator checkpoint in --run-dir; --resume=auto: if there is one, "
                   "else start the run (a Deployment's every start)")
    p = sub.add_parser("worker", help="run one island against a coordinator")
    _common(p)
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT")
    p.add_argument("--island", required=True, help="this island's name (unique; a restart reuses it)")
    p.add_argument("--run-dir", default=None, help="events and checkpoints (default: runs/NAME/islands/ISLAND)")
    p.add_argument("--inject", action="append", default=[], metavar="KIND@vN",
                   help="testing knob (what simulate --fault passes): corrupt this island's first push based on "
                   "version >= N, once; KIND one of nan, poison, inflate, truncate (see workers/inject.py)")
    p.add_argument("--device-fault", default=None, metavar="KIND:DEVICE@STEP[,OPTION=VALUE...]",
                   help="testing knob (what simulate --fault device-KIND passes): from inner step STEP on, perturb the "
                   "JAX device DEVICE's outputs in the per-device inner step; KIND one of scale (factor=F), bitflip "
                   "(bit=B, rate=R), dead; every kind takes prob=P, seed=S, until=STEP (see workers/inject.py)")
    p = sub.add_parser("status", help="ask a coordinator how the run is going")
    _common(p)
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT")
    p = sub.add_parser("config", help="print the resolved config as TOML with every field's comment")
    _common(p)
    p.add_argument("--reference", action="store_true", help="print the README's Markdown reference table instead")
    p = sub.add_parser("plot", help="write PNGs of a run (loss, bytes, utilization, a fault timeline) from its "
                       "events; a finished or a live run", description="e.g. dtrain plot runs/tiny")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder, e.g. runs/tiny")
    p.add_argument("--out", default=None, metavar="DIR", help="where the PNGs go (default: RUN_DIR/plots)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "plot":  # no config: it reads what the run wrote
        from dtrain_cli import plot

        return plot.main(args.run_dir, args.out)
    if args.host_devices:
        if "jax" in sys.modules:
            print("--host-devices must be set before JAX is imported", file=sys.stderr)
            return 2
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.host_devices}").strip()
    try:
        cfg = load_config(args.config, args.overrides)
        if args.command == "config":
            print(reference_markdown() if args.reference else to_toml(cfg))
            return 0
        from dtrain.data import DataError

        if args.command in ("coordinator", "worker", "status"):
            try:
                return _service_command(args, cfg)
            except (DataError, DtrainError) as e:
                print(f"dtrain {args.command}: error: {e}", file=sys.stderr)
                return 1
        from dtrain import runs  # imports JAX: after XLA_FLAGS is set

        try:
            if args.command == "train":
                summary = runs.run_train(cfg, resume=args.resume, quiet=args.quiet)
            elif args.command == "simulate":
                islands = args.islands if args.islands is not None else cfg.outer.islands
                if islands < 1:
                    raise ConfigError(f"--islands: must be >= 1, got {islands}")
                if args.inprocess:
                    if args.faults:
                        raise ConfigError("--fault needs worker processes: drop --inprocess")
                    summary = runs.run_simulate_inprocess(cfg, islands, quiet=args.quiet)
                else:
                    from dtrain_cli.faults import host_device_count, parse_fault
                    from dtrain_cli.simulate import run_simulation

                    # each worker has the fake CPU devices XLA_FLAGS gives (--host-devices), where it says
                    faults = [parse_fault(text, islands, host_device_count()) for text in args.faults]
                    summary = run_simulation(cfg, islands, quiet=args.quiet, pin=not args.no_pin, faults=faults)
        except (DataError, DtrainError) as e:
            print(f"dtrain {args.command}: error: {e}", file=sys.stderr)
            return 1
    except ConfigError as e:
        print(f"dtrain {args.command}: config error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: summary[k] for k in ("final_eval_loss", "rounds", "tokens", "bytes_up", "bytes_down",
                                              "wall_s", "run_dir")}))
    return 0


def _service_command(args: argparse.Namespace, cfg: Config) -> int:
    """coordinator / worker / status: the entry points into coordinator/ and workers/ (imported here only)."""
    from pathlib import Path

    from dtrain.config import run_path as run_dir

    if args.command == "coordinator":
        from coordinator.server import has_checkpoint, run_coordinator

        out = Path(args.run_dir) if args.run_dir else run_dir(cfg)
        out.mkdir(parents=True, exist_ok=True)
        resume = args.resume == "always" or (args.resume == "auto" and has_checkpoint(cfg, out))
        summary = run_coordinator(cfg, out, port=args.port, resume=resume, quiet=args.quiet)
        print(json.dumps(summary))
        return 0
    if args.command == "worker":
        import jax

        from workers.inject import Injection, check_device_fault, parse_device_fault
        from workers.island import run_worker

        inject = [Injection.parse(text) for text in args.inject]
        device_fault = parse_device_fault(args.device_fault) if args.device_fault is not None else None
        if device_fault is not None:
            check_device_fault(device_fault, [d.id for d in jax.devices()])
        out = Path(args.run_dir) if args.run_dir else run_dir(cfg) / "islands" / args.island
        summary = run_worker(cfg, args.coordinator, args.island, out, quiet=args.quiet, inject=inject,
                             device_fault=device_fault)
        if "run_over" in summary:  # nothing was trained: one line, exit 0
            print(f"dtrain worker: {summary['run_over']}: nothing to do")
            return 0
        print(json.dumps({k: summary[k] for k in ("final_eval_loss", "version", "tokens", "utilization")}))
        return 0
    from google.protobuf import json_format

    from workers.client import CoordinatorClient

    client = CoordinatorClient(args.coordinator, cfg)
    try:
        status = client.status()
    finally:
        client.close()
    # Fields at their default printed too: a quarantined device 0 at mesh index 0 keeps its "device" and "index".
    print(json_format.MessageToJson(status, preserving_proto_field_name=True,
                                    always_print_fields_with_no_presence=True))
    return 0
