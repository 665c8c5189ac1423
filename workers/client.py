"""The island's gRPC client: auth, deadlines, retries with backoff, streamed pushes and pulls.

Every call has a deadline. UNAVAILABLE (the coordinator restarting, a cut
link), DEADLINE_EXCEEDED and RESOURCE_EXHAUSTED for load (the coordinator is
busy: a stream limit, :func:`busy`) are retried with exponential backoff and
jitter for up to ``worker.retry_total_s`` of wall time; each retry is reported (with
the coordinator's address, gRPC's status code and what it means, and the time
left) and giving up names the address, how long it tried and what to check, in
words rather than gRPC's debug text. Pushes are safe to retry because they
carry a push id the coordinator applies at most once. Other errors are raised
as :class:`CoordinatorError` with the coordinator's message (and, for a push
refused while its island is throttled, the seconds left: ``retry_after_s``; for
one refused because its island is quarantined, the coordinator's version:
``stopped_at``); a Join refused because the run is over, as :class:`RunOverError`.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from dtrain.config.sections import Config
from dtrain.errors import DtrainError
from dtrain.net.probe import speaks_tls
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.proto import dtrain_pb2_grpc as pb_grpc
from dtrain.net.wire import (
    BUSY_DETAILS,
    BUSY_METADATA_KEY,
    HEARTBEAT_DEADLINE_S,
    JOIN_DEADLINE_S,
    MAX_EVIDENCE_DETAIL,
    RETRY_AFTER_METADATA_KEY,
    RUN_OVER_METADATA_KEY,
    STATUS_DEADLINE_S,
    STOPPED_METADATA_KEY,
    FrameReceiver,
    RawChunk,
    WireError,
    auth_metadata,
    channel_credentials,
    channel_options,
    chunk_deserializer,
    chunk_message,
    frame_chunks,
    keepalive_options,
    method_path,
    parse_address,
    read_token,
    serialize,
)

BROKEN_PUSH_SETTLE_S = 0.3  # push_broken: how long the sent chunks get to reach the coordinator
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}  # and busy() refusals
T = TypeVar("T")
M = TypeVar("M", bound=Message)


class CoordinatorError(DtrainError):
    """The coordinator refused a call (or stayed unreachable past the retry budget)."""

    def __init__(self, code: grpc.StatusCode, message: str, details: str = "", retry_after_s: float = 0.0,
                 stopped_at: int | None = None):
        """``details``: gRPC's own text of the last failure, when ``message`` is ours (a call given up).
        ``retry_after_s`` > 0: the coordinator refuses the same call for that many seconds more, not after (a push
        while the island is throttled: :func:`retry_after`). ``stopped_at``: the island is quarantined and is to
        stop, the coordinator being at that version (a push refused for good: :func:`stopped_at`); None
        otherwise."""
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.details = details or message
        self.retry_after_s = retry_after_s
        self.stopped_at = stopped_at


class RunOverError(CoordinatorError):
    """The coordinator refused a Join because the run is over (``str(e)`` says how many versions it merged)."""


def retry_after(e: grpc.RpcError) -> float:
    """The seconds a refusal's trailing metadata says the same call stays refused
    (:data:`dtrain.net.wire.RETRY_AFTER_METADATA_KEY`: a push while its island is throttled after a rejected one);
    0 when it says nothing, or nothing that is a finite number of seconds >= 0 (then the refusal is an ordinary
    one)."""
    for m in e.trailing_metadata() or ():
        if m.key == RETRY_AFTER_METADATA_KEY:
            try:
                seconds = float(m.value)
            except (TypeError, ValueError):
                return 0.0
            return seconds if math.isfinite(seconds) and seconds >= 0 else 0.0
    return 0.0


def stopped_at(e: grpc.RpcError) -> int | None:
    """The coordinator's version a refusal's trailing metadata names as it tells the island to stop
    (:data:`dtrain.net.wire.STOPPED_METADATA_KEY`: a push from a quarantined island); None when it says nothing. A
    value that is not a version is read as 0 (the island still stops: the mark is the coordinator's word)."""
    for m in e.trailing_metadata() or ():
        if m.key == STOPPED_METADATA_KEY:
            value = m.value if isinstance(m.value, str) else ""
            return int(value) if value.isdigit() and len(value) < 20 else 0
    return None


class PlaintextAtTls(CoordinatorError):
    """A plaintext client at a TLS coordinator port (:func:`plaintext_at_tls` says what to set)."""


def plaintext_at_tls(what: str, address: str) -> str:
    """The error of a plaintext client at a TLS coordinator port."""
    return (f"{what}: the coordinator at {address} serves TLS and this client connects in plaintext: set "
            f"security.ca to the CA certificate that signed the coordinator's (dtrain worker: --set "
            f"security.ca=FILE; dtrain status: --tls-ca FILE)")


def _one_line(text: str) -> str:
    return " ".join(text.split())


# What gRPC's debug text says went wrong, for the phrases seen on a failed connection, in words (its full text,
# e.g. "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:9: Failed to connect to remote
# host: Connection refused", is not for operators).
_CAUSES = (("connection refused", "connection refused: nothing listens there"),
           ("handshake", "TLS handshake failed: plaintext against TLS, or the wrong CA or server name"),
           ("dns resolution failed", "the host name does not resolve"),
           ("domain name not found", "the host name does not resolve"),
           ("no route to host", "no route to the host"),
           ("network is unreachable", "the network is unreachable"),
           ("connection reset", "the connection was reset"),
           ("socket closed", "the connection was closed"),
           ("deadline exceeded", "no answer before the call's deadline"),
           ("timed out", "the connection timed out"))


MAX_DETAILS = 200  # the most of an unrecognized error text a message repeats


def in_words(details: str) -> str:
    """What went wrong: in words when gRPC's debug text is recognized, else the text itself (the coordinator's own
    message, e.g. "coordinator failed: ..."), shortened to MAX_DETAILS characters."""
    text = details.lower()
    words = next((words for phrase, words in _CAUSES if phrase in text), "")
    return words or (details if len(details) <= MAX_DETAILS else details[:MAX_DETAILS - 3] + "...")


def cause(code: grpc.StatusCode, details: str) -> str:
    """gRPC's status code and what went wrong (:func:`in_words`): e.g. ``UNAVAILABLE, connection refused: nothing
    listens there``."""
    words = in_words(details)
    return f"{code.name}, {words}" if words else code.name


def busy(e: grpc.RpcError) -> bool:
    """A RESOURCE_EXHAUSTED for load, not for what the call asked (a frame over the size bound is one too, and
    would be refused again): the coordinator's stream limits mark theirs (:data:`dtrain.net.wire.BUSY_METADATA_KEY`),
    gRPC's own server-wide limit says :data:`dtrain.net.wire.BUSY_DETAILS`."""
    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return False
    trailing = e.trailing_metadata() or ()
    return any(m.key == BUSY_METADATA_KEY for m in trailing) or BUSY_DETAILS in (e.details() or "")


class Malformed:
    """A reply that does not parse as the message its method answers (a server that is not a dtrain coordinator of
    this protocol, or a corrupting proxy): what :func:`tolerant` returns instead of raising, so that gRPC does not
    log its own traceback ("Exception deserializing response!"); the client raises one CoordinatorError naming it
    (:meth:`CoordinatorClient._retry`)."""

    def __init__(self, expected: str, error: str, size: int):
        self.expected, self.error, self.size = expected, error, size

    def describe(self, what: str, address: str) -> str:
        why = _one_line(self.error).rsplit(": ", 1)[-1]  # protobuf's text names the type again before its reason
        return (f"{what}: the coordinator at {address} sent a malformed reply ({self.size} bytes that are not a "
                f"{self.expected}: {in_words(why)}); is the address a dtrain coordinator of this version?")


class MalformedReply(CoordinatorError):
    """A reply that does not parse (:class:`Malformed`): INTERNAL, not retried."""


def tolerant(parse: Callable[[bytes], T], expected: str) -> Callable[[bytes], T | Malformed]:
    """``parse`` as a response deserializer that returns :class:`Malformed` instead of raising on bytes that do not
    parse (gRPC logs a deserializer's exception with its traceback, then fails the call with INTERNAL)."""
    def go(raw: bytes) -> T | Malformed:
        try:
            return parse(raw)
        except (DecodeError, ValueError, IndexError) as e:
            return Malformed(expected, str(e) or type(e).__name__, len(raw))
    return go


def _unary(channel: grpc.Channel, method: str, request: type[Message], reply: type[M]) -> Any:
    """A unary method of the service whose reply goes through :func:`tolerant`."""
    return channel.unary_unary(method_path(method), request_serializer=request.SerializeToString,
                               response_deserializer=tolerant(reply.FromString, reply.DESCRIPTOR.full_name))


def evidence_message(evidence: Mapping[str, Any]) -> pb.DeviceEvidence:
    """workers/chip_health.py's Evidence dict as a DeviceEvidence: ``device``, ``index``, ``probe``, ``step`` and
    ``detail``, and the numbers the probe measured (``value``, ``expected``, ``z``, ``median``: floats, or
    ``"nan"``/``"inf"``/``"-inf"``; ``mismatches``); a number absent or None stays unset. Other keys (an event's
    ``healthy``) are ignored. A detail over :data:`dtrain.net.wire.MAX_EVIDENCE_DETAIL` characters is shortened to
    fit (the coordinator refuses a longer one). ValueError names a missing or malformed field."""
    try:
        msg = pb.DeviceEvidence(device=int(evidence["device"]), index=int(evidence["index"]),
                                probe=str(evidence["probe"]), step=int(evidence["step"]))
    except KeyError as e:
        raise ValueError(f"evidence {dict(evidence)!r}: no {e.args[0]!r}") from None
    for name in ("value", "expected", "z", "median"):
        if evidence.get(name) is not None:
            try:
                setattr(msg, name, float(evidence[name]))  # float() reads "nan", "inf" and "-inf" too
            except (TypeError, ValueError) as e:
                raise ValueError(f"evidence of device {msg.device}: {name}={evidence[name]!r}: {e}") from None
    if evidence.get("mismatches") is not None:
        msg.mismatches = int(evidence["mismatches"])
    detail = str(evidence.get("detail", ""))
    msg.detail = detail if len(detail) <= MAX_EVIDENCE_DETAIL else detail[:MAX_EVIDENCE_DETAIL - 3] + "..."
    return msg


@dataclass
class PulledFrame:
    header: pb.PullHeader
    frame: bytes


class CoordinatorClient:
    def __init__(self, address: str, cfg: Config, on_retry: Callable[[str, float, float], None] | None = None,
                 give_up: threading.Event | None = None):
        """``on_retry(what, pause_s, left_s)``: told before each retry's pause; ``what`` names the call, the
        error and the address, ``left_s`` how much longer the call keeps retrying. ``give_up``: once set, a
        failed call is not retried any more (the island is done: a coordinator that stopped serving after the
        run is not waited for)."""
        parse_address(address)  # ValueError naming what is wrong: gRPC would dial a bare host on port 443
        self.address = address
        self.cfg = cfg
        self._tls_checked = False  # whether a closed plaintext connection was checked for a TLS port
        self.corpus_digest = ""  # the island's corpus (Corpus.digest), sent at Join as the fingerprint's data.corpus
        sec = cfg.security
        creds = channel_credentials(sec)
        token = read_token(sec)  # before any channel: a placeholder token is refused (ConfigError)
        opts = channel_options(cfg.coordinator.max_message_bytes, sec.server_name) + keepalive_options(server=False)
        self.channel = grpc.secure_channel(address, creds, opts) if creds else grpc.insecure_channel(address, opts)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        # Join, Heartbeat and Status as the stub would call them, with replies that do not parse as Malformed.
        self._join = _unary(self.channel, "Join", pb.JoinRequest, pb.JoinResponse)
        self._heartbeat = _unary(self.channel, "Heartbeat", pb.HeartbeatRequest, pb.HeartbeatResponse)
        self._status = _unary(self.channel, "Status", pb.StatusRequest, pb.StatusResponse)
        # Pushes send pre-encoded chunk messages (wire.chunk_message), so they take a serializer that passes bytes.
        self._push_delta = self.channel.stream_unary(
            method_path("PushDelta"), request_serializer=serialize,
            response_deserializer=tolerant(pb.PushDeltaResponse.FromString, pb.PushDeltaResponse.DESCRIPTOR.full_name))
        self._pull_global = self.channel.unary_stream(
            method_path("PullGlobal"), request_serializer=pb.PullRequest.SerializeToString,
            response_deserializer=tolerant(chunk_deserializer(pb.PullMessage), pb.PullMessage.DESCRIPTOR.full_name))
        self.metadata = auth_metadata(token)
        self.on_retry = on_retry
        self.give_up = give_up
        self.bytes_up = 0
        self.bytes_down = 0
        self.bytes_down_full = 0  # of bytes_down: full θ frames (the pull at join, a catch-up), not updates
        self.retries = 0

    def close(self) -> None:
        self.channel.close()

    def _retry(self, what: str, call: Callable[[], T | Malformed], budget_s: float | None = None) -> T:
        """``call()``, retried on UNAVAILABLE / DEADLINE_EXCEEDED / a busy coordinator until ``budget_s`` (default
        worker.retry_total_s; 0: one try) of wall time has passed since the first try. A reply that does not
        parse (:class:`Malformed`) is a :class:`MalformedReply`, not retried."""
        w = self.cfg.worker
        budget = w.retry_total_s if budget_s is None else budget_s
        delay, t0 = w.retry_initial_s, time.monotonic()
        while True:
            try:
                result = call()
                if isinstance(result, Malformed):
                    raise MalformedReply(grpc.StatusCode.INTERNAL, result.describe(what, self.address))
                return result
            except grpc.RpcError as e:
                code, details = e.code(), _one_line(e.details() or "")
                loaded = busy(e)
                if code not in RETRYABLE and not loaded:
                    over = what == "join" and any(m.key == RUN_OVER_METADATA_KEY for m in e.trailing_metadata() or ())
                    if over:
                        raise RunOverError(code, details) from None
                    raise CoordinatorError(code, details, retry_after_s=retry_after(e), stopped_at=stopped_at(e)) \
                        from None
                self._check_plaintext_at_tls(what, code, details)
                left = budget - (time.monotonic() - t0)
                if self.give_up is not None and self.give_up.is_set():
                    raise CoordinatorError(code, f"{what}: the coordinator at {self.address} is unavailable "
                                                 f"({cause(code, details)}) and the island is done: not retried",
                                           details) from None
                if left <= 0:
                    tried = (f"after trying for {budget:g}s" + (" (worker.retry_total_s)" if budget_s is None else "")
                             if budget else "(one try)")
                    words = in_words(details)
                    raise CoordinatorError(code, f"{what}: gave up on the coordinator at {self.address} {tried}"
                                                 f"{': ' + words if words else ''}; is it running? check the "
                                                 f"address (--coordinator) and the coordinator's log",
                                           details) from None
                pause = min(delay * random.uniform(0.5, 1.0), left)
                self.retries += 1
                if self.on_retry is not None:
                    self.on_retry(f"{what}: the coordinator at {self.address} is busy ({cause(code, details)}); "
                                  f"waiting for it to take the call" if loaded else
                                  f"{what}: the coordinator at {self.address} is unavailable ({cause(code, details)})",
                                  pause, left)
                time.sleep(pause)
                delay = min(delay * 2, w.retry_max_s)

    def _check_plaintext_at_tls(self, what: str, code: grpc.StatusCode, details: str) -> None:
        """A plaintext client whose connection was closed (no security.ca): if the coordinator's port answers a
        TLS handshake, a CoordinatorError (FAILED_PRECONDITION, not retried) saying to set security.ca. Asked once
        per client."""
        if self.cfg.security.ca or self._tls_checked or code != grpc.StatusCode.UNAVAILABLE or \
                "socket closed" not in details.lower():
            return
        self._tls_checked = True
        if speaks_tls(self.address):
            raise PlaintextAtTls(grpc.StatusCode.FAILED_PRECONDITION, plaintext_at_tls(what, self.address),
                                 details) from None

    def join(self, island: str, hardware: str, devices: int, device_kind: str = "") -> pb.JoinResponse:
        """``device_kind``: jax's device_kind of the island's devices ("" unknown)."""
        corpus = self.corpus_digest
        req = pb.JoinRequest(island=island, hardware=hardware, devices=devices,
                             fingerprint=self.cfg.fingerprint(corpus),
                             fingerprint_fields=self.cfg.fingerprint_fields(corpus), device_kind=device_kind)
        return self._retry("join", lambda: self._join(req, timeout=JOIN_DEADLINE_S, metadata=self.metadata))

    def heartbeat(self, budget_s: float | None = None, *, island_id: str, version: int, steps: int = 0,
                  tokens: int = 0, steps_per_s: float = 0.0, params_digest: str = "", bad_devices: Sequence[str] = (),
                  pending_push_id: str = "", quarantined: Sequence[Mapping[str, Any]] = (),
                  devices: int = 0, train_loss: float | None = None, utilization: float = 0.0,
                  evals: Sequence[tuple[int, float]] = (), tokens_per_s: float = 0.0,
                  round_seconds: float = 0.0) -> pb.HeartbeatResponse:
        """``budget_s``: how long to keep retrying (default worker.retry_total_s; 0: one try). The other arguments
        are the fields of the HeartbeatRequest; left out, a field keeps the proto's default. ``quarantined``: the
        island's quarantined devices as workers/chip_health.py's Evidence dicts (:func:`evidence_message`);
        ``devices``: the devices it trains on now (0: not reported); ``train_loss``: the latest chunk's mean train
        loss (None: left unset); ``utilization``: fraction of its wall time in inner steps; ``evals``: (version,
        eval loss) of the global θs the coordinator asked it to evaluate; ``round_seconds``: the auto round length
        it took (0: none yet)."""
        req = pb.HeartbeatRequest(island_id=island_id, version=version, steps=steps, tokens=tokens,
                                  steps_per_s=steps_per_s, params_digest=params_digest, bad_devices=bad_devices,
                                  pending_push_id=pending_push_id,
                                  quarantined=[evidence_message(e) for e in quarantined], devices=devices,
                                  utilization=utilization, evals=[pb.EvalReport(version=v, loss=loss)
                                                                  for v, loss in evals], tokens_per_s=tokens_per_s,
                                  round_seconds=round_seconds)
        if train_loss is not None:
            req.train_loss = train_loss
        return self._retry("heartbeat", lambda: self._heartbeat(req, timeout=HEARTBEAT_DEADLINE_S,
                                                                    metadata=self.metadata), budget_s)

    def status(self, budget_s: float | None = None, *, within_s: float | None = None) -> pb.StatusResponse:
        """``budget_s``: how long to keep retrying (default worker.retry_total_s; 0: one try). ``within_s``
        instead: the answer, or the error, comes within this many seconds, retries included (each try's
        deadline is the time left, at most STATUS_DEADLINE_S), for a caller that must answer soon
        (``dtrain status``)."""
        end = None if within_s is None else time.monotonic() + within_s

        def call() -> pb.StatusResponse:
            timeout = STATUS_DEADLINE_S if end is None else min(STATUS_DEADLINE_S, max(end - time.monotonic(), 0.01))
            return self._status(pb.StatusRequest(), timeout=timeout, metadata=self.metadata)

        return self._retry("status", call, within_s if within_s is not None else budget_s)

    def _chunked(self, header: pb.PushHeader, frame: bytes) -> list[tuple[memoryview, int]]:
        """The frame's chunks (bytes, CRC32); completes ``header`` with the frame's size, CRC and chunk count."""
        header.total_bytes = len(frame)
        header.frame_crc32, chunks = frame_chunks(frame, self.cfg.codec.chunk_bytes)
        header.chunks = len(chunks)
        return chunks

    @staticmethod
    def _messages(header: pb.PushHeader, chunks: list[tuple[memoryview, int]]) -> Iterator[pb.PushMessage | bytes]:
        yield pb.PushMessage(header=header)
        for index, (data, crc) in enumerate(chunks):
            yield chunk_message(index, data, crc)

    def push_broken(self, header: pb.PushHeader, frame: bytes,
                    before_cancel: Callable[[int, int], None] | None = None) -> bool:
        """Fault injection (``workers.push_faults``, truncate): a push whose upload breaks off mid-stream. Sends the
        header and the first half of the frame's chunks (rounded down: none of a one-chunk frame), waits
        :data:`BROKEN_PUSH_SETTLE_S` for them to reach the coordinator, calls ``before_cancel(chunks_sent,
        chunks)``, then cancels the call with the stream still open (a real broken upload, not a short one).
        No retry; True if the call was cancelled (False: the coordinator had answered first, e.g. refused it)."""
        chunks = self._chunked(header, frame)
        keep = len(chunks) // 2
        sent, release = threading.Event(), threading.Event()

        def held() -> Iterator[pb.PushMessage | bytes]:
            yield from self._messages(header, chunks[:keep])  # a yield returns once the message before it is sent
            sent.set()
            release.wait(self.cfg.worker.rpc_deadline_s)  # no half-close: the stream stays open until cancelled

        call = self._push_delta.future(held(), timeout=self.cfg.worker.rpc_deadline_s, metadata=self.metadata)
        try:
            sent.wait(self.cfg.worker.rpc_deadline_s)
            time.sleep(BROKEN_PUSH_SETTLE_S)
            if before_cancel is not None:
                before_cancel(keep, len(chunks))
            return bool(call.cancel())
        finally:
            release.set()

    def push(self, header: pb.PushHeader, frame: bytes) -> pb.PushDeltaResponse:
        """Streams one frame; retried whole (same push_id) on UNAVAILABLE, DEADLINE_EXCEEDED or a busy
        coordinator."""
        chunks = self._chunked(header, frame)

        def call() -> pb.PushDeltaResponse | Malformed:
            resp = self._push_delta(self._messages(header, chunks), timeout=self.cfg.worker.rpc_deadline_s,
                                    metadata=self.metadata)
            self.bytes_up += len(frame)
            return resp

        return self._retry("push", call)

    def pull(self, island_id: str, have_version: int, wait_s: float = 0.0, full: bool = False,
             max_frame: int | None = None) -> list[PulledFrame]:
        """The frames that bring ``have_version`` to the latest (empty if current; a frameless CURRENT header when it
        asks the island to evaluate the θ it holds); chunks verified.

        ``max_frame``: the largest frame to accept (the worker passes the bound for its model's size)."""
        req = pb.PullRequest(island_id=island_id, have_version=have_version, full=full, wait_s=wait_s)

        def call() -> list[PulledFrame]:
            out: list[PulledFrame] = []
            header: pb.PullHeader | None = None
            receiver: FrameReceiver | None = None
            parts: list[bytes | memoryview] = []
            limit = max_frame or self.cfg.coordinator.max_message_bytes * (1 << 12)
            stream = self._pull_global(req, timeout=self.cfg.worker.rpc_deadline_s + wait_s,
                                       metadata=self.metadata)
            for msg in stream:  # chunks arrive as RawChunk (wire.chunk_deserializer)
                if isinstance(msg, Malformed):
                    stream.cancel()
                    raise MalformedReply(grpc.StatusCode.INTERNAL, msg.describe("pull", self.address))
                if not isinstance(msg, RawChunk) and msg.WhichOneof("kind") == "header":
                    if receiver is not None:
                        raise WireError(grpc.StatusCode.INVALID_ARGUMENT, "pull: a header before the last frame ended")
                    header = msg.header
                    if header.kind == pb.PULL_KIND_CURRENT:
                        if header.evaluate:  # no frame, but the island is asked to evaluate the θ it holds
                            out.append(PulledFrame(header=header, frame=b""))
                        continue
                    receiver = FrameReceiver(header.total_bytes, header.chunks, header.frame_crc32, limit,
                                             self.cfg.codec.chunk_bytes)
                    parts = []
                elif receiver is not None and header is not None:
                    parts.append(receiver.add(msg.chunk))
                    if receiver.received == receiver.chunks:
                        receiver.finish()
                        out.append(PulledFrame(header=header, frame=b"".join(parts)))
                        self.bytes_down += receiver.size
                        if header.kind == pb.PULL_KIND_FULL:
                            self.bytes_down_full += receiver.size
                        receiver = None
                else:
                    raise WireError(grpc.StatusCode.INVALID_ARGUMENT, "pull: a chunk without a header")
            if receiver is not None:
                raise WireError(grpc.StatusCode.INVALID_ARGUMENT, "pull: stream ended inside a frame")
            return out

        try:
            return self._retry("pull", call)
        except WireError as e:
            raise CoordinatorError(e.code, str(e)) from None
