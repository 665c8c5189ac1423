"""dtrain.data.mixture: data.sources, a deterministic interleaving of token stores by weight, audited per source."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from dtrain.audit import AuditParams, audit
from dtrain.config.load import load_config
from dtrain.config.sections import ConfigError
from dtrain.data.corpus import DataError, SequenceStream, Span, split
from dtrain.data.mixture import (
    MixedStream,
    Schedule,
    mixture_eval_batches,
    mixture_shards,
    open_mixture,
    source_names,
)
from dtrain.data.token_store import StoreWriter
from simulate_helpers import NO_FAKE_DEVICES

ROOT = Path(__file__).resolve().parent.parent


def _store(path: Path, tokens: int, seed: int, vocab: int = 256, offset: int = 0) -> str:
    """A store of random ids in [offset, offset + 64) (each source its own range: a row says its source)."""
    rng = np.random.default_rng(seed)
    w = StoreWriter(path, vocab_size=vocab, chunk_tokens=4096)
    for _ in range(tokens // 500):
        w.add_document(rng.integers(offset, offset + 64, size=500))
    w.close()
    return str(path)


def _mixture_overrides(tmp_path: Path, weights: tuple[float, ...] = (6, 3, 1), tokens: int = 20_000) -> list[str]:
    stores = [_store(tmp_path / name, tokens, k, offset=64 * k) for k, name in enumerate(("web", "code", "books"))]
    tables = ", ".join(f'{{path = "{p}", weight = {w}}}' for p, w in zip(stores, weights, strict=True))
    return [f"data.sources=[{tables}]", "data.max_bytes=0"]


def test_the_schedule_holds_each_share_at_every_prefix_and_is_the_same_every_time() -> None:
    weights = (0.7, 0.2, 0.1)
    s = Schedule(weights)
    again = Schedule(weights)
    assert np.array_equal(s.order, again.order)
    n = 5 * s.period + 123
    source, index = s.picks(0, n)
    assert np.array_equal(source, again.picks(0, n)[0])
    seen = np.zeros(3, np.int64)
    for c in range(n):  # counts(c) is what the picks before c hold, and each source's index runs 0, 1, 2, ...
        assert np.array_equal(s.counts(c), seen)
        assert index[c] == seen[source[c]]
        seen[source[c]] += 1
        assert np.all(np.abs(seen - (c + 1) * np.array(weights)) < 1.0), (c, seen)
    # the picks of any window are the same as those of the whole: a resumed cursor reads the same
    assert np.array_equal(s.picks(777, 50)[0], source[777:827]) and np.array_equal(s.picks(777, 50)[1],
                                                                                     index[777:827])
    assert s.ranges(100, 300) == [(int(a), int(b)) for a, b in zip(s.counts(100), s.counts(300), strict=True)]
    # weights are relative: 7, 2, 1 is 0.7, 0.2, 0.1
    assert np.array_equal(Schedule((7, 2, 1)).order, s.order)
    with pytest.raises(ValueError, match="below 1/1000"):
        Schedule((1.0, 1e-4))


def test_a_mixed_stream_reads_each_source_in_its_own_order_and_resumes_exactly(tmp_path: Path) -> None:
    cfg = load_config(ROOT / "configs" / "tiny.toml", [f"run.out_dir={tmp_path}", *_mixture_overrides(tmp_path)])
    mix = open_mixture(cfg.data, cfg.model.vocab_size, tmp_path / "cache")
    assert source_names(cfg.data) == ["web", "code", "books"]
    shards = mixture_shards(mix, 3, cfg.model.seq_len, cfg.run.seed, cfg.data.eval_fraction)
    stream = shards[1].stream
    assert isinstance(stream, MixedStream)
    whole = stream.batches(0, 6, 50).reshape(300, -1)
    pieces = np.concatenate([stream.batches(c, 1, 50)[0] for c in range(0, 300, 50)])
    assert np.array_equal(whole, pieces)  # resuming at any cursor reads the same rows
    source, index = mix.schedule.picks(0, 300)
    for k, corpus in enumerate(mix.corpora):  # row c is sequence index[c] of its source's own shard stream
        train = split(corpus, cfg.data.eval_fraction, cfg.model.seq_len).train
        size = len(train) // 3
        own = SequenceStream(corpus, cfg.model.seq_len, seed=(cfg.run.seed * 7919 + k) * 1_000_003 + 1,
                             span=Span(train.start + size, train.start + 2 * size))
        rows = whole[source == k]
        assert np.array_equal(rows, own.batches(0, 1, rows.shape[0])[0])
        assert np.all((rows >= 64 * k) & (rows < 64 * (k + 1)))  # and it holds that source's ids
    assert np.array_equal(np.bincount(source, minlength=3), [180, 90, 30])


def test_a_mixture_keeps_documents_apart_with_document_masking(tmp_path: Path) -> None:
    """data.document_masking over a mixture: every row carries its positions, restarting at each document of its
    own source (500-token documents), in training batches and in the eval batches alike."""
    sources = _mixture_overrides(tmp_path)
    cfg = load_config(ROOT / "configs" / "tiny.toml", [f"run.out_dir={tmp_path}", *sources,
                                                       "data.document_masking=true"])
    mix = open_mixture(cfg.data, cfg.model.vocab_size, tmp_path / "cache")
    stream = mixture_shards(mix, 3, cfg.model.seq_len, cfg.run.seed, cfg.data.eval_fraction)[0].stream
    rows = stream.batches(0, 2, 40)
    assert rows.shape == (2, 40, 2, cfg.model.seq_len + 1)
    ids, positions = rows[..., 0, :], rows[..., 1, :]
    plain = load_config(ROOT / "configs" / "tiny.toml", [f"run.out_dir={tmp_path}", *sources])
    plain_mix = open_mixture(plain.data, plain.model.vocab_size, tmp_path / "cache")
    same = mixture_shards(plain_mix, 3, plain.model.seq_len, plain.run.seed, plain.data.eval_fraction)[0].stream
    assert np.array_equal(ids, same.batches(0, 2, 40))  # the same ids as without masking
    steps = np.diff(positions, axis=-1)
    assert np.all((steps == 1) | (positions[..., 1:] == 0))  # counts up, or restarts at a document's start
    assert np.any(positions[..., 1:] == 0)  # some window crosses a document end
    evals = mixture_eval_batches(mix, cfg.model.seq_len, 4, 2, cfg.data.eval_fraction)
    assert evals.shape == (2, 4, 2, cfg.model.seq_len + 1)


def test_bad_mixtures_are_refused_with_one_line(tmp_path: Path) -> None:
    tiny = ROOT / "configs" / "tiny.toml"
    cases = [
        (["data.source=/x", 'data.sources=[{path = "/a"}]'], "[data] sources: given with data.source = '/x'"),
        (['data.sources=[{path = "/a", weight = -1}]'], "[data] sources[0].weight: must be a number > 0"),
        (['data.sources=[{path = "/a/s"}, {path = "/b/s"}]'], "[data] sources[1].name: 's' names two sources"),
        (['data.sources=[{path = "/a", weight = 1}, {path = "/b", weight = 1e-5}]'],
         "[data] sources[1].weight: 1e-05 is 1e-05 of the total"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError) as e:
            load_config(tiny, overrides)
        assert message in str(e.value) and "\n" not in str(e.value)
    web = _store(tmp_path / "web", 5000, 0)
    wide = _store(tmp_path / "wide", 5000, 1, vocab=300)
    for sources, message in [
        (f'[{{path = "{web}"}}, {{path = "{tmp_path / "nothing"}"}}]',
         f"data.sources[1] (nothing): '{tmp_path / 'nothing'}' is not a token store"),
        (f'[{{path = "{web}"}}, {{path = "{wide}"}}]', "data.sources[1] (wide): its vocabulary differs"),
    ]:
        cfg = load_config(tiny, [f"data.sources={sources}", "data.max_bytes=0", "model.vocab_size=512"])
        with pytest.raises(DataError) as d:
            open_mixture(cfg.data, cfg.model.vocab_size, tmp_path / "cache")
        assert message in str(d.value) and "\n" not in str(d.value)


def _merged(*pushes: tuple[int, int, int]) -> list[dict[str, object]]:
    return [{"event": "round_merged", "version": v + 1, "pushes": [
        {"push_id": f"p{v}", "shard": 0, "start": a, "end": b, "steps": 1}]} for v, (a, b, _) in enumerate(pushes)]


def test_the_audit_accounts_each_source_of_a_mixture() -> None:
    schedule = Schedule((0.5, 0.3, 0.2))
    params = AuditParams(seq_len=4, shards=1, shard_end=100, sources=("a", "b", "c"),
                         source_ranges=schedule.ranges)
    exact = audit(_merged((0, 40, 0), (40, 100, 0)), {}, params)
    assert {k: (v.merged_tokens, v.lost_tokens, v.doubled_tokens) for k, v in exact.sources.items()} == {
        "a": (200, 0, 0), "b": (120, 0, 0), "c": (80, 0, 0)}
    # sequences 40..60 lost and 80..90 merged twice: each source's part of them, in its own sequences
    faulty = audit(_merged((0, 40, 0), (60, 90, 0), (80, 100, 0)), {}, params)
    lost = {k: v.lost_tokens for k, v in faulty.sources.items()}
    doubled = {k: v.doubled_tokens for k, v in faulty.sources.items()}
    assert sum(lost.values()) == faulty.lost_tokens == 20 * 4 and sum(doubled.values()) == faulty.doubled_tokens
    for k, name in enumerate(params.sources):
        a, b = schedule.ranges(40, 60)[k]
        assert [(g.start, g.end) for g in faulty.sources[name].gaps] == [(a, b)]
        assert lost[name] == (b - a) * 4
    assert "sources" in faulty.to_dict() and "sources" not in audit(
        _merged((0, 100, 0)), {}, dataclasses.replace(params, sources=(), source_ranges=None)).to_dict()


@pytest.mark.slow  # ~40 s of worker processes
def test_a_three_source_run_is_exactly_once_per_source_through_a_kill_and_a_rewind(tmp_path: Path) -> None:
    """Three islands on a mixture of three stores (6 : 3 : 1): island-1 is SIGKILLed after version 1 for good (its
    shard taken over and split by the survivors) and island-0's push after version 3 is NaN (refused; the island
    rewinds and trains that range again). The audit finds every sequence of every source of every shard merged
    exactly once, each source's tokens in its share of the whole, and the coordinator's status says the same."""
    from dtrain.runlog import read_events
    from dtrain_cli.fault_spec import parse_fault
    from dtrain_cli.simulate import run_simulation

    cfg = load_config(ROOT / "configs" / "tiny.toml", [f"run.out_dir={tmp_path}", "outer.islands=3",
                                                        *_mixture_overrides(tmp_path)])
    s = run_simulation(cfg, 3, quiet=True, env=NO_FAKE_DEVICES, timeout_s=300,
                       faults=[parse_fault("kill:island-1@v1", 3), parse_fault("nan:island-0@v3", 3)])
    a = s["audit"]
    assert a["lost_tokens"] == 0 and a["doubled_tokens"] == 0 and not a["gaps"] and not a["overlaps"], a
    per = a["sources"]
    assert set(per) == {"web", "code", "books"}
    for name, source in per.items():
        assert source["lost_tokens"] == 0 and source["doubled_tokens"] == 0, (name, source)
        assert not source["gaps"] and not source["overlaps"], (name, source)
    shard_tokens = cfg.train.steps * cfg.train.batch_size * cfg.model.seq_len
    assert sum(s["source_tokens"].values()) == 3 * shard_tokens
    for name, share in (("web", 0.6), ("code", 0.3), ("books", 0.1)):
        assert abs(s["source_tokens"][name] / (3 * shard_tokens) - share) < 0.01
    assert [f["fault"] for f in s["faults"]] == ["kill:island-1@v1", "nan:island-0@v3"]
    assert s["faults"][1]["recovery"].startswith("the island rewound to cursor")
    stopped = [e for e in read_events(s["run_dir"]) if e["event"] == "coordinator_stopped"]
    assert stopped and stopped[-1]["source_tokens"] == s["source_tokens"]
