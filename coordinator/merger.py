"""Streaming merge of pseudo-gradients and the outer step, on flat float32 vectors.

Memory. No model-sized array is kept in RAM. θ, the outer momentum and the down-path residual live in files (one
set per version, in the merger's state folder) that the outer step reads and rewrites slab by slab; update frames
and lossless θ frames are written to disk as they are encoded and streamed to islands from there. An incoming push
is checked as it streams in (each chunk's CRC; every scale and code as zstd decompresses it) and its decompressed
body spooled to a temp file (:class:`coordinator.spool.Spool`). Once the whole frame has passed (length, CRC32,
exact size) the spool joins the pending pushes with its weight (:meth:`Merger.spooled`; a coordinator's are its
open round's, ``coordinator/pending.py``); nothing is summed yet. The outer step sums the pending pushes slab by
slab (Σ w·Δ / Σ w) on its threads. A push that fails at any point therefore changes nothing, and the coordinator's
resident size does not grow with the number of islands pushing at once. Disk: one spool per pending push (the
model's size at the up codec's width).

A version's files are never modified while it is the current version, nor
ever if anything else links them, so a checkpoint can hard-link them instead of
copying (see ``dtrain.checkpoint.FileArraysHandler``). A dead version's files
that nothing else links are renamed and written over by a later step: writing
over existing pages costs a third of filling new ones.

The outer step applies ``dtrain.steps.outer.outer_update`` (DiLoCo's SGD with
Nesterov momentum, the same function the in-process simulation maps over its
pytrees) to each slab, on a small thread pool (numpy and zstd release the GIL):

    Δ = Σ w_i·Δ_i / Σ w_i;  (u, m) = outer_update(Δ, m)   (m ← μ·m + Δ;  u = −lr·(Δ + μ·m))

The broadcast update is u quantized with the down codec, after adding the
coordinator's own error-feedback residual; the coordinator's θ is defined as
the sum of the updates it broadcast, θ_{v+1} = θ_v + dequantize(q(u + r)), so
every island that applies the same frames holds a bit-identical θ.

Sparse codecs (``codec.up``/``codec.down = "sparse"``, ``dtrain.codec.sparse``): a sparse push's spool keeps
its checked body (scales ‖ counts ‖ records) and its checker's layout (the chunks' counts and record offsets,
O(model / chunk)); each slab reads those chunks' scales and records and adds them into the dense Δ slab
(``codec.sparse_add``), so memory stays O(slab) per push as with the dense codecs. A sparse update keeps
exactly the entries where the merged Δ is non-zero (the union of the pushes' supports), or with
``codec.down_density`` > 0 the top entries of each chunk of u + residual, quantized with
``codec.sparse_bits``; whatever it leaves out, off the union too, stays in the down residual. Its records
are written in slab order after room for the counts, which are written last. ``outer.rule = "sparseloco"``
makes the step θ ← θ − lr·Δ (SparseLoCo: no momentum; ``dtrain.steps.outer.outer_update``).

The merge rules and the guards against a poisoned delta (clip factors, robust rules, the direction screen, the
non-finite check before a commit) are described in ``coordinator/merge_types.py``.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import numpy as np

from coordinator.direction import direction_cosines
from coordinator.merge_io import (
    SparseDown,
    install_file,
    read_into,
    read_pending,
    scan_theta,
    sum_pending,
    write_frame_file,
)
from coordinator.merge_types import (
    MEAN_RULES,
    MergeOptions,
    NonFiniteResult,
    Prepared,
    SpooledPush,
    Update,
    round_clip_factors,
)
from coordinator.spool import Spool, write_from
from dtrain import codec
from dtrain.codec import hasher_digest, params_hasher
from dtrain.steps.outer import coordinate_median, outer_update, trimmed_mean
from dtrain.train.fragments import Range, fragment_of_round


class Merger:
    """Pending pushes in spool files; θ, momentum and the down residual in per-version files; nothing
    model-sized in RAM."""

    def __init__(self, theta: np.ndarray | Path, opts: MergeOptions, version: int = 0,
                 momentum: np.ndarray | Path | None = None, residual: np.ndarray | Path | None = None,
                 spool_dir: str | Path | None = None):
        """``theta``/``momentum``/``residual``: arrays, or files of raw little-endian float32 (e.g. from a
        checkpoint: hard-linked, or copied, into the state folder; the originals are never modified).
        ``None``: zeros."""
        self.opts = opts
        self.spool_dir = Path(spool_dir) if spool_dir else Path(tempfile.mkdtemp(prefix="dtrain-merger-"))
        # A folder of its own (no spool_dir) goes with the merger: at close(), or when it is collected or the
        # process exits without one. A given spool_dir is its owner's (a coordinator's run folder) and stays.
        self._remove_dir = None if spool_dir else weakref.finalize(self, shutil.rmtree, self.spool_dir, True)
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self.state_dir = self.spool_dir / "state"
        self.state_dir.mkdir(exist_ok=True)
        for pattern in ("state/*", "update-*.frame*", "theta-*.frame*", "push-*.body"):
            for stale in self.spool_dir.glob(pattern):  # left by an earlier coordinator in this folder
                stale.unlink()
        self.version = version
        # The down path's error-feedback residual: what the broadcasts have left out of the true updates.
        self.feedback = opts.error_feedback and opts.down_bits != 32
        self.names = ("theta", "momentum", "residual") if self.feedback else ("theta", "momentum")
        self.n = install_file(theta, self._path("theta"), "theta")
        for name, src in (("momentum", momentum), ("residual", residual)):
            if name in self.names:
                install_file(np.zeros(0, np.float32) if src is None else src, self._path(name), name, n=self.n)
        # What the next outer step sums: its own pushes (tools, tests, a range shard) or an open round's
        self._pending: list[SpooledPush] = []
        self._source: Callable[[], list[SpooledPush]] | None = None
        self.updates: collections.deque[Update] = collections.deque()
        self._full: Update | None = None
        self.digest, self.theta_norm = scan_theta(self.theta_path)  # θ's digest and L2 norm
        # Files kept for reuse: writing over a file's existing pages costs a third of filling a new one (the
        # kernel allocates and zeroes nothing). Spools are reused whatever they held (each push rewrites its
        # whole body); a state file only once no checkpoint links it (see outer_step).
        self._spare_spools: list[tuple[int, Path]] = []
        self._spare_lock = threading.Lock()
        self._spare_state: dict[str, Path] = {}

    def close(self) -> None:
        """Drops the pending pushes and the spare spool files (the state files stay: a checkpoint may link
        them, and the next merger in this folder clears them). A merger made without ``spool_dir`` removes the
        temporary folder it made, state files and all (a checkpoint's hard links keep their own copies)."""
        for p in self.pending:
            p.spool.close()
        self._pending = []
        with self._spare_lock:
            spares, self._spare_spools = self._spare_spools, []
            self.opts = dataclasses.replace(self.opts, spare_spools=0)  # spools closed later are not kept
        for fd, path in spares:
            os.close(fd)
            path.unlink(missing_ok=True)
        if self._remove_dir is not None:
            self._remove_dir()

    # -- the state files ----------------------------------------------------------------------------

    def _path(self, name: str, version: int | None = None) -> Path:
        return self.state_dir / f"{name}-{self.version if version is None else version:08d}.f32"

    @property
    def theta_path(self) -> Path:
        return self._path("theta")

    @property
    def theta(self) -> np.ndarray:
        """θ of the current version, read from its file (a full copy: for tests and tools)."""
        return np.fromfile(self.theta_path, "<f4").astype(np.float32, copy=False)

    @property
    def momentum(self) -> np.ndarray:
        return np.fromfile(self._path("momentum"), "<f4").astype(np.float32, copy=False)

    def state_files(self) -> dict[str, Path]:
        """The current version's state files: θ, momentum and (with down-path error feedback) the residual.
        Everything a checkpoint needs besides the version (no push is pending right after a merge). They are
        never modified while they are a live version, nor later if anything else links them: safe to hard-link
        into a checkpoint; θ is verified on restore by its digest."""
        return {name: self._path(name) for name in self.names}

    # -- incoming deltas ----------------------------------------------------------------------------

    def fragment(self, index: int) -> Range:
        """Fragment ``index`` of the plan (without fragments, index 0: the whole θ). IndexError if out of range."""
        if not self.opts.ranges:
            if index:
                raise IndexError(f"fragment {index}: this merger has one, the whole θ")
            return Range(0, 0, self.n, 0, 0)
        return self.opts.ranges[index]

    @property
    def fragments(self) -> int:
        """How many fragments θ is cut into (1: none)."""
        return len(self.opts.ranges) or 1

    def next_fragment(self) -> Range:
        """The fragment the next outer step merges (version + 1's)."""
        return self.fragment(fragment_of_round(self.version + 1, self.fragments))

    def spool(self, fragment: int = 0) -> Spool:
        """A temporary file for one incoming frame of ``fragment`` (its values only), decoded and checked as it
        is written; ``close()`` it."""
        size = self.fragment(fragment).size
        with self._spare_lock:
            spare = self._spare_spools.pop() if self._spare_spools else None
        o = self.opts
        return Spool(self.spool_dir, size, o.up_bits, o.up_block or o.block, spare=spare,
                     release=self._release_spool, max_count=o.max_count)

    def _release_spool(self, fd: int, path: Path) -> bool:
        """A closed spool's file, kept for the next push (True) unless enough are kept already."""
        with self._spare_lock:
            if len(self._spare_spools) < self.opts.spare_spools:
                self._spare_spools.append((fd, path))
                return True
        return False

    def validate(self, spool: Spool) -> None:
        """Ends the spooled frame: raises CodecError unless it was complete and intact (CRC, sizes, codes) and (a
        mask push) at the config's ``codec.mask_density``."""
        spool.finish()
        mask, code = spool.sparse, self.opts.up_mask_code
        if isinstance(mask, codec.MaskChecker) and code and mask.code != code:
            raise codec.CodecError(f"a mask push at density {mask.code / 2**32:.4g}, the coordinator's "
                                   f"codec.mask_density is {code / 2**32:.4g}")

    @property
    def pending(self) -> list[SpooledPush]:
        """The pushes the next outer step merges, in arrival order."""
        return self._source() if self._source is not None else self._pending

    @property
    def total_weight(self) -> float:
        """The pending pushes' summed merge weight."""
        return sum(p.weight for p in self.pending)

    def read_pending_from(self, source: Callable[[], list[SpooledPush]]) -> None:
        """The pending pushes are ``source()``'s from now on, which alone adds and removes them (an open round's)."""
        self._source = source

    def _own(self) -> list[SpooledPush]:
        if self._source is not None:
            raise RuntimeError("this merger reads its pending pushes from the open round (read_pending_from)")
        return self._pending

    def add_pending(self, spool: Spool, weight: float, scale: float = 1.0, key: str = "",
                    norm: float | None = None) -> None:
        """Makes the push one of those the next outer step merges (:meth:`spooled`)."""
        self._own().append(self.spooled(spool, weight, scale, key, norm))

    def spooled(self, spool: Spool, weight: float, scale: float = 1.0, key: str = "",
                norm: float | None = None) -> SpooledPush:
        """The push as the next outer step merges it, with ``weight`` and its values times ``scale`` (a clip
        factor in (0, 1]); ``key`` names it (:meth:`drop_pending`, :class:`NonFiniteResult`). The merger takes over
        the spool (which :meth:`validate` accepted; its decompressed, checked body stays on disk until that step has
        summed it). ``norm``: the whole push's L2 norm when the spool holds one range of it (a sharded coordinator:
        the clip caps and the blame then go by whole pushes, the same on every shard)."""
        if not weight > 0:
            raise ValueError(f"merge weight must be > 0, got {weight}")
        if not 0 < scale <= 1:
            raise ValueError(f"clip factor must be in (0, 1], got {scale}")
        if not spool.complete:
            raise RuntimeError("add_pending() needs a spool that validate() accepted")
        if spool.n != self.next_fragment().size:
            raise ValueError(f"a push of {spool.n} values cannot join the merge of fragment "
                             f"{self.next_fragment().index} ({self.next_fragment().size} values)")
        spool.keep()
        return SpooledPush(spool, float(weight), float(scale), key, whole_norm=None if norm is None else float(norm))

    def drop_pending(self, keys: list[str]) -> None:
        """Removes the pending pushes named ``keys`` (rejected after all); their spools are released."""
        for p in self._own():
            if p.key in keys:
                p.spool.close()
        self._pending = [p for p in self._pending if p.key not in keys]

    def unpend(self) -> None:
        """Empties the pending list without releasing the spools: their owner keeps them (a range shard's held
        parts, after a step it aborted)."""
        self._pending = self._own()[:0]

    @property
    def pending_count(self) -> int:
        """How many pushes the next outer step will merge."""
        return len(self.pending)

    def pending_sum(self) -> np.ndarray:
        """Σ w·Δ over the pending pushes, in memory (a full copy of the next fragment's: for tests and tools)."""
        n = self.next_fragment().size
        out = np.zeros(n, np.float32)
        for s in range(0, n, self.opts.slab):
            self._sum_pending(s, out[s:s + self.opts.slab], np.float32(1.0))
        return out

    def _sum_pending(self, start: int, out: np.ndarray, scale: np.float32) -> None:
        """out += Σ (w·c·scale)·Δ over the pending pushes (c: each one's clip factor), for values
        [start, start + out.size) (whole blocks)."""
        sum_pending(self.pending, self.opts, self.next_fragment().size, start, out,
                    [np.float32(p.weight * p.scale * p.cap) * scale for p in self.pending])

    def direction_cosines(self) -> tuple[list[float], str]:
        """``screened_mean``'s direction screen over the pending pushes: each one's cosine with a reference
        direction and what the reference is (``coordinator.direction.direction_cosines``)."""
        return direction_cosines(len(self.pending), self.opts, self.next_fragment(), self._path("momentum"),
                                 self.stack_pending)

    def stack_pending(self, start: int, count: int) -> np.ndarray:
        """The pending pushes' values [start, start + count) (whole blocks), each times its clip factor, one row
        per push: (pushes × count) float32."""
        rows = np.zeros((len(self.pending), count), np.float32)
        self._read_pending(start, list(rows), [np.float32(p.scale * p.cap) for p in self.pending])
        return rows

    def _read_pending(self, start: int, outs: list[np.ndarray], weights: list[np.float32]) -> None:
        """outs[i] += weights[i]·Δ_i for each pending push i, values [start, start + outs[i].size)."""
        read_pending(self.pending, self.opts, self.next_fragment().size, start, outs, weights)

    def _blame(self) -> SpooledPush:
        """The pending push held responsible for a non-finite result: the largest contribution."""
        mean = self.opts.rule in MEAN_RULES
        return max(self.pending, key=lambda p: p.scale * p.cap * p.norm * (p.weight if mean else 1.0))

    def _check_finite(self, what: str, start: int, values: np.ndarray) -> None:
        if not np.isfinite(values).all():
            index = start + int(np.argmin(np.isfinite(values)))
            blame = self._blame()
            where = f"{what}[{index}] = {values[index - start]}"
            raise NonFiniteResult(where, blame.key, (
                f"the outer step for version {self.version + 1} makes {where} non-finite; blamed: push "
                f"{blame.key or '?'} (largest contribution: L2 norm {blame.norm:.4g} x clip {blame.scale:.3g}"
                f"{f' x weight {blame.weight:g}' if self.opts.rule in MEAN_RULES else ''})"))

    # -- the outer step -----------------------------------------------------------------------------

    def outer_step(self) -> Update:
        """Applies the merged pseudo-gradient; writes version+1's files; returns its broadcast update."""
        return self.commit(self.prepare())

    def prepare(self) -> Prepared:
        """The outer step up to its commit: version+1's state files written as temp files and its update frame
        written, nothing of the current version changed. :meth:`commit` makes it the current version, :meth:`abort`
        discards it (a sharded coordinator prepares every shard's range before any commits). Raises
        NonFiniteResult (nothing written) as :meth:`outer_step` does."""
        if not self.pending or not self.total_weight > 0:
            raise RuntimeError("outer_step with no pending push")
        o = self.opts
        if o.rule == "clipped_mean":
            factors = round_clip_factors([p.norm for p in self.pending], [p.scale for p in self.pending],
                                         o.clip_ratio)
            for p, c in zip(self.pending, factors, strict=True):
                p.cap = c
        new = self.version + 1
        part = self.next_fragment()  # the fragment this step merges (the whole θ without fragments)
        tmp = {name: self._path(name, new).with_suffix(".tmp") for name in self.names}
        payload_path = self.state_dir / "update.payload"  # the quantized update's codes, for write_frame_file
        frame_path = self.spool_dir / f"update-{new:08d}.frame"
        down_block = o.down_block or o.block
        scales = np.zeros(codec.n_scales(o.down_bits, part.size, down_block), np.float32)
        fds: dict[str, int] = {}
        try:
            for name in self.names:
                fds[name] = os.open(self._path(name), os.O_RDONLY)
                spare = self._spare_state.pop(name, None)
                if spare is not None:  # a dead version's file, linked by nothing else: overwritten in place
                    spare.replace(tmp[name])
                fds[name + "_new"] = os.open(tmp[name], os.O_RDWR | os.O_CREAT, 0o644)
            fds["payload"] = os.open(payload_path, os.O_RDWR | os.O_CREAT, 0o644)  # rewritten whole
            digest, theta_norm = self._step_slabs(fds, scales, part)
            payload_size = os.fstat(fds["payload"]).st_size if codec.has_records(o.down_bits) else None
            if payload_size is None:  # a smaller fragment than the last step's: the file is cut to this one's
                os.ftruncate(fds["payload"], codec.payload_len(o.down_bits, part.size))
        except BaseException:  # a non-finite result, or an I/O error: nothing is committed
            for path in tmp.values():
                path.unlink(missing_ok=True)
            raise
        finally:
            for fd in fds.values():
                os.close(fd)
        try:
            size, crc = write_frame_file(frame_path, o.down_bits, down_block, part.size, scales, payload_path,
                                         o.zstd_level, payload_size)
        except BaseException:
            for path in tmp.values():
                path.unlink(missing_ok=True)
            raise
        return Prepared(version=new, tmp=tmp, digest=digest, theta_norm=theta_norm,
                        update=Update(version=new, base_version=new - 1, path=frame_path, size=size, crc32=crc,
                                      params_digest=digest))

    def commit(self, prepared: Prepared) -> Update:
        """Makes :meth:`prepare`'s version the current one; returns its broadcast update."""
        if prepared.version != self.version + 1:
            raise RuntimeError(f"commit of version {prepared.version} on version {self.version}")
        self._commit(prepared.version, prepared.tmp)
        self.digest, self.theta_norm = prepared.digest, prepared.theta_norm
        self.updates.append(prepared.update)
        while len(self.updates) > self.opts.keep_updates:
            self.updates.popleft().path.unlink(missing_ok=True)
        return prepared.update

    def abort(self, prepared: Prepared) -> None:
        """Discards :meth:`prepare`'s files: the version and the pending pushes stay as they were."""
        for path in prepared.tmp.values():
            path.unlink(missing_ok=True)
        prepared.update.path.unlink(missing_ok=True)

    def _step_slabs(self, fds: dict[str, int], scales: np.ndarray, part: Range) -> tuple[str, float]:
        """Steps every slab of fragment ``part`` on the thread pool, a bounded window of slabs in flight, copies
        the values outside it as they are, and hashes the new θ in order; returns its digest and L2 norm.
        ``fds``: the open state files (``name`` read, ``name_new`` written) and the update's ``payload``;
        ``scales``: filled with the update's quantization scales (the update holds ``part``'s values only)."""
        o = self.opts
        slab = o.slab
        inv_w = np.float32(1.0 / self.total_weight)
        hasher = params_hasher()
        theta_sq = 0.0
        down = SparseDown(fds["payload"], part.size, o.down_block or o.block,
                          (self.version % 2 ** 32, o.mask_code) if o.down_bits == codec.MASK_BITS else None) \
            if codec.has_records(o.down_bits) else None
        pieces = ([(s, min(s + slab, part.start), False) for s in range(0, part.start, slab)]
                  + [(s, min(s + slab, part.end), True) for s in range(part.start, part.end, slab)]
                  + [(s, min(s + slab, self.n), False) for s in range(part.end, self.n, slab)])

        def digest(done: futures.Future) -> None:
            nonlocal theta_sq
            theta, sq, sparse = done.result()
            hasher.update(memoryview(theta).cast("B"))
            theta_sq += sq
            if down is not None and sparse:  # (a slab outside the merged fragment has none)
                down.append(*sparse)  # the sparse update's records, in order

        with futures.ThreadPoolExecutor(max(1, o.threads), thread_name_prefix="outer") as pool:
            window: collections.deque[futures.Future] = collections.deque()
            for s, e, step in pieces:  # digests taken in order
                window.append(pool.submit(self._step_slab, s, e, inv_w, fds, scales, part.start) if step else
                              pool.submit(self._copy_slab, s, e, fds))
                if len(window) > o.threads:
                    digest(window.popleft())
            while window:
                digest(window.popleft())
        if down is not None:
            down.close()
        return hasher_digest(hasher), math.sqrt(theta_sq)

    def _merged_delta(self, s: int, e: int, inv_w: np.float32) -> np.ndarray:
        """The merged pseudo-gradient Δ for values [s, e), by ``merge_rule``."""
        o = self.opts
        if o.rule in MEAN_RULES:
            delta = np.zeros(e - s, np.float32)
            self._sum_pending(s, delta, inv_w)  # Δ = Σ (w·c/Σw)·Δ_i
            return delta
        if o.rule == "trimmed_mean":
            return trimmed_mean(self.stack_pending(s, e - s), o.trim)
        return coordinate_median(self.stack_pending(s, e - s))

    def _copy_slab(self, s: int, e: int, fds: dict[str, int]) -> tuple[np.ndarray, float, tuple]:
        """Values [s, e) outside the fragment being merged: θ, the momentum and the residual written as they were;
        returns the θ slab and its sum of squares, as :meth:`_step_slab` does."""
        theta = np.empty(e - s, np.float32)
        for name in self.names:
            buf = theta if name == "theta" else np.empty(e - s, np.float32)
            read_into(fds[name], buf, 4 * s)
            write_from(fds[name + "_new"], buf, 4 * s)
        return theta, codec.sum_squares(theta), ()

    def _step_slab(self, s: int, e: int, inv_w: np.float32, fds: dict[str, int],
                   scales: np.ndarray, base: int = 0) -> tuple[np.ndarray, float, tuple]:
        """The outer step of values [s, e) of θ, which are values [s − ``base``, e − ``base``) of the pushes and
        of the update (``base``: the merged fragment's start): writes the new momentum, residual and θ slabs and
        the update's codes; returns the new θ slab, its sum of squares and (sparse update) its chunks' (first
        chunk, counts, records), which the caller writes in order. Raises NonFiniteResult before writing a
        non-finite value."""
        o = self.opts
        rel = s - base  # where the slab lies in the pushes' and the update's frames
        delta = self._merged_delta(rel, rel + e - s, inv_w)
        m = np.empty(e - s, np.float32)
        read_into(fds["momentum"], m, 4 * s)
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is caught below, by value
            u, m = outer_update(delta, m, o.outer)  # new slab-sized arrays
        self._check_finite("momentum", s, m)
        write_from(fds["momentum_new"], m, 4 * s)
        if self.feedback:
            r = m  # the momentum slab is written: reuse its buffer
            read_into(fds["residual"], r, 4 * s)
            with np.errstate(over="ignore", invalid="ignore"):
                u += r
        self._check_finite("update", s, u)  # before quantizing: the codec refuses NaN/Inf
        sparse: tuple = ()
        if codec.has_records(o.down_bits):
            chunk = o.down_block or o.block
            applied = np.zeros(e - s, np.float32)
            if o.down_bits == codec.MASK_BITS:  # the entries this version's mask keeps (in sync: the pushes' own)
                keep = codec.keep_mask(self.version, o.mask_code, rel, rel + e - s)
                sc, records = codec.mask_quantize_segment(chunk, u, keep)
                codec.mask_add(chunk, sc, records, keep, applied)
                sparse = (rel // chunk, None, records)
            else:  # the entries the merged pushes touched (their union), sparse-coded, or (codec.down_density) the
                # top of each chunk of u + residual
                keep = codec.top_k_mask(u, chunk, o.down_count) if o.down_count else delta != 0
                bits = o.down_bits
                assert codec.is_sparse(bits)
                sc, counts, records = codec.sparse_quantize_segment(bits, chunk, u, mask=keep)
                codec.sparse_add(bits, chunk, sc, counts, records, applied)
                sparse = (rel // chunk, counts, records)
            scales[rel // chunk: rel // chunk + sc.size] = sc
            if self.feedback:
                with np.errstate(over="ignore", invalid="ignore"):
                    u -= applied  # what the broadcast left out (everything off the union or mask, too)
                self._check_finite("residual", s, u)
                write_from(fds["residual_new"], u, 4 * s)
        elif o.down_bits == 32:
            applied = u
            write_from(fds["payload"], applied, 4 * rel)
        else:
            sc, payload = codec.quantize_segment(o.down_bits, o.block, u)
            scales[rel // o.block: rel // o.block + sc.size] = sc
            write_from(fds["payload"], payload, codec.payload_offset(o.down_bits, rel))
            applied = codec.dequantize_segment(o.down_bits, o.block, sc, payload, e - s)
            if self.feedback:
                with np.errstate(over="ignore", invalid="ignore"):
                    u -= applied  # what the broadcast left out
                self._check_finite("residual", s, u)
                write_from(fds["residual_new"], u, 4 * s)
        theta = np.empty(e - s, np.float32)
        read_into(fds["theta"], theta, 4 * s)
        with np.errstate(over="ignore", invalid="ignore"):
            theta += applied  # θ is the sum of what was broadcast
        self._check_finite("theta", s, theta)
        write_from(fds["theta_new"], theta, 4 * s)
        return theta, codec.sum_squares(theta), sparse

    def _commit(self, new: int, tmp: dict[str, Path]) -> None:
        """Makes ``new`` the current version: its files take their names, the old ones are kept for reuse
        (linked by nothing else) or unlinked, and the merged pushes' spools are released."""
        old = self.state_files()
        self.version = new
        for name in self.names:
            tmp[name].replace(self._path(name))
            if os.stat(old[name]).st_nlink == 1:  # nothing else links it: the next step writes over it
                self._spare_state[name] = old[name].replace(self.state_dir / f"{name}.spare")
            else:
                old[name].unlink()  # a checkpoint that linked it keeps its own name for it
        for p in self.pending:
            p.spool.close()
        self._pending = []  # (an open round's: PendingSet.clear, as its round closes)

    # -- outgoing parameters ------------------------------------------------------------------------

    def updates_since(self, have_version: int) -> list[Update] | None:
        """The chain of update frames from ``have_version`` to now, or None if not all are kept."""
        if have_version >= self.version:
            return []
        chain = [u for u in self.updates if u.base_version >= have_version]
        if not chain or chain[0].base_version != have_version:
            return None
        return chain

    def pull_frames(self, have_version: int, full: bool = False) -> tuple[bool, list[Update]]:
        """What a pull from ``have_version`` streams: (False, the chain of updates since it), or, when ``full`` is
        asked or the chain is no longer kept, (True, [θ itself, lossless]) (:meth:`full_update`). The one rule
        for the coordinator's PullGlobal and a range shard's."""
        chain = None if full else self.updates_since(have_version)
        return (True, [self.full_update()]) if chain is None else (False, chain)

    def full_update(self) -> Update:
        """θ itself as a lossless frame (fp32 + zstd level 1: speed over ratio, as fp32 barely compresses),
        written once per version on first request and streamed from the θ file (no copy in memory)."""
        if self._full is None or self._full.version != self.version:
            path = self.spool_dir / f"theta-{self.version:08d}.frame"
            size, crc = write_frame_file(path, 32, self.opts.block, self.n, np.zeros(0, np.float32),
                                         self.theta_path, 1)
            if self._full is not None:
                self._full.path.unlink(missing_ok=True)  # open handles keep it readable for pulls under way
            self._full = Update(version=self.version, base_version=0, path=path, size=size, crc32=crc,
                                params_digest=self.digest)
        return self._full
