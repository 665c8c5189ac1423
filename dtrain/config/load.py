"""Loading a config: a TOML file (or a bare name from configs/), ``--set section.field=value`` overrides on top,
validated once; the resolved config back as TOML, and the reference table of every field."""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
import typing
from pathlib import Path
from typing import Any

from dtrain import schema
from dtrain.config.checks import check
from dtrain.config.hf_fields import HFConfigError, model_fields, read_config_json, reconcile
from dtrain.config.sections import REMAT_LEGACY, REPO_CONFIG_DIR, ROUND_AUTO, SECTIONS, Config, ConfigError, ModelConfig


def _build_section(cls: type, values: dict[str, Any], origin: str, section: str) -> Any:
    """One section from its TOML table: field types checked by ``dtrain.schema``, missing fields defaulted."""
    try:
        return schema.load(cls, values, partial=True)
    except schema.SchemaError as e:
        raise ConfigError(f"{origin}: [{section}] {schema.format_path(e.path)}: {e.why}") from None


def parse_override(text: str) -> tuple[str, str, Any]:
    """Parses ``section.field=value``; the value is read as a TOML literal, else a string."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.field=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set {text!r}: the key must be section.field, e.g. train.lr=3e-4")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return parts[0], parts[1], value


def _from_folder(model: ModelConfig, explicit: set[str], where: str) -> ModelConfig:
    """``model.init_from``'s config.json honoured, where the folder is there (an island's config may name a path
    that is not: islands receive θ_0 from the coordinator): the [model] fields it sets are taken from it, one the
    config or a --set gives otherwise is refused (:func:`dtrain.config.hf_fields.reconcile`)."""
    try:
        raw = read_config_json(Path(model.init_from).expanduser())
        return model if raw is None else reconcile(model, model_fields(raw), explicit, model.init_from)
    except HFConfigError as e:
        raise ConfigError(f"{where}: [model] init_from {model.init_from}: {e}") from None


def resolve_config_path(path: str | Path) -> Path:
    """A path as given, else a bare name like ``tiny`` from the repo's configs/ folder."""
    p = Path(path)
    if p.exists():
        return p
    for candidate in (Path("configs") / f"{p.name}.toml", REPO_CONFIG_DIR / p.name, REPO_CONFIG_DIR / f"{p.name}.toml"):
        if candidate.exists():
            return candidate
    names = sorted({c.stem for d in (Path("configs"), REPO_CONFIG_DIR) if d.is_dir() for c in d.glob("*.toml")})
    close = difflib.get_close_matches(p.stem, names, n=1)
    raise ConfigError(f"{path}: config file not found, nor a config name (configs/: {', '.join(names) or 'none'})"
                      + (f"; did you mean {close[0]}?" if close else ""))


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Loads a TOML config (or the defaults), applies ``--set`` overrides, validates."""
    raw: dict[str, Any] = {}
    origin = "<defaults>"
    if path is not None:
        p = resolve_config_path(path)
        origin = str(p)
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{origin}: not valid TOML: {e}") from None
        except OSError as e:
            raise ConfigError(f"{origin}: cannot read: {e.strerror}") from None
    for section, values in raw.items():
        if section not in SECTIONS:
            raise ConfigError(f"{origin}: unknown section [{section}] (known: {', '.join(SECTIONS)})")
        if not isinstance(values, dict):
            raise ConfigError(f"{origin}: [{section}] must be a table")
    merged = {s: dict(raw.get(s, {})) for s in SECTIONS}
    for text in overrides:
        section, name, value = parse_override(text)
        if section not in SECTIONS:
            raise ConfigError(f"--set {text}: unknown section {section!r} (known: {', '.join(SECTIONS)})")
        if typing.get_type_hints(SECTIONS[section]).get(name) is str and not isinstance(value, str):
            value = text.split("=", 1)[1].strip()  # a string field takes the text as typed: --set run.name=2024
        merged[section][name] = value
    where = origin + (" + --set" if overrides else "")
    remat = merged["model"].get("remat")
    if isinstance(remat, (bool, str)) and remat in REMAT_LEGACY:  # a bool, as model.remat was: true is full
        merged["model"]["remat"] = REMAT_LEGACY[remat]
    if merged["worker"].get("round_seconds") == "auto":
        merged["worker"]["round_seconds"] = ROUND_AUTO
    sections = {s: _build_section(cls, merged[s], where, s) for s, cls in SECTIONS.items()}
    if sections["model"].init_from:
        sections["model"] = _from_folder(sections["model"], set(merged["model"]), where)
    cfg = Config(**sections)
    if not cfg.run.name:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name=Path(origin).stem if path else "run"))
    check(cfg, where)
    return cfg


def replace(cfg: Config, **sections: dict[str, Any]) -> Config:
    """Returns cfg with some fields replaced, e.g. ``replace(cfg, train={"steps": 10})``; re-validated."""
    new = {s: dataclasses.replace(getattr(cfg, s), **v) for s, v in sections.items()}
    out = dataclasses.replace(cfg, **new)
    check(out, "<replace>")
    return out


def _toml_literal(value: Any) -> str:
    """A field's value as a TOML literal: JSON's for scalars and lists of them (a TOML literal too), inline
    tables for a list of dataclasses (data.sources)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_literal(v) for v in value) + "]"
    if dataclasses.is_dataclass(value):
        return "{" + ", ".join(f"{f.name} = {_toml_literal(getattr(value, f.name))}"
                               for f in dataclasses.fields(value)) + "}"
    return json.dumps(value)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML, each field with its comment."""
    lines = []
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]")
        for f in dataclasses.fields(cls):
            value = getattr(getattr(cfg, section), f.name)
            lines.append(f"{f.name} = {_toml_literal(value)}  # {f.metadata['help']}")
        lines.append("")
    return "\n".join(lines)


def run_path(cfg: Config) -> Path:
    """Where a run writes: OUT_DIR/NAME."""
    return Path(cfg.run.out_dir) / cfg.run.name


def data_cache(cfg: Config) -> Path:
    """Where sources that are not token stores become stores: ``data.cache``, else OUT_DIR/data-cache."""
    return Path(cfg.data.cache).expanduser() if cfg.data.cache else Path(cfg.run.out_dir) / "data-cache"


def reference_markdown() -> str:
    """The config reference table of docs/configuration.md, generated from the dataclasses."""
    rows = ["| field | default | meaning |", "| --- | --- | --- |"]
    defaults = Config()
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            value = getattr(getattr(defaults, section), f.name)
            lit = str(value).lower() if isinstance(value, bool) else json.dumps(value)
            choices = f.metadata.get("choices")
            extra = f" (one of {', '.join(map(str, choices))})" if choices else ""
            rows.append(f"| `{section}.{f.name}` | `{lit}` | {f.metadata['help']}{extra} |")
    return "\n".join(rows)
