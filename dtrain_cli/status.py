"""``dtrain status``: ask a coordinator how its run is going; a table for people, ``--json`` for tools.

The table is built once (:func:`sections`: summary lines, then titled tables of plain strings) and drawn with
``rich`` on a terminal, or as plain aligned text when stdout is a pipe or a file. ``--json`` prints
:func:`dtrain.status_doc.message_dict` of the same Status message (numbers as numbers, every field present), the
document the coordinator's dashboard serves. A coordinator that does not answer is an error within ``--wait``
seconds (5 by default) naming the address, never a long silence.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from typing import TextIO

from dtrain.config.sections import Config
from dtrain.errors import DtrainError
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.runlog import fmt_bytes, printable
from dtrain.status_doc import message_dict
from dtrain_cli.logs import is_terminal

SHOW_ROUNDS = 5  # the latest rounds the table shows (the message holds up to 500)
SHOW_FAULTS = 5  # the latest faults the table shows


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)
    right: frozenset[int] = frozenset()  # the columns of numbers, right-aligned


def fetch(address: str, cfg: Config, wait_s: float) -> pb.StatusResponse:
    """The coordinator's Status, within ``wait_s`` seconds; DtrainError says why not, naming the address."""
    from dtrain.net.probe import listening
    from workers.client import RETRYABLE, CoordinatorClient, CoordinatorError, PlaintextAtTls, in_words

    client = CoordinatorClient(address, cfg)  # checks the address first
    if listening(address, timeout_s=min(wait_s, 2.0)) is False:  # refused: no need to wait for it
        client.close()
        raise DtrainError(f"no coordinator answers at {address} (connection refused: nothing listens there): is it "
                          f"running? check --coordinator")
    try:
        return client.status(within_s=wait_s)
    except PlaintextAtTls as e:
        raise DtrainError(e.message) from None
    except CoordinatorError as e:
        if e.code in RETRYABLE:
            words = in_words(e.details)
            raise DtrainError(f"no coordinator answers at {address} (waited {wait_s:g}s; {e.code.name}"
                              f"{', ' + words if words else ''}): is it running? check --coordinator") from None
        if e.code.name == "UNAUTHENTICATED":
            raise DtrainError(f"the coordinator at {address} refused the call: {e.message}; give the token in the "
                              f"environment variable {cfg.security.token_env or '(none)'} (--token-env NAME "
                              f"names another)") from None
        raise DtrainError(f"the coordinator at {address} refused the call: {e}") from None
    finally:
        client.close()


def _int(n: int) -> str:
    return f"{n:,}"


def _loss(x: float) -> str:
    return f"{x:.4f}" if math.isfinite(x) else str(x)


def _ago(st: pb.StatusResponse, t: float) -> str:
    """How long before the coordinator's answer ``t`` was (the coordinator's clock: no skew with ours)."""
    return f"{max(st.now - t, 0.0):.0f}s ago" if t else "-"


def summary_lines(st: pb.StatusResponse) -> list[str]:
    """The run in a few lines: progress (version x of y, or tokens), loss, the open round, rounds, bytes, drops."""
    state = f"over: {st.run_over}" if st.run_over else "stopped" if st.stopped else "running"
    lines = [f"run {st.run_id} ({st.mode} mode): {state}"]
    tokens = f"tokens merged {_int(st.tokens_merged)}"
    if st.tokens_total:
        tokens += f" of {_int(st.tokens_total)} ({st.tokens_merged / st.tokens_total:.0%})"
    if st.total_versions:
        lines.append(f"version {st.version} of {st.total_versions}; {tokens}")
    else:
        lines.append(f"version {st.version} (the data decides the last one); {tokens}")
    if st.HasField("eval_loss"):
        last = f" (version {st.evals[-1].version}, {_int(st.evals[-1].tokens)} tokens)" if st.evals else ""
        checked = "" if st.eval_confirmed else "; unconfirmed: one island's report, no second to check it"
        lines.append(f"global eval loss {_loss(st.eval_loss)}{last}{checked}")
    else:
        lines.append("global eval loss: none yet")
    if st.HasField("round"):
        r = st.round
        deadline = f", acts in {r.deadline_s:.1f}s" if r.HasField("deadline_s") else ""
        lines.append(f"open round (to version {r.target_version}): {r.pending} push{'es' * (r.pending != 1)} "
                     f"pending, {'ready' if r.ready else 'not ready'}{': ' + r.reason if r.reason else ''}{deadline}")
    lines.append(f"rounds: {len(st.rounds)} recorded, {st.merge_s:.2f}s merging in all; bytes in "
                 f"{fmt_bytes(st.bytes_in)}, out {fmt_bytes(st.bytes_out)}")
    lines.append(f"deltas: {st.deltas_merged} merged, {st.deltas_dropped} dropped, {st.deltas_rejected} rejected, "
                 f"{st.duplicates} duplicates; {st.pushes_refused} pushes refused; {len(st.faults)} faults recorded")
    if st.refusals or st.islands_forgotten:  # counted in full, logged at a bounded rate (coordinator.refusal_events)
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(st.refusals.items(), key=lambda kv: (-kv[1], kv[0])))
        lines.append(f"refused calls: {sum(st.refusals.values())}{f' ({kinds})' if kinds else ''}; "
                     f"{st.islands_forgotten} lost islands forgotten (coordinator.forget_after_s)")
    return lines


