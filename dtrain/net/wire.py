"""Shared gRPC plumbing for both ends of the protocol: deadlines, auth, TLS, chunk streams.

The coordinator and the workers never import each other; they meet here and
in ``dtrain/net/proto/dtrain.proto``.
"""

from __future__ import annotations

import asyncio
import hmac
import os
from collections.abc import Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, NoReturn, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message

from dtrain import codec
from dtrain.config.ops import SecurityConfig
from dtrain.config.sections import ConfigError
from dtrain.net.proto import dtrain_pb2 as pb

# Deadlines (seconds) of each RPC, from the caller's side. Pushes and pulls
# carry a whole model, so they scale with it; see also worker.rpc_deadline_s.
JOIN_DEADLINE_S = 30.0
HEARTBEAT_DEADLINE_S = 10.0
STATUS_DEADLINE_S = 10.0

# HTTP/2 keepalive on both ends: a peer whose host died without closing its connections (power loss, a cut
# link) is noticed within KEEPALIVE_TIME_S + KEEPALIVE_TIMEOUT_S, so a call in flight to it fails then instead of
# at its deadline, and the coordinator drops a dead island's half-received push. Liveness itself stays the
# coordinator's lease (worker.heartbeat_s, coordinator.lease_s): a failed call can have other causes.
KEEPALIVE_TIME_S = 10.0
KEEPALIVE_TIMEOUT_S = 5.0
# A worker's channel tries to reconnect to a coordinator that went away at most this often (gRPC's default
# backoff grows to 120 s: after a 2 s restart the first heartbeat could then wait longer than the 4 s lease).
RECONNECT_BACKOFF_MAX_S = 0.5

AUTH_METADATA_KEY = "authorization"
# The mark every placeholder secret in deploy/ starts with (tests/test_deploy.py checks each one does): a token or a
# TLS file that still holds one is refused at start-up, with how to make the real one, instead of a run that
# "authenticates" with a token printed in the repository, or a TLS error deep in gRPC.
PLACEHOLDER = "REPLACE-ME"
# How to make each deployed secret (docs/deploy.md, step 4): named in the refusal of its placeholder.
_MAKE_TOKEN = ('kubectl create secret generic dtrain-token --from-literal=token="$(openssl rand -hex 32)" '
               "--dry-run=client -o yaml > deploy/coordinator/secret-token.yaml")
# An island's own token (security.identity "token") and the coordinator's file of their hashes.
MAKE_ISLAND_TOKEN = ("dtrain admin issue-token NAME --out tokens/NAME.token >> tokens/island-tokens; kubectl create "
                     "secret generic dtrain-island-token-NAME --from-file=token=tokens/NAME.token --dry-run=client "
                     "-o yaml > deploy/WORKER/secret-island-token.yaml")
MAKE_ISLAND_TOKENS = ("kubectl create secret generic dtrain-island-tokens "
                      "--from-file=island-tokens=tokens/island-tokens --dry-run=client -o yaml > "
                      "deploy/coordinator/secret-island-tokens.yaml")
_MAKE_PEM = {
    "ca": "kubectl create secret generic dtrain-ca --from-file=ca.crt=tls/ca.crt --dry-run=client -o yaml > "
          "deploy/base/secret-ca.yaml",
    "server_cert": "kubectl create secret tls dtrain-coordinator-tls --cert=tls/server.crt --key=tls/server.key "
                   "--dry-run=client -o yaml > deploy/coordinator/secret-tls.yaml",
}
_MAKE_PEM["server_key"] = _MAKE_PEM["server_cert"]
# The calls answered without a token: grpc.health.v1's Check and Watch (Kubernetes' gRPC probes and load balancers
# send none). They tell whether the coordinator serves, nothing about the run.
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
# Trailing metadata on a Join refused because the run is over (its value: the last version): the island exits 0.
RUN_OVER_METADATA_KEY = "dtrain-run-over"
# Trailing metadata on a push refused (FAILED_PRECONDITION) because its island is throttled after a rejected push
# (coordinator.reject_backoff_s): its value is the seconds left of the backoff. The island waits them out and sends
# the same push again: its payload was never read.
RETRY_AFTER_METADATA_KEY = "dtrain-retry-after-s"
# Trailing metadata on a push refused (FAILED_PRECONDITION) because its island is quarantined
# (coordinator.max_rejections pushes in a row rejected): its value is the coordinator's version, the message says why.
# The island stops at once, as a heartbeat's STOP tells it to, instead of training its range again and pushing until
# its next heartbeat.
STOPPED_METADATA_KEY = "dtrain-stopped"
# Trailing metadata on a call refused for load (RESOURCE_EXHAUSTED: a stream limit), not for what it asked: workers
# retry it with backoff, as they retry UNAVAILABLE. gRPC's own load refusal (maximum_concurrent_rpcs) says BUSY_DETAILS.
BUSY_METADATA_KEY = "dtrain-busy"
BUSY_DETAILS = "Concurrent RPC limit exceeded"
MAX_CHUNKS = 1 << 20

