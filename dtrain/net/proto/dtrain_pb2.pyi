from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACTION_CONTINUE: _ClassVar[Action]
    ACTION_PULL: _ClassVar[Action]
    ACTION_STOP: _ClassVar[Action]
    ACTION_REJOIN: _ClassVar[Action]

class PushStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUSH_STATUS_UNSPECIFIED: _ClassVar[PushStatus]
    PUSH_STATUS_MERGED: _ClassVar[PushStatus]
    PUSH_STATUS_PENDING: _ClassVar[PushStatus]
    PUSH_STATUS_DUPLICATE: _ClassVar[PushStatus]
    PUSH_STATUS_DROPPED: _ClassVar[PushStatus]
    PUSH_STATUS_REJECTED: _ClassVar[PushStatus]

class PullKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PULL_KIND_UNSPECIFIED: _ClassVar[PullKind]
    PULL_KIND_UPDATE: _ClassVar[PullKind]
    PULL_KIND_FULL: _ClassVar[PullKind]
    PULL_KIND_CURRENT: _ClassVar[PullKind]
ACTION_CONTINUE: Action
ACTION_PULL: Action
ACTION_STOP: Action
ACTION_REJOIN: Action
PUSH_STATUS_UNSPECIFIED: PushStatus
PUSH_STATUS_MERGED: PushStatus
PUSH_STATUS_PENDING: PushStatus
PUSH_STATUS_DUPLICATE: PushStatus
PUSH_STATUS_DROPPED: PushStatus
PUSH_STATUS_REJECTED: PushStatus
PULL_KIND_UNSPECIFIED: PullKind
PULL_KIND_UPDATE: PullKind
PULL_KIND_FULL: PullKind
PULL_KIND_CURRENT: PullKind

