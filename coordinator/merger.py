"""Streaming merge of pseudo-gradients and the outer step, on flat float32 vectors.

Memory is O(model) however many islands push at once: an incoming frame is
spooled to disk as it streams in (its chunks verified), validated end to end
by a first decode whose output is discarded, and only then decoded a second
time block by block straight into the one accumulator. A push that fails at
any point therefore leaves the accumulator untouched.

The outer step is DiLoCo's Nesterov SGD, the same math as
``dtrain.outer.outer_step`` (optax.sgd(lr, momentum, nesterov=True)), written
in place over slabs so it needs no model-sized temporaries:

    Δ = acc / Σw;  m ← μ·m + Δ;  u = −lr·(Δ + μ·m)   (heavy ball: u = −lr·m)

The broadcast update is u quantized with the down codec, after adding the
coordinator's own error-feedback residual; the coordinator's θ is defined as
the sum of the updates it broadcast, θ_{v+1} = θ_v + dequantize(q(u + r)), so
every island that applies the same frames holds a bit-identical θ.
"""

from __future__ import annotations

import collections
import os
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dtrain import codec
from dtrain.wire import params_digest

SLAB = 1 << 20  # values per in-place slab; a multiple of every allowed block size


@dataclass(frozen=True)
class MergeOptions:
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    up_bits: codec.Bits = 8
    down_bits: codec.Bits = 8
    block: int = 1024
    zstd_level: int = 3
    error_feedback: bool = True
    keep_updates: int = 16


@dataclass(frozen=True)
class Update:
    """One broadcast outer update, kept on disk: θ_version = θ_base + dequantize(frame)."""

    version: int
    base_version: int
    path: Path  # the frame, written once; pulls stream it from here
    size: int
    crc32: int
    params_digest: str  # digest of θ_version

    @property
    def frame(self) -> bytes:
        return self.path.read_bytes()

    def pieces(self, piece_bytes: int):
        """The frame in pieces of ``piece_bytes`` (for chunked streaming without loading it whole)."""
        with open(self.path, "rb") as f:
            while piece := f.read(piece_bytes):
                yield piece