# A heartbeat's quarantined devices (DeviceEvidence): the probes an island may name (workers/chip_health.py runs them),
# the longest detail the coordinator accepts (the client shortens a longer one: a dead device's error message can
# run to kilobytes) and the most devices one report may name (also at most the island's mesh).
PROBES = ("known_answer", "finite", "stats", "replay")
MAX_EVIDENCE_DETAIL = 512
MAX_EVAL_REPORTS = 16  # EvalReports one heartbeat may carry (an island sends its oldest first)
MAX_EVIDENCE = 4096
MAX_ROUND_S = 86400.0  # an auto round length on the wire, either way (a day: longer is a broken clock or a lie)


class WireError(ValueError):
    """A received message or stream is malformed; ``code`` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def read_token(sec: SecurityConfig) -> str | None:
    """The bearer token from the environment variable the config names; None disables auth. ConfigError if it
    is still deploy/'s placeholder (:data:`PLACEHOLDER`): the coordinator and every island read it here."""
    if not sec.token_env:
        return None
    token = os.environ.get(sec.token_env, "")
    if token.strip().startswith(PLACEHOLDER):
        raise ConfigError(f"[security] token_env: ${sec.token_env} holds the placeholder of a token Secret in "
                          f"deploy/, not a token: make the real ones (docs/deploy.md, step 4): the coordinator's "
                          f"(deploy/coordinator/secret-token.yaml): {_MAKE_TOKEN}; each island's own: "
                          f"{MAKE_ISLAND_TOKEN}")
    return token or None


def bearer(token: str) -> str:
    """The ``Authorization`` value that carries ``token`` (gRPC metadata and the dashboard's HTTP header alike)."""
    return f"Bearer {token}"


def bearer_matches(header: str, token: str) -> bool:
    """Whether an ``Authorization`` value carries ``token`` (:func:`bearer`), compared in constant time."""
    return hmac.compare_digest(header.encode(), bearer(token).encode())


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((AUTH_METADATA_KEY, bearer(token)),) if token else ()


def presented_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The token a call's metadata carries (``authorization: Bearer <token>``), "" if none."""
    got = ""
    for key, value in metadata or ():
        if key == AUTH_METADATA_KEY and isinstance(value, str):  # bytes only for keys ending in "-bin"
            got = value
    return got[len("Bearer "):] if got.startswith("Bearer ") else ""


def _read_pem(path: str, what: str) -> bytes:
    """The PEM file the config's ``security.WHAT`` names; ConfigError (the CLI's one line, exit 2) if it cannot
    be read, is still deploy/'s placeholder (:data:`PLACEHOLDER`) or is not PEM."""
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as e:
        raise ConfigError(f"[security] {what}: cannot read {path}: {e.strerror}") from None
    if data.strip().startswith(PLACEHOLDER.encode()):
        make = _MAKE_PEM.get(what, f"put the PEM file there (security.{what})")
        raise ConfigError(f"[security] {what}: {path} holds a placeholder of deploy/'s Secrets, not PEM: make the "
                          f"real one (docs/deploy.md, step 4): {make}")
    if b"-----BEGIN" not in data:
        raise ConfigError(f"[security] {what}: {path} is not a PEM file (no '-----BEGIN' line): name a PEM file "
                          f"in security.{what}")
    return data


