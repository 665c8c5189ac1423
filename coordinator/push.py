"""Receiving a pushed delta: the wire side of PushDelta, up to the frame spooled and validated.

Owns reading a push's header (it must come first, and its tree digest must be the coordinator's:
:func:`read_header`), bounding what the header claims (total size, chunk count: :meth:`PushIntake.frame_receiver`),
receiving the chunks in order with their CRCs into a merger spool and validating the whole frame, step by step
(:class:`Upload`, which the reader of the stream drives: the event loop's data plane, ``coordinator/data_plane.py``,
through the coordinator's open round, ``coordinator/open_round.py``, or a range shard's, ``coordinator/shard_plane.py``;
it also bounds how many frames stream in and decode at once, ``coordinator.max_receiving``). None of it takes the
service's lock. Refusals are raised for the
caller to answer and record: WireError before the payload streams, :class:`PayloadRefused` or
:class:`UploadBroke` while it does. The state machine's decision on the push, before and after, is the open
round's.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
from opentelemetry import trace

from coordinator.memory import FrameStreams
from coordinator.merger import Merger
from coordinator.records import PushInfo
from coordinator.spool import Spool
from dtrain import codec
from dtrain.config.sections import Config
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.wire import FrameReceiver, RawChunk, WireError, max_frame_bytes
from dtrain.telemetry import Telemetry
from dtrain.train import fragments

PushMessages = Iterator[pb.PushMessage | RawChunk]  # a push's stream: chunks arrive as RawChunk


class PayloadRefused(Exception):
    """A push whose payload is bad (a broken chunk stream, a frame that does not validate); ``code`` is the gRPC
    status to answer with. ``busy``: refused for load, not for the payload (its island's streams are at their
    limit as its data arrives): RESOURCE_EXHAUSTED, which workers retry."""

    def __init__(self, code: grpc.StatusCode, message: str, busy: bool = False):
        super().__init__(message)
        self.code, self.busy = code, busy


def payload_bytes(message: pb.PushMessage | RawChunk) -> int:
    """The payload bytes a push's message carries (a chunk's data; a header none)."""
    return len(message.chunk.data) if message.WhichOneof("kind") == "chunk" else 0


class UploadBroke(Exception):
    """A push whose stream ended before its last chunk: the client cancelled the call, lost its connection or
    closed the stream early. Nothing was admitted; the partial spool is discarded as it closes."""

    def __init__(self, info: PushInfo, received: int, chunks: int):
        super().__init__(f"push {info.push_id}: stream truncated: got {received} of {chunks} chunks (the upload was "
                         f"cancelled, cut or closed early); the partial frame is discarded, nothing was applied")
        self.received, self.chunks = received, chunks


def read_header(requests: PushMessages, tree_digest: str, parts: int = 1) -> pb.PushHeader:
    """The push's header, its first message; WireError if there is none, if its payload is for another
    parameter tree than ``tree_digest`` (the coordinator's), or if the fragment it names does not fit a plan of
    ``parts`` fragments (``outer.fragments``: ``dtrain.train.fragments.check_push``).

    The digest is checked here, not by the state machine: whether a payload fits the model's parameter tree is a
    property of the merger's θ (like Join's config fingerprint); the state machine holds membership, versions and
    cursors, and admits a push on those alone."""
    first = next(requests, None)
    if first is None or isinstance(first, RawChunk) or first.WhichOneof("kind") != "header":
        raise WireError(grpc.StatusCode.INVALID_ARGUMENT, "a push must start with a PushHeader")
    h = first.header
    if h.tree_digest != tree_digest:
        raise WireError(grpc.StatusCode.FAILED_PRECONDITION,
                        f"header tree_digest {h.tree_digest!r} does not match the coordinator's "
                        f"{tree_digest!r}: the model's parameter tree differs")
    misfit = fragments.check_push(h.fragment, h.base_version, parts)
    if misfit:
        raise WireError(grpc.StatusCode.INVALID_ARGUMENT, f"push {h.push_id[:64]!r}: {misfit}")
    return h


def push_info(h: pb.PushHeader) -> PushInfo:
    """What the state machine decides a push on, from its header."""
    return PushInfo(push_id=h.push_id, island_id=h.island_id, base_version=h.base_version, tokens=h.tokens,
                    inner_steps=h.inner_steps, cursor_start=h.cursor_start, cursor_end=h.cursor_end,
                    shard_index=h.shard_index)


class PushIntake:
    """Receives pushed frames into the merger's spools (:meth:`upload`), each counted in ``streams`` and traced in
    ``telemetry``; the data plane that drives them lets ``coordinator.max_receiving`` stream in at once
    (``coordinator/data_plane.py``)."""

    def __init__(self, cfg: Config, merger: Merger, telemetry: Telemetry, streams: FrameStreams):
        self.merger, self.telemetry, self.streams = merger, telemetry, streams
        self.max_frame = max_frame_bytes(merger.n, cfg.codec.block)
        self.chunk_bytes = cfg.codec.chunk_bytes

    def frame_receiver(self, h: pb.PushHeader) -> FrameReceiver:
        """The checker of the header's frame: WireError if its size or chunk count is out of bounds for this
        model and ``codec.chunk_bytes``."""
        return FrameReceiver(h.total_bytes, h.chunks, h.frame_crc32, self.max_frame, self.chunk_bytes)

    def upload(self, receiver: FrameReceiver, spool: Spool, info: PushInfo, round_span: trace.Span | None,
               target_version: int, preview: str) -> Upload:
        """The receiving of one push's payload into ``spool`` through ``receiver``, step by step (:class:`Upload`);
        ``round_span``: the open round's span (None: a push to be dropped or rejected, a trace of its own);
        ``preview``: the state's preview decision."""
        return Upload(self, receiver, spool, info, round_span, target_version, preview)


