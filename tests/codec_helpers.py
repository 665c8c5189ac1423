"""What the codec's tests share (test_codec.py, test_codec_reader.py, test_int2.py, test_stored.py): hypothesis's
settings, the codecs' bit widths, and :func:`forge`, which rewrites a frame's header or body."""

import struct
import zlib

from hypothesis import settings

from dtrain import codec

FAST = settings(max_examples=40, deadline=None, derandomize=True, database=None)
ALL_BITS = [8, 4, "e3m0", 32]

HEADER = struct.Struct("<4sBBHIQQQQI")  # the frame header's layout, written out here, not taken from the codec
_FIELDS = ["magic", "version", "bits", "flags", "block", "n", "scales_len", "payload_len", "body_len", "crc"]


def forge(frame: bytes, body: bytes | None = None, **fields: int) -> bytes:
    """Rewrite header fields (and/or the body) and re-seal the CRC (unless ``crc`` is given), so only the intended
    fault remains."""
    values = dict(zip(_FIELDS, HEADER.unpack_from(frame), strict=True))
    body = frame[codec.HEADER_SIZE:] if body is None else body
    values["body_len"] = len(body)
    values.update(fields)
    head = HEADER.pack(*[values[k] for k in _FIELDS])[:44]
    crc = zlib.crc32(body, zlib.crc32(head)) if "crc" not in fields else fields["crc"]
    return head + struct.pack("<I", crc) + body
