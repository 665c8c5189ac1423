"""The coordinator's edge: every string a request carries, bounded and checked once, where the request enters.

A request's fields reach the coordinator's events (``events.jsonl``, replayed at ``--resume``), its log, its fault
records and Status only after :func:`check_request` passed on it: each string (at any depth: a push's header, a
heartbeat's evidence, the keys and values of Join's fingerprint fields, repeated strings) is at most its field's
limit (:data:`LIMITS`, else :data:`DEFAULT_LIMIT` characters), holds no control character
(``dtrain.runlog.CONTROL_RE``: ESC, NUL, newlines, bidirectional overrides), and an island's name or id is of
``[A-Za-z0-9._-]``; each repeated field or map has at most its limit of items. A request that fails is refused with
INVALID_ARGUMENT naming the field and its limit, and quotes at most a bounded, escaped prefix of the value
(:func:`shown`). :func:`coordinator.handlers.aio_service_handler` runs the check before the handler (a push stream's
on its header, its first message); the state machine's own checks (``coordinator.membership``,
``coordinator.admission``) then see only bounded values.

Also what else the servicer reads off a call as it enters: who the caller is (:class:`CallerIdentity`), and a
request's messages as the plain data the state machine takes (:func:`evidence_from_message`,
:func:`fingerprint_mismatch`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from coordinator.records import MAX_BAD_DEVICES, MAX_DEVICE_LEN, MAX_DIGEST_LEN, MAX_PUSH_ID_LEN
from dtrain.config.load import data_cache
from dtrain.config.sections import CORPUS_FIELD, ISLAND_NAME_RE, Config
from dtrain.data.corpus import known_digest
from dtrain.net.identity import IslandTokens, cert_identity, token_identity
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.wire import MAX_EVAL_REPORTS, MAX_EVIDENCE, MAX_EVIDENCE_DETAIL, presented_token
from dtrain.runlog import CONTROL_RE, printable

# An island's id as the coordinator makes it (coordinator.membership: NAME-SHARD, or NAME-SHARD.N): a name of at
# most 64 characters and a suffix.
MAX_ISLAND_ID_LEN = 96
ISLAND_ID_RE = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_ISLAND_ID_LEN}}}")
MAX_DEVICE_KIND_LEN = 128  # Join's device_kind (jax's device_kind, e.g. "NVIDIA H100 80GB HBM3")
MAX_FINGERPRINT_FIELDS = 256  # Join's fingerprint_fields: entries
MAX_FINGERPRINT_KEY_LEN = 128
MAX_FINGERPRINT_VALUE_LEN = 1024
DEFAULT_LIMIT = 256  # a string field not in LIMITS
DEFAULT_ITEMS = 4096  # a repeated field or map not in ITEMS
SHOWN = 32  # characters of a refused value quoted in the refusal

# Per field name (any message): the most characters it may hold.
LIMITS = {
    "island": 64, "island_id": MAX_ISLAND_ID_LEN, "push_id": MAX_PUSH_ID_LEN, "pending_push_id": MAX_PUSH_ID_LEN,
    "hardware": 16, "device_kind": MAX_DEVICE_KIND_LEN, "fingerprint": MAX_DIGEST_LEN,
    "params_digest": MAX_DIGEST_LEN, "tree_digest": MAX_DIGEST_LEN, "bad_devices": MAX_DEVICE_LEN,
    "probe": 32, "detail": MAX_EVIDENCE_DETAIL,
}
# Per repeated field or map (any message): the most items it may hold.
ITEMS = {"fingerprint_fields": MAX_FINGERPRINT_FIELDS, "quarantined": MAX_EVIDENCE, "bad_devices": MAX_BAD_DEVICES,
         "evals": MAX_EVAL_REPORTS}
_MEASURES = ("value", "expected", "z", "median", "mismatches")  # DeviceEvidence's optional numbers
# Fields that name an island: their characters too (an empty one is left to the state machine: unknown island).
NAMES = {"island": ISLAND_NAME_RE, "island_id": ISLAND_ID_RE}


class RequestRefused(ValueError):
    """A request field over its bound or malformed; ``str(e)`` names the field and the bound."""


def shown(value: str) -> str:
    """A client's string as a refusal or an event may quote it: at most :data:`SHOWN` characters, escaped."""
    return printable(value, SHOWN)


def check_string(path: str, name: str, value: str) -> None:
    """One string field ``name`` (at ``path`` in its request) against its bound; RequestRefused if over it."""
    limit = LIMITS.get(name, DEFAULT_LIMIT)
    if len(value) > limit:
        raise RequestRefused(f"{path}: {len(value):,} characters, at most {limit} (starts {shown(value)!r})")
    if CONTROL_RE.search(value):
        raise RequestRefused(f"{path}: holds a control character ({shown(value)!r}): not allowed in any field")
    pattern = NAMES.get(name)
    if pattern is not None and value and not pattern.fullmatch(value):
        raise RequestRefused(f"{path} {shown(value)!r}: must match {pattern.pattern}")


