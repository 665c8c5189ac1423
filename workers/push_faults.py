"""Push faults, injected by the island itself: a testing knob (``dtrain worker --inject KIND@vN``, which
``dtrain simulate --fault KIND:ISLAND@vN`` passes to the worker it starts). Never used in a real run.

An injection fires once, on the island's first push whose base version is >= N, and is an event
``fault_injected`` {fault_kind, push_id, at_version, base_version, ...} in the island's events. The kinds, what the
island sends, and what in the coordinator stops it:

- ``nan``: the real Δ, quantized as usual (no error feedback), with the first block's scale replaced by NaN
  (for the lossless ``up`` codec, bits=32, the first value itself). The codec's encoder refuses non-finite
  values, so the frame is written below that check (``codec.encode`` of a hand-made QuantizedVec); it is a
  well-formed frame (right sizes, right CRC) that carries a NaN. The coordinator's frame validation
  (``FrameValidator``: every scale finite and small enough, every lossless value finite) refuses it as the
  first chunk is spooled: INVALID_ARGUMENT "bad frame", a ``push_refused`` event; nothing is admitted.
- ``poison``: the real Δ × −1000 (:data:`POISON_FACTOR`), quantized without error feedback, with the honest
  header (tokens, cursor range). A valid frame with a valid weight: the coordinator's norm screen quarantines
  it (L2 norm over ``coordinator.norm_max_ratio`` × ‖θ‖, or a robust-z outlier among the recent merged norms),
  a ``push_quarantined`` event; its island is told why.
- ``inflate``: a huge constant direction, every value as large as the ``up`` codec can carry (float32's
  largest, quantized: every code at its maximum with the largest scale the codec allows), with
  ``tokens`` = 10**9 (:data:`INFLATED_TOKENS`) in the header. The coordinator refuses it from the header alone,
  before the payload streams in: the tokens exceed the cursor range it assigned (a ``push_refused`` event).
- ``truncate``: the real frame, but the upload is cut off: the client sends the header and about half of the
  chunks, then cancels the call (a real broken stream to the real server), and sends the whole push again
  with the same push_id, which succeeds. The coordinator discards the partial spool and changes nothing
  (a ``push_aborted`` event).

- ``scale`` (``scale@vN,factor=F``, F default −1): a Byzantine island, not a one-off: *every* push based on
  version >= N carries the real Δ × F with the honest header (F = −1: the honest delta reversed; −3, −20: pushed
  harder). Its norm is |F| × the honest norm: the round screen (``coordinator.round_norm_ratio`` × the round's
  median norm) rejects a large |F| from the first round on, and the robust merge rule (``coordinator.merge_rule``)
  bounds what a small one moves θ; repeated rejections quarantine the island (``coordinator.max_rejections``).
- ``ramp`` (``ramp@vN,factor=G``, G default 1.2): every push based on version >= N carries the real Δ × G^k, k
  = 1, 2, ... its pushes since: a push that grows a little each round, to creep past a screen whose reference
  follows the accepted norms.

Each push ``scale`` and ``ramp`` change is a ``fault_injected`` event (with the factor used).

Error feedback is left alone by ``nan``, ``poison``, ``inflate``, ``scale`` and ``ramp``: the island's residual
is that of a round whose real Δ was never sent.

Device faults (``dtrain worker --device-fault KIND:DEVICE@STEP[,OPTION=VALUE...]``, which ``dtrain simulate --fault
device-KIND:ISLAND@stepN,device=D,...`` passes to the worker it starts, and again to a restarted one: the chip is
still bad) are parsed here by :func:`parse_device_fault` into a :class:`dtrain.health.faults.DeviceFault`, which the
worker injects into its per-device inner step and probes (:mod:`dtrain.health.device_step`,
:mod:`dtrain.health.probes`): ``scale`` (the device's outputs × ``factor``), ``bitflip`` (bit ``bit`` of a fraction
``rate`` of its float32 outputs flipped) or ``dead`` (its computations raise), from inner step ``STEP`` on, on each
step with probability ``prob`` (drawn from ``seed``). :func:`check_device_fault` refuses a device id the worker does
not have.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dtrain import codec
from dtrain.config.sections import CodecConfig, ConfigError
from dtrain.health.faults import FAULT_KINDS, FAULT_OPTIONS, DeviceFault
from dtrain.net.proto import dtrain_pb2 as pb
from workers.client import CoordinatorClient

PUSH_FAULTS = ("nan", "poison", "inflate", "truncate", "scale", "ramp")
PERSISTENT_FAULTS = ("scale", "ramp")  # every push from vN on, not once
DEFAULT_FACTORS = {"scale": -1.0, "ramp": 1.2}  # factor=F when not given
POISON_FACTOR = -1000.0  # poison: the real Δ times this
INFLATED_TOKENS = 10**9  # inflate: the tokens the header claims


_INJECT_RE = re.compile(r"(?P<kind>[a-z]+)@v(?P<version>\d+)(?:,factor=(?P<factor>[^,]+))?")
_DEVICE_FAULT_RE = re.compile(r"(?P<kind>[a-z]+):(?P<device>\d+)@(?P<step>\d+)(?P<opts>(?:,[^,]*)*)")


@dataclass
class Injection:
    """One push fault: ``kind`` on the first push whose base version is >= ``at_version``, once (``scale`` and
    ``ramp``: on every such push, ``factor`` F: see the module docstring)."""

    kind: str
    at_version: int
    fired: bool = False
    factor: float = 0.0  # scale / ramp: F (0: the kind's default, DEFAULT_FACTORS)
    pushes: int = 0  # scale / ramp: the pushes changed so far

    @property
    def persistent(self) -> bool:
        return self.kind in PERSISTENT_FAULTS

    @classmethod
    def parse(cls, text: str) -> Injection:
        """``KIND@vN`` or ``KIND@vN,factor=F`` (``--inject``); raises ConfigError naming what is wrong."""
        m = _INJECT_RE.fullmatch(text.strip())
        if m is None:
            raise ConfigError(f"--inject {text!r}: expected KIND@vN[,factor=F] with KIND one of "
                              f"{', '.join(PUSH_FAULTS)}, e.g. nan@v2 or scale@v0,factor=-3 (push faults fire at a "
                              f"version only, not at a time)")
        if m["kind"] not in PUSH_FAULTS:
            raise ConfigError(f"--inject {text!r}: unknown kind {m['kind']!r} (one of {', '.join(PUSH_FAULTS)})")
        factor = 0.0
        if m["factor"] is not None:
            if m["kind"] not in PERSISTENT_FAULTS:
                raise ConfigError(f"--inject {text!r}: factor=F is for {' and '.join(PERSISTENT_FAULTS)} only")
            try:
                factor = float(m["factor"])
            except ValueError:
                raise ConfigError(f"--inject {text!r}: factor={m['factor']} is not a number") from None
            if not np.isfinite(factor) or factor == 0:
                raise ConfigError(f"--inject {text!r}: factor={m['factor']}: must be a finite number other than 0")
        return cls(m["kind"], int(m["version"]), factor=factor or DEFAULT_FACTORS.get(m["kind"], 0.0))


def parse_device_fault(text: str) -> DeviceFault:
    """``KIND:DEVICE@STEP[,prob=P][,factor=F][,bit=B][,rate=R][,seed=S][,until=STEP]`` (``--device-fault``) as a
    :class:`DeviceFault` starting at inner step STEP; raises ConfigError naming what is wrong."""
    where = f"--device-fault {text!r}"
    m = _DEVICE_FAULT_RE.fullmatch(text.strip())
    if m is None:
        raise ConfigError(f"{where}: expected KIND:DEVICE@STEP[,OPTION=VALUE...] with KIND one of "
                          f"{', '.join(FAULT_KINDS)}, e.g. bitflip:3@120,bit=30")
    kind = m["kind"]
    if kind not in FAULT_KINDS:
        raise ConfigError(f"{where}: unknown kind {kind!r} (one of {', '.join(FAULT_KINDS)})")
    values: dict[str, Any] = {}
    for item in m["opts"].split(",")[1:]:
        key, _, raw = item.partition("=")
        if key not in FAULT_OPTIONS:
            raise ConfigError(f"{where}: unknown option {key!r} (options: {', '.join(FAULT_OPTIONS)})")
        typ, kinds = FAULT_OPTIONS[key]
        if kind not in kinds:
            raise ConfigError(f"{where}: option {key} is for {' and '.join(kinds)} faults, not {kind}")
        if key in values:
            raise ConfigError(f"{where}: option {key} given twice")
        try:
            values[key] = typ(raw)
        except ValueError:
            raise ConfigError(f"{where}: option {key}={raw!r} is not {'an integer' if typ is int else 'a number'}"
                              ) from None
    try:
        return DeviceFault(kind=kind, device=int(m["device"]), start=int(m["step"]), **values)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def check_device_fault(fault: DeviceFault, device_ids: Sequence[int]) -> None:
    """Raises ConfigError if ``fault``'s device is not one of ``device_ids`` (this worker's JAX devices)."""
    if fault.device not in device_ids:
        raise ConfigError(f"--device-fault: device {fault.device} is not a device of this worker "
                          f"(JAX device ids {', '.join(map(str, sorted(device_ids)))})")


def take_injection(injections: Sequence[Injection], base_version: int) -> Injection | None:
    """The first injection not fired yet (or a persistent one: ``scale``, ``ramp``) that is due for a push based on
    ``base_version``, marked fired."""
    for injection in injections:
        if (not injection.fired or injection.persistent) and base_version >= injection.at_version:
            injection.fired = True
            return injection
    return None


def corrupt_push(kind: str, delta: np.ndarray, header: pb.PushHeader, bits: codec.Bits, block: int,
                 level: int, factor: float = 1.0, density: float = 0.02) -> tuple[bytes, dict[str, Any]]:
    """The frame push fault ``kind`` (nan, poison, inflate, scale or ramp) sends instead of Δ's, and what the
    ``fault_injected`` event records about it; ``header`` is changed in place where the fault says so
    (inflate's tokens). ``factor``: what scale and ramp multiply Δ by (ramp: G^k, worked out by the caller);
    ``density``: a sparse codec's (``codec.density``). See the module docstring."""
    if kind in PERSISTENT_FAULTS:
        scaled = delta * np.float32(factor)
        return (codec.encode(codec.quantize(scaled, bits, block, density), level),
                {"what": f"the real delta x {factor:.4g}, honest tokens", "factor": factor,
                 "norm": float(np.linalg.norm(scaled)), "honest_norm": float(np.linalg.norm(delta))})
    if kind == "nan":
        q = codec.quantize(delta, bits, block, density)
        if q.scales.size:
            scales = q.scales.copy()
            scales[0] = np.float32("nan")
            q = dataclasses.replace(q, scales=scales)
        else:  # bits=32: the values themselves are the payload
            payload = q.payload.copy()
            payload[:4] = np.frombuffer(np.float32("nan").tobytes(), np.uint8)
            q = dataclasses.replace(q, payload=payload)
        return codec.encode(q, level), {"what": "the real delta with a NaN in its first block"}
    if kind == "poison":
        poisoned = delta * np.float32(POISON_FACTOR)
        return (codec.encode(codec.quantize(poisoned, bits, block, density), level),
                {"what": f"the real delta x {POISON_FACTOR:g}, honest tokens",
                 "norm": float(np.linalg.norm(poisoned)), "honest_norm": float(np.linalg.norm(delta))})
    if kind == "inflate":
        honest = header.tokens
        header.tokens = INFLATED_TOKENS
        huge = np.full(delta.size, np.finfo(np.float32).max, np.float32)
        return (codec.encode(codec.quantize(huge, bits, block, density), level),
                {"what": "a constant delta as large as the codec carries", "tokens": INFLATED_TOKENS,
                 "honest_tokens": honest})
    raise ValueError(f"corrupt_push: {kind!r} is not a frame fault (nan, poison, inflate, scale, ramp)")


def injected_push(injections: Sequence[Injection], delta: np.ndarray, header: pb.PushHeader,
                  encode: Callable[[np.ndarray], bytes], client: CoordinatorClient, bits: codec.Bits,
                  codec_cfg: CodecConfig, log: Callable[..., object]
                  ) -> tuple[bytes, CoordinatorClient | TruncatedUpload]:
    """What :meth:`Worker._push <workers.island.Worker._push>` sends for Δ = ``delta``: (the frame, the client
    that pushes it). With no injection due (:func:`take_injection`) that is ``encode(delta)`` and ``client``;
    nan/poison/inflate send :func:`corrupt_push`'s frame (and log ``fault_injected`` now), truncate sends the
    real frame through a :class:`TruncatedUpload` (which logs ``fault_injected`` as it cuts the upload)."""
    injection = take_injection(injections, header.base_version)
    if injection is None:
        return encode(delta), client
    if injection.kind == "truncate":
        return encode(delta), TruncatedUpload(client, injection, log)
    injection.pushes += 1
    factor = injection.factor ** injection.pushes if injection.kind == "ramp" else injection.factor
    frame, detail = corrupt_push(injection.kind, delta, header, bits, codec_cfg.scheme(codec_cfg.up)[1],
                                 codec_cfg.push_level(), factor, codec_cfg.density)
    log("fault_injected", fault_kind=injection.kind, at_version=injection.at_version, push_id=header.push_id,
        base_version=header.base_version, **detail)
    return frame, client


class TruncatedUpload:
    """The push client for a ``truncate`` injection: the first push is cut off mid-stream
    (:meth:`CoordinatorClient.push_broken`), then sent whole; later pushes (a resend) go straight through."""

    def __init__(self, client: CoordinatorClient, injection: Injection, log: Callable[..., object]):
        self.client, self.injection, self.log = client, injection, log
        self.cut = False

    def push(self, header: pb.PushHeader, frame: bytes) -> pb.PushDeltaResponse:
        if not self.cut:
            self.cut = True

            def injected(chunks_sent: int, chunks: int) -> None:  # logged just before the call is cancelled
                self.log("fault_injected", fault_kind=self.injection.kind, at_version=self.injection.at_version,
                         push_id=header.push_id, base_version=header.base_version, chunks_sent=chunks_sent,
                         chunks=chunks, what=f"upload cancelled after {chunks_sent} of {chunks} chunks")

            self.client.push_broken(header, frame, injected)
            self.log("push_retried", push_id=header.push_id, why="the upload was cut off (fault injection)")
        return self.client.push(header, frame)
