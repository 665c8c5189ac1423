"""The token store: a tokenized corpus on disk or in object storage, as TensorStore arrays plus a manifest.

Layout of a store at ``LOCATION`` (a local path, ``file://``, ``gs://``, ``s3://`` or ``http(s)://``)::

    LOCATION/tokens/         zarr v3 array of token ids, uint16 when the vocabulary fits, else uint32;
                             chunks of ``CHUNK_TOKENS`` ids, zstd-compressed
    LOCATION/doc_ends/       zarr v3 array (uint64): the end offset of each document in ``tokens``
    LOCATION/manifest.json   :class:`Manifest`: format, dtype, vocabulary size, counts, the digest of the tokens,
                             the tokenizer; written last, by an atomic rename: a store without it is incomplete

:class:`TokenStore` opens a store by reading its manifest and the arrays' metadata only, so opening costs the same
for a corpus of a megabyte and of terabytes; :meth:`TokenStore.read` then fetches one range of ids. The digest
(:class:`ChainDigest`: a SHA-256 chain over blocks of ``DIGEST_BLOCK`` ids, whose state is one hash, so an
interrupted write resumes it) is computed once, while the store is written (:class:`StoreWriter`), and checked only
on request (:meth:`TokenStore.verify`). Only local stores are written here; any kvstore TensorStore opens is read.
"""

from __future__ import annotations

import array
import hashlib
import json
import logging
import os
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import tensorstore as ts

from dtrain import schema
from dtrain.data.remote import context, explain

FORMAT = "dtrain-token-store/1"
MANIFEST = "manifest.json"
TOKENS = "tokens/"
DOC_ENDS = "doc_ends/"
CHUNK_TOKENS = 1 << 20  # ids per stored chunk (2 MiB of uint16 before compression): one read's granularity
DIGEST_BLOCK = 1 << 20  # ids per link of the digest's chain (whatever the store's chunking)
DIGEST_SCHEME = "sha256-chain:"
ZSTD_LEVEL = 3
READ_TIMEOUT_S = 60.0  # one read of a manifest or of a range of ids, local or remote

log = logging.getLogger(__name__)


class DataError(ValueError):
    """A data source problem; the message names the path (the command line shows it as one line)."""


class StoreError(DataError):
    """A token store that cannot be opened or read as asked: the message names the store and what is wrong (a
    data-source error, which the command line shows as one line)."""


@dataclass(frozen=True)
class Manifest:
    """What a store holds, written once when it is complete."""

    format: str  # FORMAT
    dtype: Literal["uint16", "uint32"]  # the ids' type: uint16 when vocab_size <= 65536
    vocab_size: Annotated[int, schema.AtLeast(1)]  # ids are in [0, vocab_size)
    tokens: Annotated[int, schema.AtLeast(0)]  # ids in the store
    documents: Annotated[int, schema.AtLeast(0)]  # documents (entries of doc_ends)
    digest: str  # "sha256-chain:<hex>" of the ids as little-endian bytes, in order (ChainDigest)
    tokenizer: str  # "bytes" (one id per byte), or a Hugging Face tokenizer's name or file in the store
    eos_id: int | None = None  # the id that ends each document, if the tokenizer adds one

    def to_json(self) -> str:
        return json.dumps(schema.dump(self), indent=2) + "\n"


class ChainDigest:
    """The digest of a store's ids: ``"sha256-chain:" + hex(h)``, with ``h`` starting as 32 zero bytes and, for
    each block of ``DIGEST_BLOCK`` ids in order (as little-endian bytes of the store's dtype; the last block may be
    shorter), ``h = sha256(h + block)``. Its state after whole blocks is one hash (:attr:`state`), so a writer that
    was interrupted resumes it from its journal and the ids of the unfinished block; the one definition the writer
    and :meth:`TokenStore.verify` share."""

    def __init__(self, itemsize: int, state: bytes = bytes(32), pending: bytes = b""):
        self._block = DIGEST_BLOCK * itemsize
        if len(state) != 32 or len(pending) >= self._block:
            raise StoreError(f"a digest state is 32 bytes and less than a block pending, got {len(state)} and "
                             f"{len(pending)}")
        self._h = state
        self._pending = bytearray(pending)

    @property
    def state(self) -> bytes:
        """The chain's hash after the whole blocks so far (the ids of the unfinished block are not in it)."""
        return self._h

    def _link(self, block: bytes | bytearray | memoryview) -> None:
        h = hashlib.sha256(self._h)
        h.update(block)
        self._h = h.digest()

    def update(self, data: bytes | memoryview) -> None:
        """Adds the next ids' bytes."""
        view = memoryview(data).cast("B")
        if self._pending:
            take = min(len(view), self._block - len(self._pending))
            self._pending += view[:take]
            view = view[take:]
            if len(self._pending) < self._block:
                return
            self._link(self._pending)
            self._pending = bytearray()
        while len(view) >= self._block:
            self._link(view[:self._block])
            view = view[self._block:]
        self._pending += view

    def digest(self) -> str:
        """``"sha256-chain:<hex>"`` of every id added (the unfinished block as the last, shorter one)."""
        h = self._h
        if self._pending:
            link = hashlib.sha256(h)
            link.update(self._pending)
            h = link.digest()
        return DIGEST_SCHEME + h.hex()


