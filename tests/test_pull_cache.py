"""coordinator/pull_cache.py: a frame's chunk messages built once and served to every pull of it, byte for byte the
uncached stream; never a stale entry for a frame written again; bounded memory, none held once no pull streams.
And through a real coordinator: every island's pull of a version gets the frame on disk."""

from __future__ import annotations

import os
import threading
import zlib
from pathlib import Path

import grpc
import numpy as np
import pytest

from coordinator.merge_types import Update
from coordinator.pull_cache import PullCache
from dtrain import codec
from dtrain.config.load import replace
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.proto import dtrain_pb2_grpc as pb_grpc
from dtrain.net.wire import file_chunk_messages
from service_helpers import Running, delta_frame, join_island, push_header
from workers.client import CoordinatorClient

PIECE = 4096


def _write(path: Path, data: bytes, version: int = 1) -> Update:
    """A frame file written as the merger writes one (a .tmp renamed into place), and its Update."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return Update(version=version, base_version=version - 1, path=path, size=len(data), crc32=zlib.crc32(data),
                  params_digest=f"d{version}")


def _uncached(update: Update, piece: int = PIECE) -> list[bytes]:
    return list(file_chunk_messages(update.open(), piece))


def test_cached_pull_is_byte_identical_to_the_uncached_stream_and_built_once(tmp_path):
    data = np.random.default_rng(0).bytes(10 * PIECE + 123)
    update = _write(tmp_path / "update-00000001.frame", data)
    cache = PullCache(1 << 20)
    first_pull, second_pull = cache.messages(update, update.open(), PIECE), cache.messages(update, update.open(), PIECE)
    first = [next(first_pull)]  # both pulls are streaming at once
    second = list(second_pull)
    first += list(first_pull)
    assert first == second == _uncached(update) and len(first) == 11
    assert cache.builds == 1 and cache.hits == 1
    assert all(a is b for a, b in zip(first, second, strict=True))  # the same bytes objects: no copy per pull
    assert len(cache) == 0 and cache.held_bytes == 0  # no pull streams it any more: dropped
    # Another piece size is another stream (its own entry), still the uncached one.
    assert list(cache.messages(update, update.open(), 1000)) == _uncached(update, 1000) and cache.builds == 2


def test_concurrent_pulls_of_a_frame_build_it_once(tmp_path):
    data = np.random.default_rng(1).bytes(64 * PIECE)
    update = _write(tmp_path / "update-00000001.frame", data)
    cache = PullCache(1 << 20)
    results: list[list[bytes]] = [[] for _ in range(8)]
    start, streaming = threading.Barrier(8), threading.Barrier(8)

    def pull(i: int) -> None:
        start.wait()
        stream = cache.messages(update, update.open(), PIECE)
        results[i] = [next(stream)]
        streaming.wait()  # all 8 pulls are streaming the frame at once
        results[i] += list(stream)

    threads = [threading.Thread(target=pull, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = _uncached(update)
    assert all(r == expected for r in results)
    assert cache.builds == 1 and cache.hits == 7 and len(cache) == 0


def test_a_frame_written_again_is_never_served_from_the_stale_entry(tmp_path):
    """The lossless θ frame of a version is written at a fixed path; a restart, or a later write of the same
    version's file, puts other bytes there (a new file, a new Update). While a pull still streams the old bytes
    (its entry alive), a pull of the new frame gets the new bytes."""
    path = tmp_path / "theta-00000003.frame"
    rng = np.random.default_rng(2)
    old_data = rng.bytes(5 * PIECE)
    old = _write(path, old_data, version=3)
    cache = PullCache(1 << 20)
    stale_pull = cache.messages(old, old.open(), PIECE)
    stale = [next(stale_pull)]  # the old frame's entry is alive from here on
    new = _write(path, rng.bytes(5 * PIECE), version=3)  # same version, path and size: other bytes
    served = list(cache.messages(new, new.open(), PIECE))
    assert served == _uncached(new) and served[0] != stale[0]
    # Even the old Update object, its file now written over, does not get the old entry's bytes.
    assert list(cache.messages(old, old.open(), PIECE)) == _uncached(new)
    # Written in place (same inode) under the same Update, with a new modification time: rebuilt too.
    again = rng.bytes(5 * PIECE)
    new_pull = cache.messages(new, new.open(), PIECE)
    next(new_pull)
    with open(path, "r+b") as f:
        f.write(again)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert b"".join(m[-PIECE:] for m in cache.messages(new, new.open(), PIECE)) == again
    assert cache.builds == 5 and cache.hits == 0  # each of the five pulls above met other bytes
    # The pull that started on the old bytes ends on them: a frame is not spliced from two files.
    stale += list(stale_pull)
    assert b"".join(m[-PIECE:] for m in stale) == old_data and len(stale) == 5
    new_pull.close()
    assert len(cache) == 0
    # A file whose size is not the recorded one is refused rather than cached.
    path.write_bytes(b"short")
    with pytest.raises(OSError, match="bytes on disk"):
        list(cache.messages(new, new.open(), PIECE))
    assert len(cache) == 0


def test_the_cache_holds_at_most_its_budget_and_streams_the_rest_from_disk(tmp_path):
    rng = np.random.default_rng(3)
    updates = [_write(tmp_path / f"update-{v:08d}.frame", rng.bytes(10 * PIECE), version=v) for v in range(1, 5)]
    budget = int(2.5 * PullCache(0).cost(updates[0], PIECE))
    cache = PullCache(budget)
    pulls = [cache.messages(u, u.open(), PIECE) for u in updates]
    firsts = [next(p) for p in pulls]  # four frames streaming at once: two fit
    assert len(cache) == 2 and cache.held_bytes <= budget and cache.builds == 2 and cache.uncached == 2
    for u, first, p in zip(updates, firsts, pulls, strict=True):
        assert [first, *p] == _uncached(u)  # cached or not, the same stream
    assert len(cache) == 0 and cache.held_bytes == 0
    big = _write(tmp_path / "theta-00000004.frame", rng.bytes(budget + 1), version=4)
    assert list(cache.messages(big, big.open(), PIECE)) == _uncached(big)
    assert cache.builds == 2 and cache.uncached == 3  # bigger than the budget: streamed from its file
    off = PullCache(0)
    assert list(off.messages(updates[1], updates[1].open(), PIECE)) == _uncached(updates[1])
    assert len(off) == 0 and off.builds == 0


def test_every_islands_pull_of_a_version_is_the_frame_on_disk(net_cfg, tmp_path):
    """A real coordinator: two islands pull the same update frame and the same lossless θ through the cache; what
    both receive is the frame on disk, chunk by chunk with the right CRCs, and nothing stays cached after."""
    cfg = replace(net_cfg, codec={"chunk_bytes": 65536}, coordinator={"max_message_bytes": 1 << 20})
    running = Running(cfg, tmp_path / "coord")
    try:
        clients = [CoordinatorClient(running.address, cfg) for _ in range(2)]
        joins = [join_island(c, f"isl-{i}") for i, c in enumerate(clients)]
        n = joins[0].tree_size
        for i, (c, j) in enumerate(zip(clients, joins, strict=True)):
            c.push(push_header(j, f"p{i}"), delta_frame(n, i)[1])
        stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(running.address))
        service = running.service
        for full in (False, True):
            got = [list(stub.PullGlobal(pb.PullRequest(island_id=j.island_id, have_version=0, full=full),
                                        timeout=10)) for j in joins]
            assert got[0] == got[1]
            header, chunks = got[0][0].header, [m.chunk for m in got[0][1:]]
            assert header.version == 1 and header.kind == (pb.PULL_KIND_FULL if full else pb.PULL_KIND_UPDATE)
            frame = b"".join(c.data for c in chunks)
            assert all(c.crc32 == zlib.crc32(c.data) for c in chunks) and zlib.crc32(frame) == header.frame_crc32
            with service.lock:
                update = service.merger.full_update() if full else service.merger.updates_since(0)[0]
            assert frame == update.frame
        assert service.pull_cache.builds >= 2 and len(service.pull_cache) == 0  # nothing held once pulls end
        theta = codec.dequantize(codec.decode(frame, expected_n=n))
        assert codec.params_digest(theta) == service.merger.digest
        for c in clients:
            c.close()
    finally:
        running.stop()
