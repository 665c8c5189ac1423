"""The dense 2-bit codec (``codec.up/down = "int2"``, dtrain/codec/int2.py): its levels and round trip, error
feedback, the merge's sum and norm, frames a hostile sender forges, the config's check, and a merge through the
coordinator's merger."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import zstandard

from codec_helpers import forge
from coordinator.merger import MergeOptions, Merger
from dtrain import codec
from dtrain.codec import CodecError, ErrorFeedback, decode, dequantize, encode, quantize
from dtrain.config.load import replace
from dtrain.config.sections import Config, ConfigError
from dtrain.steps.outer import suited_rule


@pytest.mark.parametrize("block", [64, 1024])
@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 63, 64, 65, 1025, 5000])
def test_round_trip_levels_and_scales(n: int, block: int) -> None:
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    q = quantize(x, 2, block)
    assert q.payload.size == (n + 3) // 4 and q.scales.size == -(-n // block)
    frame = encode(q)
    assert frame[5] == 2  # the bits code
    r = decode(frame, expected_n=n)
    assert (r.bits, r.block, r.n) == (2, block, n)
    got = dequantize(r)
    np.testing.assert_array_equal(got, dequantize(q))
    for b in range(q.scales.size):
        xb, gb, s = x[b * block:(b + 1) * block], got[b * block:(b + 1) * block], q.scales[b]
        np.testing.assert_allclose(s, np.sqrt(np.mean(xb.astype(np.float64) ** 2)), rtol=1e-6)  # the block's RMS
        assert set(np.round(gb / s, 6)) <= {-1.5, -0.5, 0.5, 1.5}
        inside = np.abs(xb) <= 2 * s  # the nearest level within the levels' range; clipped beyond it
        assert (np.abs(xb - gb)[inside] <= s / 2 * (1 + 1e-5)).all()
        assert (np.abs(gb[~inside]) == np.float32(1.5) * s).all()


def test_mean_square_error_is_near_the_best_four_levels() -> None:
    x = np.random.default_rng(0).standard_normal(1 << 16).astype(np.float32)
    err = np.mean((x - dequantize(quantize(x, 2, 1024))) ** 2)
    assert 0.1 < err < 0.125  # the uniform 4-level quantizer's MSE on a unit Gaussian: 0.1188 (Lloyd-Max: 0.1175)
    assert np.mean((x - dequantize(quantize(x, 4, 1024))) ** 2) < err  # int4 is finer
    zeros = quantize(np.zeros(100, np.float32), 2, 64)
    assert not zeros.scales.any() and not dequantize(zeros).any()  # all zero: scale 0, zeros back


def test_error_feedback_sends_what_quantization_dropped_later() -> None:
    rng = np.random.default_rng(7)
    n, block, rounds = 4096, 1024, 100
    bias = rng.uniform(0, 0.02, n).astype(np.float32)  # a persistent part far below the levels' step
    ef = ErrorFeedback(n, bits=2, block=block)
    true_sum, ef_sum, plain_sum, residuals = np.zeros(n), np.zeros(n), np.zeros(n), []
    for _ in range(rounds):
        delta = (bias + rng.standard_normal(n) * 0.1).astype(np.float32)
        true_sum += delta
        ef_sum += dequantize(ef.compress(delta))
        plain_sum += dequantize(quantize(delta, 2, block))
        residuals.append(np.linalg.norm(ef.residual))
    np.testing.assert_allclose(true_sum - ef_sum, ef.residual, atol=1e-4)  # Σ sent = Σ Δ − residual
    assert max(residuals[50:]) < 2 * max(residuals[:50])  # the residual stays bounded: nothing piles up
    # with error feedback the sums differ by one round's residual; without, every round's error adds up
    ef_error, plain_error = np.linalg.norm(true_sum - ef_sum), np.linalg.norm(true_sum - plain_sum)
    assert ef_error < 0.25 * plain_error, (ef_error, plain_error)


@pytest.mark.parametrize("n", [1, 5, 1000, 3003])
def test_the_merge_sum_and_the_norm_are_the_decoder_s_values(n: int) -> None:
    rng = np.random.default_rng(n)
    q = quantize(rng.standard_normal(n).astype(np.float32), 2, 64)
    out = rng.standard_normal(n).astype(np.float32)
    want = out + codec.dequantize_segment(2, 64, q.scales * np.float32(0.37), q.payload, n)
    codec.dequantize_add(2, 64, q.scales, q.payload, out, weight=0.37)
    assert np.array_equal(out, want)
    levels = codec.dequantize_segment(2, 64, np.ones_like(q.scales), q.payload, n).astype(np.float64)
    padded = np.concatenate([levels, np.zeros(-n % 64)]).reshape(-1, 64)
    assert np.array_equal(codec.block_sum_squares(2, 64, q.payload, n), (padded ** 2).sum(axis=1))


def _body(scales: np.ndarray, payload: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(scales.astype("<f4").tobytes() + payload)


def test_hostile_frames_are_rejected() -> None:
    frame = encode(quantize(np.random.default_rng(3).standard_normal(65).astype(np.float32), 2, 64))  # 17 bytes
    assert decode(forge(frame)).n == 65
    ones = np.ones(2, np.float32)
    for scale in (np.nan, -1.0, np.inf, 3e38):  # 1.5·3e38 would overflow
        with pytest.raises(CodecError, match="invalid scale"):
            decode(forge(frame, body=_body(np.array([1.0, scale]), bytes(17))))
    with pytest.raises(CodecError, match="padding bits"):  # value 65 of 68 slots: the last byte's bits 2..7
        decode(forge(frame, body=_body(ones, bytes(16) + b"\x04")))
    assert decode(forge(frame, body=_body(ones, bytes(16) + b"\x03"))).n == 65  # the one real value: any code
    with pytest.raises(CodecError, match="multiple of 4"):
        decode(forge(frame, block=66, scales_len=8))
    with pytest.raises(CodecError, match="payload length 16 inconsistent"):
        decode(forge(frame, payload_len=16))
    with pytest.raises(CodecError, match="body decompresses to 24 bytes, header declares 25"):
        decode(forge(frame, body=_body(ones, bytes(16))))
    with pytest.raises(CodecError, match="CRC32 mismatch"):
        decode(frame[:-1] + bytes([frame[-1] ^ 1]))
    with pytest.raises(CodecError, match="bits=2 block=64, expected bits=4"):
        validator = codec.FrameValidator(65, 4, 64, out=lambda _: None)
        validator.feed(frame)
    with pytest.raises(CodecError, match="multiple of 4"):
        quantize(np.zeros(10, np.float32), 2, 66)


def test_the_config_names_int2_and_checks_its_block() -> None:
    assert codec.CODEC_BITS["int2"] == 2
    cfg = replace(Config(), codec={"up": "int2", "down": "int2"})
    assert cfg.codec.scheme("int2") == (2, cfg.codec.block)
    with pytest.raises(ConfigError, match="codec.*block.*multiple of 4"):
        replace(Config(), codec={"up": "int2", "block": 1026})
    assert replace(Config(), codec={"up": "int8", "block": 1026}).codec.block == 1026  # the others: even is enough
    # the outer rule that suits each codec: SparseLoCo's for the sparse one, DiLoCo's Nesterov for the dense ones
    assert {name: suited_rule(name) for name in (*codec.CODEC_BITS, "sparse")} == {
        "fp32": "nesterov", "int8": "nesterov", "int4": "nesterov", "int2": "nesterov", "e3m0": "nesterov",
        "sparse": "sparseloco"}


def test_a_merge_through_the_coordinator_s_merger(tmp_path, monkeypatch) -> None:
    """Pushes in int2 summed by the merger (streamed spools, the slab-wise outer step) and the update broadcast in
    int2: islands applying the update frame hold the merger's θ bit for bit, close to the exact outer step."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    rng = np.random.default_rng(0)
    n = 3000
    theta = rng.normal(size=n).astype(np.float32)
    cfg = replace(Config(), codec={"up": "int2", "down": "int2", "block": 64},
                  coordinator={"mode": "sync", "merge_rule": "mean"}, outer={"lr": 1.0, "momentum": 0.0})
    merger = Merger(theta.copy(), MergeOptions.from_config(cfg))
    deltas = [rng.normal(size=n).astype(np.float32) * 0.01 for _ in range(3)]
    for d in deltas:
        with merger.spool() as spool:
            spool.write(encode(quantize(d, 2, 64)))
            merger.validate(spool)
            assert spool.norm == pytest.approx(np.linalg.norm(dequantize(quantize(d, 2, 64))), rel=1e-6)
            merger.add_pending(spool, 100.0)
    update = merger.outer_step()
    island = theta + dequantize(decode(update.frame, expected_n=n))
    assert np.array_equal(island, merger.theta)
    exact = theta - np.mean(deltas, axis=0)
    sent = theta - np.mean([dequantize(quantize(d, 2, 64)) for d in deltas], axis=0)
    assert np.linalg.norm(island - exact) < 0.6 * np.linalg.norm(exact - theta)
    assert np.linalg.norm(island - sent) < 0.5 * np.linalg.norm(exact - theta)
