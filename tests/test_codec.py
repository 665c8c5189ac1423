"""dtrain.codec: trees, block quantization bounds, error feedback, the frame writer (the frame reader: in
test_codec_reader.py).

numpy only (no JAX), deterministic seeds, hypothesis derandomized; the whole file runs in seconds.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from functools import partial

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from codec_helpers import ALL_BITS, FAST
from dtrain import codec
from dtrain.codec import (
    CodecError,
    ErrorFeedback,
    QuantizedVec,
    compression_ratio,
    decode,
    dequantize,
    encode,
    flatten,
    quantize,
    spec_digest,
    unflatten,
)

LOSSY = [8, 4, "e3m0"]


def _tree(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)

    def f32(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    return {
        "tok_embed": {"embedding": f32(16, 8)},
        "blocks": {i: {"attn": {"qkv": {"kernel": f32(8, 24)}}, "ln1": {"scale": f32(8), "bias": f32(8)}}
                   for i in range(11)},  # 11 blocks: int keys must sort numerically (2 before 10)
        "pos_embed": f32(4, 8),
        "step_scale": np.float32(0.5),  # a 0-d leaf
        "half": f32(3, 2).astype(np.float16),
    }


def _scale_per_value(q: QuantizedVec) -> np.ndarray:
    return np.repeat(q.scales.astype(np.float64), q.block)[:q.n]


def _int_bound(q: QuantizedVec) -> np.ndarray:
    """The documented per-value bound for int8/4-bit: scale/2, plus float rounding."""
    s = _scale_per_value(q)
    return s / 2 * (1 + 2e-5) + 2.0 ** -149


# --------------------------------------------------------------------------- trees


def test_flatten_unflatten_round_trip() -> None:
    tree = _tree()
    spec, vec = flatten(tree)
    assert vec.dtype == np.float32 and vec.ndim == 1
    assert vec.size == sum(int(np.prod(shape)) for _, shape, _ in spec)
    assert json.loads(json.dumps(spec)) == spec  # JSON-native
    paths = [p for p, _, _ in spec]
    assert paths[:3] == ["blocks/0/attn/qkv/kernel", "blocks/0/ln1/bias", "blocks/0/ln1/scale"]
    assert paths.index("blocks/2/attn/qkv/kernel") < paths.index("blocks/10/attn/qkv/kernel")
    assert ["step_scale", [], "float32"] in spec and ["half", [3, 2], "float16"] in spec

    back = unflatten(spec, vec)
    assert set(back["blocks"]) == set(range(11))  # int keys come back as ints
    flat_in, flat_out = flatten(tree)[1], flatten(back)[1]
    np.testing.assert_array_equal(flat_in, flat_out)
    kernel = ("blocks", 10, "attn", "qkv", "kernel")
    leaf_in, leaf_out = tree, back
    for key in kernel:
        leaf_in, leaf_out = leaf_in[key], leaf_out[key]
    np.testing.assert_array_equal(leaf_out, leaf_in)
    assert back["half"].dtype == np.float16 and back["step_scale"].shape == ()

    # deterministic whatever the insertion order; the digest is stable across a JSON round trip
    reordered = dict(reversed(list(tree.items())))
    assert flatten(reordered)[0] == spec
    assert spec_digest(spec) == spec_digest(json.loads(json.dumps(spec)))
    assert len(spec_digest(spec)) == 16
    spec2 = flatten({**tree, "pos_embed": np.zeros((5, 8), np.float32)})[0]
    assert spec_digest(spec2) != spec_digest(spec)


def test_unflatten_rejects_wrong_length_and_bad_specs() -> None:
    spec, vec = flatten(_tree())
    with pytest.raises(CodecError, match=rf"{vec.size - 1} values but the spec describes {vec.size}"):
        unflatten(spec, vec[:-1])
    with pytest.raises(CodecError, match=rf"{vec.size + 1} values but the spec describes {vec.size}"):
        unflatten(spec, np.append(vec, np.float32(0)))
    with pytest.raises(CodecError, match="1-D float32"):
        unflatten(spec, vec.astype(np.float64))
    with pytest.raises(CodecError, match="bad shape"):
        unflatten([["a", [-1], "float32"]], np.zeros(1, np.float32))
    with pytest.raises(CodecError, match="unsupported dtype"):
        unflatten([["a", [1], "int32"]], np.zeros(1, np.float32))
    with pytest.raises(CodecError, match="runs through the leaf"):
        unflatten([["a", [1], "float32"], ["a/b", [1], "float32"]], np.zeros(2, np.float32))
    with pytest.raises(CodecError, match="appears twice"):
        unflatten([["a", [1], "float32"], ["a", [1], "float32"]], np.zeros(2, np.float32))


def test_flatten_rejects_ambiguous_keys_and_lossy_leaves() -> None:
    with pytest.raises(CodecError, match="no '/'"):
        flatten({"a/b": np.zeros(1, np.float32)})
    with pytest.raises(CodecError, match="read back as an int"):
        flatten({"0": np.zeros(1, np.float32)})
    with pytest.raises(CodecError, match="dtype float64"):
        flatten({"w": np.zeros(2)})
    with pytest.raises(CodecError, match="nested dict"):
        flatten(np.zeros(2, np.float32))


# --------------------------------------------------------------------------- quantization


def _awkward_vector(block: int) -> np.ndarray:
    """Blocks of very different magnitudes, an all-zero block, a lone huge outlier, a partial tail."""
    rng = np.random.default_rng(1)
    parts = [rng.standard_normal(block) * 10.0 ** e for e in (-8, -3, 0, 4)]
    parts.append(np.zeros(block))
    outlier = rng.standard_normal(block) * 1e-3
    outlier[17] = 3e5
    parts.append(outlier)
    parts.append(rng.standard_normal(block // 2 + 1))  # partial last block, odd length
    return np.concatenate(parts).astype(np.float32)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [64, 1024])
def test_int_error_bound_per_block(bits: int, block: int) -> None:
    x = _awkward_vector(block)
    q = quantize(x, bits, block)
    assert q.scales.dtype == np.float32 and q.scales.size == -(-x.size // block)
    y = dequantize(q)
    assert y.dtype == np.float32 and np.isfinite(y).all()
    err = np.abs(x.astype(np.float64) - y)
    assert (err <= _int_bound(q)).all()
    zero_block = slice(4 * block, 5 * block)
    assert q.scales[4] == 0 and (y[zero_block] == 0).all()
    # the scale is absmax/qmax (rounded up by at most one ulp)
    qmax = 127 if bits == 8 else 7
    absmax = np.abs(x[:block]).max()
    assert absmax / qmax <= q.scales[0] <= np.nextafter(np.float32(absmax / qmax), np.float32(np.inf))


def test_e3m0_error_bound() -> None:
    x = _awkward_vector(256)
    q = quantize(x, "e3m0", 256)
    y = dequantize(q)
    s = _scale_per_value(q)
    err = np.abs(x.astype(np.float64) - y)
    assert (err <= np.maximum(np.abs(x) / 3, s / 128) * (1 + 1e-5) + 2.0 ** -149).all()
    levels = np.unique(np.abs(y[:256]) / q.scales[0])  # every magnitude is scale·2^-k or 0
    assert set(levels.tolist()) <= {0.0} | {2.0 ** -k for k in range(7)}


def test_lossless_is_exact_and_all_zero_is_zero() -> None:
    x = _awkward_vector(128)
    q = quantize(x, 32, 128)
    assert q.scales.size == 0
    np.testing.assert_array_equal(dequantize(decode(encode(q))), x)
    for bits in ALL_BITS:
        z = dequantize(decode(encode(quantize(np.zeros(3000, np.float32), bits, 1024))))
        assert not np.isnan(z).any() and (z == 0).all()


@given(x=hnp.arrays(np.float32, st.integers(1, 300),
                    elements=st.floats(width=32, allow_nan=False, allow_infinity=False)),
       bits=st.sampled_from([8, 4]))
@FAST
def test_int_bound_holds_for_any_finite_float32(x: np.ndarray, bits: int) -> None:
    """Includes subnormals and ±FLT_MAX: the bound holds and nothing overflows."""
    q = quantize(x, bits, 64)
    y = dequantize(q)
    assert np.isfinite(y).all()
    assert (np.abs(x.astype(np.float64) - y) <= _int_bound(q)).all()


@pytest.mark.parametrize("bits", ALL_BITS)
def test_extreme_magnitudes_stay_finite(bits: codec.Bits) -> None:
    """±FLT_MAX (qmax·scale must not round to inf) and subnormal-only blocks (scale must not round to 0)."""
    big = np.finfo(np.float32).max
    tiny = np.float32(2.0 ** -140)
    x = np.zeros(128, np.float32)
    x[:3] = big, -big, np.nextafter(big, np.float32(0))
    x[64:67] = tiny, -tiny, 3 * tiny
    q = decode(encode(quantize(x, bits, 64)))
    y = dequantize(q)
    assert np.isfinite(y).all()
    if bits in (8, 4):
        assert (np.abs(x.astype(np.float64) - y) <= _int_bound(q)).all()
        assert q.scales[1] > 0 and y[64] > 0  # the subnormal block survives
    if bits == 32:
        np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_rejected(bits: codec.Bits, bad: float) -> None:
    x = np.ones(5000, np.float32)
    x[4321] = bad
    with pytest.raises(CodecError, match=r"non-finite value .* at index 4321"):
        quantize(x, bits, 1024)


def test_quantize_rejects_bad_arguments() -> None:
    x = np.ones(10, np.float32)
    with pytest.raises(CodecError, match="bits must be one of"):
        quantize(x, 16)
    with pytest.raises(CodecError, match="out of range"):
        quantize(x, 8, 32)
    with pytest.raises(CodecError, match="out of range"):
        quantize(x, 8, 1 << 17)
    with pytest.raises(CodecError, match="must be even"):
        quantize(x, 8, 65)
    with pytest.raises(CodecError, match="1-D"):
        quantize(x.reshape(2, 5), 8)
    with pytest.raises(CodecError, match="zstd level"):
        encode(quantize(x), level=23)


def test_nibble_order_is_low_then_high() -> None:
    x = np.zeros(64, np.float32)
    x[0], x[1], x[2] = 7.0, -7.0, 1.0  # scale 1: codes 7, -7 (0b1001), 1
    q = quantize(x, 4, 64)
    assert q.scales[0] == 1.0
    assert q.payload[0] == 0x97 and q.payload[1] == 0x01
    odd = quantize(np.full(65, -7.0, np.float32), 4, 64)  # odd n: padding nibble is 0
    assert odd.payload.size == 33 and odd.payload[-1] == 0x09


# --------------------------------------------------------------------------- frames


@given(n=st.one_of(st.just(1), st.integers(1, 5000)), seed=st.integers(0, 2**32 - 1),
       bits=st.sampled_from(ALL_BITS), block=st.sampled_from([64, 66, 256, 1024]),
       magnitude=st.integers(-30, 30))
@FAST
def test_encode_decode_round_trip(n: int, seed: int, bits: codec.Bits, block: int, magnitude: int) -> None:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0 ** magnitude).astype(np.float32)
    q = quantize(x, bits, block)
    frame = encode(q, level=1)
    assert frame[:4] == b"DTRC" and len(frame) == codec.HEADER_SIZE + struct.unpack_from("<Q", frame, 36)[0]
    r = decode(frame, expected_n=n)
    assert (r.bits, r.block, r.n) == (bits, block, n)
    assert not r.scales.flags.writeable and not r.payload.flags.writeable
    np.testing.assert_array_equal(r.scales, q.scales)
    np.testing.assert_array_equal(r.payload, q.payload)
    np.testing.assert_array_equal(dequantize(r), dequantize(q))
    if bits == 32:
        np.testing.assert_array_equal(dequantize(r), x)


@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("n", [1, 2, 63, 64, 65, 127, 1025])
def test_round_trip_edge_sizes(bits: codec.Bits, n: int) -> None:
    x = np.linspace(-2, 3, n, dtype=np.float32)
    q = quantize(x, bits, 64)
    r = decode(encode(q), expected_n=n)
    np.testing.assert_array_equal(dequantize(r), dequantize(q))
    if bits in (8, 4):
        assert (np.abs(x.astype(np.float64) - dequantize(r)) <= _int_bound(r)).all()


def test_empty_vector_round_trips() -> None:
    for bits in ALL_BITS:
        r = decode(encode(quantize(np.zeros(0, np.float32), bits)))
        assert r.n == 0 and dequantize(r).size == 0


def test_compression_ratios_meet_targets() -> None:
    x = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)
    ratios = {bits: compression_ratio(x.size, len(encode(quantize(x, bits, 1024)))) for bits in ALL_BITS}
    print("compression ratios (1M gaussian, block 1024): "
          + ", ".join(f"{bits}: {r:.2f}x" for bits, r in ratios.items()))
    assert ratios[8] >= 3.9
    assert ratios[4] >= 7.5
    assert ratios["e3m0"] >= 7.5
    assert ratios[32] >= 1.0
    assert compression_ratio(10, 40) == 1.0


# --------------------------------------------------------------------------- the frame writer


@pytest.mark.parametrize("bits", ALL_BITS)
def test_write_frame_from_pieces_is_encode(bits: codec.Bits, tmp_path) -> None:
    """The one writer: payload pieces from a file or from memory, at any offset of the file, give encode's bytes;
    the returned size and CRC32 are the whole frame's, taken without reading it back."""
    x = np.random.default_rng(5).standard_normal(5000).astype(np.float32)
    q = quantize(x, bits, 128)
    frame = encode(q, level=1)
    payload = q.payload.tobytes()
    (tmp_path / "payload").write_bytes(payload)
    for piece in (1, 999, len(payload), 1 << 20):
        with open(tmp_path / "frame", "wb") as out, open(tmp_path / "payload", "rb") as src:
            out.write(b"prefix")
            got = codec.write_frame(out, bits, 128, x.size, q.scales, iter(partial(src.read, piece), b""), level=1)
            assert out.tell() == 6 + len(frame)
        assert got == (len(frame), zlib.crc32(frame))
        assert (tmp_path / "frame").read_bytes() == b"prefix" + frame
    pieces = [q.payload[i:i + 700] for i in range(0, q.payload.size, 700)]
    with open(tmp_path / "frame", "wb") as out:
        assert codec.write_frame(out, bits, 128, x.size, q.scales, pieces, level=1) == (len(frame), zlib.crc32(frame))
    np.testing.assert_array_equal(dequantize(decode((tmp_path / "frame").read_bytes(), expected_n=x.size)),
                                  dequantize(q))


