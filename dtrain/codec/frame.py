"""Frames: a quantized vector as bytes, with one writer (:func:`write_frame`) and one reader (:class:`FrameValidator`).

Frame layout (all integers little endian)
-----------------------------------------
::

    offset size  field
     0      4    magic        b"DTRC"
     4      1    version      u8, currently 1
     5      1    bits code    u8: 8, 4, 2, 32, 0xE3 for "e3m0", 0x52/0x54/0x58 for "sparse2"/"sparse4"/"sparse8",
                              0x4D for "mask2"
     6      2    flags        u16: bit 0 set = the body is stored (no zstd); every other bit must be 0
     8      4    block        u32, even, in [64, 65536] (bits=2: a multiple of 4)
    12      8    n            u64, number of values
    20      8    scales_len   u64, bytes of scales = 4·ceil(n/block) (0 for bits=32)
    28      8    payload_len  u64, bytes of payload = n (int8), ceil(n/2) (4-bit), ceil(n/4) (2-bit),
                              4n (bits=32); sparse:
                              counts ‖ records, whatever the counts make (at most what the receiver's
                              per-chunk bound allows); mask2: seed ‖ density ‖ records, what they make
    36      8    body_len     u64, bytes of compressed body following the header
    44      4    crc32        u32, zlib CRC32 of header bytes [0, 44) followed by the body
    48   body_len body        one zstd frame; decompresses to exactly
                              scales (float32 LE, one per block, in order) ‖ payload;
                              stored (flags bit 0): those bytes as they are (body_len =
                              scales_len + payload_len)

The frame is exactly 48 + body_len bytes. The scales and the payload codes are
described in ``dtrain.codec.quant`` (sparse schemes: ``dtrain.codec.sparse``, mask2: ``dtrain.codec.masked``;
their ``block`` is the chunk). Scales come first, so a reader checks all
of them (n/block floats) before the first code arrives.

Writing. :func:`write_frame` writes a frame to a seekable binary file from
pieces: the scales, then the payload in any number of pieces (from memory or
read from a file), compressed as they come (single-threaded zstd with a
1 MiB window, :data:`WINDOW_LOG`, at every level; memory O(piece); zstd's
multi-threaded mode is barely faster on int8 codes, which hardly compress,
and holds ~60 MiB of job buffers), the
header written last, in place, once the body's length and CRC are known;
nothing is read back. It returns the frame's size and the CRC32 of the whole
frame (what the wire's chunk stream carries). :func:`encode` is
:func:`write_frame` into memory.

Reading. :class:`FrameValidator` takes a frame in pieces of any size and hands
out the decompressed body (scales ‖ payload), each piece only after its checks.
It checks, in this order: as soon as the 48 header bytes are in, the magic,
version, flags, bits code, block, n (against the expected n), the two
lengths against n/block/bits (a stored body's length against both), and bits/block against the expected ones; with
every input piece, that it does not run past body_len, then zstd's own errors
(one is a frame asking for a window over :data:`WINDOW_LOG`: a decoder never
holds more than 1 MiB of window) and a decompression bounded by scales_len + payload_len (a "zip bomb" that
expands beyond it is stopped after at most one output piece); all scales
(finite, ≥ 0 and small enough that dequantized values stay finite) before any
code; every code as it is decompressed (no invalid code; sparse: the counts against the chunk
and the receiver's ``max_count``, then every chunk's record, indices and padding,
by :class:`~dtrain.codec.sparse.SparseChecker`; mask2: the payload's length against the mask its seed and density
make, then every chunk's padding, by :class:`~dtrain.codec.masked.MaskChecker`); and at the end
(:meth:`FrameValidator.finish`) a truncated header or body, the CRC32, the
exact decompressed size and the padding nibble. :func:`decode` feeds a whole
frame through it. Hence nothing that :func:`decode` returns can dequantize to
NaN/Inf.
"""

from __future__ import annotations

import functools
import io
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, BinaryIO, Final

import numpy as np
import zstandard

