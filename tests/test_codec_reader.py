"""dtrain.codec's frame reader: what decode refuses (forged headers, zip bombs, short bodies, non-finite values)
and the validation without decoding (codec.FrameValidator) the coordinator's spool runs, its sums and norms.

numpy only (no JAX), deterministic seeds, hypothesis derandomized; the whole file runs in seconds.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from codec_helpers import ALL_BITS, FAST, HEADER, forge
from dtrain import codec
from dtrain.codec import (
    HEADER_SIZE,
    WINDOW_LOG,
    CodecError,
    decode,
    encode,
    quantize,
)

# --------------------------------------------------------------------------- decode rejects



def _frame(n: int = 3000, bits: codec.Bits = 8, block: int = 1024) -> bytes:
    x = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    return encode(quantize(x, bits, block))


def test_forge_helper_reproduces_valid_frames() -> None:
    frame = _frame()
    assert forge(frame) == frame


@pytest.mark.parametrize("mutate, match", [
    (lambda f: b"DTRX" + f[4:], r"bad magic b'DTRX'"),
    (lambda f: forge(f, version=2), r"unsupported format version 2"),
    (lambda f: forge(f, bits=5), r"unknown bits code 5"),
    (lambda f: forge(f, flags=2), r"header flags 0x0002: only bit 0"),
    (lambda f: forge(f, flags=1), r"stored body of \d+ bytes: must be the scales' \d+ \+ the payload's"),
    (lambda f: forge(f, block=32), r"block 32 out of range"),
    (lambda f: forge(f, block=1025), r"block 1025 out of range"),
    (lambda f: f[:20], r"frame truncated: 20 bytes, the header alone needs 48"),
    (lambda f: f[:-100], r"frame truncated: header says \d+ body bytes, got \d+"),
    (lambda f: f + b"junk", r"trailing garbage: 4 bytes"),
    (lambda f: forge(f, crc=HEADER.unpack_from(f)[-1] ^ 1), r"CRC32 mismatch"),  # body intact, CRC field off
    (lambda f: f[:60] + bytes([f[60] ^ 0x01]) + f[61:], r"CRC32 mismatch|zstd decompression failed|invalid"),
    (lambda f: f[:-5] + bytes([f[-5] ^ 0x40]) + f[-4:], r"CRC32 mismatch|zstd decompression failed|invalid"),
    (lambda f: f[:12] + bytes([f[12] ^ 0x01]) + f[13:], r"inconsistent with n=3001"),  # n flipped, CRC would catch too
    (lambda f: forge(f, n=2500), r"payload length 3000 inconsistent with n=2500"),
    (lambda f: forge(f, n=2000), r"scales length 12 inconsistent with n=2000"),
    (lambda f: forge(f, scales_len=8), r"scales length 8 inconsistent with n=3000, block=1024"),
    (lambda f: forge(f, payload_len=2999), r"payload length 2999 inconsistent"),
    (lambda f: forge(f, body=b"not zstd at all"), r"zstd decompression failed"),
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
        decode(forge(frame, body=bomb))
    lying = _zstd(bytes(50_000_000))  # content size in the zstd frame, too
    with pytest.raises(CodecError, match="zip bomb"):
        decode(forge(frame, body=lying))


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
        decode(forge(frame, body=wide))
    assert decode(forge(frame, body=_zstd(np.float32(1.0).tobytes() + bytes(1024)))).n == 1024  # the codec's: fine


def test_decode_rejects_short_body_and_forged_values() -> None:
    frame = _frame(n=1024)
    short = zstandard.ZstdCompressor().compress(bytes(1000))
    with pytest.raises(CodecError, match=r"body decompresses to 1000 bytes, header declares 1028"):
        decode(forge(frame, body=short))
    with pytest.raises(CodecError, match=r"header says n=1024, expected n=999"):
        decode(frame, expected_n=999)

    def body(scale: float, codes: bytes) -> bytes:
        return zstandard.ZstdCompressor().compress(np.float32(scale).tobytes() + codes)

    with pytest.raises(CodecError, match="invalid scale"):
        decode(forge(frame, body=body(np.nan, bytes(1024))))
    with pytest.raises(CodecError, match="invalid scale"):
        decode(forge(frame, body=body(-1.0, bytes(1024))))
    with pytest.raises(CodecError, match="invalid scale"):  # 127·scale would overflow to inf
        decode(forge(frame, body=body(3e38, bytes(1024))))
    with pytest.raises(CodecError, match="invalid int8 code -128 near value 5"):
        decode(forge(frame, body=body(1.0, bytes(5) + b"\x80" + bytes(1018))))
    frame4 = _frame(n=65, bits=4, block=64)  # 2 scales, 33 payload bytes
    scales = np.ones(2, np.float32).tobytes()
    with pytest.raises(CodecError, match="nibble 0b1000"):
        decode(forge(frame4, body=zstandard.ZstdCompressor().compress(scales + b"\x80" + bytes(32))))
    with pytest.raises(CodecError, match="padding nibble"):
        decode(forge(frame4, body=zstandard.ZstdCompressor().compress(scales + bytes(32) + b"\x11")))
    frame32 = _frame(n=4, bits=32)
    with pytest.raises(CodecError, match="non-finite value at index 2"):
        raw = np.array([1, 2, np.inf, 4], np.float32).tobytes()
        decode(forge(frame32, body=zstandard.ZstdCompressor().compress(raw)))


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
    rejects(forge(frame, crc=HEADER.unpack_from(frame)[-1] ^ 1), "CRC32 mismatch")
    flipped = bytearray(frame)
    flipped[-5] ^= 0x40  # a flipped body byte: zstd, the value checks or the CRC must catch it
    rejects(bytes(flipped), r"CRC32 mismatch|zstd decompression failed|invalid")
    # The same with the pieces' CRCs given (the wire checked them): the frame's CRC is combined from them, and a
    # header CRC that does not match the body is still caught, wherever the header ends in the pieces.
    for piece in (1, 20, 48, 97, 2000):
        assert _validate(frame, 1024, 8, 1024, piece=piece, with_crc=True) == ok
        with pytest.raises(CodecError, match="CRC32 mismatch"):
            _validate(forge(frame, crc=HEADER.unpack_from(frame)[-1] ^ 1), 1024, 8, 1024, piece=piece,
                      with_crc=True)
    with pytest.raises(CodecError, match="CRC32 mismatch"):  # a piece whose given CRC is not its bytes'
        v = codec.FrameValidator(1024, 8, 1024, out=lambda _: None)
        v.feed(frame, zlib.crc32(frame) ^ 1)
        v.finish()
    rejects(forge(frame, body=b"not zstd at all"), "zstd decompression failed")
    bomb = _zstd(bytes(50_000_000), content_size=False)
    rejects(forge(frame, body=bomb), r"more than the 1028 bytes the header declares \(zip bomb\?\)")
    rejects(forge(frame, body=zstandard.ZstdCompressor().compress(bytes(1000))),
            r"body decompresses to 1000 bytes, header declares 1028")

    def body(scale: float, codes: bytes) -> bytes:
        return zstandard.ZstdCompressor().compress(np.float32(scale).tobytes() + codes)

    for scale in (np.nan, -1.0, 3e38):
        assert rejects(forge(frame, body=body(scale, bytes(1024))), "invalid scale") == b""  # nothing out
    got = rejects(forge(frame, body=body(1.0, bytes(700) + b"\x80" + bytes(323))), "int8 code -128 near value 700",
                  out_piece=512)
    assert got == np.float32(1.0).tobytes() + bytes(508)  # the scale and the first whole piece; not the bad one
    frame4 = _frame(n=65, bits=4, block=64)  # 2 scales, 33 payload bytes
    scales = np.ones(2, np.float32).tobytes()
    rejects(forge(frame4, body=zstandard.ZstdCompressor().compress(scales + bytes(3) + b"\x80" + bytes(29))),
            "nibble 0b1000 near value 6", n=65, bits=4, block=64)
    rejects(forge(frame4, body=zstandard.ZstdCompressor().compress(scales + bytes(32) + b"\x11")),
            "padding nibble", n=65, bits=4, block=64)
    frame32 = _frame(n=4, bits=32)
    raw = np.array([1, 2, np.inf, 4], np.float32).tobytes()
    for out_piece in (3, 1 << 20):  # a float split across output pieces, or not
        rejects(forge(frame32, body=zstandard.ZstdCompressor().compress(raw)), "non-finite value at index 2",
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


@pytest.mark.parametrize("n", [0, 1, 1000, codec.squares.SUM_SQUARES_PIECE, 3 * codec.squares.SUM_SQUARES_PIECE + 17])
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
    piece = codec.squares.SUM_SQUARES_PIECE
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