def test_write_frame_rejects_wrong_sizes_and_levels(tmp_path) -> None:
    q = quantize(np.ones(1000, np.float32), 8, 256)  # 4 scales, 1000 payload bytes
    with open(tmp_path / "frame", "wb") as out:
        with pytest.raises(CodecError, match=r"got 999 payload bytes, n=1000 bits=8 needs 1000"):
            codec.write_frame(out, 8, 256, 1000, q.scales, [q.payload[:999]])
        with pytest.raises(CodecError, match=r"more than the 1000 payload bytes"):
            codec.write_frame(out, 8, 256, 1000, q.scales, [q.payload, b"x"])
        with pytest.raises(CodecError, match=r"got 3 scales, n=1000 block=256 bits=8 needs 4"):
            codec.write_frame(out, 8, 256, 1000, q.scales[:3], [q.payload])
        with pytest.raises(CodecError, match="zstd level"):
            codec.write_frame(out, 8, 256, 1000, q.scales, [q.payload], level=23)
        with pytest.raises(CodecError, match="bits must be one of"):
            codec.write_frame(out, 16, 256, 1000, q.scales, [q.payload])
        with pytest.raises(CodecError, match="n must be a non-negative int"):
            codec.write_frame(out, 8, 256, -1, q.scales, [q.payload])


