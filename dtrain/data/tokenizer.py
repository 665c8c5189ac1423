"""Tokenizers for token stores: one interface, the byte tokenizer and Hugging Face ``tokenizers``, and training a
byte-level BPE on a corpus.

A :class:`Tokenizer` turns one document (a string, or bytes for the byte tokenizer) into its ids *with* the
end-of-document id appended; its :attr:`~Tokenizer.name` is what a store's manifest records. A tokenizer crosses to
a worker process as its :meth:`~Tokenizer.spec` (plain strings), never pickled.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from dtrain.data.documents import SourceFile, read_documents
from dtrain.data.token_store import DataError

BYTE_EOS = 10  # the byte tokenizer's end of document: b"\n"
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]", "<|im_end|>")
TRAINED_EOS = "<|endoftext|>"
STORE_TOKENIZER_FILE = "tokenizer.json"  # a Hugging Face tokenizer's file, inside the store
MAX_VOCAB = 1 << 32  # ids are stored as uint32 at most


class Tokenizer(Protocol):
    """What a token store is written with."""

    @property
    def name(self) -> str:
        """What the manifest's ``tokenizer`` field says: ``"bytes"``, or the tokenizer's file in the store."""
        ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int | None: ...

    @property
    def raw(self) -> bool:
        """Whether it takes text files' bytes as they are (no UTF-8 decoding)."""
        ...

    def spec(self) -> tuple[str, str, int]:
        """(kind, its Hugging Face JSON or '', eos id): what rebuilds it in another process
        (:func:`from_spec`)."""
        ...

    def identity(self) -> str:
        """A string that differs between tokenizers that give different ids (a resumed run checks it)."""
        ...

    def encode_documents(self, documents: Sequence[str | bytes]) -> tuple[np.ndarray, np.ndarray]:
        """The documents' ids one after the other, each document's followed by the end-of-document id, and each
        document's length (int64), eos included."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (a byte sequence that is not UTF-8 shown with replacement characters)."""
        ...


class ByteTokenizer:
    """Ids are the bytes (vocab 256), with no decoding at all; each document ends with b"\\n" (id 10)."""

    name = "bytes"
    vocab_size = 256
    eos_id: int | None = BYTE_EOS
    raw = True

    def spec(self) -> tuple[str, str, int]:
        return ("bytes", "", BYTE_EOS)

    def identity(self) -> str:
        return "bytes"

    def encode_documents(self, documents: Sequence[str | bytes]) -> tuple[np.ndarray, np.ndarray]:
        blobs = [d.encode("utf-8") if isinstance(d, str) else d for d in documents]
        ids = np.frombuffer(b"".join(b + b"\n" for b in blobs), dtype=np.uint8)
        return ids, np.array([len(b) + 1 for b in blobs], dtype=np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer (its tokenizer.json text). ``eos``: the end-of-document token, or
    None to find one of :data:`EOS_NAMES` in its vocabulary. Special tokens written in a document's text are
    encoded as text, never as their special id. Raises DataError when it does not parse, has no such eos token,
    or has more ids than uint32 holds."""

    name = STORE_TOKENIZER_FILE
    raw = False

    def __init__(self, json_text: str, eos: str | None = None, where: str = "tokenizer"):
        from tokenizers import Tokenizer as HF

        try:
            self.tokenizer = HF.from_str(json_text)
        except Exception as e:  # tokenizers raises plain Exceptions for a file that does not parse
            raise DataError(f"{where}: not a Hugging Face tokenizer.json ({e})") from None
        self.json_text, self.where = json_text, where
        self.tokenizer.encode_special_tokens = True  # "<|endoftext|>" in a document is text, not an eos
        self.vocab_size = int(self.tokenizer.get_vocab_size(with_added_tokens=True))
        if not 1 <= self.vocab_size <= MAX_VOCAB:
            raise DataError(f"{where}: a vocabulary of {self.vocab_size:,} ids does not fit uint32 ids")
        names = [eos] if eos is not None else list(EOS_NAMES)
        found = [(n, i) for n in names if (i := self.tokenizer.token_to_id(n)) is not None]
        if not found:
            raise DataError(f"{where}: no end-of-document token {eos!r} in its vocabulary" if eos is not None else
                            f"{where}: none of {', '.join(EOS_NAMES)} is in its vocabulary: name its "
                            "end-of-document token with --eos")
        self.eos_token, eos_id = found[0]
        if not 0 <= eos_id < self.vocab_size:
            raise DataError(f"{where}: its end-of-document id {eos_id} is not below its vocabulary size "
                            f"{self.vocab_size}")
        self.eos_id: int | None = eos_id

    @classmethod
    def from_file(cls, path: str | Path, eos: str | None = None) -> HFTokenizer:
        """Reads a tokenizer.json (DataError naming it when it cannot be read or parsed)."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"{path}: cannot read the tokenizer: {getattr(e, 'strerror', None) or e}") from None
        return cls(text, eos, where=str(path))

    def spec(self) -> tuple[str, str, int]:
        assert self.eos_id is not None
        return ("hf", self.json_text, self.eos_id)

    def identity(self) -> str:
        return f"hf sha256:{hashlib.sha256(self.json_text.encode()).hexdigest()} eos {self.eos_id}"

    def encode_documents(self, documents: Sequence[str | bytes]) -> tuple[np.ndarray, np.ndarray]:
        texts = [d if isinstance(d, str) else d.decode("utf-8") for d in documents]
        encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        lengths = np.array([len(e.ids) + 1 for e in encodings], dtype=np.int64)
        ids = np.empty(int(lengths.sum()), dtype=np.uint32)
        eos = self.eos_id
        assert eos is not None
        at = 0
        for e, n in zip(encodings, lengths.tolist(), strict=True):
            ids[at:at + n - 1] = e.ids
            ids[at + n - 1] = eos
            at += n
        if ids.size and int(ids.max()) >= self.vocab_size:
            raise DataError(f"{self.where}: it gave id {int(ids.max())}, outside its vocabulary of "
                            f"{self.vocab_size}")
        return ids, lengths

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False))