try:  # ISA-L's CRC32: zlib's polynomial and values, ~20x faster where it has its SIMD kernels (x86-64, arm64)
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - a platform without isal's wheels: zlib's, the same values
    from zlib import crc32 as _crc32

from dtrain.codec import int2, masked
from dtrain.codec.masked import MASK_BITS, MaskChecker, has_records
from dtrain.codec.quant import (
    MAX_BLOCK,
    MIN_BLOCK,
    Bits,
    QuantizedVec,
    canonical_bits,
    check_block,
    check_codes,
    check_scales,
    n_scales,
    payload_len,
)
from dtrain.codec.sparse import MAX_CHUNK, SparseChecker, is_sparse, max_payload_len
from dtrain.codec.spec import CodecError

__all__ = [
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "STORED",
    "MAGIC",
    "FrameHeader",
    "FrameValidator",
    "compression_ratio",
    "crc32",
    "crc32_combine",
    "decode",
    "encode",
    "write_frame",
]

BytesLike = bytes | bytearray | memoryview | np.ndarray  # contiguous bytes (arrays are read as their bytes)

MAGIC: Final = b"DTRC"
FORMAT_VERSION: Final = 1
# write_frame's level for a stored body: no zstd (flags bit 0). Codes zstd cannot shrink (int8 deltas: 3.98x against
# fp32 stored, 3.99x at level 3) cost both ends its passes for nothing; a reader hands a stored body out as it comes.
STORED: Final = -(1 << 20)
_FLAG_STORED: Final = 1

_HEADER: Final = struct.Struct("<4sBBHIQQQQI")
HEADER_SIZE: Final = _HEADER.size  # 48
_CRC_OFFSET: Final = HEADER_SIZE - 4  # the CRC covers header bytes [0, 44) and the body

_BITS_CODE: Final[dict[Bits, int]] = {8: 8, 4: 4, 2: 2, 32: 32, "e3m0": 0xE3, "sparse2": 0x52, "sparse4": 0x54,
                                      "sparse8": 0x58, "mask2": 0x4D}
_CODE_BITS: Final[dict[int, Bits]] = {code: bits for bits, code in _BITS_CODE.items()}

_DECODE_PIECE: Final = 1 << 20  # decode's zstd output pieces: a whole frame in memory, few Python calls


@dataclass(frozen=True)
class FrameHeader:
    """A frame's 48 header bytes, parsed and checked (see the layout in the module docstring)."""

    bits: Bits
    block: int
    n: int
    scales_len: int
    payload_len: int
    body_len: int
    crc32: int
    raw: bytes  # the 48 header bytes
    stored: bool = False  # the body is scales ‖ payload as they are, no zstd (flags bit 0)


def _check_level(level: Any) -> int:
    if isinstance(level, bool) or not isinstance(level, int) or not (-(1 << 17) <= level <= 22 or level == STORED):
        raise CodecError(f"zstd level must be an int in [-131072, 22] (or STORED), got {level!r}")
    return level