def test_one_table_of_codec_names() -> None:
    """codec.up/codec.down name the schemes of CODEC_BITS, and the config offers exactly those names (and
    "sparse", whose scheme codec.sparse_bits picks, and "mask", the mask2 scheme on codec.sparse_chunk)."""
    from dtrain.config.sections import CodecConfig

    assert dict(codec.CODEC_BITS) == {"fp32": 32, "int8": 8, "int4": 4, "int2": 2, "e3m0": "e3m0"}
    assert all(codec.canonical_bits(bits) == bits for bits in codec.CODEC_BITS.values())
    choices = {f.name: f.metadata["choices"] for f in dataclasses.fields(CodecConfig) if f.name in ("up", "down")}
    assert choices == {"up": (*codec.CODEC_BITS, "sparse", "mask"), "down": (*codec.CODEC_BITS, "sparse", "mask")}
    assert CodecConfig().scheme("sparse") == ("sparse2", CodecConfig().sparse_chunk)  # codec.sparse_bits picks
    assert CodecConfig().scheme("mask") == ("mask2", CodecConfig().sparse_chunk)


# --------------------------------------------------------------------------- error feedback


def test_error_feedback_does_not_accumulate() -> None:
    """Small persistent components fall under the 4-bit step each round; only error feedback keeps them."""
    rng = np.random.default_rng(7)
    n, block, rounds = 4096, 1024, 200
    bias = rng.uniform(0, 0.02, n).astype(np.float32)  # far below scale/2 ≈ 0.07
    ef = ErrorFeedback(n, bits=4, block=block)
    true_sum, ef_sum, plain_sum = np.zeros(n), np.zeros(n), np.zeros(n)
    for t in range(rounds):
        delta = (bias + rng.standard_normal(n) * 0.01).astype(np.float32)
        delta[::block] = 1.0  # one outlier per block sets the scale to 1/7
        true_sum += delta
        q = ef.compress(delta)
        ef_sum += dequantize(q)
        plain_sum += dequantize(quantize(delta, 4, block))
        # at every round the transmitted sum trails the true one by this round's error only
        assert (np.abs(true_sum - ef_sum) <= _int_bound(q) * (1 + 1e-4) + 1e-5).all(), t
    np.testing.assert_allclose(true_sum - ef_sum, ef.residual, atol=1e-4)
    one_round = _int_bound(q).max()
    plain_drift = np.abs(true_sum - plain_sum).max()
    assert np.abs(true_sum - ef_sum).max() <= one_round * (1 + 1e-4) + 1e-5
    assert plain_drift > 10 * one_round  # without error feedback the dropped mass piles up
    ef.reset()
    assert not ef.residual.any()


def test_error_feedback_rejects_nan_and_wrong_size_without_state_change() -> None:
    ef = ErrorFeedback(100, bits=8, block=64)
    ef.compress(np.linspace(-1, 1, 100, dtype=np.float32))
    before = ef.residual.copy()
    bad = np.zeros(100, np.float32)
    bad[3] = np.nan
    with pytest.raises(CodecError, match="non-finite"):
        ef.compress(bad)
    with pytest.raises(CodecError, match="shape"):
        ef.compress(np.zeros(99, np.float32))
    np.testing.assert_array_equal(ef.residual, before)