def check_request(message: Message, path: str = "") -> None:
    """Every string in ``message`` (recursively) and the length of every repeated field and map, against their
    bounds (the module docstring); RequestRefused naming the first field that is not within them."""
    for field, value in message.ListFields():
        where = f"{path}.{field.name}" if path else field.name
        if field.is_repeated:
            items = ITEMS.get(field.name, DEFAULT_ITEMS)
            if len(value) > items:
                raise RequestRefused(f"{where}: {len(value):,} items, at most {items}")
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                _check_map(where, value)
            elif field.type == FieldDescriptor.TYPE_STRING:
                for i, item in enumerate(value):
                    check_string(f"{where}[{i}]", field.name, item)
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                for i, item in enumerate(value):
                    check_request(item, f"{where}[{i}]")
        elif field.type == FieldDescriptor.TYPE_STRING:
            check_string(where, field.name, value)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            check_request(value, where)


def _check_map(where: str, entries: Mapping[object, object]) -> None:
    """A map field: string keys bounded as fingerprint fields' keys, string values as their values."""
    for key, value in entries.items():
        if isinstance(key, str):
            if len(key) > MAX_FINGERPRINT_KEY_LEN or CONTROL_RE.search(key):
                raise RequestRefused(f"{where}: key {shown(key)!r}: at most {MAX_FINGERPRINT_KEY_LEN} characters, "
                                     f"no control character")
        if isinstance(value, str):
            if len(value) > MAX_FINGERPRINT_VALUE_LEN or CONTROL_RE.search(value):
                raise RequestRefused(f"{where}[{shown(str(key))!r}]: {len(value):,} characters, at most "
                                     f"{MAX_FINGERPRINT_VALUE_LEN}, no control character")
        elif isinstance(value, Message):
            check_request(value, f"{where}[{shown(str(key))!r}]")


def request_problem(message: Message) -> str:
    """'' if ``message`` is within every bound (:func:`check_request`), else why not."""
    try:
        check_request(message)
    except RequestRefused as e:
        return str(e)
    return ""


def evidence_from_message(e: pb.DeviceEvidence) -> dict[str, Any]:
    """A DeviceEvidence message as the plain data ``CoordinatorState.heartbeat`` checks: the numbers the probe did
    not measure (unset optional fields) left out."""
    data: dict[str, Any] = {"device": e.device, "index": e.index, "probe": e.probe, "step": e.step,
                            "detail": e.detail}
    data.update({name: getattr(e, name) for name in _MEASURES if e.HasField(name)})
    return data


def fingerprint_mismatch(ours: dict[str, str], theirs: dict[str, str]) -> str:
    """Names every field that differs, e.g. ``model.d_model: coordinator 64, island 32``; '' if equal."""
    diffs = []
    for key in sorted(set(ours) | set(theirs)):
        if ours.get(key) != theirs.get(key):
            diffs.append(f"{key}: coordinator {ours.get(key, '<missing>')}, island {theirs.get(key, '<missing>')}"
                         + (" (the island trains on other data: every host needs the same corpus, data.source and "
                            "data.max_bytes)" if key == CORPUS_FIELD else ""))
    return "; ".join(diffs)


class RunFingerprint:
    """What every island's Join must match (``Config.fingerprint_fields``): the config's fields and the corpus'
    digest (``data.corpus``): the coordinator's own when the store is here already (:func:`known_digest`), else
    the first joining island's, which every later Join must then match."""

    def __init__(self, cfg: Config):
        self.fields = cfg.fingerprint_fields(known_digest(cfg.data, cfg.model.vocab_size, data_cache(cfg)))

    def mismatch(self, theirs: dict[str, str]) -> str:
        """:func:`fingerprint_mismatch` of an island's fields ('' if they match). A client that names no corpus
        (a Join from a test's client, not a worker's) is not asked about it."""
        if CORPUS_FIELD not in theirs:
            return fingerprint_mismatch({k: v for k, v in self.fields.items() if k != CORPUS_FIELD}, theirs)
        if CORPUS_FIELD not in self.fields:  # the run's data: the first island's
            self.fields = {**self.fields, CORPUS_FIELD: theirs[CORPUS_FIELD]}
        return fingerprint_mismatch(self.fields, theirs)


def refusal_line(method: str, island: str, code: str, message: str) -> str:
    """The coordinator log's line for a refused call: its method, the island, the code and the reason."""
    return f"refused {method.rsplit('/', 1)[-1] or 'a call'}{' from ' + island if island else ''}: {code}: {message}"


class CallerIdentity:
    """The island identity a call carries (``security.identity``; ``dtrain/net/identity.py``): ``token:NAME`` for an
    island's own token (listed in ``tokens``), the client certificate's ``uri:``/``cn:`` identity, or None (shared
    mode; or no island identity, e.g. the operator's shared token). What it may do: ``coordinator/bindings.py``."""

    def __init__(self, mode: str, tokens: IslandTokens | None):
        self.mode, self.tokens = mode, tokens

    def of(self, context: grpc.ServicerContext) -> str | None:
        if self.mode == "token" and self.tokens is not None:
            name = self.tokens.name_of(presented_token(context.invocation_metadata()))
            return token_identity(name) if name is not None else None
        if self.mode == "cert":
            return cert_identity(context.auth_context())
        return None
