"""``dtrain`` command line: parse arguments, call a library function.

It sits above the three packages: ``train``, ``simulate`` and ``config`` call ``dtrain``; ``coordinator``,
``worker`` and ``status`` call ``coordinator`` and ``workers``, which the library itself never imports.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

from dtrain.config.load import load_config, reference_markdown, to_toml
from dtrain.config.load import replace as config_replace
from dtrain.config.sections import Config, ConfigError
from dtrain_cli import logs, look
from dtrain_cli.entry import Parser, run_main

COMMANDS = ("train", "simulate", "coordinator", "worker", "status", "config", "plot", "dashboard", "tokenize",
            "export", "generate", "eval", "admin")
STATUS_WAIT_S = 5.0  # dtrain status: how long to wait for the coordinator's answer (--wait)


def version() -> str:
    """The installed package's version (importlib.metadata)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("dtrain")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def coordinator_address(text: str) -> str:
    """``--coordinator``: HOST:PORT (:func:`dtrain.net.wire.parse_address`), as given."""
    from dtrain.net.wire import parse_address

    try:
        parse_address(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def port_number(text: str) -> int:
    """``coordinator --port``: 0..65535 (0: any free port); gRPC would bind a random port for a larger one."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not in 0..65535 (0: any free port)")
    return port


def int_at_least(minimum: int, noun: str, why: str) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``; ``noun`` names what a non-integer is not, ``why`` is said of
    one too small."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of {noun}") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"{n}: {why}")
        return n
    return parse


def slowdown_factor(text: str) -> float:
    """``worker --slowdown``: a number >= 1 (1: full speed)."""
    try:
        k = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not k >= 1.0 or k == float("inf"):
        raise argparse.ArgumentTypeError(f"{k:g}: a slowdown is a finite number >= 1 (1: full speed)")
    return k


# --host-devices: 0 leaves XLA_FLAGS as it is; simulate --island-processes: worker processes per island
device_count = int_at_least(0, "devices", "must be >= 0 (0: leave XLA_FLAGS as it is)")
process_count = int_at_least(1, "processes (an integer >= 1)", "an island has at least 1 process")


def _config_flags(p: argparse.ArgumentParser, required: bool = True) -> None:
    help = "TOML file, or a name from configs/ (tiny, small, ...)" + ("" if required else "; default: the defaults")
    p.add_argument("--config", required=required, default=None, help=help)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override one config field (repeatable), e.g. --set train.lr=3e-4")


def _common(p: argparse.ArgumentParser, config_required: bool = True) -> None:
    _config_flags(p, required=config_required)
    p.add_argument("--host-devices", type=device_count, default=0, metavar="N",
                   help="on CPU: split the host into N fake JAX devices (sets XLA_FLAGS before JAX starts)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def _cache_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache", default=None, metavar="DIR",
                   help="where builtin, text and .bin sources become token stores on first use (data.cache; "
                   "default: OUT_DIR/data-cache)")


def _command(sub: argparse._SubParsersAction[Parser], name: str, help: str, description: str,
             example: str) -> argparse.ArgumentParser:
    """A subcommand with its one-line help (``dtrain --help``), a description and an example (its ``--help``)."""
    return sub.add_parser(name, help=help, description=description, epilog=f"example:\n  {example}",
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    """The ``dtrain`` parser: every command (:data:`COMMANDS`), each with its flags, a description and an
    example."""
    parser = Parser(prog="dtrain", description="multi-datacenter asynchronous training on JAX",
                    epilog="example:\n  dtrain simulate --config small --islands 4\n\n"
                    "`dtrain COMMAND --help` describes a command.",
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train(sub)
    _add_simulate(sub)
    _add_coordinator(sub)
    _add_worker(sub)
    _add_status(sub)
    _add_config(sub)
    _add_plot(sub)
    _add_dashboard(sub)
    _add_tokenize(sub)
    _add_export(sub)
    look.add_parsers(sub, _command, int_at_least)
    _add_admin(sub)
    return parser


def _add_train(sub: argparse._SubParsersAction[Parser]) -> None:
    """``dtrain train``: one island, no coordinator (the baseline)."""
    p = _command(sub, "train", "one island: the plain baseline, with orbax checkpoints",
                 "Trains one island on all local devices, no coordinator: the baseline DiLoCo is compared with.\n"
                 "Writes runs/NAME/ (events.jsonl, summary.json, checkpoints/STEP every run.checkpoint_every steps).",
                 "dtrain train --config tiny --set train.steps=40")
    _common(p)
    _cache_flag(p)
    p.add_argument("--resume", action="store_true", help="continue runs/NAME from its latest checkpoint")


def _add_simulate(sub: argparse._SubParsersAction[Parser]) -> None:
    """``dtrain simulate``: N islands on loopback (or in this process), with ``--fault`` injection."""
    p = _command(sub, "simulate", "N islands with DiLoCo outer steps: a coordinator and N worker processes on "
                 "loopback (or --inprocess)",
                 "Runs a coordinator and N worker processes on 127.0.0.1 (or every island in this process with\n"
                 "--inprocess), optionally injecting faults, and writes runs/NAME/ with a summary.json.",
                 "dtrain simulate --config small --islands 4 --fault kill:island-1@v3+10s")
    _common(p, config_required=False)  # --config, or --resume RUN_DIR (its config.toml)
    _cache_flag(p)
    p.add_argument("--islands", type=int, default=None, help="number of islands (default: outer.islands)")
    p.add_argument("--inprocess", action="store_true", help="all islands in this process, no network")
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue an interrupted run (Ctrl-C) in RUN_DIR: its coordinator from its last checkpoint, "
                   "each island from its own folder, with the run's own config (RUN_DIR/config.toml)")
    p.add_argument("--no-pin", action="store_true", help="do not give each island's worker processes their own "
                   "share of the CPUs (Linux; by default they are pinned, as islands own their hardware)")
    p.add_argument("--island-processes", type=process_count, default=1, metavar="P",
                   help="worker processes per island (default 1): P > 1 makes every island a multi-host island, one "
                   "jax.distributed job of P processes with P times the devices (no device faults, no chip health)")
    p.add_argument("--island", dest="island_specs", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                   help="an island's own settings (repeatable): per-island config fields (train.batch_size, "
                   "train.steps_per_call, model.attention, model.remat, worker.round_seconds, outer.inner_steps, "
                   "mesh.*, ...; never a fingerprint field), host_devices=N (its fake CPU devices), slowdown=K "
                   "(its steps take K times as long), link=RATE/RTT (its own WAN link) and credential=OTHER "
                   "(with --island-tokens: it presents OTHER's issued token, a Sybil refused at Join), e.g. "
                   "island-2:train.batch_size=8,host_devices=2,slowdown=4")
    p.add_argument("--coordinator-shards", type=int, default=None, metavar="S",
                   help="a sharded coordinator: S coordinator processes, each merging its own range of θ (shard 0 "
                   "the lead; docs/architecture.md#shards; default: coordinator.shards)")
    p.add_argument("--island-tokens", action="store_true",
                   help="an identity per island: security.identity = token, each island its own issued token "
                   "(passed in security.token_env), the coordinator their hashes in RUN_DIR/island-tokens")
    p.add_argument("--link", default=None, metavar="RATE/RTT",
                   help="every island reaches the coordinator over an emulated wide-area link of this bandwidth each "
                   "way and round trip, e.g. 100mbit/100ms (a proxy per island; --island NAME:link=... for one)")
    p.add_argument("--fault", dest="faults", action="append", default=[], metavar="SPEC",
                   help="inject a fault (repeatable): KIND[:ISLAND]@(vN|Ns)[+Ds][,delay=MS] with KIND one of kill, "
                   "hang, kill-coordinator, cut, slow, nan, poison, inflate, truncate, scale, ramp (,factor=F), "
                   "e.g. kill:island-1@v3+10s or scale:island-1@v0,factor=-3; "
                   "or a device fault inside an island, KIND:ISLAND@stepN,device=ID[,factor=F][,bit=B][,rate=R]"
                   "[,prob=P][,seed=S][,until=STEP] with KIND one of device-scale, device-bitflip, device-dead, e.g. "
                   "device-bitflip:island-1@step120,device=3,bit=30 (see dtrain_cli/fault_spec.py)")


def _add_coordinator(sub: argparse._SubParsersAction[Parser]) -> None:
    """``dtrain coordinator``: serve the coordinator."""
    p = _command(sub, "coordinator", "serve the coordinator (merges the islands' deltas)",
                 "Serves the coordinator on coordinator.host:port until the run's last version is merged and every\n"
                 "live island holds it (or SIGTERM); checkpoints into RUN_DIR/coordinator/VERSION.",
                 "dtrain coordinator --config small --port 50051 --run-dir runs/demo")
    _common(p)
    p.add_argument("--port", type=port_number, default=None,
                   help="port to bind (default: coordinator.port; 0: any)")
    p.add_argument("--run-dir", default=None, help="events, checkpoints (default: runs/NAME)")
    p.add_argument("--resume", nargs="?", const="always", default=None, choices=("always", "auto"),
                   help="restore the latest coordinator checkpoint in --run-dir; --resume=auto: if there is one, "
                   "else start the run (a Deployment's every start)")
    p.add_argument("--after-finish", choices=("exit", "serve"), default="exit",
                   help="once the run is finished: exit (the default), or keep serving its final θ, Status, health "
                   "and the dashboard until SIGTERM (a Deployment's: it would restart an exited coordinator)")
    p.add_argument("--shards", type=int, default=None, metavar="S",
                   help="a sharded coordinator of S processes (default: coordinator.shards); each merges its own "
                   "range of θ (docs/architecture.md#shards)")
    p.add_argument("--shard", type=int, default=0, metavar="I",
                   help="which shard this process is: 0, the lead (the default: it runs the rounds, islands join "
                   "it), or 1..S-1, a range shard (serves until SIGTERM)")
    p.add_argument("--insecure", action="store_true",
                   help="serve beyond loopback with no token and no mutual TLS: anyone who reaches the port may act "
                   "as any island (security.insecure; without it such a coordinator refuses to start)")


def _add_worker(sub: argparse._SubParsersAction[Parser]) -> None:
    """``dtrain worker``: one island against a coordinator (and the testing knobs simulate passes it)."""
    p = _command(sub, "worker", "run one island against a coordinator",
                 "Trains one island on all local devices against a running coordinator; a restarted worker with\n"
                 "the same --island name rejoins its shard. An unreachable coordinator is retried for\n"
                 "worker.retry_total_s (600 s by default), each retry naming the address and the time left.",
                 "dtrain worker --config small --coordinator 10.0.0.5:50051 --island dc-east")
    _common(p)
    _cache_flag(p)
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT", type=coordinator_address,
                   help="the coordinator's address, e.g. 10.0.0.5:50051 or [::1]:50051")
    p.add_argument("--island", required=True, help="this island's name (unique; a restart reuses it)")
    p.add_argument("--run-dir", default=None, help="events and checkpoints (default: runs/NAME/islands/ISLAND)")
    p.add_argument("--inject", action="append", default=[], metavar="KIND@vN[,factor=F]",
                   help="testing knob (what simulate --fault passes): corrupt this island's first push based on "
                   "version >= N, once; KIND one of nan, poison, inflate, truncate, or scale / ramp (every push "
                   "from vN on: Δ x F, or Δ x F^k; see workers/push_faults.py)")
    p.add_argument("--device-fault", default=None, metavar="KIND:DEVICE@STEP[,OPTION=VALUE...]",
                   help="testing knob (what simulate --fault device-KIND passes): from inner step STEP on, perturb the "
                   "JAX device DEVICE's outputs in the per-device inner step; KIND one of scale (factor=F), bitflip "
                   "(bit=B, rate=R), dead; every kind takes prob=P, seed=S, until=STEP (see workers/push_faults.py)")
    p.add_argument("--slowdown", type=slowdown_factor, default=1.0, metavar="K",
                   help="testing knob (what simulate --island NAME:slowdown=K passes): every chunk of inner steps "
                   "takes K times its measured compute time (a sleep after it): slower hardware, emulated")
    p.add_argument("--num-processes", type=int, default=None, metavar="P",
                   help="an island of P processes, one per host, one jax.distributed job (default: "
                   "DTRAIN_NUM_PROCESSES, SLURM_NTASKS or a TPU slice's hosts, else 1); only process 0 talks to the "
                   "coordinator")
    p.add_argument("--process-id", type=int, default=None, metavar="I",
                   help="this process's id in the island, 0..P-1 (default: DTRAIN_PROCESS_ID, JOB_COMPLETION_INDEX, "
                   "SLURM_PROCID or TPU_WORKER_ID)")
    p.add_argument("--jax-coordinator", default=None, metavar="HOST:PORT",
                   help="process 0's jax.distributed address, the same for every process (default: "
                   "DTRAIN_JAX_COORDINATOR; 'auto' under SLURM and on TPU slices: JAX finds it)")


def _add_status(sub: argparse._SubParsersAction[Parser]) -> None:
    """``dtrain status``: ask a coordinator how the run is going (no config needed)."""
    p = _command(sub, "status", "ask a coordinator how the run is going",
                 "Prints the run's progress (version x of y, tokens), the global eval loss, each island (state,\n"
                 "shard, cursor, step rate, loss, utilization, devices), the open round, the latest rounds, bytes\n"
                 "and faults: a table, or with --json the Status message as JSON (numbers as numbers). Needs no\n"
                 "config: the token is read from $DTRAIN_TOKEN (--token-env), TLS is set with the --tls flags.",
                 "dtrain status --coordinator 127.0.0.1:50051 --json")
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT", type=coordinator_address,
                   help="the coordinator's address, e.g. 127.0.0.1:50051 or [::1]:50051")
    p.add_argument("--json", action="store_true", help="print the Status message as JSON instead of a table")
    p.add_argument("--wait", type=float, default=STATUS_WAIT_S, metavar="SECONDS",
                   help=f"give up when no answer comes within this long (default {STATUS_WAIT_S:g})")
    p.add_argument("--config", default=None, help="optional: take [security] (token variable, TLS files) from "
                   "this config file or name; the flags below override it")
    p.add_argument("--token-env", default=None, metavar="NAME",
                   help="environment variable holding the bearer token (default: security.token_env, DTRAIN_TOKEN)")
    p.add_argument("--tls-ca", default=None, metavar="FILE", help="PEM CA bundle: speak TLS, verify the coordinator")
    p.add_argument("--tls-cert", default=None, metavar="FILE", help="client certificate for mutual TLS (PEM)")
    p.add_argument("--tls-key", default=None, metavar="FILE", help="client private key for mutual TLS (PEM)")
    p.add_argument("--tls-server-name", default=None, metavar="NAME",
                   help="the name on the coordinator's certificate, if not the address's host")


def _add_config(sub: argparse._SubParsersAction[Parser]) -> None:
    """``dtrain config``: print the resolved config, or the reference table."""
    p = _command(sub, "config", "print the resolved config as TOML with every field's comment",
                 "Prints the config after --set overrides, every field with its comment, as TOML that loads back;\n"
                 "or with --reference the Markdown table of every field (docs/configuration.md).",
                 "dtrain config --config tiny --set train.lr=1e-3 > my.toml")
    _config_flags(p, required=False)
    p.add_argument("--reference", action="store_true",
                   help="print the Markdown reference table of docs/configuration.md instead")


def _add_plot(sub: argparse._SubParsersAction[Parser]) -> None:
    """``dtrain plot``: PNGs of a run from its events."""
    p = _command(sub, "plot", "write PNGs of a run (loss, bytes, utilization, a fault timeline) from its events; "
                 "a finished or a live run",
                 "Reads the events a run wrote (the coordinator's and each island's) and writes PNGs: eval and train\n"
                 "loss over tokens, bytes, utilization, and a timeline of faults and their detection.",
                 "dtrain plot runs/tiny --out /tmp/plots")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder, e.g. runs/tiny")
    p.add_argument("--out", default=None, metavar="DIR", help="where the PNGs go (default: RUN_DIR/plots)")


def _add_dashboard(sub: argparse._SubParsersAction[Parser]) -> None:
    """``dtrain dashboard``: a run's dashboard from its files."""
    p = _command(sub, "dashboard", "serve the dashboard of a finished run (or one whose coordinator is gone) from "
                 "its files", "Serves the coordinator's page for RUN_DIR from its events.jsonl and history.json: the "
                 "whole run's\nloss, throughput, rounds, faults and recoveries, until Ctrl-C.",
                 "dtrain dashboard runs/tiny --port 8051")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder the coordinator wrote, e.g. runs/tiny")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=0, help="port to bind (default 0: any free port)")


def _add_tokenize(sub: argparse._SubParsersAction[Parser]) -> None:
    """``dtrain tokenize``: a corpus into a token store."""
    p = _command(sub, "tokenize", "tokenize text, .jsonl, .parquet files or a datasets dataset into a token store "
                 "(in parallel or on a Ray cluster, resumable)",
                 "Tokenizes the documents of SRC (files and folders: text files, .jsonl with the text in --field,\n"
                 ".parquet and .arrow with a string column --field, .gz and .zst decompressed; a datasets folder, or\n"
                 "hf:NAME on the Hugging Face hub) into a token store at --out, an end-of-document token after each,\n"
                 "on every core or over a Ray cluster (--ray). Killed and run again with the same arguments, it\n"
                 "continues where it stopped and writes the same store (docs/data.md#tokenizing-a-corpus).",
                 "dtrain tokenize data/web/ --tokenizer tokenizer.json --out stores/web")
    p.add_argument("sources", nargs="+", metavar="SRC", help="a file, a folder (recursed, sorted, hidden files "
                   "left out; a datasets save_to_disk folder: its data files), or hf:NAME (a hub dataset); the "
                   "documents' order, file after file, is the store's")
    p.add_argument("--out", required=True, metavar="STORE", help="the store's folder (a new one, or an "
                   "interrupted run's to finish)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--tokenizer", default=None, metavar="FILE",
                       help="a Hugging Face tokenizer.json (copied into the store), or 'bytes': one id per byte")
    which.add_argument("--vocab-size", type=int_at_least(257, "ids", "a byte-level BPE needs at least 257 ids"),
                       default=None, metavar="N", help="no tokenizer given: train a byte-level BPE of N ids on the "
                       "sources (written into the store)")
    p.add_argument("--eos", default=None, metavar="TOKEN", help="the end-of-document token of --tokenizer FILE "
                   "(default: the first of <|endoftext|>, </s>, <|end_of_text|>, <eos>, ... in its vocabulary)")
    p.add_argument("--field", default="text", metavar="NAME",
                   help="the document text's field in .jsonl, column in .parquet, .arrow and datasets (default: text)")
    p.add_argument("--skip-bad", action="store_true", help="leave out (and count) a file that cannot be read, "
                   "instead of stopping at it")
    p.add_argument("--workers", type=process_count, default=os.cpu_count() or 1, metavar="N",
                   help="processes encoding files (default: every core)")
    p.add_argument("--ray", default=None, metavar="ADDRESS", help="spread the work over the Ray cluster whose head "
                   "is at ADDRESS (HOST:PORT, or auto): its tasks write the store themselves, so --out and the "
                   "sources must be at the same path on every node (pip install 'dtrain[ray]')")
    p.add_argument("--overwrite", action="store_true", help="replace a store, or an interrupted run, at --out")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def _add_export(sub: argparse._SubParsersAction[Parser]) -> None:
    """``dtrain export``: the coordinator's θ as a Hugging Face model folder."""
    from dtrain.models.hf import EXPORT_DTYPES, SHARD_BYTES

    p = _command(sub, "export", "write a run's θ at a version as a Hugging Face model folder (llama: its family's "
                 "*ForCausalLM, gpt: GPT2LMHeadModel)",
                 "Reads a run's θ in RUN_DIR (a coordinator's checkpoints and current θ, a train or simulate\n"
                 "--inprocess run's final θ) and writes a folder that transformers loads: config.json,\n"
                 "generation_config.json, safetensors (sharded past --max-shard-bytes), a README.md model card and\n"
                 "the run's tokenizer files when its token store has them (docs/models.md). No JAX is needed.",
                 "dtrain export runs/llama-tiny --dtype bfloat16 --out /tmp/llama-tiny-hf")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder, e.g. runs/llama-tiny")
    p.add_argument("--version", type=int_at_least(0, "versions", "versions start at 0"), default=None,
                   metavar="V", help="the version to export (default: the newest on disk)")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write (new, or empty)")
    p.add_argument("--dtype", choices=EXPORT_DTYPES, default="float32",
                   help="the weights' type: float32 (θ as trained) or bfloat16 (rounded to nearest even; half the "
                   "size)")
    p.add_argument("--max-shard-bytes", type=int_at_least(1, "bytes", "must be >= 1"), default=SHARD_BYTES,
                   metavar="N", help=f"one safetensors file up to N bytes, else shards and an index (default "
                   f"{SHARD_BYTES:,})")


def _add_admin(sub: argparse._SubParsersAction[Parser]) -> None:
    """``dtrain admin``: the operator's credentials for a run's islands."""
    p = _command(sub, "admin", "the operator's tools: issue-token NAME makes an island's own token",
                 "issue-token NAME: a fresh token for island NAME, written to --out (a new file, readable by you\n"
                 "only), and, on stdout, its line for the coordinator's security.island_tokens file (the token's\n"
                 "SHA-256: the coordinator never holds the token). With security.identity = \"token\" the token acts\n"
                 "only as island NAME (docs/security.md); issuing a new one for NAME replaces its line.",
                 "dtrain admin issue-token gpu-a --out tokens/gpu-a.token >> tokens/island-tokens")
    p.add_argument("action", choices=("issue-token",), help="what to do")
    p.add_argument("name", metavar="NAME", help="the island's name (its worker's --island)")
    p.add_argument("--out", required=True, metavar="FILE", help="where the token goes (must not exist yet)")


def _admin(args: argparse.Namespace) -> int:
    """``dtrain admin issue-token NAME --out FILE``: the token to FILE (mode 0600, never over a file), its
    ``security.island_tokens`` line to stdout."""
    from dtrain.config.sections import ISLAND_NAME_RE
    from dtrain.net.identity import hash_line, issue_token

    if not ISLAND_NAME_RE.fullmatch(args.name):
        raise ConfigError(f"NAME {args.name!r}: an island name is 1 to 64 of A-Z a-z 0-9 . _ -")
    token = issue_token()
    try:
        fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(f"--out {args.out}: exists already; a token is never written over a file (remove it, "
                          f"or name another)") from None
    except OSError as e:
        raise ConfigError(f"--out {args.out}: cannot create it: {e.strerror}") from None
    with os.fdopen(fd, "w") as f:
        f.write(token)  # no newline: kubectl create secret --from-file keeps the bytes, and the env var gets them
    print(hash_line(args.name, token))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``dtrain ...``: returns the exit status (0; 2 for a usage or config error; 1 for other errors the user can
    fix, each one line on stderr: :mod:`dtrain_cli.entry`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = f"dtrain {argv[0]}" if argv and argv[0] in COMMANDS else "dtrain"
    return run_main(prog, lambda: _run(argv, prog))


def _run(argv: list[str], prog: str) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named here, not by the top parser: the command's own flags are the ones to look up
        parser.exit(2, f"{prog}: error: unrecognized arguments: {' '.join(extra)} ({prog} --help shows the usage)\n")
    if args.command == "status":
        return _status(args)
    if args.command == "plot":  # no config: it reads what the run wrote
        from dtrain_cli import plot

        return plot.main(args.run_dir, args.out)
    if args.command == "dashboard":  # no config either
        from dtrain_cli import dashboard

        return dashboard.main(args.run_dir, args.host, args.port)
    if args.command == "export":  # no config: it reads what the coordinator wrote
        from dtrain_cli import export

        return export.main(args.run_dir, args.version, args.out, args.max_shard_bytes, args.dtype)
    if args.command in ("generate", "eval"):  # no config: the folder says what the model is
        return look.main(args)
    if args.command == "admin":  # no config either
        return _admin(args)
    if args.command == "tokenize":  # no config either
        from dtrain_cli import tokenize

        return tokenize.main(args)
    if getattr(args, "host_devices", 0):
        if "jax" in sys.modules:
            raise ConfigError("--host-devices must be set before JAX is imported")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.host_devices}").strip()
    if args.command == "simulate":
        from dtrain_cli.simulate import resume_args

        resume_args(args)
    cache = [f"data.cache={args.cache}"] if getattr(args, "cache", None) else []
    cfg = load_config(args.config, [*args.overrides, *cache])
    if getattr(args, "quiet", False):  # no progress lines: the library's info records too (cli_logging restores it)
        logs.quiet()
    if args.command == "config":
        print(reference_markdown() if args.reference else to_toml(cfg))
        return 0
    if args.command in ("coordinator", "worker"):
        return _service_command(args, cfg)
    from dtrain.train import runs

    if args.command == "train":
        summary = runs.run_train(cfg, resume=args.resume, quiet=args.quiet)
    else:
        islands = args.islands if args.islands is not None else cfg.outer.islands
        if islands < 1:
            raise ConfigError(f"--islands: must be >= 1, got {islands}")
        if args.inprocess:
            if args.faults:
                raise ConfigError("--fault needs worker processes: drop --inprocess")
            if args.island_processes > 1:
                raise ConfigError("--island-processes needs worker processes: drop --inprocess")
            if args.island_specs or args.link or args.island_tokens:
                raise ConfigError("--island, --link and --island-tokens need worker processes: drop --inprocess")
            if (args.coordinator_shards or cfg.coordinator.shards) > 1:
                raise ConfigError("--coordinator-shards needs coordinator processes: drop --inprocess")
            summary = runs.run_simulate_inprocess(cfg, islands, quiet=args.quiet)
        else:
            from dtrain_cli.fault_spec import host_device_count, parse_fault
            from dtrain_cli.island_spec import parse_islands
            from dtrain_cli.simulate import run_simulation

            # each worker has the fake CPU devices XLA_FLAGS gives (--host-devices), where it says
            faults = [parse_fault(text, islands, host_device_count()) for text in args.faults]
            # --link: every island's link, as island specs (an --island NAME:link=... of its own comes later: it wins)
            links = [f"island-{i}:link={args.link}" for i in range(islands)] if args.link else []
            if args.link:
                from dtrain_cli.link_proxy import LinkError, parse_link

                try:
                    parse_link(args.link)
                except LinkError as e:
                    raise ConfigError(f"--link: {e}") from None
            from dtrain_cli.simulate_report import Interrupted

            try:
                summary = run_simulation(cfg, islands, quiet=args.quiet, pin=not args.no_pin, faults=faults,
                                         island_processes=args.island_processes, own_tokens=args.island_tokens,
                                         coordinator_shards=args.coordinator_shards,
                                         island_specs=parse_islands(links + args.island_specs, islands, cfg),
                                         resume_dir=args.resume)
            except Interrupted as e:  # Ctrl-C: the partial summary is written; how to go on
                print(f"dtrain simulate: {e}", file=sys.stderr)
                return 130
    if args.command == "simulate":  # a line a person reads; the numbers are all in RUN_DIR/summary.json
        from dtrain_cli.simulate_report import closing_line

        print(closing_line(summary))
        return 0
    print(json.dumps({k: summary[k] for k in ("final_eval_loss", "rounds", "tokens", "bytes_up", "bytes_down",
                                              "wall_s", "run_dir")}))
    return 0


def _status(args: argparse.Namespace) -> int:
    """``dtrain status``: the security settings from --config (optional) and the flags; the answer printed."""
    import dataclasses
    import math

    from dtrain_cli.status import fetch, print_status

    if not (math.isfinite(args.wait) and args.wait > 0):
        raise ConfigError(f"--wait: must be a number of seconds > 0, got {args.wait}")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together (mutual TLS needs both)")
    cfg = load_config(args.config)
    flags = {"token_env": args.token_env, "ca": args.tls_ca, "client_cert": args.tls_cert,
             "client_key": args.tls_key, "server_name": args.tls_server_name}
    security = dataclasses.replace(cfg.security, **{k: v for k, v in flags.items() if v is not None})
    cfg = dataclasses.replace(cfg, security=security)
    print_status(fetch(args.coordinator, cfg, args.wait), as_json=args.json)
    return 0


def _service_command(args: argparse.Namespace, cfg: Config) -> int:
    """coordinator / worker: the entry points into coordinator/ and workers/ (imported here only)."""
    from pathlib import Path

    from dtrain.config.load import run_path as run_dir

    if args.command == "coordinator":
        from coordinator.lifecycle import run_coordinator, run_shard
        from coordinator.loading import has_checkpoint

        if args.shards is not None:
            cfg = config_replace(cfg, coordinator={"shards": args.shards})
        if args.insecure:
            cfg = config_replace(cfg, security={"insecure": True})
        if not 0 <= args.shard < cfg.coordinator.shards:
            raise ConfigError(f"--shard {args.shard}: must be in 0..{cfg.coordinator.shards - 1} (coordinator.shards "
                              f"= {cfg.coordinator.shards}; --shards S sets it)")
        # not made here: a start refused by its checks (a port in use, a missing file) leaves no folder behind;
        # the coordinator makes it once they pass
        out = Path(args.run_dir) if args.run_dir else run_dir(cfg)
        from coordinator.grpc_noise import HandshakeFold

        fold = HandshakeFold()
        if cfg.security.server_cert:  # gRPC's own line per failed TLS handshake, folded into one
            fold.install()
        try:
            if args.shard > 0:
                print(json.dumps(run_shard(cfg, args.shard, out, port=args.port)))
                return 0
            resume = args.resume == "always" or (args.resume == "auto" and has_checkpoint(cfg, out))
            summary = run_coordinator(cfg, out, port=args.port, resume=resume, quiet=args.quiet,
                                      after_finish=args.after_finish)
        finally:
            fold.close()  # the handshakes not said yet, while the log's handler is there
        print(json.dumps(summary))
        return 0
    if args.command == "worker":
        from workers.hosts import initialize, resolve_processes

        # jax.distributed starts before anything touches a JAX backend (the device check below does)
        hosts = initialize(resolve_processes(args.num_processes, args.process_id, args.jax_coordinator, os.environ))
        import jax

        from workers.app import run_worker
        from workers.push_faults import Injection, check_device_fault, parse_device_fault

        inject = [Injection.parse(text) for text in args.inject]
        device_fault = parse_device_fault(args.device_fault) if args.device_fault is not None else None
        if device_fault is not None:
            check_device_fault(device_fault, [d.id for d in jax.devices()])
        out = Path(args.run_dir) if args.run_dir else run_dir(cfg) / "islands" / args.island
        summary = run_worker(cfg, args.coordinator, args.island, out, quiet=args.quiet, inject=inject,
                             device_fault=device_fault, hosts=hosts, slowdown=args.slowdown)
        if "run_over" in summary:  # nothing was trained: one line, exit 0
            print(f"dtrain worker: {summary['run_over']}: nothing to do")
            return 0
        print(json.dumps({k: summary[k] for k in ("final_eval_loss", "version", "tokens", "utilization")}))
        return 0
    raise AssertionError(f"not a service command: {args.command}")
