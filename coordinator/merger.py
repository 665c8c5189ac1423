"""Streaming merge of pseudo-gradients and the outer step, on flat float32 vectors.

Memory. The accumulator is the only model-sized array the coordinator keeps
in RAM. θ and the outer momentum live in files (one pair per version, in the
merger's state folder) that the outer step reads and rewrites slab by slab;
update frames and lossless θ frames are written to disk as they are encoded
and streamed to islands from there. An incoming push is spooled to disk as it
streams in (its chunks verified), validated end to end by a first decode whose
output is discarded, and only then decoded a second time straight into the
accumulator. A push that fails at any point therefore leaves the accumulator
untouched, and the coordinator's resident size does not grow with the number
of islands pushing at once.

Version files are written once and never modified, so a checkpoint can hard-link
them instead of copying (see ``dtrain.checkpoint.FileArraysHandler``).

The outer step is DiLoCo's Nesterov SGD, the same math as
``dtrain.outer.outer_step`` (optax.sgd(lr, momentum, nesterov=True)), slab by
slab, on a small thread pool (numpy and zstd release the GIL):

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
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np
import zstandard

from dtrain import codec
from dtrain.wire import params_hasher

SLAB_TARGET = 1 << 18  # values per slab of the outer step and of accumulation (1 MiB of float32)
IO_PIECE = 1 << 22  # bytes per read when streaming a file into a frame


def slab_values(block: int) -> int:
    """The slab length: a whole number of quantization blocks, about SLAB_TARGET values."""
    return max(1, SLAB_TARGET // block) * block


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
    threads: int = 2  # outer-step worker threads (and zstd's)


@dataclass(frozen=True)
class Update:
    """One frame on disk: an outer update (θ_version = θ_base + dequantize(frame)) or a lossless θ."""

    version: int
    base_version: int
    path: Path  # written once; pulls stream it from here
    size: int
    crc32: int
    params_digest: str  # digest of θ_version

    @property
    def frame(self) -> bytes:
        """The whole frame in memory (tests and tools; the service streams it with :meth:`open`)."""
        return self.path.read_bytes()

    def open(self) -> BinaryIO:
        """An open handle: the frame stays readable even if it is deleted before the pull finishes."""
        return open(self.path, "rb")


def pieces(f: BinaryIO, piece_bytes: int) -> Iterator[bytes]:
    """Reads an open frame in pieces of ``piece_bytes`` and closes it."""
    with f:
        while piece := f.read(piece_bytes):
            yield piece


def _read_into(fd: int, buf: np.ndarray, offset: int) -> None:
    view = memoryview(buf).cast("B")
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise OSError(f"short read at offset {offset + got} (file truncated?)")
        got += n


def _write_from(fd: int, buf: np.ndarray | memoryview, offset: int) -> None:
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def write_frame(path: Path, bits: codec.Bits, block: int, n: int, scales: np.ndarray, payload_file: Path | None,
                payload_len: int, level: int, threads: int) -> tuple[int, int]:
    """Writes header + zstd(scales ‖ payload) to ``path`` (atomically), the payload streamed from a file.

    The same layout as ``codec.encode``; returns (frame size, CRC32 of the whole frame). The body is compressed as it is read, so
    memory stays O(piece) whatever the model size."""
    tmp = path.with_name(path.name + ".tmp")
    scale_bytes = np.ascontiguousarray(scales, dtype="<f4").tobytes()
    cobj = zstandard.ZstdCompressor(level=level, threads=threads if threads > 1 else 0).compressobj(
        size=len(scale_bytes) + payload_len)
    with open(tmp, "w+b") as out:
        out.write(bytes(codec.HEADER_SIZE))
        out.write(cobj.compress(scale_bytes))
        if payload_file is not None:
            with open(payload_file, "rb") as src:
                while piece := src.read(IO_PIECE):
                    out.write(cobj.compress(piece))
        out.write(cobj.flush())
        body_len = out.tell() - codec.HEADER_SIZE
        head = codec.frame_header(bits, block, n, len(scale_bytes), payload_len, body_len)
        crc = zlib.crc32(head)
        out.seek(codec.HEADER_SIZE)
        while piece := out.read(IO_PIECE):  # the body is hot in the page cache
            crc = zlib.crc32(piece, crc)
        out.seek(0)
        out.write(head + crc.to_bytes(4, "little"))
        out.seek(0)
        whole = 0  # the wire's CRC32 is over the whole frame, the codec's own CRC field included
        while piece := out.read(IO_PIECE):
            whole = zlib.crc32(piece, whole)
    tmp.replace(path)
    return codec.HEADER_SIZE + body_len, whole


class Merger:
    """Holds the accumulator and the down residual in memory; θ and momentum in per-version files."""

    def __init__(self, theta: np.ndarray | Path, opts: MergeOptions, version: int = 0,
                 momentum: np.ndarray | Path | None = None, residual: dict[str, np.ndarray] | None = None,
                 spool_dir: str | Path | None = None):
        """``theta``/``momentum``: arrays, or files of raw little-endian float32 (e.g. from a checkpoint:
        they are hard-linked, or copied, into the state folder; the originals are never modified)."""
        self.opts = opts
        self.spool_dir = Path(spool_dir) if spool_dir else Path(tempfile.mkdtemp(prefix="dtrain-merger-"))
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self.state_dir = self.spool_dir / "state"
        self.state_dir.mkdir(exist_ok=True)
        for stale in self.state_dir.iterdir():  # left by an earlier coordinator in this folder
            stale.unlink()
        self.version = version
        self.n = self._install(theta, self.theta_path, "theta")
        self._install(np.zeros(0, np.float32) if momentum is None else momentum, self.momentum_path, "momentum",
                      n=self.n)
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
        self._full: Update | None = None
        self.digest, theta_crc = self._hash_file(self.theta_path)
        self.crcs = {"theta": theta_crc, "momentum": self._hash_file(self.momentum_path)[1]}

    # -- the state files ----------------------------------------------------------------------------

    @property
    def theta_path(self) -> Path:
        return self.state_dir / f"theta-{self.version:08d}.f32"

    @property
    def momentum_path(self) -> Path:
        return self.state_dir / f"momentum-{self.version:08d}.f32"

    def _install(self, src: np.ndarray | Path, dest: Path, what: str, n: int | None = None) -> int:
        if isinstance(src, (str, Path)):
            size = Path(src).stat().st_size
            if size % 4 or (n is not None and size != 4 * n):
                raise ValueError(f"{what} file {src} holds {size} bytes, expected {4 * (n or 0) or 'a multiple of 4'}")
            try:
                os.link(src, dest)
            except OSError:  # another file system, or no hard links: copy (the kernel's copy, not via memory)
                import shutil

                shutil.copyfile(src, dest)
            return size // 4
        arr = np.asarray(src)
        if arr.size == 0 and n is not None:  # zeros: a sparse file
            with open(dest, "wb") as f:
                f.truncate(4 * n)
            return n
        arr = np.ascontiguousarray(arr, dtype="<f4").ravel()
        if n is not None and arr.size != n:
            raise ValueError(f"{what} has {arr.size} values, θ has {n}")
        arr.tofile(dest)
        return int(arr.size)

    @staticmethod
    def _hash_file(path: Path) -> tuple[str, int]:
        """(params digest, CRC32) of a file."""
        h, crc = params_hasher(), 0
        with open(path, "rb") as f:
            while piece := f.read(IO_PIECE):
                h.update(piece)
                crc = zlib.crc32(piece, crc)
        return h.hexdigest()[:32], crc

    @property
    def theta(self) -> np.ndarray:
        """θ of the current version, read from its file (a full copy: for tests and tools)."""
        return np.fromfile(self.theta_path, "<f4").astype(np.float32, copy=False)

    @property
    def momentum(self) -> np.ndarray:
        return np.fromfile(self.momentum_path, "<f4").astype(np.float32, copy=False)

    def state_files(self) -> dict[str, tuple[Path, int]]:
        """The current version's θ and momentum files with their CRC32s (never modified: safe to hard-link
        into a checkpoint)."""
        return {"theta": (self.theta_path, self.crcs["theta"]), "momentum": (self.momentum_path, self.crcs["momentum"])}

    def state_arrays(self) -> dict[str, np.ndarray]:
        """The in-memory state a checkpoint must hold besides the files (the accumulator is empty after a merge)."""
        if not self.feedback:
            return {}
        return {"residual_codes": self.residual_codes, "residual_scales": self.residual_scales}

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
        """acc += weight · Δ from a spool that :meth:`validate` accepted, slab by slab with no model-sized
        temporary (the second decode skips the checks the first one made)."""
        if not weight > 0:
            raise ValueError(f"merge weight must be > 0, got {weight}")
        o = self.opts
        slab = slab_values(o.block)
        spool.flush()
        with open(spool.path, "rb") as f:
            f.seek(codec.HEADER_SIZE)
            reader = zstandard.ZstdDecompressor().stream_reader(f, read_size=IO_PIECE)
            n_blocks = codec.n_scales(o.up_bits, self.n, o.block)
            scales = np.frombuffer(_read_exact(reader, 4 * n_blocks), "<f4").astype(np.float32)
            buf = np.empty(codec.payload_len(o.up_bits, slab), np.uint8)
            for s in range(0, self.n, slab):
                e = min(s + slab, self.n)
                payload = buf[:codec.payload_len(o.up_bits, e - s)]
                _read_exact_into(reader, payload)
                codec.dequantize_add(o.up_bits, o.block, scales[s // o.block: -(-e // o.block)], payload,
                                     self.acc[s:e], weight=np.float32(weight))
        self.total_weight += float(weight)
        self.pushes_in_acc += 1

    # -- the outer step -----------------------------------------------------------------------------

    def outer_step(self) -> Update:
        """Applies the merged pseudo-gradient; writes version+1's files; returns its broadcast update."""
        if self.pushes_in_acc == 0 or not self.total_weight > 0:
            raise RuntimeError("outer_step with no accumulated delta")
        o = self.opts
        slab = slab_values(o.block)
        inv_w = np.float32(1.0 / self.total_weight)
        new = self.version + 1
        theta_new = self.state_dir / f"theta-{new:08d}.f32.tmp"
        mom_new = self.state_dir / f"momentum-{new:08d}.f32.tmp"
        payload_path = self.state_dir / f"update-{new:08d}.payload.tmp"
        frame_path = self.spool_dir / f"update-{new:08d}.frame"
        n_scales = codec.n_scales(o.down_bits, self.n, o.block)
        scales = np.zeros(n_scales, np.float32)
        fds = {}
        try:
            fds["theta"] = os.open(self.theta_path, os.O_RDONLY)
            fds["mom"] = os.open(self.momentum_path, os.O_RDONLY)
            fds["theta_new"] = os.open(theta_new, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            fds["mom_new"] = os.open(mom_new, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            fds["payload"] = os.open(payload_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)

            def step(s: int) -> tuple[np.ndarray, np.ndarray]:
                e = min(s + slab, self.n)
                delta = self.acc[s:e]
                delta *= inv_w  # Δ, in place in the accumulator
                m = np.empty(e - s, np.float32)
                _read_into(fds["mom"], m, 4 * s)
                if o.momentum:
                    mu = np.float32(o.momentum)
                    m *= mu
                    m += delta  # m ← μ·m + Δ
                    if o.nesterov:
                        delta += mu * m  # Δ + μ·m
                    else:
                        delta[:] = m
                _write_from(fds["mom_new"], m, 4 * s)
                delta *= np.float32(-o.lr)  # u = −lr·(…)
                if self.feedback:
                    b0, b1 = s // o.block, -(-e // o.block)
                    codec.dequantize_add(8, o.block, self.residual_scales[b0:b1], self.residual_codes[s:e], delta)
                if o.down_bits == 32:
                    applied = delta
                    _write_from(fds["payload"], applied, 4 * s)
                else:
                    sc, payload = codec.quantize_segment(o.down_bits, o.block, delta)
                    scales[s // o.block: s // o.block + sc.size] = sc
                    _write_from(fds["payload"], payload, codec.payload_offset(o.down_bits, s))
                    applied = codec.dequantize_segment(o.down_bits, o.block, sc, payload, e - s)
                    if self.feedback:
                        delta -= applied  # what the broadcast left out
                        rs, rc = codec.quantize_segment(8, o.block, delta)
                        self.residual_scales[s // o.block: s // o.block + rs.size] = rs
                        self.residual_codes[s:e] = rc
                theta = np.empty(e - s, np.float32)
                _read_into(fds["theta"], theta, 4 * s)
                theta += applied  # θ is the sum of what was broadcast
                _write_from(fds["theta_new"], theta, 4 * s)
                self.acc[s:e] = 0.0
                return theta, m

            hasher, crcs = params_hasher(), {"theta": 0, "momentum": 0}

            def digest(done: futures.Future) -> None:
                theta, m = (memoryview(a).cast("B") for a in done.result())
                hasher.update(theta)
                crcs["theta"] = zlib.crc32(theta, crcs["theta"])
                crcs["momentum"] = zlib.crc32(m, crcs["momentum"])

            with futures.ThreadPoolExecutor(max(1, o.threads), thread_name_prefix="outer") as pool:
                window: collections.deque[futures.Future] = collections.deque()
                for s in range(0, self.n, slab):  # a bounded window of slabs in flight; digests taken in order
                    window.append(pool.submit(step, s))
                    if len(window) > 2 * o.threads:
                        digest(window.popleft())
                while window:
                    digest(window.popleft())
        finally:
            for fd in fds.values():
                os.close(fd)
        size, crc = write_frame(frame_path, o.down_bits, o.block, self.n, scales, payload_path,
                                codec.payload_len(o.down_bits, self.n), o.zstd_level, o.threads)
        payload_path.unlink()
        old_theta, old_mom = self.theta_path, self.momentum_path
        self.version = new
        theta_new.replace(self.theta_path)
        mom_new.replace(self.momentum_path)
        old_theta.unlink()
        old_mom.unlink()
        self.total_weight = 0.0
        self.pushes_in_acc = 0
        self.digest = hasher.hexdigest()[:32]
        self.crcs = crcs
        update = Update(version=new, base_version=new - 1, path=frame_path, size=size, crc32=crc,
                        params_digest=self.digest)
        self.updates.append(update)
        while len(self.updates) > self.opts.keep_updates:
            self.updates.popleft().path.unlink(missing_ok=True)
        return update

    # -- outgoing parameters ------------------------------------------------------------------------

    def updates_since(self, have_version: int) -> list[Update] | None:
        """The chain of update frames from ``have_version`` to now, or None if not all are kept."""
        if have_version >= self.version:
            return []
        chain = [u for u in self.updates if u.base_version >= have_version]
        if not chain or chain[0].base_version != have_version:
            return None
        return chain

    def full_update(self) -> Update:
        """θ itself as a lossless frame (fp32 + zstd level 1: speed over ratio, as fp32 barely compresses),
        written once per version on first request and streamed from the θ file (no copy in memory)."""
        if self._full is None or self._full.version != self.version:
            path = self.spool_dir / f"theta-{self.version:08d}.frame"
            size, crc = write_frame(path, 32, self.opts.block, self.n, np.zeros(0, np.float32), self.theta_path,
                                    4 * self.n, 1, self.opts.threads)
            if self._full is not None:
                self._full.path.unlink(missing_ok=True)  # open handles keep it readable for pulls under way
            self._full = Update(version=self.version, base_version=0, path=path, size=size, crc32=crc,
                                params_digest=self.digest)
        return self._full


def _read_exact(reader, size: int) -> bytes:
    buf = np.empty(size, np.uint8)
    _read_exact_into(reader, buf)
    return buf.tobytes()


def _read_exact_into(reader, buf: np.ndarray) -> None:
    view = memoryview(buf).cast("B")
    got = 0
    while got < len(view):
        n = reader.readinto(view[got:])
        if not n:
            raise codec.CodecError(f"spooled frame ends early ({got} of {len(view)} bytes)")
        got += n


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

    def flush(self) -> None:
        self._f.flush()

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
