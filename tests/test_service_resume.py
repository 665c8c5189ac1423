"""A real coordinator resuming from its checkpoints: the newest good one after damage or a crash mid-write, and
one line per checkpoint when none is good."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest

from dtrain.config.load import replace
from dtrain.errors import CheckpointError
from dtrain.net.proto import dtrain_pb2 as pb
from service_helpers import JoinTwo, Running, delta_frame, join_island, push_header
from workers.client import CoordinatorClient


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