def write_frame(out: BinaryIO, bits: Bits, block: int, n: int, scales: np.ndarray, payload: Iterable[BytesLike],
                level: int = 3, payload_size: int | None = None) -> tuple[int, int]:
    """Writes one frame to ``out`` (binary, seekable) from its current position: the encoder's one writer.

    Args:
        out: the file; left at the frame's end.
        bits, block, n: the scheme, the block size and the number of values.
        scales: float32, one per block (empty for bits=32).
        payload: the payload bytes in pieces of any size (one array in memory, or a file read piece by piece),
            ``payload_len(bits, n)`` bytes in all; each is compressed as it comes, so memory stays O(piece).
        level: the zstd level (an int in [-131072, 22]), or :data:`STORED`: the body as it is, no zstd.
        payload_size: the payload's bytes; required for a sparse scheme (its size depends on its counts), and
            for the others, if given, must be ``payload_len(bits, n)``.

    Returns:
        ``(frame size, CRC32 of the whole frame)``: what the wire's chunk stream carries (the body is never read
        back: its CRC32, taken as it is written, is combined with the header's by :func:`crc32_combine`).

    Raises:
        CodecError: bad arguments, scales or payload of the wrong size, or a zstd error.
    """
    bits, block, level = canonical_bits(bits), check_block(block), _check_level(level)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise CodecError(f"n must be a non-negative int, got {n!r}")
    n = int(n)
    scale_array = np.ascontiguousarray(scales, dtype="<f4")
    want_scales = n_scales(bits, n, block)
    if has_records(bits):
        if payload_size is None:
            raise CodecError(f"write_frame needs payload_size for the {bits} scheme")
        want_payload = int(payload_size)
    else:
        want_payload = payload_len(bits, n)
        if payload_size is not None and payload_size != want_payload:
            raise CodecError(f"payload_size {payload_size} for n={n} bits={bits}, which needs {want_payload}")
    if scale_array.shape != (want_scales,):
        raise CodecError(f"write_frame got {scale_array.size} scales, n={n} block={block} bits={bits} "
                         f"needs {want_scales}")
    start = out.tell()
    out.write(bytes(HEADER_SIZE))
    body_crc = body_len = got = 0

    def emit(data: bytes | memoryview) -> None:
        nonlocal body_crc, body_len
        body_crc = crc32(data, body_crc)
        body_len += len(data)
        out.write(data)

    stored = level == STORED
    try:
        size = scale_array.nbytes + want_payload
        cobj: Any = None
        if not stored:
            params = zstandard.ZstdCompressionParameters.from_level(level, source_size=size, window_log=WINDOW_LOG)
            cobj = zstandard.ZstdCompressor(compression_params=params).compressobj(size=size)
        emit(scale_array.data.cast("B") if stored else cobj.compress(scale_array.data))
        for piece in payload:
            data = (np.ascontiguousarray(piece).data if isinstance(piece, np.ndarray) else memoryview(piece)).cast("B")
            got += data.nbytes
            if got > want_payload:
                raise CodecError(f"write_frame got more than the {want_payload} payload bytes of n={n} bits={bits}")
            emit(data if stored else cobj.compress(data))
        if got != want_payload:
            raise CodecError(f"write_frame got {got} payload bytes, n={n} bits={bits} needs {want_payload}")
        if not stored:
            emit(cobj.flush())
    except zstandard.ZstdError as e:
        raise CodecError(f"zstd compression failed (level {level}): {e}") from e
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, _BITS_CODE[bits], _FLAG_STORED if stored else 0, block, n,
                        scale_array.nbytes, want_payload, body_len, 0)[:_CRC_OFFSET]
    head += crc32_combine(crc32(head), body_crc, body_len).to_bytes(4, "little")  # header[:44] ‖ body
    out.seek(start)
    out.write(head)
    out.seek(start + HEADER_SIZE + body_len)
    return HEADER_SIZE + body_len, crc32_combine(crc32(head), body_crc, body_len)  # the whole frame


def encode(q: QuantizedVec, level: int = 3) -> bytes:
    """Frame a QuantizedVec in memory: :func:`write_frame` into a bytes buffer.

    Args:
        q: the quantized vector (:func:`dtrain.codec.quantize`, or ``ErrorFeedback.compress``).
        level: zstd level (3 is fast and already gets what there is to get from quantized codes; negative
            levels are faster still).

    Returns:
        The whole frame (header ‖ zstd body), ready for :func:`decode` or the wire's chunks.

    Raises:
        CodecError: a bad ``level`` or a zstd error.
    """
    out = io.BytesIO()
    write_frame(out, q.bits, q.block, q.n, q.scales, (q.payload,), level, payload_size=q.payload.size)
    return out.getvalue()


