"""The ``--fault SPEC`` grammar of ``dtrain simulate``: what a fault is, parsed and checked before anything starts.

A spec is ``KIND[:TARGET]@WHEN[+DURATION][,KEY=VALUE...]``:

- ``KIND``: ``kill`` (SIGKILL an island, every process of it; with ``+DURATION`` it is started again that long
  after, ``+0s``: at once, as a supervisor restarts a crashed process), ``hang`` (SIGSTOP an island, every
  process of it, SIGCONT after ``DURATION``), ``kill-coordinator``
  (SIGKILL the coordinator; with ``+DURATION`` it is started again with ``--resume`` on the same port; with
  ``shard=I``, I >= 1, and ``dtrain simulate --coordinator-shards S``: SIGKILL range shard I, a failed
  coordinator: after ``DURATION`` the lead is killed too, shard I is started again on its port and the lead with
  ``--resume``, which restores every shard to its checkpoint's version), ``cut``
  (the island's link to the coordinator drops every connection and accepts none for ``DURATION``), ``slow`` (the
  island's link delays every piece of data by ``delay=MS`` milliseconds for ``DURATION``); the push faults ``nan`` (the
  island's next push carries a NaN), ``poison`` (its real delta x -1000, honest tokens), ``inflate`` (a
  constant delta as large as the codec carries, tokens claimed 10**9) and ``truncate`` (its upload is cancelled
  after about half of its chunks, then sent whole again): the driver passes these to the island's worker
  (``dtrain worker --inject KIND@vN``), which corrupts its first push based on version >= N
  (:mod:`workers.push_faults` says exactly what is sent and what in the coordinator stops it), and the Byzantine
  island's ``scale`` (every push from vN on: its real delta x ``factor=F``, default -1) and ``ramp`` (every push
  from vN on: its real delta x G^k, ``factor=G``, default 1.2, k its pushes since); the device faults
  ``device-scale`` (one device's outputs x ``factor=F``, default 10), ``device-bitflip`` (bit ``bit=B`` of its
  float32 outputs flipped, default 22, in a fraction ``rate=R`` of them, default 1) and ``device-dead`` (its
  computations raise), on the device ``device=ID`` (a JAX device id of the island, required), each step with
  probability ``prob=P`` (default 1: always; below 1 intermittent, drawn from ``seed=S``), up to inner step
  ``until=U`` (excluded; default: to the end, a transient fault ends): the driver passes
  these to the island's worker (``dtrain worker --device-fault KIND:ID@N,...``, and again to a restarted
  worker: the chip is still bad), which injects them into its per-device inner step from inner step N on
  (:class:`dtrain.health.faults.DeviceFault`).
- ``TARGET``: an island name (``island-0`` ... ``island-N-1``); none for ``kill-coordinator``.
- ``WHEN``: ``vN`` (once the coordinator has merged version N) or ``Ns`` (N seconds after the workers
  were started); push faults take ``vN`` only (the island's first push based on version N or later); device
  faults take ``stepN`` only (inner step N of that island), and only they do.
- ``DURATION``: seconds, e.g. ``+10s``; ``hang``, ``cut`` and ``slow`` need one; push and device faults take none.

Examples: ``kill:island-1@v3+10s``, ``hang:island-2@20s+30s``, ``kill-coordinator@v5+3s``,
``kill-coordinator@v3+3s,shard=1``,
``cut:island-0@v2+8s``, ``slow:island-3@10s+20s,delay=200``, ``nan:island-1@v2``, ``truncate:island-0@v1``,
``scale:island-1@v0,factor=-20``, ``ramp:island-2@v0,factor=1.2``,
``device-bitflip:island-1@step120,device=3,bit=30``, ``device-scale:island-0@step200,device=5,factor=8``,
``device-dead:island-2@step150,device=6``.

Everything here is plain parsing; the driver (:mod:`dtrain_cli.simulate_processes`) decides when a fault fires and
records it in the run's events, link faults act through :class:`dtrain_cli.link_proxy.LinkProxy`, and
:mod:`dtrain_cli.fault_score` scores each fault against what the run detected.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dtrain.config.sections import ConfigError
from dtrain.health.faults import FAULT_OPTIONS, DeviceFault

PUSH_KINDS = ("nan", "poison", "inflate", "truncate", "scale", "ramp")  # injected by the island's worker
# (workers.push_faults); scale and ramp change every push from vN on and take factor=F
DEVICE_KINDS = ("device-scale", "device-bitflip", "device-dead")  # injected by the island's worker into one device
KINDS = ("kill", "hang", "kill-coordinator", "cut", "slow", *PUSH_KINDS, *DEVICE_KINDS)
NEEDS_DURATION = ("hang", "cut", "slow")
LINK_KINDS = ("cut", "slow")
_DEVICES_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")
_SPEC_RE = re.compile(r"(?P<kind>[a-z-]+)(?::(?P<target>[A-Za-z0-9._-]+))?"
                      r"@(?P<when>v\d+|step\d+|\d+(?:\.\d+)?s)"
                      r"(?:\+(?P<duration>\d+(?:\.\d+)?)s)?(?P<opts>(?:,[a-z_]+=[0-9.eE+-]+)*)")


@dataclass(frozen=True)
class FaultSpec:
    """One parsed ``--fault`` spec (:func:`parse_fault`): what to do (``kind``), to which island (``target``),
    when (``at_version`` or ``at_s``; a device fault's step is its ``device_fault.start``) and for how long."""

    kind: str
    target: str  # an island name, or "coordinator"
    at_version: int | None  # fire once this version is merged ...
    at_s: float | None  # ... or this many seconds after the workers started
    duration_s: float | None  # restart / resume / restore after this long (0: at once; None: never)
    delay_ms: float = 0.0  # slow: added per forwarded piece of data
    text: str = ""  # the spec as given
    factor: float = 0.0  # scale / ramp: factor=F (0: the worker's default)
    device_fault: DeviceFault | None = None  # device faults: what the island's worker injects (start = stepN)
    shard: int = 0  # kill-coordinator: the coordinator shard killed (0: the lead, or the one coordinator)

    def describe(self) -> str:
        """The fault in words, for the driver's progress lines and events (e.g. ``kill island-1 after version 3
        for 10s``)."""
        if self.device_fault is not None:
            f = self.device_fault
            return f"{self.kind} {self.target} device {f.device} from inner step {f.start}" + \
                (f" until step {f.until}" if f.until else "")
        when = f"after version {self.at_version}" if self.at_version is not None else f"at {self.at_s:g}s"
        if self.shard:
            return (f"{self.kind} shard {self.shard} {when}" + (f"; every shard restarted from the checkpoints "
                                                                f"{self.duration_s:g}s later"
                                                                if self.duration_s is not None else ""))
        if self.duration_s == 0:  # a kill or kill-coordinator restarted at once
            return f"{self.kind} {self.target} {when}, restarted at once"
        return f"{self.kind} {self.target} {when}" + (f" for {self.duration_s:g}s" if self.duration_s else "")

    def inject_arg(self) -> str:
        """A push fault as ``dtrain worker --inject`` takes it (``workers.push_faults.Injection.parse``)."""
        return f"{self.kind}@v{self.at_version}" + (f",factor={self.factor!r}" if self.factor else "")

    def worker_arg(self) -> str:
        """A device fault as ``dtrain worker --device-fault`` takes it (:func:`workers.push_faults.parse_device_fault`):
        ``KIND:DEVICE@STEP`` and the options that differ from their defaults."""
        f = self.device_fault
        if f is None:
            raise ValueError(f"FaultSpec.worker_arg: {self.text!r} is not a device fault")
        defaults = DeviceFault(kind=f.kind, device=f.device)
        opts = "".join(f",{k}={getattr(f, k)!r}" for k in FAULT_OPTIONS if getattr(f, k) != getattr(defaults, k))
        return f"{f.kind}:{f.device}@{f.start}{opts}"


def parse_fault(text: str, islands: int, devices: int | None = None) -> FaultSpec:
    """Parses one ``--fault`` value.

    Args:
        text: the spec as given (``KIND[:TARGET]@WHEN[+DURATION][,KEY=VALUE...]``, see the module docstring).
        islands: the run's island count (a target must be one of ``island-0`` .. ``island-{islands-1}``).
        devices: each island's device count, where known (a device fault's ``device`` must be below it).

    Returns the :class:`FaultSpec`; raises ConfigError naming what is wrong."""
    m = _SPEC_RE.fullmatch(text.strip())
    if m is None:
        raise ConfigError(f"--fault {text!r}: expected KIND[:ISLAND]@(vN|Ns|stepN)[+Ds][,KEY=VALUE...], "
                          f"e.g. kill:island-1@v3+10s or device-scale:island-0@step20,device=3")
    kind, target = m["kind"], m["target"]
    if kind not in KINDS:
        raise ConfigError(f"--fault {text!r}: unknown kind {kind!r} (one of {', '.join(KINDS)})")
    names = [f"island-{i}" for i in range(islands)]
    if kind == "kill-coordinator":
        if target:
            raise ConfigError(f"--fault {text!r}: kill-coordinator takes no target")
        target = "coordinator"
    elif not target:
        example = f"{kind}:{names[-1]}@step20,device=3" if kind in DEVICE_KINDS else f"{kind}:{names[-1]}@v2"
        raise ConfigError(f"--fault {text!r}: {kind} needs an island, e.g. {example}")
    elif target not in names:
        raise ConfigError(f"--fault {text!r}: target {target!r} is not an island of this run "
                          f"({names[0]} .. {names[-1]})")
    duration = float(m["duration"]) if m["duration"] else None
    if kind in PUSH_KINDS:
        if not m["when"].startswith("v"):
            raise ConfigError(f"--fault {text!r}: {kind} fires at a version only (the island's first push based "
                              f"on it), e.g. {kind}:{target}@v2")
        if m["duration"]:
            raise ConfigError(f"--fault {text!r}: {kind} takes no duration (it corrupts pushes, not a time)")
    if kind in NEEDS_DURATION and not duration:
        raise ConfigError(f"--fault {text!r}: {kind} needs a duration, e.g. {kind}:{target}@v2+10s")
    pairs = [kv.split("=") for kv in m["opts"].split(",") if kv]
    opts = dict(pairs)
    if len(opts) < len(pairs):
        raise ConfigError(f"--fault {text!r}: an option is given twice")
    if kind in DEVICE_KINDS:
        return _device_fault(text, kind, target, m["when"], m["duration"], opts, devices)
    if m["when"].startswith("step"):
        raise ConfigError(f"--fault {text!r}: stepN (an island's inner step) is for device faults only "
                          f"({', '.join(DEVICE_KINDS)}); {kind} takes vN or Ns")
    unknown = set(opts) - ({"delay"} if kind == "slow" else {"factor"} if kind in ("scale", "ramp") else
                           {"shard"} if kind == "kill-coordinator" else set())
    if unknown:
        raise ConfigError(f"--fault {text!r}: unknown option(s) {', '.join(sorted(unknown))}")
    delay = _number(f"--fault {text!r}", "delay", opts["delay"], float) if "delay" in opts else \
        (100.0 if kind == "slow" else 0.0)
    factor = _number(f"--fault {text!r}", "factor", opts["factor"], float) if "factor" in opts else 0.0
    if "factor" in opts and (factor == 0 or not math.isfinite(factor)):
        raise ConfigError(f"--fault {text!r}: factor={opts['factor']}: must be a finite number other than 0")
    when = m["when"]
    at_version = int(when[1:]) if when.startswith("v") else None
    at_s = float(when[:-1]) if at_version is None else None
    shard = _number(f"--fault {text!r}", "shard", opts["shard"], int) if "shard" in opts else 0
    if shard < 0:
        raise ConfigError(f"--fault {text!r}: shard={shard}: must be >= 0 (0: the lead)")
    if shard and duration is None:
        raise ConfigError(f"--fault {text!r}: a killed shard is a failed coordinator, restarted from the checkpoints: "
                          f"give it a duration, e.g. kill-coordinator@{m['when']}+3s,shard={shard}")
    return FaultSpec(kind=kind, target=target, at_version=at_version, at_s=at_s, duration_s=duration,
                     delay_ms=delay, text=text.strip(), factor=factor, shard=shard)


def _device_fault(text: str, kind: str, target: str, when: str, duration: str | None, opts: dict[str, str],
                  devices: int | None) -> FaultSpec:
    """A device fault's FaultSpec (``parse_fault`` past the kind and the target)."""
    where = f"--fault {text!r}"
    if not when.startswith("step"):
        raise ConfigError(f"{where}: {kind} starts at an inner step of the island only, e.g. {kind}:{target}@step20")
    if duration:
        raise ConfigError(f"{where}: {kind} takes no duration (the device stays faulty)")
    fault_kind = kind.removeprefix("device-")
    if "device" not in opts:
        raise ConfigError(f"{where}: {kind} needs the device, e.g. {kind}:{target}@{when},device=3")
    values: dict[str, Any] = {}
    for key, raw in opts.items():
        if key == "device":
            continue
        if key not in FAULT_OPTIONS:
            raise ConfigError(f"{where}: unknown option {key!r} (a device fault takes device, "
                              f"{', '.join(FAULT_OPTIONS)})")
        typ, kinds = FAULT_OPTIONS[key]
        if fault_kind not in kinds:
            raise ConfigError(f"{where}: option {key} is for {' and '.join('device-' + k for k in kinds)}, "
                              f"not {kind}")
        values[key] = _number(where, key, raw, typ)
    device = _number(where, "device", opts["device"], int)
    try:
        fault = DeviceFault(kind=fault_kind, device=device, start=int(when.removeprefix("step")), **values)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    spec = FaultSpec(kind=kind, target=target, at_version=None, at_s=None, duration_s=None, text=text.strip(),
                     device_fault=fault)
    check_devices([spec], devices)
    return spec


def _number(where: str, key: str, raw: str, typ: type) -> Any:
    try:
        return typ(raw)
    except ValueError:
        raise ConfigError(f"{where}: option {key}={raw} is not {'an integer' if typ is int else 'a number'}"
                          ) from None


def host_device_count(env: Mapping[str, str] = os.environ) -> int | None:
    """The fake CPU devices each process started with ``env`` has (``--xla_force_host_platform_device_count``
    in its ``XLA_FLAGS``, the last one if repeated), or None where that flag is absent (the device count is
    then the backend's)."""
    found = _DEVICES_FLAG.findall(env.get("XLA_FLAGS", ""))
    return int(found[-1]) if found else None


def check_devices(faults: Sequence[FaultSpec], devices: int | None) -> None:
    """Raises ConfigError for a device fault whose device is not below ``devices`` (an island's device count;
    None: unknown, nothing to check: the worker refuses a device id it does not have)."""
    for f in faults:
        if f.device_fault is not None and devices is not None and f.device_fault.device >= devices:
            raise ConfigError(f"--fault {f.text!r}: device {f.device_fault.device} is not a device of {f.target} "
                              f"(it has {devices}: ids 0..{devices - 1})")
