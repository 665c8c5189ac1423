"""The mask codec (``codec.up``/``down = "mask"``, scheme "mask2", ``dtrain.codec.masked``): index-free shared
selection. Its selection, round trip, frames, hostile frames, error feedback, config and the merger's use of it;
the end-to-end run in process mode is in tests/test_simulate_processes.py."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest

from coordinator.merge_types import MergeOptions
from coordinator.merger import Merger
from dtrain import codec
from dtrain.codec import CodecError, ErrorFeedback, decode, dequantize, encode, quantize
from dtrain.codec import masked as M
from dtrain.config.load import load_config, replace
from dtrain.config.sections import Config, ConfigError

CHUNK = 256


def _x(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


@pytest.mark.parametrize("density, period", [(0.2, 5), (0.25, 4), (0.5, 2), (1.0, 1)])
def test_consecutive_seeds_partition_the_values(density: float, period: int) -> None:
    """Seeds v, v+1, …, v+P−1 at density 1/P keep every value exactly once, and each chunk holds its share."""
    n, code = 10_007, M.density_code(density)
    masks = [M.keep_mask(v, code, 0, n) for v in range(17, 17 + period)]
    np.testing.assert_array_equal(np.sum(masks, axis=0), np.ones(n))
    counts = M.chunk_counts(17, code, n, CHUNK)
    assert counts.sum() == masks[0].sum()
    full = counts[:-1]
    assert full.min() >= math.floor(density * CHUNK) - 2 and full.max() <= math.ceil(density * CHUNK) + 2


def test_a_slab_of_the_mask_is_the_whole_masks_slab() -> None:
    code = M.density_code(0.3)
    whole = M.keep_mask(5, code, 0, 5000)
    np.testing.assert_array_equal(M.keep_mask(5, code, 1024, 3072), whole[1024:3072])
    assert not np.array_equal(M.keep_mask(6, code, 0, 5000), whole)


@pytest.mark.parametrize("n", [1, 255, 256, 1000, 4097])
def test_round_trip_sends_the_masked_values_in_two_bits(n: int) -> None:
    x = _x(n, n)
    q = quantize(x, "mask2", CHUNK, density=0.25, seed=3)
    y = dequantize(decode(encode(q), expected_n=n))
    keep = M.keep_mask(3, M.density_code(0.25), 0, n)
    assert np.all(y[~keep] == 0)
    for c in range(0, n, CHUNK):  # per chunk: the int2 levels of the chunk's kept values' RMS
        k = keep[c:c + CHUNK]
        if not k.any():
            continue
        rms = np.sqrt(np.mean(np.square(x[c:c + CHUNK][k], dtype=np.float64)))
        want = (np.clip(np.floor(x[c:c + CHUNK][k] / np.float32(rms)) + 2, 0, 3) - 1.5) * np.float32(rms)
        np.testing.assert_allclose(y[c:c + CHUNK][k], want, rtol=1e-6)
    # the frame: 48 header bytes + zstd of (scales, 8 descriptor bytes, 2 bits a kept value), no index
    assert len(encode(q)) <= 48 + 4 * -(-n // CHUNK) + 8 + -(-n // CHUNK) + keep.sum() // 4 + 16


def test_a_zero_vector_and_an_empty_one_round_trip() -> None:
    for n in (0, 300):
        y = dequantize(decode(encode(quantize(np.zeros(n, np.float32), "mask2", CHUNK, 0.2, seed=1))))
        np.testing.assert_array_equal(y, np.zeros(n, np.float32))


@pytest.mark.parametrize("piece", [1, 7, 100, 1 << 20])
def test_the_validator_hands_out_the_checked_body_in_pieces(piece: int) -> None:
    x = _x(3000, 1)
    q = quantize(x, "mask2", CHUNK, density=0.2, seed=9)
    frame = encode(q)
    body = bytearray()
    v = codec.FrameValidator(3000, "mask2", CHUNK, out=body.extend)
    for s in range(0, len(frame), piece):
        v.feed(frame[s:s + piece])
    v.finish()
    assert bytes(body) == q.scales.tobytes() + q.payload.tobytes()
    assert isinstance(v.sparse, codec.MaskChecker) and v.sparse.seed == 9
    assert v.sparse.norm == pytest.approx(float(np.linalg.norm(dequantize(q))), rel=1e-6)


def _frame(seed: int, code: int, records: bytes, scales: list[float] | None = None, n: int = 2 * CHUNK) -> bytes:
    """A mask frame with exactly this body, sealed (CRC, lengths) so only the intended fault remains."""
    sc = np.array(scales if scales is not None else [1.0] * -(-n // CHUNK), np.float32)
    payload = np.frombuffer(np.array([seed, code], "<u4").tobytes() + records, np.uint8)
    out = io.BytesIO()
    codec.write_frame(out, "mask2", CHUNK, n, sc, [payload], payload_size=payload.size)
    return out.getvalue()


QUARTER = M.density_code(0.25)
COUNTS = M.chunk_counts(0, QUARTER, 2 * CHUNK, CHUNK)  # about 64 a chunk
GOOD = b"".join(bytes(-(-int(c) // 4)) for c in COUNTS)  # code 0 everywhere, padding 0
SIZE = 8 + len(GOOD)
HALF = 8 + sum(-(-int(c) // 4) for c in M.chunk_counts(0, M.density_code(0.5), 2 * CHUNK, CHUNK))

HOSTILE = [  # (seed, code, records, scales, the reason): each body holds one fault
    (0, 0, b"", None, r"mask density code 0 \(an empty mask\) is invalid"),
    (0, QUARTER, GOOD[:-1], None, rf"makes a {SIZE}-byte payload, the header declares {SIZE - 1}"),
    (0, QUARTER, GOOD + b"\0", None, rf"makes a {SIZE}-byte payload, the header declares {SIZE + 1}"),
    (0, M.density_code(0.5), GOOD, None, rf"makes a {HALF}-byte payload, the header declares {SIZE}"),
    (0, QUARTER, GOOD, [float("nan"), 1.0], r"invalid scale .*nan.* for block 0"),
    (0, QUARTER, GOOD, [1.0, -1.0], r"invalid scale .*-1.0.* for block 1"),
]


@pytest.mark.parametrize("seed, code, records, scales, match", HOSTILE)
def test_hostile_frames_are_refused_with_a_reason(seed, code, records, scales, match: str) -> None:
    assert abs(COUNTS - 64).max() <= 1
    with pytest.raises(CodecError, match=match):
        decode(_frame(seed, code, records, scales), expected_n=2 * CHUNK)


def test_padding_bits_and_hostile_headers_are_refused() -> None:
    n = CHUNK + 10  # chunk 1 keeps 2 or 3 of its 10 values at 25%: its last byte has padding bits
    counts = M.chunk_counts(0, QUARTER, n, CHUNK)
    assert counts[1] % 4
    first = bytes(-(-int(counts[0]) // 4))
    with pytest.raises(CodecError, match=r"chunk 1: padding bits after the last code must be 0"):
        decode(_frame(0, QUARTER, first + bytes([0xC0]), n=n))
    decode(_frame(0, QUARTER, first + bytes(1), n=n))  # the same frame with zero padding is fine
    big = _frame(0, QUARTER, GOOD)
    with pytest.raises(CodecError, match=r"mask payload length \d+ outside \[8, \d+\]"):
        decode(big[:28] + (10 ** 6).to_bytes(8, "little") + big[36:])  # (the CRC is checked later)
    with pytest.raises(CodecError, match="needs payload_size"):
        codec.write_frame(io.BytesIO(), "mask2", CHUNK, 10, np.ones(1, np.float32), [bytes(8)])
    with pytest.raises(CodecError, match="frame truncated"):
        decode(big[:-3])


@pytest.mark.parametrize("decay", [1.0, 0.8])
def test_error_feedback_sends_the_mask_and_keeps_the_rest(decay: float) -> None:
    """With error feedback, what is not on a round's mask waits in the residual (decayed by β) and goes when the
    mask comes round: Σ sent = Σ β-weighted Δ − residual, exactly but for the float32 sums."""
    n, ef = 2000, ErrorFeedback(2000, "mask2", CHUNK, decay, density=0.25)
    rng = np.random.default_rng(0)
    residual = np.zeros(n, np.float64)
    for v in range(8):
        delta = rng.standard_normal(n).astype(np.float32)
        corrected = delta + decay * residual
        sent = dequantize(ef.compress(delta, seed=v))
        keep = M.keep_mask(v, M.density_code(0.25), 0, n)
        assert np.all(sent[~keep] == 0)
        np.testing.assert_allclose(ef.residual[~keep], corrected[~keep], rtol=1e-5, atol=1e-5)
        residual = corrected - sent
        np.testing.assert_allclose(ef.residual, residual, rtol=1e-5, atol=1e-5)
        assert np.linalg.norm(ef.residual[keep]) < 0.6 * np.linalg.norm(corrected[keep])  # 2-bit rounding only


def test_the_config_checks_the_mask_fields() -> None:
    cfg = load_config("tiny", ["codec.up=mask", "codec.down=mask", "codec.mask_density=0.25"])
    assert cfg.codec.scheme("mask") == ("mask2", cfg.codec.sparse_chunk)
    assert cfg.codec.density_of("mask") == 0.25 and cfg.codec.density_of("sparse") == cfg.codec.density
    assert Config().codec.mask_density == 0.2
    for bad in ("0", "1.5", "-0.1"):
        with pytest.raises(ConfigError, match=r"\[codec\] mask_density: must be in \(0, 1\]"):
            load_config("tiny", ["codec.up=mask", f"codec.mask_density={bad}"])
    fp = replace(cfg, codec={"mask_density": 0.5}).fingerprint_fields()
    assert fp["codec.mask_density"] == "0.5" and "codec.mask_density" not in Config().fingerprint_fields()


def test_pushes_on_one_mask_merge_into_an_update_on_the_same_entries() -> None:
    """Sync round v: every island pushes under seed v, the merger's update keeps exactly those entries (the
    sparseloco rule: −lr times the mean of the pushes), and an island applying the update frame holds the
    coordinator's θ bit for bit; the next version's update uses the next mask."""
    n = 3 * CHUNK + 17
    cfg = replace(Config(), codec={"up": "mask", "down": "mask", "sparse_chunk": CHUNK, "mask_density": 0.25},
                  coordinator={"mode": "sync", "merge_rule": "mean"},
                  outer={"rule": "sparseloco", "mask_lr": 0.5, "sparseloco_lr": 3.0})  # the mask's lr rules
    theta = _x(n, 7)
    m = Merger(theta.copy(), MergeOptions.from_config(cfg))
    try:
        held = theta.copy()
        for v in range(3):
            sent = []
            for i in range(3):
                q = quantize(_x(n, 10 * v + i), "mask2", CHUNK, 0.25, seed=m.version)
                sent.append(dequantize(q))
                with m.spool() as sp:
                    sp.write(encode(q))
                    m.validate(sp)
                    m.add_pending(sp, 1.0)
            update = m.outer_step()
            values = dequantize(decode(update.frame, expected_n=n))
            keep = M.keep_mask(v, M.density_code(0.25), 0, n)
            assert np.all(values[~keep] == 0) and np.count_nonzero(values[keep]) > 0.9 * keep.sum()
            target = -0.5 * np.mean(sent, axis=0)[keep]
            assert np.linalg.norm(values[keep] - target) < 0.6 * np.linalg.norm(target)  # 2-bit rounding
            held = held + values
            np.testing.assert_array_equal(held, m.theta)
    finally:
        m.close()


def test_the_coordinator_refuses_a_mask_push_at_another_density_and_commits_nothing() -> None:
    n = 2 * CHUNK
    cfg = replace(Config(), codec={"up": "mask", "down": "mask", "sparse_chunk": CHUNK, "mask_density": 0.25},
                  coordinator={"mode": "sync", "merge_rule": "mean"}, outer={"rule": "sparseloco"})
    theta = _x(n, 3)
    m = Merger(theta.copy(), MergeOptions.from_config(cfg))
    try:
        with m.spool() as sp, pytest.raises(CodecError, match=r"a mask push at density 0.5, the coordinator's "
                                                                r"codec.mask_density is 0.25"):
            sp.write(encode(quantize(_x(n, 4), "mask2", CHUNK, 0.5, seed=0)))
            m.validate(sp)
            m.add_pending(sp, 1.0)
        assert m.pending_count == 0 and m.version == 0
        np.testing.assert_array_equal(m.theta, theta)
    finally:
        m.close()