class Merger:
    """Holds θ, the outer momentum, the accumulator, the down residual, and recent update frames."""

    def __init__(self, theta: np.ndarray, opts: MergeOptions, version: int = 0, momentum: np.ndarray | None = None,
                 residual: dict[str, np.ndarray] | None = None, spool_dir: str | Path | None = None):
        self.opts = opts
        self.theta = np.ascontiguousarray(theta, dtype=np.float32)
        self.n = int(self.theta.size)
        self.version = version
        self.momentum = np.zeros(self.n, np.float32) if momentum is None else np.asarray(momentum, np.float32)
        # The down path's error-feedback residual, itself stored int8-quantized per block: 1 byte per
        # parameter instead of 4. Its own rounding error is 1/254 of one quantization step of the update.
        self.feedback = opts.error_feedback and opts.down_bits != 32
        n_blocks = -(-self.n // opts.block)
        self.residual_codes = np.zeros(self.n if self.feedback else 0, np.uint8)
        self.residual_scales = np.zeros(n_blocks if self.feedback else 0, np.float32)
        if residual is not None and self.feedback:
            self.residual_codes[:] = residual["codes"]
            self.residual_scales[:] = residual["scales"]
        self.acc = np.zeros(self.n, np.float32)
        self.total_weight = 0.0
        self.pushes_in_acc = 0
        self.updates: collections.deque[Update] = collections.deque()
        self.digest = params_digest(self.theta)
        self.spool_dir = Path(spool_dir) if spool_dir else Path(tempfile.gettempdir())
        self.spool_dir.mkdir(parents=True, exist_ok=True)

    # -- incoming deltas ----------------------------------------------------------------------------

    def spool(self) -> "Spool":
        """A temporary file for one incoming frame; delete it with ``close()``."""
        return Spool(self.spool_dir)

    def validate(self, spool: "Spool") -> None:
        """Decodes the whole spooled frame once, discarding the values: raises CodecError if anything is wrong."""
        dec = codec.StreamingDecoder(self.n, self.opts.up_bits, self.opts.block, values=False)
        for piece in spool.read_pieces():
            dec.feed(piece)
        dec.finish()

    def accumulate(self, spool: "Spool", weight: float) -> None:
        """acc += weight · Δ, decoded block by block from a validated spool (no model-sized temporary)."""
        if not weight > 0:
            raise ValueError(f"merge weight must be > 0, got {weight}")
        dec = codec.StreamingDecoder(self.n, self.opts.up_bits, self.opts.block, weight=weight)
        for piece in spool.read_pieces():
            for start, values in dec.feed(piece):  # weight · Δ, folded into the block scales
                self.acc[start:start + values.size] += values
        dec.finish()
        self.total_weight += float(weight)
        self.pushes_in_acc += 1

    # -- the outer step -----------------------------------------------------------------------------

    def outer_step(self) -> Update:
        """Applies the merged pseudo-gradient; returns the broadcast update for version+1."""
        if self.pushes_in_acc == 0 or not self.total_weight > 0:
            raise RuntimeError("outer_step with no accumulated delta")
        o = self.opts
        lr, mu = np.float32(o.lr), np.float32(o.momentum)
        inv_w = np.float32(1.0 / self.total_weight)
        scales, payloads = [], []
        for s in range(0, self.n, SLAB):
            e = min(s + SLAB, self.n)
            delta = self.acc[s:e]
            delta *= inv_w  # Δ, in place in the accumulator
            m = self.momentum[s:e]
            if mu:
                m *= mu
                m += delta  # m ← μ·m + Δ
                if o.nesterov:
                    delta += mu * m  # Δ + μ·m
                else:
                    delta[:] = m
            delta *= -lr  # u = −lr·(…)
            if self.feedback:
                delta += self._residual(s, e)
            if o.down_bits == 32:
                applied = delta
            else:
                q = codec.quantize(delta, o.down_bits, o.block)
                applied = codec.dequantize(q)
                if self.feedback:
                    self._store_residual(s, e, delta - applied)  # what the broadcast left out
                scales.append(q.scales)
                payloads.append(q.payload)
            if o.down_bits == 32:
                payloads.append(applied.view(np.uint8).copy())
            self.theta[s:e] += applied  # θ is the sum of what was broadcast
        if o.down_bits == 32:
            frame_q = codec.QuantizedVec(bits=32, block=o.block, n=self.n, scales=np.zeros(0, np.float32),
                                         payload=np.concatenate(payloads))
        else:
            frame_q = codec.QuantizedVec(bits=o.down_bits, block=o.block, n=self.n, scales=np.concatenate(scales),
                                         payload=np.concatenate(payloads))
        frame = codec.encode(frame_q, o.zstd_level)
        del frame_q, scales, payloads
        self.acc[:] = 0.0
        self.total_weight = 0.0
        self.pushes_in_acc = 0
        self.version += 1
        self.digest = params_digest(self.theta)
        path = self.spool_dir / f"update-{self.version:08d}.frame"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(frame)
        tmp.replace(path)
        update = Update(version=self.version, base_version=self.version - 1, path=path, size=len(frame),
                        crc32=zlib.crc32(frame), params_digest=self.digest)
        self.updates.append(update)
        while len(self.updates) > self.opts.keep_updates:
            self.updates.popleft().path.unlink(missing_ok=True)
        return update

    def _residual(self, s: int, e: int) -> np.ndarray:
        b = self.opts.block
        q = codec.QuantizedVec(bits=8, block=b, n=e - s, scales=self.residual_scales[s // b: -(-e // b)],
                               payload=self.residual_codes[s:e])
        return codec.dequantize(q)

    def _store_residual(self, s: int, e: int, r: np.ndarray) -> None:
        b = self.opts.block
        q = codec.quantize(r, 8, b)
        self.residual_scales[s // b: -(-e // b)] = q.scales
        self.residual_codes[s:e] = q.payload

    @staticmethod
    def state_layout(n: int, opts: MergeOptions) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Shape and dtype of each array in :meth:`state_arrays`, without allocating them (for restores)."""
        layout = {"theta": ((n,), np.dtype(np.float32)), "momentum": ((n,), np.dtype(np.float32))}
        if opts.error_feedback and opts.down_bits != 32:
            layout.update(residual_codes=((n,), np.dtype(np.uint8)),
                          residual_scales=((-(-n // opts.block),), np.dtype(np.float32)))
        return layout

    def state_arrays(self) -> dict[str, np.ndarray]:
        """What a checkpoint must hold besides the version (the accumulator is empty after a merge)."""
        arrays = {"theta": self.theta, "momentum": self.momentum}
        if self.feedback:
            arrays.update(residual_codes=self.residual_codes, residual_scales=self.residual_scales)
        return arrays

    # -- outgoing parameters ------------------------------------------------------------------------

    def updates_since(self, have_version: int) -> list[Update] | None:
        """The chain of update frames from ``have_version`` to now, or None if not all are kept."""
        if have_version >= self.version:
            return []
        chain = [u for u in self.updates if u.base_version >= have_version]
        if not chain or chain[0].base_version != have_version:
            return None
        return chain

    def full_frame(self) -> bytes:
        """θ itself, lossless (fp32 + zstd level 1: speed over ratio, as fp32 barely compresses)."""
        q = codec.QuantizedVec(bits=32, block=self.opts.block, n=self.n, scales=np.zeros(0, np.float32),
                               payload=self.theta.view(np.uint8))  # no copy: θ is contiguous little-endian f32
        return codec.encode(q, 1)


class Spool:
    """A temp file an incoming frame is written to while it streams in."""

    READ = 1 << 20

    def __init__(self, directory: Path):
        fd, name = tempfile.mkstemp(prefix="push-", suffix=".frame", dir=directory)
        self.path = Path(name)
        self._f = os.fdopen(fd, "w+b")
        self.size = 0

    def write(self, data: bytes) -> None:
        self._f.write(data)
        self.size += len(data)

    def read_pieces(self):
        self._f.flush()
        self._f.seek(0)
        while piece := self._f.read(self.READ):
            yield piece

    def close(self) -> None:
        self._f.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> "Spool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
