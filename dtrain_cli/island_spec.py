"""The ``--island SPEC`` grammar of ``dtrain simulate``: one island's own settings, parsed and checked up front.

A spec is ``NAME:KEY=VALUE[,KEY=VALUE...]`` (repeatable, one island per flag or several flags per island):

- ``NAME``: an island of the run, ``island-0`` ... ``island-N-1``.
- ``SECTION.FIELD=VALUE``: a config field the island has of its own, one of
  :data:`dtrain.config.sections.PER_ISLAND_FIELDS` (how it computes: its batch size, chunk length, attention kernel,
  rematerialization, round length or H, mesh, ...), passed to its worker as ``--set``. A field of the config
  fingerprint (:meth:`dtrain.config.sections.Config.fingerprint_fields`: the model's shapes and dtype, the codecs) is
  refused here in one line: islands that differ there would train different models (the coordinator refuses
  them at Join too). Any other field is run-wide and refused as well.
- ``host_devices=N``: the island's fake CPU devices (its worker's ``XLA_FLAGS``; ``--host-devices`` for the
  others).
- ``slowdown=K`` (K >= 1): the island's every chunk of steps takes K times its measured compute time, a sleep
  after each chunk (``dtrain worker --slowdown``, :mod:`workers.pacing`): slower hardware, emulated.
- ``link=RATE/RTT`` (e.g. ``100mbit/100ms``): the island reaches the coordinator over a wide-area link of that
  bandwidth each way and round trip, emulated by a proxy (:mod:`dtrain_cli.link_proxy`); ``dtrain simulate
  --link`` gives every island one.
- ``credential=OTHER`` (with ``dtrain simulate --island-tokens``, which issues each island a token of its own):
  the island presents island OTHER's token instead of its own, the Sybil case: the coordinator refuses it at Join
  (PERMISSION_DENIED), and the driver counts it as refused (the summary's ``refused_islands``), not as a failure.

Example: ``--island island-2:train.batch_size=16,host_devices=2,slowdown=2 --island island-3:slowdown=4``.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dtrain.config.load import load_config, replace, to_toml
from dtrain.config.sections import PER_ISLAND_FIELDS, Config, ConfigError
from dtrain_cli.link_proxy import LinkError, LinkShape, parse_link

SLOWDOWN_HOW = "a sleep after each chunk of (K-1) x that chunk's measured compute time"


@dataclass
class IslandSpec:
    """One island's own settings (several ``--island`` flags for one island add up)."""

    name: str
    overrides: list[str] = field(default_factory=list)  # SECTION.FIELD=VALUE, as its worker's --set
    host_devices: int | None = None  # its fake CPU devices (None: the run's)
    slowdown: float = 1.0  # its chunks take this many times their compute time
    link: LinkShape | None = None  # its link to the coordinator (None: loopback as it is)
    credential: str = ""  # the island whose issued token it presents (simulate --island-tokens; "": its own)

    def describe(self) -> dict[str, object]:
        """The island's settings for the run's summary (the slowdown said as what it is: emulated)."""
        out: dict[str, object] = {"overrides": list(self.overrides)}
        if self.host_devices is not None:
            out["host_devices"] = self.host_devices
        if self.slowdown != 1.0:
            out["slowdown"] = self.slowdown
            out["slowdown_emulated_by"] = SLOWDOWN_HOW
        if self.link is not None:
            out["link"] = str(self.link)
        if self.credential:
            out["credential"] = self.credential
        return out


def parse_islands(texts: Sequence[str], islands: int, cfg: Config) -> dict[str, IslandSpec]:
    """The ``--island`` specs by island name; raises ConfigError naming the spec and what is wrong with it (an
    unknown island, a malformed pair, a fingerprint field, a run-wide field, a value the config refuses)."""
    specs: dict[str, IslandSpec] = {}
    fingerprint = set(cfg.fingerprint_fields())
    for text in texts:
        name, sep, rest = text.partition(":")
        if not sep or not rest:
            raise ConfigError(f"--island {text}: expected NAME:KEY=VALUE[,KEY=VALUE...], e.g. "
                              f"island-2:train.batch_size=8,host_devices=2")
        names = {f"island-{i}" for i in range(islands)}
        if name not in names:
            raise ConfigError(f"--island {text}: no island {name!r} in this run (island-0 ... island-{islands - 1})")
        spec = specs.setdefault(name, IslandSpec(name))
        for pair in rest.split(","):
            key, eq, value = pair.partition("=")
            key, value = key.strip(), value.strip()
            if not eq or not key or not value:
                raise ConfigError(f"--island {text}: {pair!r} is not KEY=VALUE")
            if key == "host_devices":
                if not value.isdigit() or int(value) < 1:
                    raise ConfigError(f"--island {text}: host_devices must be an integer >= 1, got {value!r}")
                spec.host_devices = int(value)
            elif key == "slowdown":
                try:
                    k = float(value)
                except ValueError:
                    k = math.nan
                if not (math.isfinite(k) and k >= 1.0):
                    raise ConfigError(f"--island {text}: slowdown must be a finite number >= 1, got {value!r}")
                spec.slowdown = k
            elif key == "credential":
                if value not in names:
                    raise ConfigError(f"--island {text}: credential must name an island of this run (island-0 ... "
                                      f"island-{islands - 1}), got {value!r}")
                spec.credential = value if value != name else ""
            elif key == "link":
                try:
                    spec.link = parse_link(value)
                except LinkError as e:
                    raise ConfigError(f"--island {text}: {e}") from None
            elif key in fingerprint:
                raise ConfigError(f"--island {text}: {key} is in the config fingerprint: every island must train "
                                  f"the same model (set it for the whole run with --set)")
            elif key not in PER_ISLAND_FIELDS:
                raise ConfigError(f"--island {text}: {key} is not a per-island setting (per-island: "
                                  f"{', '.join(PER_ISLAND_FIELDS)}, host_devices, slowdown, link, credential)")
            else:
                spec.overrides.append(f"{key}={value}")
    for spec in specs.values():  # each island's config must load (its batch over its mesh, ...)
        island_config(run_config(cfg, specs), spec, f"--island {spec.name}")
    return specs


def run_config(cfg: Config, specs: dict[str, IslandSpec]) -> Config:
    """The run's config with islands of their own batch size: ``train.base_batch_size`` pinned to the run's
    batch (unless set), so every shard, lr schedule and step round counts the same tokens."""
    differ = any(o.startswith("train.batch_size=") for s in specs.values() for o in s.overrides)
    if differ and not cfg.train.base_batch_size:
        return replace(cfg, train={"base_batch_size": cfg.train.batch_size})
    return cfg


def island_config(cfg: Config, spec: IslandSpec, origin: str) -> Config:
    """The run's ``cfg`` with ``spec``'s overrides applied as its worker applies them (``--set`` on the run's
    resolved config.toml) and validated; ConfigError names ``origin``."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.toml"
        path.write_text(to_toml(cfg))
        try:
            return load_config(path, spec.overrides)
        except ConfigError as e:
            raise ConfigError(f"{origin}: {str(e).replace(str(path), 'the run config')}") from None