def _parse_header(raw: bytes | bytearray, n: int | None, bits: Bits | None, block: int | None,
                  max_count: int | None = None) -> FrameHeader:
    """The fixed header, checked in itself and against the n/bits/block a receiver expects (None: any), and a
    sparse frame's payload length against the most its chunks may hold (``max_count`` per chunk; None: all)."""
    magic, version, code, flags, got_block, got_n, scales_len, got_payload, body_len, crc = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise CodecError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CodecError(f"unsupported format version {version} (this build reads {FORMAT_VERSION})")
    if flags & ~_FLAG_STORED:
        raise CodecError(f"header flags {flags:#06x}: only bit 0 (a stored body) is defined, the others must be 0")
    if code not in _CODE_BITS:
        raise CodecError(f"unknown bits code {code} (known: 8, 4, 2, 32, 0xE3 for e3m0, 0x52/0x54/0x58 for sparse, "
                         "0x4D for mask2)")
    got_bits = _CODE_BITS[code]
    if not MIN_BLOCK <= got_block <= MAX_BLOCK or got_block % 2:
        raise CodecError(f"block {got_block} out of range: must be even and in [{MIN_BLOCK}, {MAX_BLOCK}]")
    if got_bits == 2 and (why := int2.check_block(got_block)):
        raise CodecError(why)
    if n is not None and got_n != n:
        raise CodecError(f"header says n={got_n}, expected n={n}")
    want_scales = 4 * n_scales(got_bits, got_n, got_block)
    if scales_len != want_scales:
        raise CodecError(f"scales length {scales_len} inconsistent with n={got_n}, block={got_block}, "
                         f"bits={got_bits} (expected {want_scales})")
    if is_sparse(got_bits):
        if got_block > MAX_CHUNK:
            raise CodecError(f"sparse chunk {got_block} out of range: at most {MAX_CHUNK}")
        low = 2 * n_scales(got_bits, got_n, got_block)
        high = max_payload_len(got_bits, got_n, got_block, got_block if max_count is None else max_count)
        if not low <= got_payload <= high:
            raise CodecError(f"sparse payload length {got_payload} outside [{low}, {high}] for n={got_n}, "
                             f"chunk={got_block}, at most {got_block if max_count is None else max_count} "
                             "entries per chunk")
    elif got_bits == MASK_BITS:
        high = masked.max_payload_len(got_n, got_block)
        if not masked.DESCRIPTOR_SIZE <= got_payload <= high:
            raise CodecError(f"mask payload length {got_payload} outside [{masked.DESCRIPTOR_SIZE}, {high}] for "
                             f"n={got_n}, chunk={got_block}")
    elif got_payload != (want_payload := payload_len(got_bits, got_n)):
        raise CodecError(f"payload length {got_payload} inconsistent with n={got_n}, bits={got_bits} "
                         f"(expected {want_payload})")
    if (bits is not None and got_bits != bits) or (block is not None and got_block != block):
        raise CodecError(f"frame header says bits={got_bits} block={got_block}, "
                         f"expected bits={bits} block={block}")
    stored = bool(flags & _FLAG_STORED)
    if stored and body_len != scales_len + got_payload:
        raise CodecError(f"stored body of {body_len} bytes: must be the scales' {scales_len} + the payload's "
                         f"{got_payload}")
    return FrameHeader(got_bits, got_block, got_n, scales_len, got_payload, body_len, crc, bytes(raw[:HEADER_SIZE]),
                       stored)


# zstd's window (log2 bytes) for every frame, whatever the level: each receiver's decompression context holds one
# window, so this bounds its memory (1 MiB; zstd's default lets a frame ask for 128 MiB, and a coordinator decodes
# many pushes at once). Quantized codes have no long-range repeats: a 2 MiB window (level 3's own) compresses an
# int8 frame to the same size, and a 128 KiB one does too.
WINDOW_LOG: Final = 20


def _push(writer: Any, data: bytes | memoryview) -> None:
    try:
        writer.write(data)
    except zstandard.ZstdError as e:
        hint = f" (a frame's zstd window may be at most {1 << WINDOW_LOG} bytes)" if "memory" in str(e) else ""
        raise CodecError(f"zstd decompression failed: {e}{hint}") from e


