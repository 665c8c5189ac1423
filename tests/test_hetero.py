"""Islands that differ: per-island settings (dtrain_cli/island_spec.py), batch-scaled step counts
(train.base_batch_size), the auto round length (workers/pacing.py), and two islands of different batch size and
device count through a real coordinator."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtrain.config.load import load_config
from dtrain.config.sections import ROUND_AUTO, ConfigError
from dtrain.runlog import read_events
from dtrain_cli.island_spec import island_config, parse_islands, run_config
from dtrain_cli.simulate import run_simulation
from simulate_helpers import NO_FAKE_DEVICES
from workers.pacing import RateMeter, auto_round_seconds, retimed
from workers.rounds import Schedule

ROOT = Path(__file__).resolve().parent.parent


def _tiny(*extra: str):
    return load_config(ROOT / "configs" / "tiny.toml", list(extra))


def test_a_fingerprint_field_per_island_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="model.d_model is in the config fingerprint"):
        parse_islands(["island-1:model.d_model=64"], 2, _tiny())
    with pytest.raises(ConfigError, match="train.lr is not a per-island setting"):
        parse_islands(["island-1:train.lr=0.1"], 2, _tiny())
    with pytest.raises(ConfigError, match="no island 'island-5'"):
        parse_islands(["island-5:slowdown=2"], 2, _tiny())
    with pytest.raises(ConfigError, match="slowdown must be"):
        parse_islands(["island-0:slowdown=0.5"], 2, _tiny())
    with pytest.raises(ConfigError, match="batch_size"):  # 7 does not divide a shard of 60 x 8 sequences
        parse_islands(["island-0:train.batch_size=7"], 2, _tiny())
    with pytest.raises(ConfigError, match="--island island-1:link=fast: link 'fast': expected RATE/RTT"):
        parse_islands(["island-1:link=fast"], 2, _tiny())


def test_an_island_link_of_its_own_wins_over_the_run_wide_one() -> None:
    """``--link`` becomes a ``link=`` spec per island ahead of the user's: an island's own comes later and wins."""
    from dtrain_cli.link_proxy import LinkShape

    specs = parse_islands(["island-0:link=100mbit/100ms", "island-1:link=100mbit/100ms",
                           "island-1:link=20mbit/200ms,slowdown=2"], 2, _tiny())
    assert specs["island-0"].link == LinkShape(100e6, 0.1) and specs["island-1"].link == LinkShape(20e6, 0.2)
    assert specs["island-1"].describe()["link"] == "20mbit/200ms"


def test_per_island_settings_keep_the_fingerprint_and_scale_steps_by_tokens() -> None:
    cfg = _tiny()
    specs = parse_islands(["island-1:train.batch_size=4,host_devices=2,slowdown=3",
                           "island-1:model.remat=true,worker.round_seconds=auto"], 2, cfg)
    spec = specs["island-1"]
    assert (spec.host_devices, spec.slowdown) == (2, 3.0)
    run = run_config(cfg, specs)
    assert run.train.base_batch_size == 8
    own = island_config(run, spec, "test")
    assert own.fingerprint() == run.fingerprint() == cfg.fingerprint()
    assert own.worker.round_seconds == ROUND_AUTO and own.model.remat
    # the same tokens: twice the steps of half the batch, for the shard, H and the lr schedule
    assert own.train.shard_sequences == run.train.shard_sequences == 60 * 8
    s = Schedule.from_config(own)
    assert (s.total_steps, s.inner_steps) == (120, 40)
    assert own.train.island_steps(own.train.warmup_steps) == 10


def test_lr_schedules_of_different_batches_end_together_by_tokens() -> None:
    from dtrain.steps.inner import lr_schedule

    big = _tiny("train.base_batch_size=8").train
    small = _tiny("train.base_batch_size=8", "train.batch_size=2").train
    for tokens_done in (0, 40, 200, 480):  # sequences
        assert float(lr_schedule(big)(tokens_done // 8)) == pytest.approx(float(lr_schedule(small)(tokens_done // 2)))


def test_auto_round_carries_h_base_steps_per_island_and_retimes_the_schedule() -> None:
    cfg = _tiny("outer.inner_steps=10", "worker.round_seconds=auto")
    seconds = auto_round_seconds(cfg, [4096.0, 1024.0])
    # islands x H x base batch x seq_len / the sum of the rates: together they train 2 x 10 base steps a round
    assert seconds == pytest.approx(2 * 10 * 8 * 32 / 5120)
    assert (4096.0 + 1024.0) * seconds / (8 * 32) == pytest.approx(2 * 10)
    fast, slow = retimed(cfg, seconds, 6 * seconds, 4096.0), retimed(cfg, seconds, 6 * seconds, 1024.0)
    assert (fast.train.steps, slow.train.steps) == (96, 24)  # 4x the rate: 4x the steps in the same rounds
    assert fast.train.steps + slow.train.steps == 6 * 2 * 10  # 6 rounds of 2 x H base steps
    assert fast.worker.round_seconds == seconds
    # resolved in round 1 after 30 steps of the base batch: those, and the steps the time left holds
    assert retimed(cfg, seconds, 5 * seconds, 1024.0, done=30).train.steps == 30 + 20
    with pytest.raises(ValueError):
        auto_round_seconds(cfg, [])


def test_rate_meter_leaves_out_the_warm_up_chunk() -> None:
    meter = RateMeter(tokens_per_step=8 * 32, skip=1, chunks=2)
    meter.add(5, 10.0)  # the first chunk: warm-up, not counted
    assert not meter.done and meter.tokens_per_s == meter.step_s == 0.0
    meter.add(25, 0.5)
    meter.add(25, 0.5)
    assert meter.done and meter.step_s == pytest.approx(0.02)
    assert meter.tokens_per_s == pytest.approx(50 * 8 * 32 / 1.0)
    meter.add(25, 99.0)  # known: it stays
    assert meter.step_s == pytest.approx(0.02)


@pytest.mark.slow
def test_two_islands_of_different_batch_and_devices_through_a_coordinator(tmp_path, compile_cache) -> None:
    """island-1: half the batch on 2 fake devices (island-0: 1 device); the same tokens per shard, pushes
    weighted by their tokens, nothing lost or doubled, one final θ."""
    cfg = _tiny(f"run.out_dir={tmp_path}", "outer.islands=2", "train.steps=20", "outer.inner_steps=10",
                "worker.heartbeat_s=0.5", "coordinator.grace_s=60", compile_cache)
    specs = parse_islands(["island-1:train.batch_size=4,host_devices=2"], 2, cfg)
    s = run_simulation(cfg, 2, quiet=True, env=NO_FAKE_DEVICES, timeout_s=300,
                       island_specs=specs)
    islands = {i["island"]: i for i in s["islands"]}
    assert (islands["island-0"]["devices"], islands["island-1"]["devices"]) == (1, 2)
    assert (islands["island-0"]["steps"], islands["island-1"]["steps"]) == (20, 40)
    assert islands["island-0"]["tokens"] == islands["island-1"]["tokens"] == 20 * 8 * 32
    assert s["audit"]["lost_tokens"] == s["audit"]["doubled_tokens"] == 0
    assert s["audit"]["coverage"] == {"0": [[0, 160]], "1": [[0, 160]]}
    assert s["bit_identical_final_params"]
    assert s["island_settings"] == {"island-1": {"overrides": ["train.batch_size=4"], "host_devices": 2}}
    merges = [e for e in read_events(Path(s["run_dir"])) if e["event"] == "round_merged"]
    assert len(merges) == 2
    # the shard each island was given at its Join (the order of the Joins decides which)
    own_shard = [islands["island-0"]["shard"], islands["island-1"]["shard"]]
    assert sorted(own_shard) == [0, 1]
    for m in merges:  # each round: 10 steps of 8 and 20 steps of 4, weighted by their equal tokens
        by_shard = {p["shard"]: p for p in m["pushes"]}
        assert (by_shard[own_shard[0]]["steps"], by_shard[own_shard[1]]["steps"]) == (10, 20)
        assert by_shard[0]["weight"] == by_shard[1]["weight"] == by_shard[0]["tokens"] == 10 * 8 * 32
    own = load_config(Path(s["run_dir"]) / "islands" / "island-1" / "config.toml")
    assert (own.train.batch_size, own.train.base_batch_size) == (4, 8)


@pytest.mark.slow
def test_auto_rounds_measure_the_islands_in_training(tmp_path) -> None:
    """``worker.round_seconds = auto`` through a real coordinator: island-1 3x slower; each island times a chunk of
    real training and both take the same round length from the slower rate, then the lengths the coordinator
    paces each version with; nothing lost or doubled."""
    cfg = _tiny(f"run.out_dir={tmp_path}", "outer.islands=2", "train.steps=200", "outer.inner_steps=20",
                "worker.round_seconds=auto", "worker.heartbeat_s=0.5")
    specs = parse_islands(["island-1:slowdown=3"], 2, cfg)
    s = run_simulation(cfg, 2, quiet=True, env=NO_FAKE_DEVICES, timeout_s=300,
                       island_specs=specs)
    islands = {i["island"]: i for i in s["islands"]}
    fast, slow = islands["island-0"], islands["island-1"]
    assert fast["round_seconds"] == slow["round_seconds"] > 0
    assert fast["measured_tokens_per_s"] > 1.5 * slow["measured_tokens_per_s"]
    assert fast["round_seconds"] == pytest.approx(auto_round_seconds(
        cfg, [fast["measured_tokens_per_s"], slow["measured_tokens_per_s"]]))
    assert fast["tokens"] > 1.5 * slow["tokens"]
    assert s["audit"]["lost_tokens"] == s["audit"]["doubled_tokens"] == 0
    # Rounds 2 on are paced by the coordinator (coordinator.pacing): every island takes the length it gave.
    given = {e["version"]: e["next_round_s"] for e in read_events(Path(s["run_dir"]))
             if e["event"] == "round_merged" and "next_round_s" in e}
    assert set(given) == set(range(1, 10))  # every version but the last starts a paced round
    for name in ("island-0", "island-1"):
        events = list(read_events(Path(s["run_dir"]) / "islands" / name))
        kinds = [e["event"] for e in events]
        assert kinds.count("rate") == 1 and kinds.count("auto_rounds") == 1
        taken = {e["version"]: e["round_seconds"] for e in events if e["event"] == "paced"}
        assert taken and all(taken[v] == pytest.approx(given[v], abs=1e-4) for v in taken)
        # An auto island compiled everything before it joined: θ_0's eval, if asked of it, is start-up (done while
        # it waits for its peers), and the run's last θ's is the run's end: its eval time is the evals between.
        evals = [(e["version"], e["seconds"]) for e in events if e["event"] == "evaluated"]
        final = max(v for v, _ in evals)
        assert islands[name]["eval_s"] == pytest.approx(sum(t for v, t in evals if 0 < v < final), abs=0.01), name


def test_the_run_keeps_the_first_auto_round_length_an_island_reports() -> None:
    """``worker.round_seconds = auto``: the first round length a live island reports is the run's (Status), for an
    island that joins later; later reports do not move it; a length in a run of step rounds, or outside (0, a day],
    is refused and changes nothing."""
    from state_helpers import T0, join_all, make, unchanged

    st = make("worker.round_seconds=auto")
    a, b, *_ = join_all(st)
    st.heartbeat(a, 0, 0, 0, 0.0, "", (), T0 + 1, tokens_per_s=900.0)
    assert st.round_seconds == 0.0  # not decided: a has a rate, no length yet
    st.heartbeat(a, 0, 0, 0, 0.0, "", (), T0 + 2, round_seconds=12.5)
    st.heartbeat(b, 0, 0, 0, 0.0, "", (), T0 + 2, round_seconds=30.0)
    assert st.round_seconds == 12.5
    for bad in (-1.0, float("nan"), float("inf"), 1e9):
        unchanged(st, lambda bad=bad: st.heartbeat(b, 0, 0, 0, 0.0, "", (), T0 + 3, round_seconds=bad),
                  "INVALID_ARGUMENT", "round_seconds")
    assert st.round_seconds == 12.5
    steps = make()
    c, *_ = join_all(steps)
    unchanged(steps, lambda: steps.heartbeat(c, 0, 0, 0, 0.0, "", (), T0 + 1, round_seconds=5.0),
              "INVALID_ARGUMENT", "step rounds")


def test_the_pace_takes_round_1s_surplus_off_the_rounds_after_it_and_follows_the_measured_rate() -> None:
    """``coordinator.pacing``: round 1 of an auto run brought in 3 versions' worth of tokens; the rounds after it
    are shortened so the run's budget (total_versions x a step round's tokens) is met at its last version, at the
    rate measured between commits, less the lag between a round's deadline and the next commit."""
    from coordinator.pacing import MAX_FACTOR, MIN_FACTOR, Pace

    pace = Pace(base_s=4.0, version_tokens=1000, total_versions=11, plan_rate=250.0)
    assert pace.budget == 11_000 and pace.seconds_at(1) == 0.0  # round 1: the islands' own length
    assert pace.committed(1, 100.0, 3000) == pytest.approx(8000 / 10 / 250)  # 3.2 s, not 4
    # Version 2 came 4.2 s later with 1050 tokens (250 tokens/s): 1.0 s lag beyond the 3.2 s given.
    rate, lag = 1050 / 4.2, 4.2 - 3.2
    assert pace.committed(2, 104.2, 4050) == pytest.approx((11_000 - 4050) / 9 / rate - lag)
    # Rates far off are followed within [1/4, 4] x round 1's length; the last version gives no next round.
    assert pace.committed(3, 200.0, 4100) == MAX_FACTOR * 4.0
    assert pace.committed(4, 200.5, 20_000) == MIN_FACTOR * 4.0
    assert pace.committed(11, 300.0, 11_000) == 0.0
    assert set(pace.commits) == {11}  # only the window before the next version is kept
    with pytest.raises(ValueError, match="round 1's length must be > 0"):
        Pace(base_s=0.0, version_tokens=1, total_versions=1, plan_rate=0.0)


def test_a_run_of_auto_rounds_is_paced_from_the_first_length_an_island_reports() -> None:
    """Sync auto rounds: the coordinator adopts the first reported length with the live islands' rates and paces
    each round it commits; async runs (every push a version) and step rounds are not paced."""
    from state_helpers import T0, join_all, make

    st = make("worker.round_seconds=auto")
    ids = join_all(st)
    for i in ids:
        st.heartbeat(i, 0, 0, 0, 0.0, "", (), T0 + 1, tokens_per_s=1000.0)
    st.heartbeat(ids[0], 0, 0, 0, 0.0, "", (), T0 + 2, round_seconds=5.0)
    pace = st.pace
    assert pace is not None and pace.base_s == 5.0 and pace.plan_rate == 1000.0 * len(ids)
    o = st.opts
    assert pace.version_tokens == o.islands * o.round_steps * o.batch_size * o.seq_len
    assert pace.total_versions == o.total_versions
    assert make().pace is None
    st_async = make("worker.round_seconds=auto", "coordinator.mode=async")
    a = join_all(st_async)[0]
    st_async.heartbeat(a, 0, 0, 0, 0.0, "", (), T0 + 2, round_seconds=5.0)
    assert st_async.round_seconds == 5.0 and st_async.pace is None
