"""The open round, driven with no server at all (coordinator/open_round.py): a push is begin / chunk / finish on
one record, and a pending push lives in one place (coordinator/pending.py), which the ledger and the merger
read."""

from __future__ import annotations

import threading

import grpc
import pytest

from conftest import initial_parameters
from coordinator.app import build_service
from coordinator.pending import PushRecord
from coordinator.refusals import CallRefused
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.wire import RawChunk, frame_chunks
from service_helpers import delta_frame


@pytest.fixture
def service(net_cfg, tmp_path):
    theta, spec = initial_parameters(net_cfg)
    svc = build_service(net_cfg, tmp_path / "coord", theta, spec, quiet=True)
    yield svc
    svc.close()


def _join(svc, name: str):
    with svc.lock:
        record, _ = svc.state.join(name, "cpu", 1, svc.clock())
        return record


def _header(svc, record, push_id: str, frame: bytes, chunk_bytes: int) -> pb.PushHeader:
    crc, chunks = frame_chunks(frame, chunk_bytes)
    return pb.PushHeader(island_id=record.island_id, base_version=0, push_id=push_id, tokens=640, inner_steps=10,
                         cursor_start=0, cursor_end=80, tree_digest=svc.tree_digest, shard_index=record.shard_index,
                         total_bytes=len(frame), chunks=len(chunks), frame_crc32=crc)


def _push(svc, record, push_id: str, seed: int, cut: int | None = None) -> pb.PushDeltaResponse:
    """One push through the open round's calls, as a server would drive them (``cut``: the client goes away after
    that many chunks)."""
    chunk_bytes = svc.cfg.codec.chunk_bytes
    frame = delta_frame(svc.tree_size, seed)[1]
    rec = svc.round.begin(_header(svc, record, push_id, frame, chunk_bytes), None)
    assert isinstance(rec, PushRecord)
    try:
        for i, (data, crc) in enumerate(frame_chunks(frame, chunk_bytes)[1][:cut]):
            svc.round.chunk(rec, RawChunk(i, data, crc))
        if cut is not None:
            raise svc.round.broke(rec)
        return svc.round.finish(rec)
    finally:
        svc.round.close(rec)


def _sum_reads(svc) -> list[str]:
    """The pushes the merger's next outer step would sum."""
    return [p.key for p in svc.merger.pending]


def test_a_push_is_one_record_and_lives_in_one_pending_set(service):
    a, b = _join(service, "a"), _join(service, "b")
    assert service.pending is service.state.ledger.pending  # the ledger's accounting is the set itself
    first = _push(service, a, "p-a", 1)
    assert first.status == pb.PUSH_STATUS_PENDING and first.version == 0
    with service.lock:
        assert list(service.pending) == ["p-a"] and _sum_reads(service) == ["p-a"]
        pushed = service.pending["p-a"]
        assert pushed.admission.status == "accept" and [i.push_id for i, _ in service.state.pending()] == ["p-a"]
        (spooled,) = service.merger.pending
        assert spooled.spool.n == service.tree_size and service.merger.total_weight == pushed.admission.weight
    # A retry of the pending push is answered from its header: no record, nothing received.
    retry = service.round.begin(_header(service, a, "p-a", delta_frame(service.tree_size, 1)[1], 4096), None)
    assert isinstance(retry, pb.PushDeltaResponse) and retry.status == pb.PUSH_STATUS_DUPLICATE
    # An upload that breaks off is discarded: it never joins the round.
    with pytest.raises(CallRefused) as broke:
        _push(service, b, "p-b-cut", 2, cut=1)
    assert not broke.value.record and "truncated" in str(broke.value)
    with service.lock:
        assert list(service.pending) == ["p-a"] and _sum_reads(service) == ["p-a"]
    # The second island's push completes the round: the clock merges it, the reply waits for that.
    done = _push(service, b, "p-b", 3)
    assert done.status == pb.PUSH_STATUS_MERGED and done.version == 1
    with service.lock:
        assert not service.pending and service.merger.pending == [] and service.state.pending() == []
        assert service.state.deltas_merged == 2


def test_a_pending_push_taken_out_unmerged_leaves_every_reader_and_lets_its_spool_go(service):
    """A pending push the round rejects (a round screen, a non-finite step) leaves the one set: the ledger's view and
    the merger's sum no longer hold it, its spool is closed and its parts elsewhere are let go (on_release)."""
    a, b = _join(service, "a"), _join(service, "b")
    _push(service, a, "p-a", 1)
    released: list[str] = []
    with service.lock:
        service.pending.on_release = released.extend
        (spooled,) = service.merger.pending
        (info,) = service.state.reject_pending(["p-a"], "screened out", service.clock())
        assert info.push_id == "p-a" and released == ["p-a"] and spooled.spool.fd == -1
        assert not service.pending and service.merger.pending == [] and service.state.deltas_rejected == 1
    # The round no longer waits for it: the other island's push completes it, merged on its own.
    done = _push(service, b, "p-b", 2)
    assert done.status == pb.PUSH_STATUS_MERGED and done.version == 1
    with service.lock:
        assert not service.pending and service.state.deltas_merged == 1 and service.state.deltas_rejected == 1


def test_a_push_driven_from_another_thread_is_refused_the_same_way(service):
    """Whichever thread drives it, a refusal is a CallRefused the driver answers: an unknown island is NOT_FOUND,
    counted as a refused push, before anything of its payload is read."""
    a = _join(service, "a")
    frame = delta_frame(service.tree_size, 4)[1]
    header = _header(service, a, "ghost", frame, 4096)
    header.island_id = "nobody"
    out: list[BaseException] = []

    def drive() -> None:
        try:
            service.round.begin(header, None)
        except CallRefused as e:
            out.append(e)

    t = threading.Thread(target=drive)
    t.start()
    t.join(30)
    assert len(out) == 1 and isinstance(out[0], CallRefused)
    e = out[0]
    assert e.code == grpc.StatusCode.NOT_FOUND and e.push is not None and e.push.push_id == "ghost"
    with service.lock:
        assert not service.pending and service.merger.pending == []