def sections(st: pb.StatusResponse) -> tuple[list[str], list[Table]]:
    """The summary lines and the tables (islands, latest rounds, latest faults) as plain strings, every control
    character escaped (``dtrain.runlog.printable``): what islands sent reaches the terminal as text, never as an
    escape sequence."""
    lines, tables = _sections(st)
    for t in tables:
        t.rows = [[printable(c) for c in row] for row in t.rows]
    return [printable(line) for line in lines], tables


def _sections(st: pb.StatusResponse) -> tuple[list[str], list[Table]]:
    # quar.: the devices the island quarantined; seen: seconds since its last call
    islands = Table("islands", ["island", "state", "shard", "cursor", "version", "steps/s", "tokens", "loss", "util",
                                "devices", "quar.", "seen"], right=frozenset(range(2, 12)))
    for i in st.islands:
        devices = f"{i.devices} {i.hardware}".strip()
        islands.rows.append([
            i.name, i.state, str(i.shard_index), _int(i.cursor), str(i.version), f"{i.steps_per_s:.2f}", _int(i.tokens),
            _loss(i.train_loss) if i.HasField("train_loss") else "-", f"{i.utilization:.0%}", devices,
            str(len(i.quarantined)), f"{i.last_seen_s:.1f}s"])
    rounds = Table(f"rounds (latest {SHOW_ROUNDS})", ["version", "pushes", "tokens", "bytes in", "merge s",
                                                     "max staleness", "merged"], right=frozenset(range(7)))
    for r in st.rounds[-SHOW_ROUNDS:]:
        rounds.rows.append([str(r.version), str(r.pushes), _int(r.tokens), fmt_bytes(r.bytes_in), f"{r.merge_s:.2f}",
                            f"{r.max_staleness:g}", _ago(st, r.t)])
    faults = Table(f"faults (latest {SHOW_FAULTS})", ["when", "kind", "island", "detail"])
    for f in st.faults[-SHOW_FAULTS:]:
        faults.rows.append([_ago(st, f.t), f.kind, f.island_id or "-", f.detail])
    return summary_lines(st), [t for t in (islands, rounds, faults) if t.rows]


def plain(lines: list[str], tables: list[Table]) -> str:
    """Plain text: the lines, then each table with aligned columns (no colour, no box drawing)."""
    out = list(lines)
    for t in tables:
        widths = [max(len(c) for c in col) for col in zip(t.headers, *t.rows, strict=False)]
        out += ["", f"{t.title}:"]
        for row in (t.headers, *t.rows):
            cells = [c.rjust(w) if i in t.right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths,
                                                                                              strict=True))]
            out.append("  ".join(cells).rstrip())
    return "\n".join(out)


def print_status(st: pb.StatusResponse, as_json: bool, stream: TextIO | None = None) -> None:
    """``--json``: the message as plain JSON; else the table: rich on a terminal, plain text otherwise."""
    stream = stream or sys.stdout
    if as_json:
        print(json.dumps(message_dict(st), indent=2), file=stream)
        return
    lines, tables = sections(st)
    if not is_terminal(stream):
        print(plain(lines, tables), file=stream)
        return
    from rich import box
    from rich.console import Console
    from rich.table import Table as RichTable
    from rich.text import Text

    console = Console(file=stream, highlight=False)
    for line in lines:
        console.print(line, markup=False)
    for t in tables:
        # no padding: the box's one-space column divider only, so the islands' table fits 80 columns
        table = RichTable(title=Text(t.title), title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 0),
                          pad_edge=False)
        for i, h in enumerate(t.headers):
            table.add_column(h, justify="right" if i in t.right else "left")
        for row in t.rows:
            table.add_row(*(Text(c) for c in row))  # Text: a detail's "[...]" is not rich markup
        console.print(table)
