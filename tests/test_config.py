"""Config loading, validation, ``--set`` overrides and round trips."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import jax
import pytest

from conftest import CONFIG_DIR, TINY
from dtrain.config.load import load_config, parse_override, replace, resolve_config_path, to_toml
from dtrain.config.sections import SECTIONS, Config, ConfigError
from dtrain.steps.inner import make_mesh

ALL_CONFIGS = sorted(CONFIG_DIR.glob("*.toml"))


def test_repo_has_configs():
    assert {p.stem for p in ALL_CONFIGS} >= {"tiny", "small", "gpt-125m", "gpt-350m", "gpt-1b", "llama-tiny",
                                             "llama-small", "llama-150m", "llama-1b", "llama-8b"}


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=lambda p: p.stem)
def test_every_repo_config_loads(path: Path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    raw = tomllib.loads(path.read_text())
    # Every value written in the file is what the config holds.
    for section, values in raw.items():
        for key, value in values.items():
            assert getattr(getattr(cfg, section), key) == value, (section, key)
    assert cfg.run.name == raw.get("run", {}).get("name", path.stem)
    assert cfg.train.batch_size % (max(cfg.mesh.data, 1) * cfg.mesh.fsdp) == 0


def test_defaults_and_name_from_file_stem(tmp_path: Path):
    assert load_config() == Config(run=dataclasses.replace(Config().run, name="run"))
    p = tmp_path / "my-exp.toml"
    p.write_text("[train]\nsteps = 100\n")
    cfg = load_config(p)
    assert cfg.run.name == "my-exp"
    assert cfg.train.steps == 100 and cfg.train.lr == Config().train.lr


def test_tiny_values():
    cfg = load_config(TINY)
    assert (cfg.model.seq_len, cfg.model.d_model, cfg.model.n_layers, cfg.model.n_heads) == (32, 32, 1, 2)
    assert (cfg.train.steps, cfg.train.batch_size, cfg.outer.inner_steps) == (60, 8, 20)
    assert cfg.rounds == 3
    assert load_config(TINY, ["train.steps=50"]).rounds == 3  # ceil(50 / 20)
    assert load_config(TINY, ["train.steps=40"]).rounds == 2


def test_int_widens_to_float(tmp_path: Path):
    p = tmp_path / "c.toml"
    p.write_text("[train]\nlr = 1\n")
    cfg = load_config(p)
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)


# (toml text, the "[section] field" the message must name)
BAD_FILES = [
    ("[bogus]\nx = 1\n", "[bogus]"),
    ("train = 3\n", "[train]"),
    ("[train]\nfoo = 1\n", "[train] foo"),
    ("[model]\nd_modle = 64\n", "[model] d_modle"),
    ('[train]\nlr = "fast"\n', "[train] lr"),
    ("[train]\nsteps = 1.5\n", "[train] steps"),
    ("[train]\nsteps = true\n", "[train] steps"),
    ("[train]\nbatch_size = false\n", "[train] batch_size"),
    ("[outer]\nnesterov = 1\n", "[outer] nesterov"),
    ("[run]\nname = 3\n", "[run] name"),
    ("[data]\nsource = [1, 2]\n", "[data] source"),
    ("[train]\nbatch_size = 10\n[mesh]\ndata = 4\n", "[train] batch_size"),
    ("[train]\nbatch_size = 12\n[mesh]\ndata = 2\nfsdp = 4\n", "[train] batch_size"),
    ("[train]\nbatch_size = 6\n[mesh]\nfsdp = 4\n", "[train] batch_size"),
    ("[outer]\ninner_steps = 0\n", "[outer] inner_steps"),
    ("[outer]\nmomentum = 1.0\n", "[outer] momentum"),
    ("[model]\nd_model = 64\nn_heads = 3\n", "[model] n_heads"),
    ("[train]\nsteps = 100\nwarmup_steps = 100\n", "[train] warmup_steps"),
    ("[train]\nsteps = 100\nwarmup_steps = 150\n", "[train] warmup_steps"),
    ("[data]\neval_fraction = 0.0\n", "[data] eval_fraction"),
    ("[data]\neval_fraction = 0.5\n", "[data] eval_fraction"),
    ("[data]\neval_fraction = -0.1\n", "[data] eval_fraction"),
    ("[data]\neval_fraction = 1.5\n", "[data] eval_fraction"),
    ("[data]\ntokenizer = \"bpe:100\"\n", "[data] tokenizer"),
    ("[data]\ntokenizer = \"gpt2\"\n", "[data] tokenizer"),
    ("[data]\nread_timeout_s = 0\n", "[data] read_timeout_s"),
    ('[model]\nkind = "rnn"\n', "[model] kind"),
    ('[model]\ndtype = "float16"\n', "[model] dtype"),
    ("[model]\nvocab_size = 2147483649\n", "[model] vocab_size"),
    ('[model]\nkind = "llama"\nn_heads = 4\nn_kv_heads = 3\n', "[model] n_kv_heads"),
    ('[model]\nkind = "llama"\nn_kv_heads = -1\n', "[model] n_kv_heads"),
    ('[model]\nkind = "llama"\nd_model = 60\nn_heads = 4\n', "[model] n_heads"),
    ('[model]\nkind = "llama"\nrope_theta = 0.0\n', "[model] rope_theta"),
    ('[model]\nkind = "llama"\nnorm_eps = 0.0\n', "[model] norm_eps"),
    ('[model]\nkind = "llama"\nmlp_hidden = -1\n', "[model] mlp_hidden"),
    ("[model]\nn_kv_heads = 2\n", "[model] n_kv_heads"),
    ("[model]\ntie_embeddings = true\n", "[model] tie_embeddings"),
    ('[model]\nkind = "mlp"\nrope_theta = 500000.0\n', "[model] rope_theta"),
    ("[model]\nseq_len = 0\n", "[model] seq_len"),
    ("[train]\nlr = 0.0\n", "[train] lr"),
    ("[train]\nb2 = 1.0\n", "[train] b2"),
    ("[train]\nmin_lr_ratio = 1.5\n", "[train] min_lr_ratio"),
    ("[train]\nsteps_per_call = 0\n", "[train] steps_per_call"),
    ("[outer]\nmomentum = 1.0\n", "[outer] momentum"),
    ("[outer]\nlr = -0.7\n", "[outer] lr"),
    ("[outer]\nislands = 0\n", "[outer] islands"),
    ("[outer]\nstaleness_alpha = -1.0\n", "[outer] staleness_alpha"),
    ("[run]\nlog_every = 0\n", "[run] log_every"),
    ("[run]\ncheckpoint_every = -5\n", "[run] checkpoint_every"),
    ("[mesh]\ndata = 0\n", "[mesh] data"),
    ("[mesh]\ndata = -2\n", "[mesh] data"),
    ("[mesh]\nfsdp = 0\n", "[mesh] fsdp"),
    ("[worker]\nheartbeat_s = 2.5\n", "[worker] heartbeat_s"),  # more than half of the default 4 s lease
    ("[coordinator]\nlease_s = 1.5\n", "[worker] heartbeat_s"),  # the default 1 s heartbeat: over half of it
    ("[health]\nknown_answer_every = -1\n", "[health] known_answer_every"),
    ("[health]\nreplay_every = -10\n", "[health] replay_every"),
    ("[health]\nz_max = 0.0\n", "[health] z_max"),
    ("[health]\nz_max = inf\n", "[health] z_max"),
    ("[health]\nmin_devices = 0\n", "[health] min_devices"),
    ("[health]\nstats = 1\n", "[health] stats"),
    ("[codec]\nup_zstd_level = -8\n", "[codec] up_zstd_level"),
    ("[codec]\nup_zstd_level = 20\n", "[codec] up_zstd_level"),
]


@pytest.mark.parametrize("text,field", BAD_FILES, ids=[f"{i}:{f}" for i, (_, f) in enumerate(BAD_FILES)])
def test_bad_config_names_field_and_file(tmp_path: Path, text: str, field: str):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert field in msg, msg
    assert str(p) in msg, msg


def test_valid_edge_values_pass(tmp_path: Path):
    p = tmp_path / "ok.toml"
    p.write_text("[train]\nsteps = 100\nwarmup_steps = 99\nbatch_size = 8\n[outer]\ninner_steps = 100\n"
                 "momentum = 0.0\n[data]\neval_fraction = 0.49\n[model]\nvocab_size = 2147483648\n[mesh]\ndata = 2\n"
                 "fsdp = 4\n")
    cfg = load_config(p)
    assert cfg.rounds == 1 and cfg.mesh.fsdp == 4


@pytest.mark.parametrize("text,expected", [
    ("train.lr=3e-4", ("train", "lr", 3e-4)),
    ("train.lr = 0.5", ("train", "lr", 0.5)),
    ("train.steps=10", ("train", "steps", 10)),
    ("train.steps=1_000", ("train", "steps", 1000)),
    ("outer.nesterov=false", ("outer", "nesterov", False)),
    ("outer.nesterov=true", ("outer", "nesterov", True)),
    ("run.name=hello", ("run", "name", "hello")),
    ('run.name="quoted name"', ("run", "name", "quoted name")),
    ("data.source=/some/where/file.txt", ("data", "source", "/some/where/file.txt")),
    ("run.name=a=b", ("run", "name", "a=b")),
])
def test_parse_override(text: str, expected: tuple):
    got = parse_override(text)
    assert got == expected
    assert type(got[2]) is type(expected[2])


@pytest.mark.parametrize("text", ["foo", "train.lr", "lr=3e-4", "train.=1", ".lr=1", "a.b.c=1", "=1"])
def test_malformed_override(text: str):
    with pytest.raises(ConfigError) as ei:
        parse_override(text)
    assert "--set" in str(ei.value) and text in str(ei.value)


def test_overrides_apply_and_validate():
    cfg = load_config(TINY, ["train.lr=3e-4", "outer.nesterov=false", "run.name=abc", "train.steps=80",
                             "model.kind=mlp"])
    assert cfg.train.lr == 3e-4 and cfg.outer.nesterov is False and cfg.run.name == "abc"
    assert cfg.train.steps == 80 and cfg.model.kind == "mlp"
    assert cfg.model.d_model == 32  # the file's values stay
    # a later --set wins
    assert load_config(TINY, ["train.steps=80", "train.steps=90"]).train.steps == 90


@pytest.mark.parametrize("override,field", [
    ("train.lr=fast", "[train] lr"),
    ("train.steps=1.5", "[train] steps"),
    ("train.bogus=1", "[train] bogus"),
    ("train.warmup_steps=60", "[train] warmup_steps"),
    ("outer.inner_steps=0", "[outer] inner_steps"),
    ("model.n_heads=3", "[model] n_heads"),
    ("coordinator.stream_window_bytes=1000", "[coordinator] stream_window_bytes"),
    ("coordinator.stream_idle_s=0", "[coordinator] stream_idle_s"),
    ("coordinator.stream_idle_s=inf", "[coordinator] stream_idle_s"),
    ("coordinator.max_streams_per_peer=-1", "[coordinator] max_streams_per_peer"),
    ("coordinator.max_streams_per_island=0", "[coordinator] max_streams_per_island"),
    ("nope.x=1", "nope"),
])
def test_bad_override_names_field(override: str, field: str):
    with pytest.raises(ConfigError) as ei:
        load_config(TINY, [override])
    msg = str(ei.value)
    assert field in msg and "--set" in msg, msg


def test_missing_config_file(tmp_path: Path):
    p = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert str(p) in str(ei.value) and "not found" in str(ei.value)


def test_config_by_bare_name():
    assert resolve_config_path("tiny").resolve() == TINY.resolve()
    assert load_config("tiny") == load_config(TINY)


def test_invalid_toml(tmp_path: Path):
    p = tmp_path / "broken.toml"
    p.write_text("[train\nlr = \n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert str(p) in str(ei.value) and "TOML" in str(ei.value)


def test_replace_revalidates():
    cfg = load_config(TINY)
    assert replace(cfg, train={"steps": 100}).train.steps == 100
    with pytest.raises(ConfigError, match=r"\[train\] warmup_steps"):
        replace(cfg, train={"steps": 5})


def test_make_mesh_checks_batch_against_devices():
    assert len(jax.devices()) == 8
    cfg = load_config(TINY, ["train.batch_size=12"])  # valid at load time: mesh.data=-1 fixes nothing
    with pytest.raises(ConfigError) as ei:
        make_mesh(cfg)
    assert "[train] batch_size" in str(ei.value) and "12" in str(ei.value)
    # the same batch is fine on 4 (or 1) devices
    assert make_mesh(cfg, devices=jax.devices()[:4]).shape == {"data": 4, "fsdp": 1}
    assert make_mesh(cfg, devices=jax.devices()[:1]).shape == {"data": 1, "fsdp": 1}
    mesh = make_mesh(load_config(TINY, ["mesh.fsdp=2"]))
    assert mesh.shape == {"data": 4, "fsdp": 2}
    with pytest.raises(ConfigError, match=r"\[mesh\]"):
        make_mesh(load_config(TINY, ["train.batch_size=16", "mesh.data=16"]))


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=lambda p: p.stem)
def test_to_toml_round_trip(tmp_path: Path, path: Path):
    cfg = load_config(path)
    out = tmp_path / "resolved.toml"
    out.write_text(to_toml(cfg))
    assert load_config(out) == cfg


def test_to_toml_round_trip_non_defaults(tmp_path: Path):
    cfg = load_config(TINY, ["train.lr=3e-4", "outer.nesterov=false", 'run.name="odd \\"name\\" é"',
                             "data.source=/x/y z.txt", "outer.staleness_alpha=0.25", "train.min_lr_ratio=1e-5"])
    text = to_toml(cfg)
    # every field of every section is written, with its comment
    for cls in SECTIONS.values():
        for f in dataclasses.fields(cls):
            assert any(line.startswith(f"{f.name} = ") and f.metadata["help"] in line for line in text.splitlines())
    out = tmp_path / "resolved.toml"
    out.write_text(text)
    again = load_config(out)
    assert again == cfg
    assert again.run.name == 'odd "name" é'


def test_set_on_a_string_field_keeps_the_text_as_typed():
    cfg = load_config(TINY, ["run.name=2024-01-01", "data.source=123"])
    assert cfg.run.name == "2024-01-01" and cfg.data.source == "123"


def test_h_larger_than_steps_is_refused_at_load():
    """docs/configuration.md: H > steps fails at load time, naming the field (H = steps is one round: the edge
    case test)."""
    with pytest.raises(ConfigError, match=r"\[outer\] inner_steps: must be <= train.steps \(30\), got 50"):
        load_config(TINY, ["train.steps=30", "outer.inner_steps=50"])
    assert load_config(TINY, ["train.steps=30", "outer.inner_steps=30"]).rounds == 1


def test_merge_rule_auto_is_the_screened_mean_or_with_sparse_pushes_the_clipped_mean():
    """The robust default must not discard SparseLoCo's pushes: a per-coordinate median of sparse pushes keeps
    only the entries most pushes hold (few), so auto picks the clipped mean there, and an explicit median,
    trimmed mean or screened mean (screened against the coordinate median) with a sparse codec.up is refused
    naming the field. min_cosine is a cosine: in [-1, 1)."""
    from dtrain.config.derived import merge_rule

    assert merge_rule(load_config(TINY)) == "screened_mean"
    assert merge_rule(load_config(TINY, ["codec.up=sparse"])) == "clipped_mean"
    assert merge_rule(load_config(TINY, ["coordinator.merge_rule=mean", "codec.up=sparse"])) == "mean"
    for rule in ("median", "trimmed_mean", "screened_mean"):
        with pytest.raises(ConfigError, match=r"coordinator.*merge_rule.*sparse pushes"):
            load_config(TINY, [f"coordinator.merge_rule={rule}", "codec.up=sparse"])
    assert load_config(TINY).coordinator.min_cosine == 0.0
    assert load_config(TINY, ["coordinator.min_cosine=-1"]).coordinator.min_cosine == -1.0
    for bad in ("1", "-1.5", "nan"):
        with pytest.raises(ConfigError, match=r"\[coordinator\] min_cosine: must be a finite number in \[-1, 1\)"):
            load_config(TINY, [f"coordinator.min_cosine={bad}"])