@dataclass(frozen=True)
class Committed:
    """What a :class:`StoreWriter` has made durable (:meth:`StoreWriter.commit`): the ids and document ends on disk
    and the digest's chain state after the whole blocks among them; a writer given it resumes from there."""

    tokens: int
    documents: int
    chain: str  # hex of ChainDigest.state after tokens // DIGEST_BLOCK blocks


def dtype_for(vocab_size: int) -> Literal["uint16", "uint32"]:
    """The narrowest id type for a vocabulary: uint16 up to 65,536 ids, else uint32."""
    if vocab_size < 1:
        raise StoreError(f"a vocabulary needs at least one id, got vocab_size={vocab_size}")
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def kvstore_spec(location: str | Path) -> dict[str, Any]:
    """The TensorStore kvstore spec of a store's location: a local path or ``file://``, ``gs://BUCKET/PATH``,
    ``s3://BUCKET/PATH`` or ``http(s)://HOST/PATH`` (read-only). The path always ends with ``/``. An ``s3://``
    store is looked for at ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` when one is set (an S3-compatible
    service), in ``AWS_REGION`` or ``AWS_DEFAULT_REGION`` if set."""
    text = str(location)
    parsed = urllib.parse.urlparse(text)
    if parsed.scheme in ("", "file"):
        path = parsed.path if parsed.scheme == "file" else text
        return {"driver": "file", "path": str(Path(path).expanduser().resolve()) + "/"}
    if parsed.scheme in ("gs", "s3"):
        if not parsed.netloc:
            raise StoreError(f"token store {text}: no bucket in the URL (expected {parsed.scheme}://BUCKET/PATH)")
        spec = {"driver": "gcs" if parsed.scheme == "gs" else "s3", "bucket": parsed.netloc,
                "path": parsed.path.strip("/") + "/"}
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if parsed.scheme == "s3" and endpoint:  # an S3-compatible store (MinIO, R2, ...): the AWS SDKs' variables
            spec.update({"endpoint": endpoint, **({"aws_region": region} if region else {})})
        return spec
    if parsed.scheme in ("http", "https"):
        return {"driver": "http", "base_url": text.rstrip("/") + "/"}
    raise StoreError(f"token store {text}: unknown scheme {parsed.scheme!r} (a path, file://, gs://, s3://, "
                     "http:// or https://)")


def _array_spec(kv: dict[str, Any], name: str) -> dict[str, Any]:
    if kv["driver"] == "http":
        return {"driver": "zarr3", "kvstore": {**kv, "base_url": kv["base_url"] + name}}
    return {"driver": "zarr3", "kvstore": {**kv, "path": kv["path"] + name}}


def _new_array(kv: dict[str, Any], name: str, dtype: str, chunk: int) -> Any:
    metadata = {"shape": [0], "data_type": dtype,
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [chunk]}},
                "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                           {"name": "zstd", "configuration": {"level": ZSTD_LEVEL}}]}
    return ts.open({**_array_spec(kv, name), "metadata": metadata}, create=True, delete_existing=True).result()


