"""dtrain.codec: trees, block quantization bounds, error feedback, the frame writer and the frame reader.

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
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dtrain import codec
from dtrain.codec import (
    HEADER_SIZE,
    WINDOW_LOG,
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

FAST = settings(max_examples=40, deadline=None, derandomize=True, database=None)
LOSSY = [8, 4, "e3m0"]
ALL_BITS = [8, 4, "e3m0", 32]


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


# --------------------------------------------------------------------------- decode rejects

_HEADER = struct.Struct("<4sBBHIQQQQI")


def _frame(n: int = 3000, bits: codec.Bits = 8, block: int = 1024) -> bytes:
    x = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    return encode(quantize(x, bits, block))


def _forge(frame: bytes, body: bytes | None = None, **fields: int) -> bytes:
    """Rewrite header fields (and/or the body) and re-seal the CRC, so only the intended fault remains."""
    names = ["magic", "version", "bits", "reserved", "block", "n", "scales_len", "payload_len", "body_len", "crc"]
    values = dict(zip(names, _HEADER.unpack_from(frame), strict=True))
    body = frame[codec.HEADER_SIZE:] if body is None else body
    values["body_len"] = len(body)
    values.update(fields)
    head = _HEADER.pack(*[values[k] for k in names])[:44]
    crc = zlib.crc32(body, zlib.crc32(head)) if "crc" not in fields else fields["crc"]
    return head + struct.pack("<I", crc) + body


def test_forge_helper_reproduces_valid_frames() -> None:
    frame = _frame()
    assert _forge(frame) == frame


@pytest.mark.parametrize("mutate, match", [
    (lambda f: b"DTRX" + f[4:], r"bad magic b'DTRX'"),
    (lambda f: _forge(f, version=2), r"unsupported format version 2"),
    (lambda f: _forge(f, bits=5), r"unknown bits code 5"),
    (lambda f: _forge(f, reserved=2), r"header flags 0x0002: only bit 0"),
    (lambda f: _forge(f, reserved=1), r"stored body of \d+ bytes: must be the scales' \d+ \+ the payload's"),
    (lambda f: _forge(f, block=32), r"block 32 out of range"),
    (lambda f: _forge(f, block=1025), r"block 1025 out of range"),
    (lambda f: f[:20], r"frame truncated: 20 bytes, the header alone needs 48"),
    (lambda f: f[:-100], r"frame truncated: header says \d+ body bytes, got \d+"),
    (lambda f: f + b"junk", r"trailing garbage: 4 bytes"),
    (lambda f: _forge(f, crc=_HEADER.unpack_from(f)[-1] ^ 1), r"CRC32 mismatch"),  # body intact, CRC field off
    (lambda f: f[:60] + bytes([f[60] ^ 0x01]) + f[61:], r"CRC32 mismatch|zstd decompression failed|invalid"),
    (lambda f: f[:-5] + bytes([f[-5] ^ 0x40]) + f[-4:], r"CRC32 mismatch|zstd decompression failed|invalid"),
    (lambda f: f[:12] + bytes([f[12] ^ 0x01]) + f[13:], r"inconsistent with n=3001"),  # n flipped, CRC would catch too
    (lambda f: _forge(f, n=2500), r"payload length 3000 inconsistent with n=2500"),
    (lambda f: _forge(f, n=2000), r"scales length 12 inconsistent with n=2000"),
    (lambda f: _forge(f, scales_len=8), r"scales length 8 inconsistent with n=3000, block=1024"),
    (lambda f: _forge(f, payload_len=2999), r"payload length 2999 inconsistent"),
    (lambda f: _forge(f, body=b"not zstd at all"), r"zstd decompression failed"),
])
def test_decode_rejects(mutate, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        decode(mutate(_frame()))


def _zstd(data: bytes, window_log: int = WINDOW_LOG, content_size: bool = True) -> bytes:
    """``data`` as one zstd frame with the given window (the codec's own by default), like a sender would;
    ``content_size=False``: streamed, the frame says neither its size nor a window shrunk to fit it."""
    if content_size:
        params = zstandard.ZstdCompressionParameters.from_level(3, source_size=len(data), window_log=window_log)
        return zstandard.ZstdCompressor(compression_params=params).compress(data)
    params = zstandard.ZstdCompressionParameters(compression_level=3, window_log=window_log, write_content_size=False)
    writer = zstandard.ZstdCompressor(compression_params=params).compressobj()
    return writer.compress(data) + writer.flush()


def test_decode_rejects_zip_bomb() -> None:
    frame = _frame(n=1024)  # header declares 4 + 1024 body bytes
    bomb = _zstd(bytes(50_000_000), content_size=False)
    assert len(bomb) < 5000
    with pytest.raises(CodecError, match=r"more than the 1028 bytes the header declares \(zip bomb\?\)"):
        decode(_forge(frame, body=bomb))
    lying = _zstd(bytes(50_000_000))  # content size in the zstd frame, too
    with pytest.raises(CodecError, match="zip bomb"):
        decode(_forge(frame, body=lying))


def test_frames_use_the_codec_window_and_a_bigger_one_is_refused() -> None:
    """Every frame written asks for a window of at most 2**WINDOW_LOG bytes, whatever the level; a frame asking
    for more (zstd would allow 128 MiB, per decoder) is refused before its window is allocated."""
    q = quantize(np.random.default_rng(0).standard_normal(3_000_000).astype(np.float32), 8, 1024)
    for level in (1, 3, 19):
        body = encode(q, level=level)[HEADER_SIZE:]
        assert zstandard.get_frame_parameters(body).window_size <= 1 << WINDOW_LOG, level
    frame = _frame(n=1024)
    wide = _zstd(np.float32(1.0).tobytes() + bytes(1024), window_log=WINDOW_LOG + 1, content_size=False)
    assert zstandard.get_frame_parameters(wide).window_size == 2 << WINDOW_LOG
    with pytest.raises(CodecError, match=rf"window may be at most {1 << WINDOW_LOG} bytes"):
        decode(_forge(frame, body=wide))
    assert decode(_forge(frame, body=_zstd(np.float32(1.0).tobytes() + bytes(1024)))).n == 1024  # the codec's: fine


def test_decode_rejects_short_body_and_forged_values() -> None:
    frame = _frame(n=1024)
    short = zstandard.ZstdCompressor().compress(bytes(1000))
    with pytest.raises(CodecError, match=r"body decompresses to 1000 bytes, header declares 1028"):
        decode(_forge(frame, body=short))
    with pytest.raises(CodecError, match=r"header says n=1024, expected n=999"):
        decode(frame, expected_n=999)

    def body(scale: float, codes: bytes) -> bytes:
        return zstandard.ZstdCompressor().compress(np.float32(scale).tobytes() + codes)

    with pytest.raises(CodecError, match="invalid scale"):
        decode(_forge(frame, body=body(np.nan, bytes(1024))))
    with pytest.raises(CodecError, match="invalid scale"):
        decode(_forge(frame, body=body(-1.0, bytes(1024))))
    with pytest.raises(CodecError, match="invalid scale"):  # 127·scale would overflow to inf
        decode(_forge(frame, body=body(3e38, bytes(1024))))
    with pytest.raises(CodecError, match="invalid int8 code -128 near value 5"):
        decode(_forge(frame, body=body(1.0, bytes(5) + b"\x80" + bytes(1018))))
    frame4 = _frame(n=65, bits=4, block=64)  # 2 scales, 33 payload bytes
    scales = np.ones(2, np.float32).tobytes()
    with pytest.raises(CodecError, match="nibble 0b1000"):
        decode(_forge(frame4, body=zstandard.ZstdCompressor().compress(scales + b"\x80" + bytes(32))))
    with pytest.raises(CodecError, match="padding nibble"):
        decode(_forge(frame4, body=zstandard.ZstdCompressor().compress(scales + bytes(32) + b"\x11")))
    frame32 = _frame(n=4, bits=32)
    with pytest.raises(CodecError, match="non-finite value at index 2"):
        raw = np.array([1, 2, np.inf, 4], np.float32).tobytes()
        decode(_forge(frame32, body=zstandard.ZstdCompressor().compress(raw)))


# --------------------------------------------------------------------------- validation without decoding


def _validate(frame: bytes, n: int, bits: codec.Bits, block: int, piece: int = 1 << 20,
              out_piece: int = 1 << 20, got: bytearray | None = None, with_crc: bool = False) -> bytes:
    """``with_crc``: each piece fed with its CRC32, as the coordinator feeds chunks whose CRC the wire checked."""
    got = bytearray() if got is None else got
    validator = codec.FrameValidator(n, bits, block, out=got.extend, out_piece=out_piece)
    for i in range(0, len(frame), piece):
        validator.feed(frame[i:i + piece], zlib.crc32(frame[i:i + piece]) if with_crc else None)
    validator.finish()
    return bytes(got)


@given(n=st.integers(0, 3000), bits=st.sampled_from(ALL_BITS), block=st.sampled_from([64, 130, 1024]),
       piece=st.integers(1, 900), out_piece=st.sampled_from([5, 131, 1 << 20]), seed=st.integers(0, 1000),
       with_crc=st.booleans())
@FAST
def test_frame_validator_hands_out_the_decoded_body(n: int, bits: codec.Bits, block: int, piece: int,
                                                    out_piece: int, seed: int, with_crc: bool) -> None:
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    q = quantize(x, bits, block)
    body = np.asarray(q.scales, "<f4").tobytes() + np.asarray(q.payload, np.uint8).tobytes()
    assert _validate(encode(q), n, bits, block, piece, out_piece, with_crc=with_crc) == body


def test_frame_validator_faults() -> None:
    frame = _frame(n=1024)  # one scale, 1024 int8 codes
    ok = _validate(frame, 1024, 8, 1024, piece=100)
    assert len(ok) == 4 + 1024

    def rejects(bad: bytes, match: str, n: int = 1024, bits: codec.Bits = 8, block: int = 1024,
                out_piece: int = 1 << 20) -> bytes:
        got = bytearray()
        with pytest.raises(CodecError, match=match):
            _validate(bad, n, bits, block, piece=97, out_piece=out_piece, got=got)
        return bytes(got)

    rejects(frame, r"header says n=1024, expected n=999", n=999)
    rejects(frame, r"expected bits=4 block=1024", bits=4)
    rejects(frame + b"abc", "trailing garbage: 3 bytes")
    rejects(frame[:-10], r"frame truncated: header says \d+ body bytes")
    rejects(frame[:30], "frame truncated: 30 bytes")
    rejects(_forge(frame, crc=_HEADER.unpack_from(frame)[-1] ^ 1), "CRC32 mismatch")
    flipped = bytearray(frame)
    flipped[-5] ^= 0x40  # a flipped body byte: zstd, the value checks or the CRC must catch it
    rejects(bytes(flipped), r"CRC32 mismatch|zstd decompression failed|invalid")
    # The same with the pieces' CRCs given (the wire checked them): the frame's CRC is combined from them, and a
    # header CRC that does not match the body is still caught, wherever the header ends in the pieces.
    for piece in (1, 20, 48, 97, 2000):
        assert _validate(frame, 1024, 8, 1024, piece=piece, with_crc=True) == ok
        with pytest.raises(CodecError, match="CRC32 mismatch"):
            _validate(_forge(frame, crc=_HEADER.unpack_from(frame)[-1] ^ 1), 1024, 8, 1024, piece=piece,
                      with_crc=True)
    with pytest.raises(CodecError, match="CRC32 mismatch"):  # a piece whose given CRC is not its bytes'
        v = codec.FrameValidator(1024, 8, 1024, out=lambda _: None)
        v.feed(frame, zlib.crc32(frame) ^ 1)
        v.finish()
    rejects(_forge(frame, body=b"not zstd at all"), "zstd decompression failed")
    bomb = _zstd(bytes(50_000_000), content_size=False)
    rejects(_forge(frame, body=bomb), r"more than the 1028 bytes the header declares \(zip bomb\?\)")
    rejects(_forge(frame, body=zstandard.ZstdCompressor().compress(bytes(1000))),
            r"body decompresses to 1000 bytes, header declares 1028")

    def body(scale: float, codes: bytes) -> bytes:
        return zstandard.ZstdCompressor().compress(np.float32(scale).tobytes() + codes)

    for scale in (np.nan, -1.0, 3e38):
        assert rejects(_forge(frame, body=body(scale, bytes(1024))), "invalid scale") == b""  # nothing out
    got = rejects(_forge(frame, body=body(1.0, bytes(700) + b"\x80" + bytes(323))), "int8 code -128 near value 700",
                  out_piece=512)
    assert got == np.float32(1.0).tobytes() + bytes(508)  # the scale and the first whole piece; not the bad one
    frame4 = _frame(n=65, bits=4, block=64)  # 2 scales, 33 payload bytes
    scales = np.ones(2, np.float32).tobytes()
    rejects(_forge(frame4, body=zstandard.ZstdCompressor().compress(scales + bytes(3) + b"\x80" + bytes(29))),
            "nibble 0b1000 near value 6", n=65, bits=4, block=64)
    rejects(_forge(frame4, body=zstandard.ZstdCompressor().compress(scales + bytes(32) + b"\x11")),
            "padding nibble", n=65, bits=4, block=64)
    frame32 = _frame(n=4, bits=32)
    raw = np.array([1, 2, np.inf, 4], np.float32).tobytes()
    for out_piece in (3, 1 << 20):  # a float split across output pieces, or not
        rejects(_forge(frame32, body=zstandard.ZstdCompressor().compress(raw)), "non-finite value at index 2",
                n=4, bits=32, out_piece=out_piece)

    dead = codec.FrameValidator(1024, 8, 1024, out=lambda _: None)
    with pytest.raises(CodecError, match="trailing garbage"):
        dead.feed(frame + b"x")
    with pytest.raises(CodecError, match="validator closed: an earlier error"):
        dead.feed(b"")
    done = codec.FrameValidator(1024, 8, 1024, out=lambda _: None)
    done.feed(frame)
    done.finish()
    with pytest.raises(CodecError, match="validator closed: finish"):
        done.feed(b"")


@given(n=st.integers(1, 3000), bits=st.sampled_from(ALL_BITS), block=st.sampled_from([64, 130, 1024]),
       weight=st.sampled_from([1.0, 0.37, 3e-5]), scratch=st.booleans(), seed=st.integers(0, 1000))
@FAST
def test_the_merge_sum_and_the_norm_are_the_decoder_s_values(n: int, bits: codec.Bits, block: int, weight: float,
                                                               scratch: bool, seed: int) -> None:
    """``dequantize_add`` (the outer step's sum) adds exactly ``dequantize_segment``'s float32 values (scales times
    the weight), and ``block_sum_squares`` (the push norm) is Σ level² per block of the same values, exactly."""
    rng = np.random.default_rng(seed)
    q = quantize(rng.standard_normal(n).astype(np.float32), bits, block)
    out = rng.standard_normal(n).astype(np.float32)
    w = np.float32(weight)
    want = out + (codec.dequantize_segment(bits, block, q.scales * w, q.payload, n) if bits != 32
                  else codec.dequantize_segment(bits, block, q.scales, q.payload, n) * w)  # lossless: no scales
    codec.dequantize_add(bits, block, q.scales, q.payload, out, weight=weight,
                         scratch=np.empty(n, np.float32) if scratch else None)
    assert np.array_equal(out, want)
    if bits != 32:
        levels = codec.dequantize_segment(bits, block, np.ones_like(q.scales), q.payload, n).astype(np.float64)
        padded = np.concatenate([levels, np.zeros(-n % block)]).reshape(-1, block)
        assert np.array_equal(codec.block_sum_squares(bits, block, q.payload, n), (padded ** 2).sum(axis=1))
        if bits in (4, "e3m0") and n % 2:  # the last byte's high nibble is padding, not a value: not counted
            dirty = q.payload.copy()
            dirty[-1] |= 0x70
            assert np.array_equal(codec.block_sum_squares(bits, block, dirty, n), (padded ** 2).sum(axis=1))


def test_crc32_combine_matches_zlib() -> None:
    rng = np.random.default_rng(0)
    for a_len, b_len in [(0, 0), (0, 5), (5, 0), (1, 1), (1000, 1 << 20), (3, 12345)]:
        a, b = rng.bytes(a_len), rng.bytes(b_len)
        assert codec.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    with pytest.raises(ValueError, match="len2"):
        codec.crc32_combine(0, 0, -1)


def test_spec_size_counts_the_flat_vector() -> None:
    tree = {"a": np.zeros((3, 4), np.float32), "b": {"c": np.zeros((), np.float32), "d": np.zeros(0, np.float32)}}
    spec, vec = codec.flatten(tree)
    assert codec.spec_size(spec) == vec.size == 13
    with pytest.raises(CodecError, match="bad shape"):
        codec.spec_size([["a", [-1], "float32"]])


@pytest.mark.parametrize("n", [0, 1, 1000, codec.quant.SUM_SQUARES_PIECE, 3 * codec.quant.SUM_SQUARES_PIECE + 17])
def test_sum_squares_is_the_float64_sum_to_float32_rounding(n: int, tmp_path) -> None:
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * rng.choice([1e-4, 1.0, 1e3], n)).astype(np.float32)
    exact = float(np.sum(x.astype(np.float64) ** 2))
    got = codec.sum_squares(x)
    assert isinstance(got, float) and got == pytest.approx(exact, rel=1e-6, abs=0)
    path = tmp_path / "v.f32"  # a memory map of a file, read piece by piece (nothing model-sized in memory)
    x.tofile(path)
    assert codec.sum_squares(np.memmap(path, "<f4", mode="r") if n else np.zeros(0, np.float32)) == got
    assert codec.sum_squares(x.reshape(-1, 1)) == got
    assert np.isnan(codec.sum_squares(np.array([1.0, np.nan], np.float32)))
    big = np.array([3e38, 1.0], np.float32)  # its float32 squares overflow: that piece is summed in float64
    assert codec.sum_squares(big) == pytest.approx(float(np.float64(big[0]) ** 2 + 1.0), rel=1e-12)


@pytest.mark.filterwarnings("error")  # an overflow (RuntimeWarning) on the way fails the test
def test_sum_squares_of_values_near_the_float32_max_is_finite_and_exact() -> None:
    """Values whose float32 squares (or their float32 sum) would overflow are summed in float64: no overflow
    anywhere, a finite sum, equal to the float64 one; a piece of ordinary values keeps its float32 sum."""
    top = np.finfo(np.float32).max
    piece = codec.quant.SUM_SQUARES_PIECE
    rng = np.random.default_rng(7)
    x = rng.standard_normal(3 * piece + 5).astype(np.float32)
    x[piece + 3] = top  # the second piece alone holds huge values
    x[piece + 9] = -top
    x[2 * piece + 1] = np.float32(1e17)  # the third: a square that fits float32, but not the piece's float32 sum
    x[2 * piece + 2:3 * piece] = np.float32(1e17)
    got = codec.sum_squares(x)
    exact = float(np.sum(x.astype(np.float64) ** 2))
    assert np.isfinite(got) and got == pytest.approx(exact, rel=1e-12)
    first = float(np.square(x[:piece], dtype=np.float32).sum())  # the ordinary first piece: its float32 sum
    assert codec.sum_squares(x[:piece]) == first
    full = np.full(piece, -top, np.float32)
    assert codec.sum_squares(full) == pytest.approx(piece * float(top) ** 2, rel=1e-12)
    assert np.isnan(codec.sum_squares(np.array([top, np.nan], np.float32)))