def server_credentials(sec: SecurityConfig) -> grpc.ServerCredentials | None:
    """TLS (or mutual TLS with ``client_auth``) for the coordinator; None: plaintext."""
    if not sec.server_cert:
        return None
    key, cert = _read_pem(sec.server_key, "server_key"), _read_pem(sec.server_cert, "server_cert")
    ca = _read_pem(sec.ca, "ca") if sec.ca else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=sec.client_auth)


def channel_credentials(sec: SecurityConfig) -> grpc.ChannelCredentials | None:
    """TLS for a worker's channel when ``security.ca`` is set; with a client cert, mutual TLS."""
    if not sec.ca:
        return None
    ca = _read_pem(sec.ca, "ca")
    if sec.client_cert:
        return grpc.ssl_channel_credentials(ca, _read_pem(sec.client_key, "client_key"),
                                            _read_pem(sec.client_cert, "client_cert"))
    return grpc.ssl_channel_credentials(ca)


def channel_options(max_message_bytes: int, server_name: str = "") -> list[tuple[str, int | str]]:
    opts: list[tuple[str, int | str]] = [("grpc.max_receive_message_length", max_message_bytes),
                                   ("grpc.max_send_message_length", max_message_bytes)]
    if server_name:
        opts.append(("grpc.ssl_target_name_override", server_name))
    return opts