class Upload:
    """One push's payload arriving, driven by whoever reads the stream (sans I/O: the data plane's awaits):
    :meth:`chunk` for each message after the header,
    :meth:`end` when the client half-closes, :meth:`broke` when the call is cancelled, :meth:`close` always. Counted
    in the intake's frame streams and traced from its first chunk to its close."""

    def __init__(self, intake: PushIntake, receiver: FrameReceiver, spool: Spool, info: PushInfo,
                 round_span: trace.Span | None, target_version: int, preview: str):
        self.intake, self.receiver, self.spool, self.info = intake, receiver, spool, info
        self.round_span, self.target_version, self.preview = round_span, target_version, preview
        self.started = False  # its first chunk has arrived: counted and traced from there
        self.ended = False  # end() accepted the whole frame
        self._span: trace.Span | None = None

    def _start(self) -> None:
        i = self.info
        self._span = self.intake.telemetry.start_span("dtrain.receive", parent=self.round_span, island=i.island_id,
                                                      push_id=i.push_id, version=self.target_version,
                                                      preview=self.preview)
        self.intake.streams.begin()  # counted from here to close(): nothing between them can raise
        self.started = True

    def chunk(self, msg: pb.PushMessage | RawChunk) -> None:
        """One message after the header: a chunk, checked (its CRC, its place) and spooled. PayloadRefused for a
        message that is not a chunk, or a chunk or frame found bad."""
        if not self.started:
            self._start()
        try:
            if msg.WhichOneof("kind") != "chunk":
                raise WireError(grpc.StatusCode.INVALID_ARGUMENT, "only chunks may follow the header")
            self.spool.write(self.receiver.add(msg.chunk), msg.chunk.crc32)  # the CRC add() checked: no second pass
        except WireError as e:
            raise PayloadRefused(e.code, f"push {self.info.push_id}: {e}") from None
        except codec.CodecError as e:
            raise PayloadRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"push {self.info.push_id}: bad frame: {e}") from None

    def end(self) -> None:
        """The client half-closed: the whole frame is checked (its chunk count, size and CRC) and validated (it
        decodes cleanly before anything is applied). UploadBroke for a truncated stream, PayloadRefused for a bad
        frame."""
        r, tele, i = self.receiver, self.intake.telemetry, self.info
        if self.ended:
            return
        if r.received < r.chunks:
            raise self.broke()
        try:
            r.finish()
            if self._span is not None:
                tele.end(self._span, bytes=r.size)
            with tele.span("dtrain.validate", parent=self.round_span, island=i.island_id, push_id=i.push_id,
                           version=self.target_version):
                self.intake.merger.validate(self.spool)  # the whole frame decodes cleanly before anything is applied
            self.ended = True
        except WireError as e:
            raise PayloadRefused(e.code, f"push {i.push_id}: {e}") from None
        except codec.CodecError as e:
            raise PayloadRefused(grpc.StatusCode.INVALID_ARGUMENT, f"push {i.push_id}: bad frame: {e}") from None

    def broke(self) -> UploadBroke:
        """What a stream that ended (or was cancelled) before its last chunk is: the exception to raise."""
        return UploadBroke(self.info, self.receiver.received, self.receiver.chunks)

    def close(self) -> None:
        """Uncounted; a refused or broken upload's span ends here, with what arrived. Idempotent."""
        if self.started:
            self.started = False
            self.intake.streams.end()
            if self._span is not None:
                self.intake.telemetry.end(self._span, bytes=self.receiver.size)
