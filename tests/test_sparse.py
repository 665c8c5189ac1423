"""dtrain.codec.sparse: top-k selection, 2/4/8-bit values, gap-coded indices, the checks of hostile frames, and
error feedback with a decaying accumulator (SparseLoCo), and the coordinator refusing hostile sparse pushes.
numpy and the coordinator's merger; runs in seconds."""

from __future__ import annotations

import io

import numpy as np
import pytest

from coordinator.merge_types import MergeOptions
from coordinator.merger import Merger
from dtrain import codec
from dtrain.codec import CodecError, ErrorFeedback, decode, dequantize, encode, quantize
from dtrain.config.load import load_config, replace
from dtrain.config.sections import Config, ConfigError

CHUNK = 256
SPARSE = ["sparse2", "sparse4", "sparse8"]


def _x(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


@pytest.mark.parametrize("bits", SPARSE)
@pytest.mark.parametrize("n", [1, 255, 256, 1000, 4097])
def test_round_trip_keeps_the_top_k_of_every_chunk(bits: codec.Bits, n: int) -> None:
    x = _x(n)
    k = codec.kept_per_chunk(0.03, CHUNK)  # 8 of 256
    frame = encode(quantize(x, bits, CHUNK, density=0.03))
    q = decode(frame, expected_n=n, max_count=k)
    assert q.bits == bits and q.block == CHUNK
    got = dequantize(q)
    levels = (1 << codec.SPARSE_BITS[bits]) - 1
    for s in range(0, n, CHUNK):
        chunk = x[s:s + CHUNK]
        kept = np.flatnonzero(got[s:s + CHUNK])
        want = np.sort(np.argsort(-np.abs(chunk), kind="stable")[:min(k, chunk.size)])
        np.testing.assert_array_equal(kept, want)
        scale = np.abs(chunk[kept]).max()
        assert np.abs(got[s + kept] - chunk[kept]).max() <= scale / levels * (1 + 1e-6)
        assert np.all(np.sign(got[s + kept]) == np.sign(chunk[kept]))  # no zero level: a kept entry moves
    assert np.count_nonzero(got) == sum(min(k, n - s) for s in range(0, n, CHUNK))


@pytest.mark.parametrize("bits", SPARSE)
@pytest.mark.parametrize("k", [0, 1, 3, 7, 40])
def test_the_sum_of_chunks_with_equal_counts_is_the_per_entry_sum(bits: codec.Bits, k: int) -> None:
    """``sparse_add``'s 2-D path (every chunk holds the same count: an island's top-k) adds exactly what the
    per-entry path adds, for every value width and a count that fills its last code byte or not; chunks with
    different counts (a masked update, a partial last chunk) take the per-entry path, checked against it too."""
    from dtrain.codec import sparse

    rng = np.random.default_rng(k)
    x = _x(5 * CHUNK + 77, k)
    for masked in (False, True):
        mask = rng.random(x.size) < 0.05 if masked else None
        scales, counts, records = sparse.sparse_quantize_segment(bits, CHUNK, x, k=None if masked else k, mask=mask)
        rec = np.frombuffer(records, np.uint8)
        got = _x(x.size, 99)
        want = got.copy()
        sparse.sparse_add(bits, CHUNK, scales, counts, rec, got, weight=0.3)
        chunk_of, _, within, codes, _ = sparse._unpack(bits, counts, rec)  # the per-entry path, by hand
        want[chunk_of * CHUNK + within] += sparse._level_table(bits)[codes] * (scales * np.float32(0.3))[chunk_of]
        assert np.array_equal(got, want)
        if not masked:  # the partial last chunk keeps k of its 77 values too: every count is k
            assert counts.min() == counts.max() == k or k == 0


def test_a_zero_vector_and_an_empty_one_round_trip() -> None:
    np.testing.assert_array_equal(dequantize(decode(encode(quantize(np.zeros(1000, np.float32), "sparse2",
                                                                    CHUNK)))), 0)
    assert dequantize(decode(encode(quantize(np.zeros(0, np.float32), "sparse2", CHUNK)))).size == 0


def test_bits_per_kept_value_and_the_density_bound() -> None:
    """At 2% of 4096-value chunks, a 2-bit frame costs under 16 + 2 bits per kept value (gaps squeezed by zstd),
    and a receiver that allows fewer entries per chunk refuses it."""
    x = _x(1 << 18)
    q = quantize(x, "sparse2", 4096, density=0.02)
    frame = encode(q)
    kept = codec.kept_per_chunk(0.02, 4096) * (x.size // 4096)
    assert 8 * len(frame) / kept < 16
    decode(frame, max_count=82)
    with pytest.raises(CodecError, match=r"sparse payload length \d+ outside .* at most 40 entries per chunk"):
        decode(frame, max_count=40)  # the header's payload length alone is above what 40 per chunk can make


def test_quantize_rejects_bad_sparse_arguments() -> None:
    with pytest.raises(CodecError, match="density must be in"):
        quantize(_x(100), "sparse2", CHUNK, density=0)
    with pytest.raises(CodecError, match="at most 32768"):
        quantize(_x(100), "sparse2", 65536)
    with pytest.raises(CodecError, match="non-finite"):
        quantize(np.array([1.0, np.nan], np.float32), "sparse2", CHUNK)
    with pytest.raises(CodecError, match="sparse value bits must be 2, 4 or 8"):
        codec.sparse_scheme(3)


# --------------------------------------------------------------------------- hostile frames


def _frame(counts: list[int], records: bytes, scales: list[float] | None = None, n: int = 2 * CHUNK,
           bits: codec.Bits = "sparse2", chunk: int = CHUNK) -> bytes:
    """A sparse frame with exactly this body, sealed (CRC, lengths) so only the intended fault remains."""
    n_chunks = -(-n // chunk)
    sc = np.array(scales if scales is not None else [1.0] * n_chunks, np.float32)
    payload = np.frombuffer(np.array(counts, "<u2").tobytes() + records, np.uint8)
    out = io.BytesIO()
    codec.write_frame(out, bits, chunk, n, sc, [payload], payload_size=payload.size)
    return out.getvalue()


def _record(indices_or_gaps: list[int], codes: list[int], gaps: bool = False) -> bytes:
    """One chunk's record: its gaps (from indices unless ``gaps``) as u16, then 2-bit codes packed."""
    gap = list(indices_or_gaps) if gaps else [indices_or_gaps[0]] + [
        (b - a) & 0xFFFF for a, b in zip(indices_or_gaps, indices_or_gaps[1:], strict=False)]
    packed = bytearray((len(codes) * 2 + 7) // 8)
    for i, c in enumerate(codes):
        packed[i // 4] |= c << (2 * (i % 4))
    return np.array(gap, "<u2").tobytes() + bytes(packed)


def test_the_hand_made_frame_is_what_the_encoder_writes() -> None:
    x = np.zeros(2 * CHUNK, np.float32)
    x[[3, 10]] = [1.0, -1.0]
    x[[CHUNK + 5, CHUNK + 200]] = [-1.0, 1.0]
    frame = _frame([2, 2], _record([3, 10], [3, 0]) + _record([5, 200], [0, 3]))
    assert frame == encode(quantize(x, "sparse2", CHUNK, density=2 / CHUNK))
    np.testing.assert_array_equal(dequantize(decode(frame)), x)


GOOD = _record([5, 200], [0, 3])


HOSTILE = [  # (counts, records, scales, the reason): each body holds one fault
    ([2, 2], _record([3, 256], [1, 1]) + GOOD, None, r"chunk 0: index 256 out of range \[0, 256\)"),
    ([2, 2], _record([300, 1], [1, 1], gaps=True) + GOOD, None, r"chunk 0: index 300 out of range"),
    ([2, 2], _record([7, 7], [1, 1]) + GOOD, None, r"chunk 0: duplicate index 7"),
    ([2, 2], GOOD + _record([9, 4], [1, 1]), None, r"chunk 1: index \d+ out of range.*sorted and unique"),  # unsorted
    ([3, 1], _record([1, 2, 3], [1, 1, 1]) + _record([5], [0]), None, r"chunk 0 holds 3 entries, above the 2 per "),
    ([257, 0], b"", None, r"chunk 0 claims 257 entries, more than its 256 values"),
    ([2, 2], _record([3, 10], [1, 1]) + GOOD, [float("nan"), 1.0], r"invalid scale .*nan.* for block 0"),
    ([2, 2], _record([3, 10], [1, 1]) + GOOD, [1.0, float("inf")], r"invalid scale .*inf.* for block 1"),
    ([2, 2], _record([3, 10], [1, 1]) + GOOD, [-1.0, 1.0], r"invalid scale .*-1.0.* for block 0"),
    ([2, 1], _record([3, 10], [1, 1]) + GOOD, None, r"the counts make a \d+-byte payload, the header declares"),
    ([2, 2], _record([3, 10], [1, 1])[:-1] + bytes([0x45]) + GOOD, None, r"chunk 0: padding bits .* must be 0"),
]


@pytest.mark.parametrize("counts, records, scales, match", HOSTILE)
def test_hostile_frames_are_refused_with_a_reason(counts, records, scales, match: str) -> None:
    frame = _frame(counts, records, scales)
    with pytest.raises(CodecError, match=match):
        decode(frame, expected_n=2 * CHUNK, max_count=2)


@pytest.mark.parametrize("counts, records, scales, match", HOSTILE)
def test_the_coordinator_refuses_a_hostile_push_and_commits_nothing(counts, records, scales, match: str) -> None:
    """Through the coordinator's merger (its spool validates the frame as it arrives): the reason is raised,
    nothing is pending, θ and the version are unchanged, and an honest push still merges after it."""
    cfg = replace(Config(), codec={"up": "sparse", "down": "sparse", "sparse_chunk": CHUNK,
                                   "density": 2 / CHUNK},
                  coordinator={"mode": "sync", "merge_rule": "mean"}, outer={"rule": "sparseloco"})
    theta = _x(2 * CHUNK, 7)
    m = Merger(theta.copy(), MergeOptions.from_config(cfg))
    try:
        assert m.opts.max_count == 2
        with m.spool() as sp, pytest.raises(CodecError, match=match):
            sp.write(_frame(counts, records, scales))
            m.validate(sp)
            m.add_pending(sp, 1.0)
        assert m.pending_count == 0 and m.version == 0
        np.testing.assert_array_equal(m.theta, theta)
        with m.spool() as sp:  # the merger is still whole
            sp.write(_frame([2, 2], _record([3, 10], [3, 0]) + GOOD))
            m.validate(sp)
            m.add_pending(sp, 1.0)
        m.outer_step()
        assert m.version == 1 and np.count_nonzero(m.theta - theta) == 4
    finally:
        m.close()


def test_hostile_headers_are_refused() -> None:
    frame = _frame([2, 2], _record([3, 10], [1, 1]) + GOOD)
    with pytest.raises(CodecError, match=r"sparse payload length \d+ outside"):
        decode(frame, max_count=1)  # more bytes than 1 entry per chunk can make
    with pytest.raises(CodecError, match="sparse chunk 65536 out of range"):
        decode(_frame([0], b"", [1.0], n=10, chunk=65536))
    with pytest.raises(CodecError, match="frame truncated"):
        decode(frame[:-3])
    with pytest.raises(CodecError, match="needs payload_size"):
        codec.write_frame(io.BytesIO(), "sparse2", CHUNK, 10, np.ones(1, np.float32), [b"\0\0"])


@pytest.mark.parametrize("piece", [1, 7, 100, 1 << 20])
def test_the_validator_hands_out_the_checked_body_in_pieces(piece: int) -> None:
    x = _x(5000, 4)
    frame = encode(quantize(x, "sparse4", CHUNK, density=0.05))
    body = bytearray()
    v = codec.FrameValidator(5000, "sparse4", CHUNK, out=body.extend, out_piece=piece, max_count=13)
    for s in range(0, len(frame), piece):
        v.feed(frame[s:s + piece])
    v.finish()
    q = decode(frame)
    assert bytes(body) == q.scales.tobytes() + q.payload.tobytes()
    assert v.sparse is not None
    assert v.sparse.norm == pytest.approx(float(np.linalg.norm(dequantize(q))), rel=1e-6)


# --------------------------------------------------------------------------- error feedback


@pytest.mark.parametrize("decay", [1.0, 0.9])
def test_error_feedback_conserves_mass(decay: float) -> None:
    """Each round: sent + new residual == delta + decay·residual (what was not sent is kept, exactly off the kept
    entries); over rounds with decay 1 the sum sent trails the sum of deltas by the last residual."""
    n = 3000
    ef = ErrorFeedback(n, "sparse2", CHUNK, decay=decay, density=0.02)
    total_sent = np.zeros(n, np.float64)
    total_in = np.zeros(n, np.float64)
    for r in range(6):
        delta = _x(n, r)
        before = ef.residual.copy()
        sent = dequantize(ef.compress(delta))
        corrected = delta + before * np.float32(decay)
        np.testing.assert_allclose(sent + ef.residual, corrected, rtol=0, atol=1e-6)
        off = sent == 0
        np.testing.assert_array_equal(ef.residual[off], corrected[off])
        total_sent += sent
        total_in += delta
    if decay == 1.0:
        np.testing.assert_allclose(total_sent + ef.residual, total_in, atol=1e-5)


def test_error_feedback_rejects_bad_decay() -> None:
    with pytest.raises(CodecError, match="decay must be in"):
        ErrorFeedback(10, "sparse2", CHUNK, decay=0.0)


def test_the_config_checks_the_sparse_fields() -> None:
    cfg = load_config("tiny", ["codec.up=sparse", "codec.sparse_bits=4", "codec.sparse_chunk=1024"])
    assert cfg.codec.scheme("sparse") == ("sparse4", 1024)
    assert cfg.codec.scheme("int8") == (8, cfg.codec.block)
    for bad, match in [("codec.density=0", "density"), ("codec.density=1.5", "density"),
                       ("codec.sparse_chunk=65536", "sparse_chunk"), ("codec.sparse_bits=3", "sparse_bits"),
                       ("outer.sparseloco_beta=0", "sparseloco_beta"), ("outer.rule=adam", "rule"),
                       ("codec.down_density=-0.1", "down_density"), ("codec.down_density=1.5", "down_density")]:
        with pytest.raises(ConfigError, match=match):
            load_config("tiny", [bad])


@pytest.mark.parametrize("bits", SPARSE)
@pytest.mark.parametrize("dist", ["normal", "t2"])
def test_fitted_scale_beats_the_largest_magnitude(bits: codec.Bits, dist: str) -> None:
    rng = np.random.default_rng(3)
    n, chunk, density = 16 * 4096, 4096, 0.02
    x = (rng.standard_normal(n) if dist == "normal" else rng.standard_t(2, n)).astype(np.float32)
    q = quantize(x, bits, chunk, density=density)
    got = dequantize(decode(encode(q), expected_n=n))
    kept = got != 0
    levels = (1 << codec.SPARSE_BITS[bits]) - 1
    fitted_err, max_err = 0.0, 0.0
    for c in range(n // chunk):
        sel = np.flatnonzero(kept[c * chunk:(c + 1) * chunk]) + c * chunk
        v, s, largest = x[sel].astype(np.float64), float(q.scales[c]), float(np.abs(x[sel]).max())
        assert 0 < s <= largest  # fitted below the largest kept magnitude, never above
        assert set(np.round(np.abs(got[sel]) / s * levels).astype(int)) <= set(range(1, levels + 1, 2))
        assert np.all(np.sign(got[sel]) == np.sign(v))  # no zero level: a kept entry moves
        odd = np.clip(2 * np.floor(np.abs(v) / largest * levels / 2) + 1, 1, levels)  # nearest level, s = largest
        max_err += float(np.sum((np.abs(v) - odd * largest / levels) ** 2))
        fitted_err += float(np.sum((got[sel] - v) ** 2))
    assert fitted_err <= max_err * (1 + 1e-6)
    if bits == "sparse2":  # the inner level sits where the top 2% are: far less error than the largest's scale
        assert fitted_err < 0.5 * max_err
