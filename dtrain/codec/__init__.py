"""The delta codec: trees as flat vectors, block quantization with error feedback, zstd frames.

Pure numpy + zstandard: no JAX, no pickle, no gRPC. Five modules, each
importing only the ones before it:

* ``spec``: a nested dict of arrays ↔ (spec, one float32 vector); the spec's
  and the vector's digests; :class:`CodecError`.
* ``sparse``: the sparse schemes (``"sparse2"``, ``"sparse4"``, ``"sparse8"``): per chunk, the top entries
  by magnitude, 2 (4, 8)-bit values and gap-coded indices; their checker (:class:`SparseChecker`) and
  :func:`sparse_add` (checked chunks summed into a dense slab).
* ``masked``: the mask scheme (``"mask2"``): index-free shared selection, the entries a seeded mask picks
  each round, 2-bit values; its checker (:class:`MaskChecker`) and :func:`mask_add`.
* ``int2``: the dense 2-bit scheme's levels (four, scaled by each block's RMS), packing and checks.
* ``quant``: block quantization (int8, int4, int2, e3m0, lossless 32), error
  feedback, the checks of scales and codes, and :data:`CODEC_BITS`, the
  config's codec names → schemes.
* ``frame``: the frame layout, its one writer (:func:`write_frame`, and
  :func:`encode` in memory) and its one incremental reader/validator
  (:class:`FrameValidator`, and :func:`decode` for a whole frame).

An island, per round::

    spec, delta_vec = flatten(delta_tree)           # one float32 vector + its layout
    q = error_feedback.compress(delta_vec)          # block-quantize delta + residual
    frame = encode(q)                               # header + zstd(scales ‖ payload)

(``dtrain.net.wire.frame_chunks`` cuts the frame into the chunk stream.) The
coordinator checks an incoming frame with :class:`FrameValidator` as its
chunks arrive, sums the checked bodies slab by slab (:func:`dequantize_add`),
quantizes its outer update the same way (:func:`quantize_segment`) and writes
the update's frame with :func:`write_frame`; islands read it back with
:func:`decode` and :func:`dequantize`.

The entry points, each documented with its arguments, returns and errors
(every error is a :class:`CodecError`):

* encoding: :func:`flatten` ``(tree) -> (spec, vec)``; :func:`quantize`
  ``(vec, bits, block) -> QuantizedVec``, or with error feedback
  :class:`ErrorFeedback` ``(n, bits, block)`` and its ``compress(delta_vec)``;
  :func:`encode` ``(q, level) -> frame bytes``, or :func:`write_frame`
  ``(out, bits, block, n, scales, payload, level) -> (size, crc32)`` into a
  file from pieces.
* decoding: :func:`decode` ``(frame, expected_n=n) -> QuantizedVec``, or
  :class:`FrameValidator` ``(expected_n, bits, block, out=sink)`` fed a
  frame piece by piece (``feed``, then ``finish``); :func:`dequantize`
  ``(q) -> vec``, or :func:`dequantize_add` into a running sum;
  :func:`unflatten` ``(spec, vec) -> tree``.
"""

from dtrain.codec.frame import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    STORED,
    WINDOW_LOG,
    FrameHeader,
    FrameValidator,
    compression_ratio,
    crc32,
    crc32_combine,
    decode,
    encode,
    write_frame,
)
from dtrain.codec.masked import (
    MASK_BITS,
    MaskChecker,
    density_code,
    has_records,
    keep_mask,
    mask_add,
    mask_quantize_segment,
)
from dtrain.codec.quant import (
    CODEC_BITS,
    DEFAULT_BLOCK,
    MAX_BLOCK,
    MIN_BLOCK,
    Bits,
    ErrorFeedback,
    QuantizedVec,
    canonical_bits,
    check_block,
    check_codes,
    check_scales,
    dequantize,
    dequantize_add,
    dequantize_segment,
    error_feedback_step,
    n_scales,
    payload_len,
    payload_offset,
    quantize,
    quantize_segment,
)
from dtrain.codec.sparse import (
    MAX_CHUNK,
    SPARSE_BITS,
    SparseChecker,
    is_sparse,
    kept_per_chunk,
    record_len,
    sparse_add,
    sparse_quantize_segment,
    sparse_scheme,
    top_k_mask,
)
from dtrain.codec.spec import (
    CodecError,
    Hasher,
    Spec,
    flatten,
    hasher_digest,
    params_digest,
    params_hasher,
    spec_digest,
    spec_size,
    unflatten,
)
from dtrain.codec.squares import block_sum_squares, sum_squares
from dtrain.codec.sums import dequantize_sum, sum_piece_values

__all__ = [
    "CODEC_BITS",
    "DEFAULT_BLOCK",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MaskChecker",
    "MAGIC",
    "STORED",
    "MASK_BITS",
    "MAX_BLOCK",
    "MAX_CHUNK",
    "MIN_BLOCK",
    "SPARSE_BITS",
    "WINDOW_LOG",
    "Bits",
    "CodecError",
    "ErrorFeedback",
    "FrameHeader",
    "FrameValidator",
    "Hasher",
    "QuantizedVec",
    "SparseChecker",
    "Spec",
    "block_sum_squares",
    "canonical_bits",
    "check_block",
    "check_codes",
    "check_scales",
    "compression_ratio",
    "crc32",
    "crc32_combine",
    "decode",
    "density_code",
    "dequantize",
    "dequantize_add",
    "dequantize_sum",
    "sum_piece_values",
    "dequantize_segment",
    "encode",
    "error_feedback_step",
    "flatten",
    "has_records",
    "hasher_digest",
    "is_sparse",
    "keep_mask",
    "kept_per_chunk",
    "mask_add",
    "mask_quantize_segment",
    "n_scales",
    "params_digest",
    "params_hasher",
    "payload_len",
    "payload_offset",
    "quantize",
    "quantize_segment",
    "record_len",
    "sparse_add",
    "sparse_quantize_segment",
    "sparse_scheme",
    "spec_digest",
    "spec_size",
    "sum_squares",
    "top_k_mask",
    "unflatten",
    "write_frame",
]
