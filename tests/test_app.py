"""The worker's composition root (workers/app.py): what it opens is closed, in reverse order, also when the start-up
fails half way; and "one coordinator or a sharded one" is chosen in one place, by choosing which parts to build."""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path

import numpy as np
import pytest

from dtrain.config.load import replace
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.train import fragments
from workers.app import build_worker, coordinator_link
from workers.client import CoordinatorClient
from workers.exchange import Puller, ShardFrames, Uplink, WorkerError
from workers.links import OneCoordinator, ShardedCoordinator
from workers.push_faults import Injection
from workers.shard_links import ShardedPuller, ShardedPush, ShardedUplink

WORKERS = Path(__file__).resolve().parent.parent / "workers"
NOWHERE = "127.0.0.1:1"  # a client is made without a call: nothing listens here, nothing is asked


HEADER = pb.PushHeader(island_id="i", base_version=0, push_id="i-1", fragment=0)


def _quiet(*_args: object, **_kwargs: object) -> None:
    return None


def _sharded(cfg, tmp_path: Path):
    (tmp_path / "secret").write_text("0123456789abcdef0123456789abcdef")
    return replace(cfg, coordinator={"shards": 2, "merge_rule": "mean", "shard_secret_file": str(tmp_path / "secret")})


def _open_files(under: Path) -> list[str]:
    """The files under ``under`` this process holds open (Linux: /proc/self/fd)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(under)):
                out.append(target)
    return out


def _closed(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage().removeprefix("closing the ") for r in caplog.records if r.name == "workers.app"]


def test_a_start_up_failing_half_way_closes_what_it_had_opened(net_cfg, tmp_path, caplog) -> None:
    """Push faults with a sharded coordinator are refused once the island knows its θ (after the run log and the
    client are open, before the link and the checkpointer): the two opened are closed, the last opened first, and
    the island's events file is not left open."""
    cfg = _sharded(net_cfg, tmp_path)
    run_dir = tmp_path / "island-a"
    caplog.set_level(logging.DEBUG, logger="workers.app")
    with pytest.raises(WorkerError, match="not built yet"), contextlib.ExitStack() as stack:
        build_worker(stack, cfg, NOWHERE, "a", run_dir, quiet=True, inject=[Injection.parse("nan@v1")])
    assert _closed(caplog) == ["coordinator client", "run log"]
    assert (run_dir / "events.jsonl").exists() and _open_files(run_dir) == []
    assert not (run_dir / "checkpoints").exists()  # never reached


def test_a_built_worker_closes_every_part_in_reverse_order(net_cfg, tmp_path, caplog) -> None:
    """A worker built and never run: leaving its stack stops its threads first and closes the rest in the reverse
    order of opening, the run log last."""
    run_dir = tmp_path / "island-a"
    caplog.set_level(logging.DEBUG, logger="workers.app")
    with contextlib.ExitStack() as stack:
        worker = build_worker(stack, net_cfg, NOWHERE, "a", run_dir, quiet=True)
        assert isinstance(worker.link, OneCoordinator) and _closed(caplog) == []
        assert _open_files(run_dir)  # the events file, at least
    assert _closed(caplog) == ["heartbeats", "telemetry", "checkpointer", "coordinator link", "coordinator client",
                               "run log"]
    assert worker.mailbox.stopping.is_set() and _open_files(run_dir) == []


def test_one_coordinator_or_a_sharded_one_is_chosen_in_one_place(net_cfg, tmp_path) -> None:
    """coordinator_link builds one kind or the other, each with its own puller and uplink; the uplink hands back
    the client that sends its frames (the coordinator's own, or the sharded push to every shard). Nothing else in
    workers/ builds either kind."""
    n = 1000
    client = CoordinatorClient(NOWHERE, net_cfg)
    try:
        one = coordinator_link(net_cfg, client, n, (), (), (), _quiet)
        assert isinstance(one, OneCoordinator) and type(one.puller) is Puller and type(one.uplink) is Uplink
        delta = np.full(n, 1e-3, np.float32)
        frame, sender = one.uplink.frame(delta, HEADER)
        assert sender is client and not isinstance(frame, ShardFrames)

        ranges = fragments.plan([400, 600], 2)
        sharded_cfg = _sharded(net_cfg, tmp_path)
        two = coordinator_link(sharded_cfg, client, n, (), ranges, (), _quiet)
        assert isinstance(two, ShardedCoordinator)
        assert isinstance(two.puller, ShardedPuller) and isinstance(two.uplink, ShardedUplink)
        frame, sender = two.uplink.frame(delta, HEADER)
        assert isinstance(sender, ShardedPush) and isinstance(frame, ShardFrames) and len(frame.frames) == 2
        with pytest.raises(WorkerError, match="not built yet"):
            coordinator_link(sharded_cfg, client, n, (), ranges, [Injection.parse("nan@v1")], _quiet)
    finally:
        client.close()
    builders = re.compile(r"(?<!class )\b(OneCoordinator|ShardedCoordinator|ShardedUplink|ShardedPuller|ShardLinks)\(")
    building = sorted(p.name for p in WORKERS.glob("*.py") if builders.search(p.read_text()))
    assert building == ["app.py"]