def from_spec(spec: tuple[str, str, int]) -> Tokenizer:
    """The tokenizer a :meth:`Tokenizer.spec` describes (in a worker process)."""
    kind, text, eos_id = spec
    if kind == "bytes":
        return ByteTokenizer()
    tok = HFTokenizer.__new__(HFTokenizer)  # the checks were made where the spec came from
    from tokenizers import Tokenizer as HF

    tok.tokenizer, tok.json_text, tok.where = HF.from_str(text), text, "tokenizer"
    tok.tokenizer.encode_special_tokens = True
    tok.vocab_size, tok.eos_id = int(tok.tokenizer.get_vocab_size(with_added_tokens=True)), eos_id
    return tok


def train_bpe(files: Sequence[SourceFile], vocab_size: int, *, field: str = "text", skip_bad: bool = False,
              max_bytes: int = 0) -> HFTokenizer:
    """A byte-level BPE of ``vocab_size`` ids (the 256 bytes, ``<|endoftext|>``, then merges) trained on the
    documents of ``files`` in order (the first ``max_bytes`` of text, 0: all): the same files give the same
    tokenizer. A bad file raises DataError, or with ``skip_bad`` is left out."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise DataError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least 257 ids (256 bytes and "
                        f"{TRAINED_EOS})")
    if vocab_size > MAX_VOCAB:
        raise DataError(f"--vocab-size {vocab_size:,} does not fit uint32 ids")
    tok = HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[TRAINED_EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_text(files, field, skip_bad, max_bytes), trainer)
    return HFTokenizer(tok.to_str(), TRAINED_EOS, where=f"the BPE trained on {len(files)} files")


def _training_text(files: Sequence[SourceFile], field: str, skip_bad: bool, max_bytes: int) -> Iterable[str]:
    seen = 0
    for source in files:
        try:
            texts = [t if isinstance(t, str) else t.decode("utf-8") for t in read_documents(source, field)]
        except DataError:
            if skip_bad:
                continue  # tokenize() names it when it skips it
            raise
        for text in texts:
            yield text
            seen += len(text)
            if max_bytes and seen >= max_bytes:
                return
