"""Stored frames (codec.STORED: the body without zstd, flags bit 0): written and read by the one writer and the one
reader, in any pieces, for every dense scheme, and every hostile variant refused with the check that names it."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from codec_helpers import forge
from dtrain import codec

N, BLOCK = 5000, 64


def _frame(bits: codec.Bits = 8, seed: int = 0) -> tuple[codec.QuantizedVec, bytes]:
    q = codec.quantize(np.random.default_rng(seed).normal(size=N).astype(np.float32), bits, BLOCK)
    return q, codec.encode(q, codec.STORED)


@pytest.mark.parametrize("bits", [8, 4, 2, "e3m0", 32])
@pytest.mark.parametrize("piece", [1, 777, 1 << 20])
def test_a_stored_frame_decodes_to_the_same_values_fed_in_any_pieces(bits, piece):
    q, frame = _frame(bits)
    head = codec.FrameValidator(N, bits, BLOCK, out=lambda _: None)
    head.feed(frame[:codec.HEADER_SIZE])
    assert head.header is not None and head.header.stored
    assert len(frame) == codec.HEADER_SIZE + head.header.scales_len + head.header.payload_len  # no zstd framing
    body = bytearray()
    v = codec.FrameValidator(N, bits, BLOCK, out=body.extend)
    for k in range(0, len(frame), piece):
        v.feed(memoryview(frame)[k:k + piece])
    v.finish()
    assert bytes(body) == q.scales.astype("<f4").tobytes() + q.payload.tobytes()
    np.testing.assert_array_equal(codec.dequantize(codec.decode(frame, expected_n=N)), codec.dequantize(q))


def test_hostile_stored_frames_are_refused_by_name():
    q, frame = _frame(8)
    body = frame[codec.HEADER_SIZE:]
    scales_len = 4 * q.scales.size
    cases = [
        (forge(frame, body + b"\x01"), r"stored body of \d+ bytes: must be the scales' \d+ \+ the payload's"),
        (forge(frame, body, flags=3), r"header flags 0x0003"),
        (forge(frame, body[:scales_len] + b"\x80" + body[scales_len + 1:]), r"invalid int8 code -128 near value 0"),
        (forge(frame, struct.pack("<f", float("nan")) + body[4:]), r"invalid scale .*nan.* for block 0"),
        (frame[:-1], r"frame truncated"),
        (frame[:codec.HEADER_SIZE] + bytes([frame[codec.HEADER_SIZE] ^ 1]) + frame[codec.HEADER_SIZE + 1:],
         r"CRC32 mismatch"),  # the first scale's lowest mantissa bit: still a valid scale
    ]
    for bad, why in cases:
        with pytest.raises(codec.CodecError, match=why):
            codec.decode(bad, expected_n=N)


def test_a_stored_int4_frame_with_a_padding_nibble_is_refused():
    q = codec.quantize(np.random.default_rng(1).normal(size=N + 1).astype(np.float32), 4, BLOCK)
    frame = codec.encode(q, codec.STORED)
    body = bytearray(frame[codec.HEADER_SIZE:])
    body[-1] |= 0x10
    with pytest.raises(codec.CodecError, match="padding nibble"):
        codec.decode(forge(frame, bytes(body)), expected_n=N + 1)


def test_stored_is_a_level_of_its_own_and_zstd_levels_still_compress():
    q, stored = _frame(4)
    zstd = codec.encode(q, 3)
    assert len(zstd) < len(stored)  # int4 codes compress: the codecs other than int8 keep zstd by default
    with pytest.raises(codec.CodecError, match="zstd level must be an int"):
        codec.encode(q, codec.STORED + 1)