def keepalive_options(server: bool) -> list[tuple[str, int | str]]:
    """gRPC keepalive options (see KEEPALIVE_TIME_S): both ends ping an idle connection every KEEPALIVE_TIME_S and
    drop it when no answer comes within KEEPALIVE_TIMEOUT_S; the server accepts the workers' pings that often.
    A worker's channel also reconnects every RECONNECT_BACKOFF_MAX_S while the coordinator is away."""
    opts: list[tuple[str, int | str]] = [("grpc.keepalive_time_ms", int(KEEPALIVE_TIME_S * 1000)),
                                         ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
                                         ("grpc.keepalive_permit_without_calls", 1)]
    if server:  # pings from workers at KEEPALIVE_TIME_S are welcome, not "too many pings"
        opts.append(("grpc.http2.min_recv_ping_interval_without_data_ms", int(KEEPALIVE_TIME_S * 1000) // 2))
    else:
        ms = int(RECONNECT_BACKOFF_MAX_S * 1000)
        opts += [("grpc.http2.max_pings_without_data", 0), ("grpc.initial_reconnect_backoff_ms", ms),
                 ("grpc.min_reconnect_backoff_ms", ms), ("grpc.max_reconnect_backoff_ms", ms)]
    return opts


# What a server's TokenAuthInterceptor tells about a refused call: (the peer as gRPC names it, e.g.
# "ipv4:10.0.0.7:53122", the method's path, why: "missing token" or "wrong token").
AuthDenied = Callable[[str, str, str], None]
# gRPC's handler constructor for each (request streaming, response streaming): the interceptor's refusals and the
# coordinator's service handlers.
HANDLER_KINDS: dict[tuple[bool, bool], Any] = {
    (False, False): grpc.unary_unary_rpc_method_handler, (True, False): grpc.stream_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Rejects every call without ``authorization: Bearer <token>`` (constant-time compare), except the health
    checks of :data:`OPEN_METHODS`: the shared ``token`` or, with ``island_tokens`` (``security.identity`` =
    "token": ``dtrain.net.identity.IslandTokens.name_of``, a token's island name or None), an island's own token.
    Which island a token may act as is the coordinator's (its name bindings).
    ``on_denied``, if given, is told of each refused call (:data:`AuthDenied`), from the call's own thread,
    before it ends."""

    def __init__(self, token: str | None, on_denied: AuthDenied | None = None,
                 island_tokens: Callable[[str], str | None] | None = None,
                 open_methods: frozenset[str] = OPEN_METHODS):
        """``open_methods``: the methods let through without a token (a range shard's Shard service checks its
        own secret)."""
        self._open = open_methods
        self._token = token
        self._island_tokens = island_tokens
        self._on_denied = on_denied

    def _accepts(self, header: str) -> bool:
        if self._token is not None and bearer_matches(header, self._token):
            return True
        return (self._island_tokens is not None and header.startswith("Bearer ")
                and self._island_tokens(header[len("Bearer "):]) is not None)

    def _deny(self, method: str, why: str, streams: tuple[bool, bool]) -> grpc.RpcMethodHandler[Any, Any]:
        """A handler of the method's streaming kind (Any: it serves every method, whatever its message types)
        that reports the refusal and ends the call with UNAUTHENTICATED."""
        def deny(_request: object, context: grpc.ServicerContext) -> NoReturn:
            if self._on_denied is not None:
                self._on_denied(context.peer(), method, why)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, self.denied(why))

        handler: grpc.RpcMethodHandler[Any, Any] = HANDLER_KINDS[streams](deny)
        return handler

    def denied(self, why: str) -> str:
        """What a refused call is told."""
        own = ("; an island's own token must be listed in the coordinator's security.island_tokens (`dtrain "
               "admin issue-token NAME`)" if self._island_tokens is not None else "")
        return (f"{why}: missing or wrong bearer token (set the token in the environment variable named by "
                f"security.token_env{own})")

    def refusal(self, details: grpc.HandlerCallDetails) -> str:
        """'' when the call may go on, else why not ("missing token", "wrong token")."""
        if details.method in self._open:
            return ""
        got = ""
        for key, value in details.invocation_metadata or ():
            if key == AUTH_METADATA_KEY and isinstance(value, str):  # bytes only for keys ending in "-bin"
                got = value
        if self._accepts(got):
            return ""
        return "wrong token" if got else "missing token"

    def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        why = self.refusal(details)
        handler = continuation(details)
        if not why or handler is None:
            return handler
        return self._deny(details.method, why, (handler.request_streaming, handler.response_streaming))


class AioTokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """:class:`TokenAuthInterceptor` for a ``grpc.aio`` server: the same rule and the same refusal, as a coroutine
    (``on_denied`` runs on the loop's default executor: it may wait for its owner's lock)."""

    def __init__(self, sync: TokenAuthInterceptor, on_denied: AuthDenied | None = None):
        self._sync, self._on_denied = sync, on_denied

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(details)
        why = self._sync.refusal(details)
        if not why or handler is None:
            return handler
        method, on_denied, message = details.method, self._on_denied, self._sync.denied(why)

        async def deny(_request: object, context: grpc.aio.ServicerContext) -> None:
            if on_denied is not None:
                await asyncio.get_running_loop().run_in_executor(None, on_denied, context.peer(), method, why)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        denied: grpc.RpcMethodHandler[Any, Any] = HANDLER_KINDS[handler.request_streaming,
                                                                handler.response_streaming](deny)
        return denied


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host in brackets: ``[::1]:50051``) as (host, port); ValueError says what is wrong
    and shows the form. gRPC itself would take a bare host as port 443, and a scheme or path as a target of
    its own, so these are refused here, before anything is dialled."""
    def bad(why: str) -> ValueError:
        return ValueError(f"{text!r}: {why}; expected HOST:PORT, e.g. 127.0.0.1:50051 (IPv6: [::1]:50051)")

    if not text or text != text.strip():
        raise bad("empty" if not text.strip() else "spaces around it")
    if "/" in text:
        raise bad("a scheme or path")
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep or not host or "]" in host:
            raise bad("an IPv6 address goes in brackets, then :PORT")
    else:
        host, sep, port = text.rpartition(":")
        if not sep:
            raise bad("no port")
        if not host:
            raise bad("no host")
        if ":" in host:
            raise bad(f"an IPv6 address goes in brackets: [{host}]:{port}")
    if not (port.isascii() and port.isdigit()):
        raise bad(f"the port {port!r} is not a number")
    if not 1 <= int(port) <= 65535:
        raise bad(f"the port {port} is not in 1..65535")
    return host, int(port)


def chunk_count(frame_len: int, chunk_bytes: int) -> int:
    return max(1, -(-frame_len // chunk_bytes))


SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name


def method_path(name: str) -> str:
    """The gRPC path of one of the Coordinator service's methods, e.g. /dtrain.v1.Coordinator/PushDelta."""
    return f"/{SERVICE}/{name}"


def frame_chunks(frame: bytes, chunk_bytes: int) -> tuple[int, list[tuple[memoryview, int]]]:
    """(the frame's CRC32, [(chunk bytes as a view, its CRC32), ...]): one pass over the frame, no copy."""
    view = memoryview(frame)
    out, crc = [], 0
    for i in range(chunk_count(len(frame), chunk_bytes)):
        piece = view[i * chunk_bytes:(i + 1) * chunk_bytes]
        piece_crc = codec.crc32(piece)
        crc = codec.crc32_combine(crc, piece_crc, len(piece))
        out.append((piece, piece_crc))
    return crc, out


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def chunk_message(index: int, data: bytes | memoryview, crc32: int) -> bytes:
    """A serialized PushMessage or PullMessage holding ``Chunk(index, data, crc32)`` (``chunk`` is field 2 of
    both), built by hand in protobuf's wire format with one copy of ``data``; the generated classes cost
    three (the Chunk, the oneof's copy of it, the serialization), which made a Python island's pushes
    CPU-bound. Send it through :func:`serialize`; the receiver parses it with the generated classes as usual
    (the equivalence is tested)."""
    fields = b""
    if index:
        fields += b"\x08" + _varint(index)
    if crc32:
        fields += b"\x18" + _varint(crc32)
    if len(data):
        fields += b"\x12" + _varint(len(data))
    return b"\x12" + _varint(len(fields) + len(data)) + fields + data


def file_chunk_messages(f: BinaryIO, piece_bytes: int) -> Iterator[bytes]:
    """A frame file's chunk stream: :func:`chunk_message` of each ``piece_bytes`` read from ``f``, which is closed at
    the end. While a message is out (gRPC copies it and sends it before asking for the next), the piece it was
    built from is already dropped: a stream being sent holds one piece in Python, not two."""
    with f:
        index = 0
        while data := f.read(piece_bytes):
            message = chunk_message(index, data, codec.crc32(data))
            del data
            yield message
            del message  # sent: not kept while the next piece is read
            index += 1


M = TypeVar("M", bound=Message)


class RawChunk:
    """A chunk message parsed without copying its data: ``data`` is a view into the received bytes. Quacks
    like the generated PushMessage/PullMessage holding a chunk (``WhichOneof("kind")``, ``.chunk``)."""

    __slots__ = ("index", "data", "crc32")

    def __init__(self, index: int, data: memoryview, crc32: int):
        self.index, self.data, self.crc32 = index, data, crc32

    @property
    def chunk(self) -> RawChunk:
        return self

    def WhichOneof(self, group: str) -> str:  # noqa: N802 - protobuf's name
        return "chunk"


def _varint_at(buf: bytes, pos: int) -> tuple[int, int]:
    """(value, next position); value -1 if the varint is truncated or longer than 10 bytes."""
    value = shift = 0
    while pos < len(buf) and shift < 70:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    return -1, pos


def _chunk_fast(raw: bytes) -> RawChunk | None:
    """The common case of a chunk message, exactly as :func:`chunk_message` (or protobuf) lays it out: one
    field 2 spanning the message, holding fields 1, 2, 3 at most once each. None for anything else."""
    if len(raw) < 2 or raw[0] != 0x12:
        return None
    length, pos = _varint_at(raw, 1)
    if length < 0 or pos + length != len(raw):
        return None
    fields: dict[int, Any] = {}
    while pos < len(raw):
        tag = raw[pos]
        pos += 1
        if tag in fields or tag not in (0x08, 0x12, 0x18):
            return None
        value, pos = _varint_at(raw, pos)
        if value < 0:
            return None
        if tag == 0x12:
            if pos + value > len(raw):
                return None
            fields[tag] = memoryview(raw)[pos:pos + value]
            pos += value
        elif value > 0xFFFFFFFF:  # protobuf would truncate to uint32: leave such oddities to it
            return None
        else:
            fields[tag] = value
    return RawChunk(fields.get(0x08, 0), fields.get(0x12, memoryview(b"")), fields.get(0x18, 0))


def chunk_deserializer(message_class: type[M]) -> Callable[[bytes], RawChunk | M]:
    """Deserializer for PushMessage / PullMessage streams: chunks as :class:`RawChunk` (no copy of their
    data; the generated classes make two), anything else (headers, unusual encodings) by ``message_class``."""
    def parse(raw: bytes) -> RawChunk | M:
        fast = _chunk_fast(raw)
        return fast if fast is not None else message_class.FromString(raw)
    return parse


def serialize(message: bytes | Message) -> bytes:
    """Serializer for the chunked streams: a pre-encoded message (:func:`chunk_message`) as is, anything
    else through protobuf."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def max_frame_bytes(n_values: int, block: int) -> int:
    """Upper bound of a frame's size for ``n_values`` (the lossless case, plus zstd's worst-case growth)."""
    raw = 4 * n_values + 4 * (n_values // max(block, 1) + 1)
    return codec.HEADER_SIZE + raw + raw // 128 + (1 << 16)


class FrameReceiver:
    """Checks a header's sizes, then chunks one by one: index order, CRC, running total, frame CRC.

    ``add(chunk)`` returns the chunk's verified bytes; ``finish()`` checks the
    chunk count, total size and the frame's CRC32 against the header. Nothing
    is kept here: the caller spools or decodes the bytes.
    """

    def __init__(self, total_bytes: int, chunks: int, frame_crc32: int, max_total: int, chunk_limit: int):
        if not 0 < total_bytes <= max_total:
            raise WireError(grpc.StatusCode.RESOURCE_EXHAUSTED if total_bytes > max_total
                            else grpc.StatusCode.INVALID_ARGUMENT,
                            f"header total_bytes={total_bytes}: must be in [1, {max_total}] for this model")
        lo, hi = -(-total_bytes // chunk_limit), total_bytes
        if not lo <= chunks <= min(hi, MAX_CHUNKS):
            raise WireError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"header chunks={chunks}: {total_bytes} bytes need between {lo} and {hi} chunks "
                            f"of at most {chunk_limit} bytes")
        self.total_bytes, self.chunks, self.frame_crc32 = total_bytes, chunks, frame_crc32
        self.chunk_limit = chunk_limit
        self.received = 0
        self.size = 0
        self._crc = 0

    def add(self, chunk: pb.Chunk | RawChunk) -> bytes | memoryview:
        if chunk.index != self.received:
            raise WireError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"chunk index {chunk.index} out of order: expected {self.received}")
        if self.received >= self.chunks:
            raise WireError(grpc.StatusCode.INVALID_ARGUMENT, f"more chunks than the header's {self.chunks}")
        data = chunk.data
        if len(data) > self.chunk_limit:
            raise WireError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"chunk {chunk.index} has {len(data)} bytes, over the limit of {self.chunk_limit}")
        if not data:
            raise WireError(grpc.StatusCode.INVALID_ARGUMENT, f"chunk {chunk.index} is empty")
        if self.size + len(data) > self.total_bytes:
            raise WireError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"chunks exceed the header's total_bytes={self.total_bytes}")
        crc = codec.crc32(data)
        if crc != chunk.crc32:
            raise WireError(grpc.StatusCode.INVALID_ARGUMENT, f"chunk {chunk.index}: CRC32 mismatch (garbled)")
        self._crc = codec.crc32_combine(self._crc, crc, len(data))  # the frame's CRC without a second pass
        self.received += 1
        self.size += len(data)
        return data

    def finish(self) -> None:
        if self.received != self.chunks or self.size != self.total_bytes:
            raise WireError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"stream truncated: got {self.received} of {self.chunks} chunks, "
                            f"{self.size} of {self.total_bytes} bytes")
        if self._crc != self.frame_crc32:
            raise WireError(grpc.StatusCode.INVALID_ARGUMENT, "frame CRC32 mismatch")