class RestoreRequest(_message.Message):
    __slots__ = ("version", "params_digest")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARAMS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    version: int
    params_digest: str
    def __init__(self, version: _Optional[int] = ..., params_digest: _Optional[str] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("version", "params_digest", "theta_sum_squares")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARAMS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    THETA_SUM_SQUARES_FIELD_NUMBER: _ClassVar[int]
    version: int
    params_digest: str
    theta_sum_squares: float
    def __init__(self, version: _Optional[int] = ..., params_digest: _Optional[str] = ..., theta_sum_squares: _Optional[float] = ...) -> None: ...

class ClaimRequest(_message.Message):
    __slots__ = ("push_id", "island_id", "wait_s")
    PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    ISLAND_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    push_id: str
    island_id: str
    wait_s: float
    def __init__(self, push_id: _Optional[str] = ..., island_id: _Optional[str] = ..., wait_s: _Optional[float] = ...) -> None: ...

class ClaimResponse(_message.Message):
    __slots__ = ("held", "sum_squares", "identity", "bytes", "version")
    HELD_FIELD_NUMBER: _ClassVar[int]
    SUM_SQUARES_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    held: bool
    sum_squares: float
    identity: str
    bytes: int
    version: int
    def __init__(self, held: _Optional[bool] = ..., sum_squares: _Optional[float] = ..., identity: _Optional[str] = ..., bytes: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class MergeEntry(_message.Message):
    __slots__ = ("push_id", "weight", "scale", "norm")
    PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    NORM_FIELD_NUMBER: _ClassVar[int]
    push_id: str
    weight: float
    scale: float
    norm: float
    def __init__(self, push_id: _Optional[str] = ..., weight: _Optional[float] = ..., scale: _Optional[float] = ..., norm: _Optional[float] = ...) -> None: ...

class PrepareRequest(_message.Message):
    __slots__ = ("version", "merges")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MERGES_FIELD_NUMBER: _ClassVar[int]
    version: int
    merges: _containers.RepeatedCompositeFieldContainer[MergeEntry]
    def __init__(self, version: _Optional[int] = ..., merges: _Optional[_Iterable[_Union[MergeEntry, _Mapping]]] = ...) -> None: ...

class PrepareResponse(_message.Message):
    __slots__ = ("finite", "blame", "reason", "params_digest", "theta_sum_squares", "update_bytes")
    FINITE_FIELD_NUMBER: _ClassVar[int]
    BLAME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PARAMS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    THETA_SUM_SQUARES_FIELD_NUMBER: _ClassVar[int]
    UPDATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    finite: bool
    blame: str
    reason: str
    params_digest: str
    theta_sum_squares: float
    update_bytes: int
    def __init__(self, finite: _Optional[bool] = ..., blame: _Optional[str] = ..., reason: _Optional[str] = ..., params_digest: _Optional[str] = ..., theta_sum_squares: _Optional[float] = ..., update_bytes: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("version", "params_digest")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARAMS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    version: int
    params_digest: str
    def __init__(self, version: _Optional[int] = ..., params_digest: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("push_ids",)
    PUSH_IDS_FIELD_NUMBER: _ClassVar[int]
    push_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, push_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("island", "hardware", "devices", "fingerprint", "fingerprint_fields", "device_kind")
    class FingerprintFieldsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ISLAND_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    island: str
    hardware: str
    devices: int
    fingerprint: str
    fingerprint_fields: _containers.ScalarMap[str, str]
    device_kind: str
    def __init__(self, island: _Optional[str] = ..., hardware: _Optional[str] = ..., devices: _Optional[int] = ..., fingerprint: _Optional[str] = ..., fingerprint_fields: _Optional[_Mapping[str, str]] = ..., device_kind: _Optional[str] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("island_id", "version", "shard_index", "shard_count", "cursor", "lease_s", "run_id", "tree_size", "tree_digest", "total_versions", "cursor_end", "segment_start", "shard_addresses")
    ISLAND_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_SIZE_FIELD_NUMBER: _ClassVar[int]
    TREE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    CURSOR_END_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_START_FIELD_NUMBER: _ClassVar[int]
    SHARD_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    island_id: str
    version: int
    shard_index: int
    shard_count: int
    cursor: int
    lease_s: float
    run_id: str
    tree_size: int
    tree_digest: str
    total_versions: int
    cursor_end: int
    segment_start: int
    shard_addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, island_id: _Optional[str] = ..., version: _Optional[int] = ..., shard_index: _Optional[int] = ..., shard_count: _Optional[int] = ..., cursor: _Optional[int] = ..., lease_s: _Optional[float] = ..., run_id: _Optional[str] = ..., tree_size: _Optional[int] = ..., tree_digest: _Optional[str] = ..., total_versions: _Optional[int] = ..., cursor_end: _Optional[int] = ..., segment_start: _Optional[int] = ..., shard_addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("island_id", "version", "steps", "tokens", "steps_per_s", "params_digest", "bad_devices", "pending_push_id", "quarantined", "devices", "train_loss", "utilization", "evals", "tokens_per_s", "round_seconds")
    ISLAND_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PARAMS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    BAD_DEVICES_FIELD_NUMBER: _ClassVar[int]
    PENDING_PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    EVALS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    ROUND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    island_id: str
    version: int
    steps: int
    tokens: int
    steps_per_s: float
    params_digest: str
    bad_devices: _containers.RepeatedScalarFieldContainer[str]
    pending_push_id: str
    quarantined: _containers.RepeatedCompositeFieldContainer[DeviceEvidence]
    devices: int
    train_loss: float
    utilization: float
    evals: _containers.RepeatedCompositeFieldContainer[EvalReport]
    tokens_per_s: float
    round_seconds: float
    def __init__(self, island_id: _Optional[str] = ..., version: _Optional[int] = ..., steps: _Optional[int] = ..., tokens: _Optional[int] = ..., steps_per_s: _Optional[float] = ..., params_digest: _Optional[str] = ..., bad_devices: _Optional[_Iterable[str]] = ..., pending_push_id: _Optional[str] = ..., quarantined: _Optional[_Iterable[_Union[DeviceEvidence, _Mapping]]] = ..., devices: _Optional[int] = ..., train_loss: _Optional[float] = ..., utilization: _Optional[float] = ..., evals: _Optional[_Iterable[_Union[EvalReport, _Mapping]]] = ..., tokens_per_s: _Optional[float] = ..., round_seconds: _Optional[float] = ...) -> None: ...

class EvalReport(_message.Message):
    __slots__ = ("version", "loss")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    version: int
    loss: float
    def __init__(self, version: _Optional[int] = ..., loss: _Optional[float] = ...) -> None: ...

class DeviceEvidence(_message.Message):
    __slots__ = ("device", "index", "probe", "step", "value", "expected", "z", "median", "mismatches", "detail")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    Z_FIELD_NUMBER: _ClassVar[int]
    MEDIAN_FIELD_NUMBER: _ClassVar[int]
    MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    device: int
    index: int
    probe: str
    step: int
    value: float
    expected: float
    z: float
    median: float
    mismatches: int
    detail: str
    def __init__(self, device: _Optional[int] = ..., index: _Optional[int] = ..., probe: _Optional[str] = ..., step: _Optional[int] = ..., value: _Optional[float] = ..., expected: _Optional[float] = ..., z: _Optional[float] = ..., median: _Optional[float] = ..., mismatches: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("action", "version", "lease_s", "reason", "push_unknown")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PUSH_UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    action: Action
    version: int
    lease_s: float
    reason: str
    push_unknown: bool
    def __init__(self, action: _Optional[_Union[Action, str]] = ..., version: _Optional[int] = ..., lease_s: _Optional[float] = ..., reason: _Optional[str] = ..., push_unknown: _Optional[bool] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("island_id", "base_version", "push_id", "tokens", "inner_steps", "cursor_start", "cursor_end", "tree_digest", "total_bytes", "frame_crc32", "chunks", "shard_index", "fragment", "shard")
    ISLAND_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    CURSOR_START_FIELD_NUMBER: _ClassVar[int]
    CURSOR_END_FIELD_NUMBER: _ClassVar[int]
    TREE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    FRAME_CRC32_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    island_id: str
    base_version: int
    push_id: str
    tokens: int
    inner_steps: int
    cursor_start: int
    cursor_end: int
    tree_digest: str
    total_bytes: int
    frame_crc32: int
    chunks: int
    shard_index: int
    fragment: int
    shard: int
    def __init__(self, island_id: _Optional[str] = ..., base_version: _Optional[int] = ..., push_id: _Optional[str] = ..., tokens: _Optional[int] = ..., inner_steps: _Optional[int] = ..., cursor_start: _Optional[int] = ..., cursor_end: _Optional[int] = ..., tree_digest: _Optional[str] = ..., total_bytes: _Optional[int] = ..., frame_crc32: _Optional[int] = ..., chunks: _Optional[int] = ..., shard_index: _Optional[int] = ..., fragment: _Optional[int] = ..., shard: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("index", "data", "crc32")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    index: int
    data: bytes
    crc32: int
    def __init__(self, index: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ...) -> None: ...

class PushMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class PushDeltaResponse(_message.Message):
    __slots__ = ("status", "merged_version", "version", "reason", "weight", "cursor", "stop_reason")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MERGED_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    status: PushStatus
    merged_version: int
    version: int
    reason: str
    weight: float
    cursor: int
    stop_reason: str
    def __init__(self, status: _Optional[_Union[PushStatus, str]] = ..., merged_version: _Optional[int] = ..., version: _Optional[int] = ..., reason: _Optional[str] = ..., weight: _Optional[float] = ..., cursor: _Optional[int] = ..., stop_reason: _Optional[str] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("island_id", "have_version", "full", "wait_s")
    ISLAND_ID_FIELD_NUMBER: _ClassVar[int]
    HAVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    island_id: str
    have_version: int
    full: bool
    wait_s: float
    def __init__(self, island_id: _Optional[str] = ..., have_version: _Optional[int] = ..., full: _Optional[bool] = ..., wait_s: _Optional[float] = ...) -> None: ...

class PullHeader(_message.Message):
    __slots__ = ("kind", "version", "base_version", "tree_digest", "total_bytes", "frame_crc32", "chunks", "params_digest", "evaluate", "round_seconds")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TREE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    FRAME_CRC32_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    EVALUATE_FIELD_NUMBER: _ClassVar[int]
    ROUND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    kind: PullKind
    version: int
    base_version: int
    tree_digest: str
    total_bytes: int
    frame_crc32: int
    chunks: int
    params_digest: str
    evaluate: bool
    round_seconds: float
    def __init__(self, kind: _Optional[_Union[PullKind, str]] = ..., version: _Optional[int] = ..., base_version: _Optional[int] = ..., tree_digest: _Optional[str] = ..., total_bytes: _Optional[int] = ..., frame_crc32: _Optional[int] = ..., chunks: _Optional[int] = ..., params_digest: _Optional[str] = ..., evaluate: _Optional[bool] = ..., round_seconds: _Optional[float] = ...) -> None: ...

class PullMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PullHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[PullHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IslandStatus(_message.Message):
    __slots__ = ("island_id", "name", "state", "version", "tokens_merged", "pushes_merged", "lease_left_s", "steps_per_s", "shard_index", "quarantined", "devices", "hardware", "device_kind", "steps", "tokens", "train_loss", "utilization", "params_digest", "cursor", "bytes_in", "bytes_out", "last_seen_s", "tokens_per_s", "segment_start", "segment_end")
    ISLAND_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_MERGED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_MERGED_FIELD_NUMBER: _ClassVar[int]
    LEASE_LEFT_S_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    PARAMS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_START_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_END_FIELD_NUMBER: _ClassVar[int]
    island_id: str
    name: str
    state: str
    version: int
    tokens_merged: int
    pushes_merged: int
    lease_left_s: float
    steps_per_s: float
    shard_index: int
    quarantined: _containers.RepeatedCompositeFieldContainer[DeviceEvidence]
    devices: int
    hardware: str
    device_kind: str
    steps: int
    tokens: int
    train_loss: float
    utilization: float
    params_digest: str
    cursor: int
    bytes_in: int
    bytes_out: int
    last_seen_s: float
    tokens_per_s: float
    segment_start: int
    segment_end: int
    def __init__(self, island_id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[str] = ..., version: _Optional[int] = ..., tokens_merged: _Optional[int] = ..., pushes_merged: _Optional[int] = ..., lease_left_s: _Optional[float] = ..., steps_per_s: _Optional[float] = ..., shard_index: _Optional[int] = ..., quarantined: _Optional[_Iterable[_Union[DeviceEvidence, _Mapping]]] = ..., devices: _Optional[int] = ..., hardware: _Optional[str] = ..., device_kind: _Optional[str] = ..., steps: _Optional[int] = ..., tokens: _Optional[int] = ..., train_loss: _Optional[float] = ..., utilization: _Optional[float] = ..., params_digest: _Optional[str] = ..., cursor: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., last_seen_s: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., segment_start: _Optional[int] = ..., segment_end: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("run_id", "version", "mode", "islands", "tokens_merged", "bytes_in", "bytes_out", "deltas_dropped", "total_versions", "tokens_total", "stopped", "run_over", "deltas_merged", "deltas_rejected", "duplicates", "pushes_refused", "shard_cursors", "round", "merge_s", "params_digest", "started_at", "now", "eval_loss", "rounds", "evals", "faults", "refusals", "islands_forgotten", "round_seconds", "eval_confirmed", "source_tokens")
    class RefusalsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class SourceTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    ISLANDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_MERGED_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    DELTAS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    RUN_OVER_FIELD_NUMBER: _ClassVar[int]
    DELTAS_MERGED_FIELD_NUMBER: _ClassVar[int]
    DELTAS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    PUSHES_REFUSED_FIELD_NUMBER: _ClassVar[int]
    SHARD_CURSORS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MERGE_S_FIELD_NUMBER: _ClassVar[int]
    PARAMS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    NOW_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    EVALS_FIELD_NUMBER: _ClassVar[int]
    FAULTS_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    ISLANDS_FORGOTTEN_FIELD_NUMBER: _ClassVar[int]
    ROUND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EVAL_CONFIRMED_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    version: int
    mode: str
    islands: _containers.RepeatedCompositeFieldContainer[IslandStatus]
    tokens_merged: int
    bytes_in: int
    bytes_out: int
    deltas_dropped: int
    total_versions: int
    tokens_total: int
    stopped: bool
    run_over: str
    deltas_merged: int
    deltas_rejected: int
    duplicates: int
    pushes_refused: int
    shard_cursors: _containers.RepeatedScalarFieldContainer[int]
    round: OpenRound
    merge_s: float
    params_digest: str
    started_at: float
    now: float
    eval_loss: float
    rounds: _containers.RepeatedCompositeFieldContainer[RoundRecord]
    evals: _containers.RepeatedCompositeFieldContainer[EvalPoint]
    faults: _containers.RepeatedCompositeFieldContainer[FaultRecord]
    refusals: _containers.ScalarMap[str, int]
    islands_forgotten: int
    round_seconds: float
    eval_confirmed: bool
    source_tokens: _containers.ScalarMap[str, int]
    def __init__(self, run_id: _Optional[str] = ..., version: _Optional[int] = ..., mode: _Optional[str] = ..., islands: _Optional[_Iterable[_Union[IslandStatus, _Mapping]]] = ..., tokens_merged: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., deltas_dropped: _Optional[int] = ..., total_versions: _Optional[int] = ..., tokens_total: _Optional[int] = ..., stopped: _Optional[bool] = ..., run_over: _Optional[str] = ..., deltas_merged: _Optional[int] = ..., deltas_rejected: _Optional[int] = ..., duplicates: _Optional[int] = ..., pushes_refused: _Optional[int] = ..., shard_cursors: _Optional[_Iterable[int]] = ..., round: _Optional[_Union[OpenRound, _Mapping]] = ..., merge_s: _Optional[float] = ..., params_digest: _Optional[str] = ..., started_at: _Optional[float] = ..., now: _Optional[float] = ..., eval_loss: _Optional[float] = ..., rounds: _Optional[_Iterable[_Union[RoundRecord, _Mapping]]] = ..., evals: _Optional[_Iterable[_Union[EvalPoint, _Mapping]]] = ..., faults: _Optional[_Iterable[_Union[FaultRecord, _Mapping]]] = ..., refusals: _Optional[_Mapping[str, int]] = ..., islands_forgotten: _Optional[int] = ..., round_seconds: _Optional[float] = ..., eval_confirmed: _Optional[bool] = ..., source_tokens: _Optional[_Mapping[str, int]] = ...) -> None: ...

class OpenRound(_message.Message):
    __slots__ = ("target_version", "ready", "reason", "pending", "deadline_s")
    TARGET_VERSION_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    target_version: int
    ready: bool
    reason: str
    pending: int
    deadline_s: float
    def __init__(self, target_version: _Optional[int] = ..., ready: _Optional[bool] = ..., reason: _Optional[str] = ..., pending: _Optional[int] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class RoundRecord(_message.Message):
    __slots__ = ("version", "t", "pushes", "tokens", "bytes_in", "merge_s", "max_staleness")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    T_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    MERGE_S_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    version: int
    t: float
    pushes: int
    tokens: int
    bytes_in: int
    merge_s: float
    max_staleness: float
    def __init__(self, version: _Optional[int] = ..., t: _Optional[float] = ..., pushes: _Optional[int] = ..., tokens: _Optional[int] = ..., bytes_in: _Optional[int] = ..., merge_s: _Optional[float] = ..., max_staleness: _Optional[float] = ...) -> None: ...

class EvalPoint(_message.Message):
    __slots__ = ("version", "tokens", "loss", "island_id", "t", "confirmed", "confirmed_by")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    ISLAND_ID_FIELD_NUMBER: _ClassVar[int]
    T_FIELD_NUMBER: _ClassVar[int]
    CONFIRMED_FIELD_NUMBER: _ClassVar[int]
    CONFIRMED_BY_FIELD_NUMBER: _ClassVar[int]
    version: int
    tokens: int
    loss: float
    island_id: str
    t: float
    confirmed: bool
    confirmed_by: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., tokens: _Optional[int] = ..., loss: _Optional[float] = ..., island_id: _Optional[str] = ..., t: _Optional[float] = ..., confirmed: _Optional[bool] = ..., confirmed_by: _Optional[_Iterable[str]] = ...) -> None: ...

class FaultRecord(_message.Message):
    __slots__ = ("t", "kind", "island_id", "detail")
    T_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ISLAND_ID_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    t: float
    kind: str
    island_id: str
    detail: str
    def __init__(self, t: _Optional[float] = ..., kind: _Optional[str] = ..., island_id: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...