class FrameValidator:
    """Checks a frame fed in pieces, completely, without dequantizing anything: the header against the
    receiver's n/bits/block as soon as it is in, every decompressed piece as zstd hands it out (all scales
    first, then every code), and in :meth:`finish` the length, the CRC32 and the exact decompressed size
    (the module docstring lists the checks in order).

    Args:
        expected_n, bits, block: what the receiver expects; None accepts whatever the header says
            (:func:`decode` without ``expected_n``).
        out: receives the decompressed body (scales ‖ payload) in order, each piece only after its checks
            (the piece is not retained: copy or write it).
        out_piece: the largest piece zstd hands out at once (bytes).
        max_count: sparse frames: the most entries a chunk may hold (the receiver's density bound; None: the
            whole chunk). A frame with more is refused.

    Raises:
        CodecError: a bad ``expected_n``, ``bits`` or ``block``.

    Use: :meth:`feed` the frame's bytes in order, then :meth:`finish`. :attr:`header` is the parsed header once
    its 48 bytes are in. What ``out`` has stored is the whole, checked body once
    ``finish()`` returns; if any call raises, throw it away. Decompression is bounded by the size the header
    declares (a zip bomb is stopped after one output piece). Few Python calls per input byte: whole input
    pieces go to zstd, whose output comes in pieces of up to ``out_piece`` bytes.
    """

    def __init__(self, expected_n: int | None, bits: Bits | None = None, block: int | None = None, *,
                 out: Callable[[bytes | bytearray | memoryview], Any], out_piece: int = 1 << 18,
                 max_count: int | None = None):
        if expected_n is not None and (isinstance(expected_n, bool) or not isinstance(expected_n, int)
                                       or expected_n < 0):
            raise CodecError(f"expected_n must be a non-negative int, got {expected_n!r}")
        self.n = expected_n
        self.bits: Bits | None = None if bits is None else canonical_bits(bits)
        self.block = None if block is None else check_block(block)
        self.out = out
        self._out_piece = out_piece
        self._head = bytearray()
        self.header: FrameHeader | None = None
        self._writer: Any = None
        self._crc = 0
        self._body_received = 0
        self._total = 0  # decompressed bytes so far
        self._scales = bytearray()
        self._carry = b""  # bits=32: bytes of a float32 split across output pieces
        self._last = 0  # the last payload byte (4-bit schemes: its high nibble may be padding)
        self._closed: str | None = None
        if max_count is not None and (isinstance(max_count, bool) or not isinstance(max_count, int)
                                      or max_count < 1):
            raise CodecError(f"max_count must be a positive int, got {max_count!r}")
        self.max_count = max_count
        # a sparse (mask) frame's payload checker, once its scales are in
        self.sparse: SparseChecker | MaskChecker | None = None

    def feed(self, data: bytes | bytearray | memoryview, crc32: int | None = None) -> None:
        """Takes the next piece of the frame (any size, in order) and hands the decompressed bytes it completes to
        ``out`` once checked. Raises CodecError as soon as something is wrong (then the validator is dead: every
        later call raises too). ``crc32``: ``crc32(data)`` where the caller has computed it already (a chunk
        whose CRC the wire checked): the frame's CRC is combined from it instead of a second pass over the bytes."""
        if self._closed is not None:
            raise CodecError(f"validator closed: {self._closed}")
        try:
            self._feed(memoryview(data).cast("B"), crc32)
        except CodecError as e:
            self._closed = f"an earlier error ({e})"
            self._writer = None  # dead: its decompression context goes now (see finish)
            raise

    def _feed(self, data: memoryview, crc: int | None) -> None:
        if self.header is None:
            take = HEADER_SIZE - len(self._head)
            head = data[:take]
            self._head += head
            data = data[take:]
            if crc is not None:  # the rest's CRC: crc32(head ‖ rest) = shift(crc32(head), len(rest)) ^ crc32(rest)
                crc ^= crc32_combine(crc32(head), 0, len(data))
            if len(self._head) < HEADER_SIZE:
                return
            header = self.header = _parse_header(self._head, self.n, self.bits, self.block, self.max_count)
            self._crc = crc32(header.raw[:_CRC_OFFSET])
            if not header.stored:  # a stored body goes to write() as it comes, in the pieces it came in
                self._writer = zstandard.ZstdDecompressor(max_window_size=1 << WINDOW_LOG).stream_writer(  # -> write
                    self, write_size=self._out_piece, write_return_read=True, closefd=False)  # type: ignore[arg-type]
        if not data:
            return
        if self._body_received + len(data) > self.header.body_len:
            extra = self._body_received + len(data) - self.header.body_len
            raise CodecError(f"trailing garbage: {extra} bytes after the {self.header.body_len}-byte body")
        self._crc = crc32(data, self._crc) if crc is None else crc32_combine(self._crc, crc, len(data))
        self._body_received += len(data)
        if self.header.stored:
            self.write(data)
        else:
            _push(self._writer, data)

    def write(self, data: bytes | memoryview) -> int:
        """zstd's output sink, and a stored body's (not for callers)."""
        header = self.header
        assert header is not None
        bits = header.bits
        size = len(data)
        if self._total + size > header.scales_len + header.payload_len:
            raise CodecError(f"body decompresses to more than the {header.scales_len + header.payload_len} bytes "
                             "the header declares (zip bomb?)")
        start = 0
        if self._total < header.scales_len:  # the scales (n/block floats): all checked before any code
            start = min(size, header.scales_len - self._total)
            self._scales += memoryview(data)[:start]
            self._total += start
            if self._total == header.scales_len:
                scales = np.frombuffer(self._scales, "<f4")
                check_scales(bits, scales, 0)
                self.out(self._scales)
                if is_sparse(bits):
                    self.sparse = SparseChecker(bits, header.block, header.n, header.payload_len,
                                                min(header.block, self.max_count or header.block), scales,
                                                self.out)
                elif bits == MASK_BITS:
                    self.sparse = MaskChecker(header.block, header.n, header.payload_len, scales, self.out)
            if start == size:
                return size
        piece = data if start == 0 else data[start:]
        if self.sparse is not None:  # counts and records, each handed out once checked
            self.sparse.feed(piece)
            self._total += size - start
            return size
        first = self._total - header.scales_len  # payload byte offset of this piece
        if bits == 32:
            if self._carry:
                piece = self._carry + bytes(piece)
                first -= len(self._carry)
            cut = len(piece) - len(piece) % 4
            piece, self._carry = piece[:cut], bytes(piece[cut:])  # a copy: a stored body's piece is not ours
            check_codes(32, piece, first // 4)
        else:
            check_codes(bits, piece, first if bits == 8 else 2 * first)
            self._last = piece[-1]
        self.out(piece)
        self._total += size - start
        return size

    def finish(self) -> None:
        """Checks the frame was complete and intact: all bytes, CRC32, exact decompressed size, padding. Call once,
        after the last :meth:`feed`; when it returns, ``out`` has had the whole, checked body. Raises CodecError
        otherwise (and on a second call)."""
        if self._closed is not None:
            raise CodecError(f"validator closed: {self._closed}")
        self._closed = "finish() was called"
        # The zstd writer refers back to this validator (its sink): dropped now, so the decompression context
        # (megabytes of native memory) is freed with the validator's last reference, not at the next cyclic GC.
        self._writer = None
        header = self.header
        if header is None:
            raise CodecError(f"frame truncated: {len(self._head)} bytes, the header alone needs {HEADER_SIZE}")
        if self._body_received < header.body_len:
            raise CodecError(f"frame truncated: header says {header.body_len} body bytes, got {self._body_received}")
        if self._crc != header.crc32:
            raise CodecError(f"CRC32 mismatch: header says {header.crc32:#010x}, computed {self._crc:#010x}")
        expected = header.scales_len + header.payload_len
        if self._total != expected or self._carry:
            raise CodecError(f"body decompresses to {self._total} bytes, header declares {expected}")
        if self.sparse is not None:
            self.sparse.finish()
        if header.bits in (4, "e3m0") and header.n % 2 and self._last >> 4:
            raise CodecError("padding nibble (high nibble of the last payload byte) must be 0")
        if header.bits == 2 and not int2.padding_ok(self._last, header.n):
            raise CodecError("padding bits (the unused high bits of the last 2-bit payload byte) must be 0")
        self._scales = bytearray()  # handed to ``out`` long ago: a validator kept after its frame holds no copy


def decode(frame: bytes | bytearray | memoryview, *, expected_n: int | None = None,
           max_count: int | None = None) -> QuantizedVec:
    """Parse and fully validate a whole frame (:class:`FrameValidator`; the checks are in the module docstring).

    Args:
        frame: the whole frame, as :func:`encode` or :func:`write_frame` wrote it.
        expected_n: the receiver's model size; pass it so a forged header cannot make the decoder read a bigger
            vector than the model (None: any n).
        max_count: sparse frames: the most entries a chunk may hold (None: the whole chunk).

    Returns:
        The :class:`QuantizedVec` (:func:`dtrain.codec.dequantize` gives its values). Its arrays are read-only
        views of one buffer holding the decompressed body.

    Raises:
        CodecError: anything wrong with the frame (truncated, corrupt, forged, an invalid scale or code).
    """
    body = bytearray()
    reader = FrameValidator(expected_n, out=body.extend, out_piece=_DECODE_PIECE, max_count=max_count)
    reader.feed(frame)
    reader.finish()
    header = reader.header
    assert header is not None
    scales = np.frombuffer(body, "<f4", count=header.scales_len // 4).astype(np.float32, copy=False)
    payload = np.frombuffer(body, np.uint8, offset=header.scales_len)
    scales.flags.writeable = payload.flags.writeable = False
    return QuantizedVec(header.bits, header.block, header.n, scales, payload)


# --------------------------------------------------------------------------- CRC32 of concatenations

_CRC_POLY: Final = 0xEDB88320  # zlib's CRC-32, reflected


def _crc_multmodp(a: int, b: int) -> int:
    """a·b modulo the CRC polynomial (reflected bit order, as in zlib)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1


def _crc_x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _crc_multmodp(p, p)
    return table


_CRC_X2N: Final = _crc_x2n_table()  # x^(2^k) mod the polynomial


@functools.lru_cache(maxsize=64)
def _crc_shift(length: int) -> int:
    """x^(8·length) mod the polynomial: appending ``length`` zero bytes, as an operator."""
    p, k, n = 1 << 31, 3, length
    while n:
        if n & 1:
            p = _crc_multmodp(_CRC_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32(data: bytes | bytearray | memoryview | np.ndarray, value: int = 0) -> int:
    """The CRC32 (zlib's polynomial: ``zlib.crc32``'s values) of ``data``, continuing from ``value``: every
    checksum the wire and the frames carry. ISA-L's where it is installed (a dependency: ~20x zlib's speed, the GIL
    released), else zlib's."""
    return _crc32(data, value)


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32 of A ‖ B from crc32(A), crc32(B) and len(B), without touching the bytes (zlib's crc32_combine,
    which Python's zlib does not expose). Lets a receiver check a whole frame's CRC from its chunks' CRCs,
    and :func:`write_frame` take the frame's CRCs without reading the body back."""
    if len2 < 0:
        raise ValueError(f"len2 must be >= 0, got {len2}")
    return _crc_multmodp(_crc_shift(len2), crc1) ^ crc2 if len2 else crc1


def compression_ratio(n_values: int, frame_len: int) -> float:
    """Raw float32 bytes over bytes on the wire: 4·n / frame_len."""
    if frame_len <= 0:
        raise CodecError(f"frame_len must be positive, got {frame_len}")
    return 4 * n_values / frame_len