class StoreWriter:
    """Writes a local token store document by document; :meth:`close` writes the manifest, which completes it.

    ``path``: a local folder (created; a complete store there is refused unless ``overwrite``). ``vocab_size``:
    every id must be below it. ``tokenizer``: what made the ids ("bytes", or a tokenizer's name). ``eos_id``:
    the end-of-document id, if the caller appends one to each document. ``resume``: what an interrupted writer of
    the same store had committed (:meth:`commit`): the arrays there are cut back to it and writing goes on after
    it (else any arrays there are replaced).
    """

    def __init__(self, path: str | Path, vocab_size: int, tokenizer: str = "bytes", eos_id: int | None = None,
                 overwrite: bool = False, chunk_tokens: int = CHUNK_TOKENS, resume: Committed | None = None):
        self.path = Path(path)
        if (self.path / MANIFEST).exists() and not overwrite:
            raise StoreError(f"token store {self.path} exists already (its {MANIFEST} is there): choose another "
                             "--out, or delete it first")
        if chunk_tokens < 1:
            raise StoreError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
        self.dtype = np.dtype(dtype_for(vocab_size))
        if eos_id is not None and not 0 <= eos_id < vocab_size:
            raise StoreError(f"eos_id {eos_id} is not an id of a vocabulary of {vocab_size}")
        # Every argument checked: only now is anything on disk touched.
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / MANIFEST).unlink(missing_ok=True)  # overwriting: incomplete until the new manifest
        self.vocab_size, self.tokenizer, self.eos_id = vocab_size, tokenizer, eos_id
        kv = kvstore_spec(self.path)
        self._buffer: list[np.ndarray] = []
        self._buffered = 0
        self._doc_ends = array.array("Q")  # ends not yet written: 8 bytes a document, not a Python int's 28
        self._closed = False
        if resume is None:
            self._tokens = _new_array(kv, TOKENS, self.dtype.name, chunk_tokens)
            self._doc_ends_array = _new_array(kv, DOC_ENDS, "uint64", chunk_tokens)
            self._chunk = chunk_tokens
            self._written = 0  # ids flushed to the tokens array
            self._ends_written = 0  # document ends flushed to the doc_ends array
            self._digest = ChainDigest(self.dtype.itemsize)
        else:
            self._resume(kv, resume)

    def _resume(self, kv: dict[str, Any], at: Committed) -> None:
        """Opens the arrays an interrupted writer left, cuts them back to what it had committed (it may have
        written more before it stopped) and restores the digest from ``at.chain`` and the unfinished block's ids."""
        where = str(self.path)
        self._tokens = _open_array(where, kv, TOKENS, READ_TIMEOUT_S, writable=True)
        self._doc_ends_array = _open_array(where, kv, DOC_ENDS, READ_TIMEOUT_S, writable=True)
        if self._tokens.dtype.name != self.dtype.name:
            raise StoreError(f"token store {where}: its ids are {self._tokens.dtype.name}, a vocabulary of "
                             f"{self.vocab_size} needs {self.dtype.name}: it was begun with another tokenizer")
        if self._tokens.shape[0] < at.tokens or self._doc_ends_array.shape[0] < at.documents:
            raise StoreError(f"token store {where}: it holds {self._tokens.shape[0]} ids and "
                             f"{self._doc_ends_array.shape[0]} document ends, fewer than the {at.tokens} and "
                             f"{at.documents} committed: it is damaged (start over with --overwrite)")
        self._tokens = self._tokens.resize(exclusive_max=[at.tokens], shrink_only=True).result()
        self._doc_ends_array = self._doc_ends_array.resize(exclusive_max=[at.documents], shrink_only=True).result()
        self._chunk = int(self._tokens.chunk_layout.read_chunk.shape[0])
        self._written, self._ends_written = at.tokens, at.documents
        tail = (at.tokens // DIGEST_BLOCK) * DIGEST_BLOCK
        pending = np.asarray(self._tokens[tail:at.tokens].read().result())
        try:
            state = bytes.fromhex(at.chain)
        except ValueError:
            raise StoreError(f"token store {where}: digest state {at.chain!r} is not hex") from None
        self._digest = ChainDigest(self.dtype.itemsize, state, pending.astype(self.dtype.newbyteorder("<")).tobytes())

    @property
    def tokens(self) -> int:
        """Ids added so far."""
        return self._written + self._buffered

    @property
    def documents(self) -> int:
        """Documents added so far."""
        return self._ends_written + len(self._doc_ends)

    def add_document(self, ids: np.ndarray) -> None:
        """Appends one document's ids (an integer array of any integer type; each id below ``vocab_size``)."""
        ids = np.asarray(ids)
        self.add_documents(ids, np.array([ids.size if ids.ndim == 1 else 0], dtype=np.int64))

    def add_documents(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Appends documents given as their ids one after the other (a 1-D integer array, each id below
        ``vocab_size``) and each one's length (``lengths`` sums to ``ids.size``); nothing is kept of a refused
        call."""
        if self._closed:
            raise StoreError(f"token store {self.path} is closed: no more documents")
        ids, lengths = np.asarray(ids), np.asarray(lengths)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise StoreError(f"a document is a 1-D array of integer ids, got shape {ids.shape} of {ids.dtype}")
        if lengths.ndim != 1 or (lengths.size and int(lengths.min()) < 0) or int(lengths.sum()) != ids.size:
            raise StoreError(f"document lengths {lengths.tolist()[:8]}... do not add up to the {ids.size} ids")
        if ids.size:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.vocab_size:
                raise StoreError(f"id {hi if hi >= self.vocab_size else lo} is outside the vocabulary of "
                                 f"{self.vocab_size} ids")
        ends = self.tokens + np.cumsum(lengths, dtype=np.uint64)
        stored = ids.astype(self.dtype.newbyteorder("<"), copy=False)
        self._buffer.append(stored)
        self._buffered += stored.size
        self._doc_ends.frombytes(ends.astype("<u8").tobytes())
        if self._buffered >= self._chunk:
            self._flush(whole_chunks=True)
        if len(self._doc_ends) >= self._chunk:
            self._flush_ends()

    def _flush(self, whole_chunks: bool) -> None:
        data = np.concatenate(self._buffer) if self._buffer else np.zeros(0, self.dtype)
        n = (data.size // self._chunk) * self._chunk if whole_chunks else data.size
        if n:
            start = self._written
            self._tokens = self._tokens.resize(exclusive_max=[start + n], expand_only=True).result()
            self._tokens[start:start + n].write(data[:n]).result()
            self._digest.update(np.ascontiguousarray(data[:n]).data)
            self._written += n
        rest = data[n:]
        self._buffer = [rest] if rest.size else []
        self._buffered = rest.size

    def _flush_ends(self) -> None:
        if not self._doc_ends:
            return
        ends = np.frombuffer(self._doc_ends, dtype=np.uint64)
        start, stop = self._ends_written, self._ends_written + ends.size
        self._doc_ends_array = self._doc_ends_array.resize(exclusive_max=[stop], expand_only=True).result()
        self._doc_ends_array[start:stop].write(ends).result()
        self._ends_written = stop
        self._doc_ends = array.array("Q")

    @property
    def chunk(self) -> int:
        """Ids (and document ends) per stored chunk."""
        return self._chunk

    def reserve(self, tokens: int, documents: int) -> None:
        """Grows the arrays to hold at least ``tokens`` ids and ``documents`` document ends, for writers in other
        processes (:func:`writable_array`) to fill whole chunks of them; :meth:`adopt` then takes what they wrote."""
        if tokens > self._tokens.shape[0]:
            self._tokens = self._tokens.resize(exclusive_max=[tokens], expand_only=True).result()
        if documents > self._doc_ends_array.shape[0]:
            self._doc_ends_array = self._doc_ends_array.resize(exclusive_max=[documents], expand_only=True).result()

    def adopt(self, tokens: int, documents: int) -> None:
        """Takes ``tokens`` ids and ``documents`` document ends that other processes wrote right after what this
        writer holds (nothing may be buffered here): the digest reads the ids back from the array."""
        if self._buffered or self._doc_ends:
            raise StoreError(f"token store {self.path}: ids written elsewhere cannot follow ids still buffered here")
        stop = self._written + tokens
        for start in range(self._written, stop, DIGEST_BLOCK):
            ids = np.asarray(self._tokens[start:min(stop, start + DIGEST_BLOCK)].read().result())
            self._digest.update(np.ascontiguousarray(ids.astype(self.dtype.newbyteorder("<"), copy=False)).data)
        self._written, self._ends_written = stop, self._ends_written + documents

    def commit(self) -> Committed:
        """Writes every id and document end added so far (a partly filled chunk too, rewritten by later writes) and
        returns what is now on disk: given back as ``resume``, a writer goes on from exactly here."""
        if self._closed:
            raise StoreError(f"token store {self.path} is closed already")
        self._flush(whole_chunks=False)
        self._flush_ends()
        return Committed(tokens=self._written, documents=self._ends_written, chain=self._digest.state.hex())

    def close(self) -> Manifest:
        """Flushes the ids and document ends, then writes the manifest (atomically): the store is complete."""
        self.commit()
        manifest = Manifest(format=FORMAT, dtype=dtype_for(self.vocab_size), vocab_size=self.vocab_size,
                            tokens=self._written, documents=self._ends_written, digest=self._digest.digest(),
                            tokenizer=self.tokenizer, eos_id=self.eos_id)
        tmp = self.path / (MANIFEST + ".tmp")
        tmp.write_text(manifest.to_json())
        os.replace(tmp, self.path / MANIFEST)  # the commit marker: readers see a whole store or none
        self._closed = True
        return manifest


class TokenStore:
    """A complete token store, opened from its manifest; ids are read on demand (:meth:`read`)."""

    def __init__(self, location: str, manifest: Manifest, tokens: Any, doc_ends: Any,
                 timeout_s: float = READ_TIMEOUT_S):
        self.location, self.manifest, self.timeout_s = location, manifest, timeout_s
        self._tokens, self._doc_ends = tokens, doc_ends

    @classmethod
    def open(cls, location: str | Path, timeout_s: float = READ_TIMEOUT_S) -> TokenStore:
        """Opens the store at ``location``: reads its manifest and the arrays' metadata, nothing of the ids,
        waiting at most ``timeout_s`` for each. Raises :class:`StoreError` naming the store and what is wrong (not
        there, not complete, not answering, a manifest or an array that does not match)."""
        where = str(location)
        kv = kvstore_spec(location)
        if kv["driver"] != "file":
            log.info("opening token store %s (waits up to %.0f s for each answer)", where, timeout_s)
        ctx = context(kv)  # remote: retries capped, so a store that cannot answer says why within seconds
        manifest = _read_manifest(where, kv, timeout_s, ctx)
        tokens = _open_array(where, kv, TOKENS, timeout_s, ctx=ctx)
        doc_ends = _open_array(where, kv, DOC_ENDS, timeout_s, ctx=ctx)
        if tokens.dtype.name != manifest.dtype or tokens.shape != (manifest.tokens,):
            raise StoreError(f"token store {where}: its tokens array is {tokens.dtype.name}[{tokens.shape[0]}], "
                             f"its manifest says {manifest.dtype}[{manifest.tokens}]: the store is damaged")
        if doc_ends.shape != (manifest.documents,):
            raise StoreError(f"token store {where}: {doc_ends.shape[0]} document ends, its manifest says "
                             f"{manifest.documents}: the store is damaged")
        return cls(where, manifest, tokens, doc_ends, timeout_s)

    def __len__(self) -> int:
        return self.manifest.tokens

    def read(self, start: int, stop: int) -> np.ndarray:
        """Ids ``[start, stop)`` as an array of the store's dtype (one read of the chunks they span)."""
        future = self.read_async(start, stop)
        with answered(self.location, self.timeout_s, f"reading ids [{start}, {stop})"):
            return np.asarray(future.result(timeout=self.timeout_s))

    @property
    def chunk_tokens(self) -> int:
        """Ids per stored chunk: the granularity of a read (a read decodes every chunk it touches)."""
        return int(self._tokens.chunk_layout.read_chunk.shape[0])

    def read_async(self, start: int, stop: int) -> Any:
        """Starts reading ids ``[start, stop)`` on TensorStore's own threads; ``.result(timeout=...)`` of the
        returned future gives the array. :meth:`read` is the blocking form."""
        if not 0 <= start <= stop <= self.manifest.tokens:
            raise StoreError(f"token store {self.location}: range [{start}, {stop}) is outside its "
                             f"{self.manifest.tokens} ids")
        return self._tokens[start:stop].read()

    def doc_ends(self) -> np.ndarray:
        """The end offset of every document (uint64; the last equals the token count)."""
        return np.asarray(self._doc_ends.read().result(timeout=self.timeout_s))

    def verify(self, block: int = 16 * CHUNK_TOKENS) -> None:
        """Reads every id and checks the manifest's digest (and the vocabulary bound); raises StoreError on a
        mismatch. Its cost grows with the store: a check to run on request, never at start-up."""
        if not self.manifest.digest.startswith(DIGEST_SCHEME):
            raise StoreError(f"token store {self.location}: its digest {self.manifest.digest!r} is not a "
                             f"{DIGEST_SCHEME!r} digest, the one this dtrain checks")
        digest = ChainDigest(np.dtype(self.manifest.dtype).itemsize)
        n = self.manifest.tokens
        for start in range(0, n, block):
            ids = self.read(start, min(n, start + block))
            if ids.size and int(ids.max()) >= self.manifest.vocab_size:
                raise StoreError(f"token store {self.location}: id {int(ids.max())} is outside its vocabulary "
                                 f"of {self.manifest.vocab_size}")
            digest.update(np.ascontiguousarray(ids.astype(ids.dtype.newbyteorder("<"), copy=False)).data)
        if digest.digest() != self.manifest.digest:
            raise StoreError(f"token store {self.location}: its ids do not match the manifest's digest "
                             f"{self.manifest.digest}: the store is damaged")


@contextmanager
def answered(where: str, timeout_s: float, doing: str, hint: str = "") -> Iterator[None]:
    """Around a wait on TensorStore for the store at ``where``: its timeout and its errors become one StoreError line
    naming the store and what was being done (``doing``; ``hint`` follows a timeout), the cause read out of the
    error's text (``dtrain.data.remote.explain``)."""
    try:
        yield
    except TimeoutError:
        raise StoreError(f"token store {where} did not answer within {timeout_s:g} s ({doing}){hint}") from None
    except ValueError as e:
        raise StoreError(f"token store {where}: {doing} failed: {explain(where, str(e))}") from None


def read_store_file(location: str | Path, name: str, timeout_s: float = READ_TIMEOUT_S) -> bytes | None:
    """The bytes of the file ``name`` beside a store's arrays (``tokenizer.json``, say), or None if there is none;
    raises StoreError naming the store when it cannot be read."""
    where = str(location)
    kv = kvstore_spec(location)
    with answered(where, timeout_s, f"reading its {name}"):
        result = ts.KvStore.open(kv, context=context(kv)).result(timeout=timeout_s).read(name).result(
            timeout=timeout_s)
    return bytes(result.value) if result.state == "value" else None


def _read_manifest(where: str, kv: dict[str, Any], timeout_s: float, ctx: Any = None) -> Manifest:
    with answered(where, timeout_s, f"reading its {MANIFEST}",
                  hint=": check the address and that it is reachable from here"):
        store = ts.KvStore.open(kv, context=ctx).result(timeout=timeout_s)
        result = store.read(MANIFEST).result(timeout=timeout_s)
    if result.state != "value":
        raise StoreError(f"token store {where} is not complete: it has no {MANIFEST} (a store is complete once "
                         "`dtrain tokenize` finishes; run it again to finish an interrupted one)")
    try:
        manifest = schema.load(Manifest, json.loads(bytes(result.value)))
    except ValueError as e:  # bad JSON, or a schema.SchemaError naming the field
        raise StoreError(f"token store {where}: its {MANIFEST} is not a manifest: {e}") from None
    if manifest.format != FORMAT:
        raise StoreError(f"token store {where}: format {manifest.format!r}, this dtrain reads {FORMAT!r}")
    if manifest.dtype != dtype_for(manifest.vocab_size):
        raise StoreError(f"token store {where}: its {MANIFEST} does not add up (dtype {manifest.dtype} for a "
                         f"vocabulary of {manifest.vocab_size})")
    return manifest


def writable_array(path: str | Path, name: str) -> Any:
    """One array (:data:`TOKENS` or :data:`DOC_ENDS`) of a local store being written, opened for writing from
    another process: a worker that fills chunks its :class:`StoreWriter` reserved."""
    return _open_array(str(path), kvstore_spec(path), name, READ_TIMEOUT_S, writable=True)


def _open_array(where: str, kv: dict[str, Any], name: str, timeout_s: float, writable: bool = False,
                ctx: Any = None) -> Any:
    # A missing chunk is an error, never a run of zeros: a store's every chunk is written before its manifest. (A
    # writer resuming an interrupted store writes into chunks not there yet: those read as the fill value.)
    spec = {**_array_spec(kv, name), "fill_missing_data_reads": writable}
    try:
        return ts.open(spec, open=True, read=True, write=writable, context=ctx).result(timeout=timeout_s)
    except TimeoutError:
        raise StoreError(f"token store {where} did not answer within {timeout_s:g} s (opening its "
                         f"{name.rstrip('/')} array)") from None
    except ValueError as e:
        raise StoreError(f"token store {where}: its {name.rstrip('/')} array cannot be opened: "
                         f"{explain(where, str(e))}") from None
