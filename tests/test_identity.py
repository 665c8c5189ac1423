"""Identity per island (security.identity; dtrain/net/identity.py, coordinator/bindings.py), through a real
coordinator on 127.0.0.1:0: with its own token or client certificate, an island cannot join, push, pull or heartbeat
as another island, one credential holds one name, the operator re-binds, and the shared-token mode works as before
(and, as docs/security.md says, protects nothing between islands: the first test shows the attack it lets through)."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from conftest import openssl
from coordinator.bindings import Binding, Bindings
from coordinator.records import StateError, StateOptions
from coordinator.state import CoordinatorState
from dtrain.config.load import load_config, replace
from dtrain.config.sections import ConfigError
from dtrain.net.identity import IslandTokens, cert_identity, hash_line, issue_token, token_hash
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.proto import dtrain_pb2_grpc as pb_grpc
from dtrain.net.wire import auth_metadata
from dtrain_cli.main import main as cli_main
from service_helpers import Running, delta_frame, push_header
from workers.client import CoordinatorClient, CoordinatorError

QUARANTINE = [{"device": 0, "index": 0, "probe": "finite", "step": 3, "detail": "forged"}]


def _client(address: str, cfg, token: str | None, env: str, monkeypatch) -> CoordinatorClient:
    """A client sending ``token`` (from its own environment variable ``env``; None: no token)."""
    if token is None:
        monkeypatch.delenv(env, raising=False)
    else:
        monkeypatch.setenv(env, token)
    return CoordinatorClient(address, replace(cfg, security={"token_env": env}))


def _denied(call, code=grpc.StatusCode.PERMISSION_DENIED) -> str:
    with pytest.raises(CoordinatorError) as e:
        call()
    assert e.value.code == code, e.value
    return e.value.message


def _record(running: Running, island_id: str) -> dict:
    with running.service.lock:
        return next(r for r in running.service.state.to_json()["islands"] if r["island_id"] == island_id)


def _impersonate(mallory: CoordinatorClient, victim: CoordinatorClient, jb: pb.JoinResponse, n: int) -> list[str]:
    """What the issue's hostile island did, as the island called mallory, against island b (``victim``, joined as
    ``jb``): join under b's name, push b's next range, heartbeat as b with a quarantine report, pull as b. Returns
    the refusals (PERMISSION_DENIED), empty where every call went through."""
    refusals = []
    for call in (lambda: mallory.join("b", "cpu", 1),
                 lambda: mallory.push(push_header(jb, "forged-1"), delta_frame(n, 1)[1]),
                 lambda: mallory.heartbeat(island_id=jb.island_id, version=0, quarantined=QUARANTINE),
                 lambda: mallory.pull(jb.island_id, 0, full=True)):
        try:
            call()
        except CoordinatorError as e:
            assert e.code == grpc.StatusCode.PERMISSION_DENIED, e
            refusals.append(e.message)
    return refusals


# -- shared mode: what it does not protect ---------------------------------------------------------------------


def test_shared_token_mode_works_and_lets_any_holder_act_as_any_island(net_cfg, tmp_path, monkeypatch):
    """The simple mode, unchanged: every holder of the one token joins; and (what docs/security.md warns of) one of
    them acts as another island: rejoins under its live name, pushes its range, puts a quarantine record on it."""
    monkeypatch.setenv("DTRAIN_TOKEN", "one-token-for-all")
    running = Running(net_cfg, tmp_path / "shared")
    try:
        a = _client(running.address, net_cfg, "one-token-for-all", "TOKEN_A", monkeypatch)
        b = _client(running.address, net_cfg, "one-token-for-all", "TOKEN_B", monkeypatch)
        a.join("a", "cpu", 1)
        jb = b.join("b", "cpu", 1)
        assert _impersonate(a, b, jb, jb.tree_size) == []
        assert _record(running, jb.island_id)["quarantined"], "the forged report stands in shared mode"
        assert b.push(push_header(jb, "b-own"), delta_frame(jb.tree_size, 2)[1]).status == pb.PUSH_STATUS_DROPPED
        for c in (a, b):
            c.close()
    finally:
        running.stop()


# -- token mode ----------------------------------------------------------------------------------------------------


@pytest.fixture
def token_run(net_cfg, tmp_path, monkeypatch):
    """A coordinator with security.identity "token": tokens issued (as `dtrain admin issue-token` does) for
    islands a and b, listed in its island_tokens file; the operator's shared token in DTRAIN_TOKEN."""
    tokens = {name: issue_token() for name in ("a", "b")}
    listing = tmp_path / "island-tokens"
    listing.write_text("# islands of the test run\n" + "".join(hash_line(n, t) + "\n" for n, t in tokens.items()))
    cfg = replace(net_cfg, security={"identity": "token", "island_tokens": str(listing)})
    monkeypatch.setenv("DTRAIN_TOKEN", "operator-token")
    running = Running(cfg, tmp_path / "token-run")
    yield running, cfg, tokens, listing
    running.stop()


def test_an_island_token_cannot_act_as_another_island(token_run, monkeypatch):
    """Each of the issue's attacks, with island a's own token against island b: refused (PERMISSION_DENIED), state
    untouched, and b's own push then counts (on main, with the one shared token, each went through: the test
    above)."""
    running, cfg, tokens, _ = token_run
    a = _client(running.address, cfg, tokens["a"], "TOKEN_A", monkeypatch)
    b = _client(running.address, cfg, tokens["b"], "TOKEN_B", monkeypatch)
    ja, jb = a.join("a", "cpu", 1), b.join("b", "cpu", 1)
    before = _record(running, jb.island_id)
    refusals = _impersonate(a, b, jb, jb.tree_size)
    assert len(refusals) == 4, refusals
    assert refusals[0] == ("token:a may not act as island b: the name b is bound to another identity (a token acts "
                           "only as the name it is issued for); the operator re-binds a name with a security.bindings "
                           "pin (docs/security.md)"), refusals[0]
    for message in refusals[1:]:
        assert message.startswith(f"token:a may not act as island {jb.island_id}: the name b is bound to another "
                                  f"identity"), message
    after = _record(running, jb.island_id)
    assert after["quarantined"] == [] and after["state"] == "live" and after == before
    # b's own range is b's: accepted, not dropped as an overlap of a forged push.
    assert b.push(push_header(jb, "b-own"), delta_frame(jb.tree_size, 2)[1]).status in (
        pb.PUSH_STATUS_PENDING, pb.PUSH_STATUS_MERGED)
    assert a.push(push_header(ja, "a-own"), delta_frame(ja.tree_size, 3)[1]).status == pb.PUSH_STATUS_MERGED
    for c in (a, b):
        c.close()


def test_one_token_is_one_island_and_an_unknown_token_is_one_refusal(token_run, monkeypatch):
    running, cfg, tokens, _ = token_run
    a = _client(running.address, cfg, tokens["a"], "TOKEN_A", monkeypatch)
    a.join("a", "cpu", 1)
    # The Sybil case: a's token under a second name (one no token is issued for) is refused at Join.
    message = _denied(lambda: a.join("spare", "cpu", 1))
    assert message.startswith("token:a may not act as island spare: the name spare is bound to another identity "
                              "(a token acts only as the name it is issued for)"), message
    with running.service.lock:
        assert [r.name for r in running.service.state.islands.values()] == ["a"]
    # A token that is not listed: UNAUTHENTICATED, one line naming where island tokens come from.
    bad = _client(running.address, cfg, issue_token(), "TOKEN_X", monkeypatch)
    message = _denied(lambda: bad.join("b", "cpu", 1), grpc.StatusCode.UNAUTHENTICATED)
    assert message == ("wrong token: missing or wrong bearer token (set the token in the environment variable named "
                       "by security.token_env; an island's own token must be listed in the coordinator's "
                       "security.island_tokens (`dtrain admin issue-token NAME`))")
    # The operator's shared token reads Status but is no island.
    op = _client(running.address, cfg, "operator-token", "TOKEN_OP", monkeypatch)
    assert op.status().run_id
    message = _denied(lambda: op.join("b", "cpu", 1))
    assert "carries no island identity" in message and "the shared token is the operator's" in message, message
    for c in (a, bad, op):
        c.close()


def test_the_operator_reissues_a_token_and_the_old_one_stops_working(token_run, tmp_path, monkeypatch):
    """Re-binding in token mode: a new token for b replaces b's line (the operator's file); after the coordinator's
    restart (--resume) the old token is refused and the new one acts as b, its record and shard kept."""
    running, cfg, tokens, listing = token_run
    a = _client(running.address, cfg, tokens["a"], "TOKEN_A", monkeypatch)
    old_b = _client(running.address, cfg, tokens["b"], "TOKEN_B", monkeypatch)
    jb = _merge_one_round(a, old_b, "a", "b")[1]
    running.stop()
    fresh = issue_token()
    listing.write_text(hash_line("a", tokens["a"]) + "\n" + hash_line("b", fresh) + "\n")
    again = Running(cfg, running.run_dir, resume=True)
    running.server, running.service = again.server, again.service  # the fixture stops this one
    old_b = _client(again.address, cfg, tokens["b"], "TOKEN_B", monkeypatch)
    _denied(lambda: old_b.join("b", "cpu", 1), grpc.StatusCode.UNAUTHENTICATED)
    new_b = _client(again.address, cfg, fresh, "TOKEN_B2", monkeypatch)
    rejoined = new_b.join("b", "cpu", 1)
    assert (rejoined.island_id, rejoined.shard_index) == (jb.island_id, jb.shard_index)
    for c in (old_b, new_b):
        c.close()


def _merge_one_round(c1: CoordinatorClient, c2: CoordinatorClient, n1: str, n2: str
                     ) -> tuple[pb.JoinResponse, pb.JoinResponse]:
    """Both join and push their first range: version 1 is merged and checkpointed (a restart resumes from it)."""
    j1, j2 = c1.join(n1, "cpu", 1), c2.join(n2, "cpu", 1)
    c1.push(push_header(j1, f"{n1}-1"), delta_frame(j1.tree_size, 5)[1])
    assert c2.push(push_header(j2, f"{n2}-1"), delta_frame(j2.tree_size, 6)[1]).status == pb.PUSH_STATUS_MERGED
    for c in (c1, c2):
        c.close()
    return j1, j2


def test_island_tokens_file_errors_are_one_clear_line(tmp_path):
    t = issue_token()
    cases = {
        "missing": None,
        "malformed": "a sha256:nothex\n",
        "twice": f"{hash_line('a', t)}\n{hash_line('a', issue_token())}\n",
        "shared": f"{hash_line('a', t)}\n{hash_line('b', t)}\n",
        "empty": "# nothing\n",
        "placeholder": "REPLACE-ME-with-dtrain-admin-issue-token\n",
    }
    expected = {"missing": "cannot read it", "malformed": "line 1: expected 'NAME sha256:HEX'",
                "twice": "line 2: island a is listed twice", "shared": "line 2: the same token is listed for two",
                "empty": "lists no island", "placeholder": "holds the placeholder of deploy/coordinator/"}
    for case, text in cases.items():
        path = tmp_path / case
        if text is not None:
            path.write_text(text)
        with pytest.raises(ConfigError, match=expected[case]):
            IslandTokens.read(str(path))
    path.write_text(f"{hash_line('a', t)}  # island a\n\n")
    tokens = IslandTokens.read(str(path))
    assert tokens.name_of(t) == "a" and tokens.name_of(t + "x") is None and tokens.name_of("") is None
    assert tokens.entries == {"a": token_hash(t)}


def test_config_checks_the_identity_settings():
    with pytest.raises(ConfigError, match=r"\[security\] island_tokens: identity 'token' needs"):
        load_config(None, ["security.identity=token"])
    with pytest.raises(ConfigError, match=r"\[security\] identity: 'cert' reads the islands' client certificates"):
        load_config(None, ["security.identity=cert"])
    with pytest.raises(ConfigError, match=r"\[security\] bindings: pins bind names"):
        load_config(None, ['security.bindings=["b=token:b"]'])
    with pytest.raises(ConfigError, match=r"\[security\] bindings\[0\]: 'b': expected NAME=IDENTITY"):
        load_config(None, ["security.identity=token", "security.island_tokens=x", 'security.bindings=["b"]'])
    with pytest.raises(ConfigError, match=r"bindings\[1\]: 'c=mail:x': the identity must be token:VALUE"):
        load_config(None, ["security.identity=token", "security.island_tokens=x",
                           'security.bindings=["b=token:b2", "c=mail:x"]'])
    cfg = load_config(None, ["security.identity=token", "security.island_tokens=x",
                             'security.bindings=["b = uri:spiffe://d/b"]'])
    assert StateOptions.from_config(cfg).pins == (("b", "uri:spiffe://d/b"),)


def test_admin_issue_token_writes_the_token_and_prints_its_line(tmp_path, capsys):
    out = tmp_path / "gpu-a.token"
    assert cli_main(["admin", "issue-token", "gpu-a", "--out", str(out)]) == 0
    line = capsys.readouterr().out
    token = out.read_text()
    assert len(token) == 64 and line == hash_line("gpu-a", token) + "\n"
    assert out.stat().st_mode & 0o777 == 0o600
    assert cli_main(["admin", "issue-token", "gpu-a", "--out", str(out)]) == 2  # never over a file
    assert "exists already" in capsys.readouterr().err and out.read_text() == token


# -- the bindings themselves (pure) ----------------------------------------------------------------------------


def test_bindings_first_join_binds_and_pins_override():
    b = Bindings("cert", {"y": "cn:c"})
    b.check("x", "uri:a")
    b.bind("x", "uri:a")
    with pytest.raises(StateError, match="uri:b may not act as island x-0: the name x is bound") as e:
        b.check("x", "uri:b", island_id="x-0")
    assert e.value.code == "PERMISSION_DENIED"
    with pytest.raises(StateError, match="uri:a cannot act as z: it is island x's identity"):
        b.check("z", "uri:a")
    with pytest.raises(StateError, match="bound to another identity"):
        b.check("y", "uri:b")  # pinned to cn:c
    with pytest.raises(StateError, match="carries no island identity"):
        b.check("x", None)
    b.check("y", "cn:c")
    b.bind("y", "cn:c")
    assert b.rows() == [Binding("x", "uri:a")]  # a pinned name is not learned
    # A pin moves x to another identity: the learned binding no longer counts, and uri:a is free for a new name.
    moved = Bindings("cert", {"x": "uri:new"}, b.rows())
    with pytest.raises(StateError, match="bound to another identity"):
        moved.check("x", "uri:a")
    moved.check("x", "uri:new")
    moved.check("z", "uri:a")
    shared = Bindings("shared", {})
    shared.check("x", None)
    shared.bind("x", "uri:a")
    assert shared.rows() == []


def test_bindings_are_checkpointed_and_an_old_checkpoint_has_none(net_cfg):
    cfg = replace(net_cfg, security={"identity": "cert", "client_auth": True, "ca": "ca", "server_cert": "s",
                                     "server_key": "k"})
    opts = StateOptions.from_config(cfg)
    st = CoordinatorState(opts, "run", 0.0)
    st.join("x", "cpu", 1, 1.0, identity="uri:a")
    blob = st.to_json()
    assert blob["bindings"] == [["x", "uri:a"]]
    back = CoordinatorState.from_json(opts, blob, 2.0)
    assert back.bindings.rows() == [Binding("x", "uri:a")]
    with pytest.raises(StateError, match="bound to another identity"):
        back.join("x", "cpu", 1, 3.0, identity="uri:b")
    before = back.to_json()
    with pytest.raises(StateError):
        back.authorize("x-0", "uri:b")
    assert back.to_json() == before
    old = {k: v for k, v in blob.items() if k != "bindings"}
    assert CoordinatorState.from_json(opts, old, 2.0).bindings.rows() == []
    with pytest.raises(StateError, match=r"state\.bindings\[1\]\.name: 'x': not a valid island name, or bound"):
        CoordinatorState.from_json(opts, {**blob, "bindings": [["x", "uri:a"], ["x", "uri:b"]]}, 2.0)


# -- cert mode: real certificates -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def island_certs(certs: Path) -> Path:
    """Client certificates signed by the test CA: x (a SPIFFE URI SAN), y and z (a CN only)."""
    for name, ext in (("x", "subjectAltName=DNS:x.example,URI:spiffe://dtrain/island/x"),
                      ("y", "basicConstraints=CA:FALSE"), ("z", "basicConstraints=CA:FALSE")):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN=host-{name}", cwd=certs)
        (certs / f"{name}.ext").write_text(ext + "\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", "-extfile", str(certs / f"{name}.ext"), cwd=certs)
    return certs


def _mtls(cfg, d: Path, client: str | None, **security):
    sec = {"ca": str(d / "ca.pem"), "server_cert": str(d / "server.pem"), "server_key": str(d / "server.key"),
           "client_auth": True, "server_name": "localhost", "identity": "cert", **security}
    if client is not None:
        sec.update(client_cert=str(d / f"{client}.pem"), client_key=str(d / f"{client}.key"))
    return replace(cfg, security=sec)


def test_mutual_tls_binds_each_name_to_its_certificate(net_cfg, tmp_path, island_certs):
    """Under mutual TLS the coordinator reads the client certificate's identity (its URI SAN, else its CN): the
    issue's attacks from certificate x against island y are refused, x cannot take a second name, the bindings
    survive a restart, and the operator's pin moves y to certificate z."""
    d = island_certs
    run_dir = tmp_path / "mtls"
    running = Running(_mtls(net_cfg, d, None), run_dir)
    try:
        x = CoordinatorClient(running.address, _mtls(net_cfg, d, "x"))
        y = CoordinatorClient(running.address, _mtls(net_cfg, d, "y"))
        x.join("x", "cpu", 1)
        jy = y.join("y", "cpu", 1)
        before = _record(running, jy.island_id)
        refusals = _impersonate(x, y, jy, jy.tree_size)
        assert len(refusals) == 4 and refusals[0].startswith("uri:spiffe://dtrain/island/x "), refusals
        assert "the name y is bound to another identity" in refusals[1]
        assert _record(running, jy.island_id) == before
        message = _denied(lambda: x.join("spare", "cpu", 1))  # the Sybil case: one certificate, one island
        assert message.startswith("uri:spiffe://dtrain/island/x cannot act as spare: it is island x's identity")
        with running.service.lock:
            assert running.service.state.bindings.rows() == [Binding("x", "uri:spiffe://dtrain/island/x"),
                                                             Binding("y", "cn:host-y")]
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
        assert [e.get("identity") for e in events if e["event"] == "island_joined"] == [
            "uri:spiffe://dtrain/island/x", "cn:host-y"]
        _merge_one_round(x, y, "x", "y")  # checkpointed with the bindings
    finally:
        running.stop()
    # Restarted with the operator's pin: y is now certificate z's; the learned x binding came back from the checkpoint.
    pinned = _mtls(net_cfg, d, None, bindings=("y=cn:host-z",))
    running = Running(pinned, run_dir, resume=True)
    try:
        y = CoordinatorClient(running.address, _mtls(net_cfg, d, "y"))
        z = CoordinatorClient(running.address, _mtls(net_cfg, d, "z"))
        x = CoordinatorClient(running.address, _mtls(net_cfg, d, "x"))
        assert "the name y is bound to another identity" in _denied(lambda: y.join("y", "cpu", 1))
        assert z.join("y", "cpu", 1).island_id == jy.island_id
        assert "bound to another identity" in _denied(lambda: x.join("y", "cpu", 1))
        x.join("x", "cpu", 1)
        for c in (x, y, z):
            c.close()
    finally:
        running.stop()


def test_cert_identity_reads_the_uri_san_else_the_cn():
    assert cert_identity({"peer_uri": [b"spiffe://d/x"], "x509_common_name": [b"h"]}) == "uri:spiffe://d/x"
    assert cert_identity({"x509_common_name": [b"h"]}) == "cn:h"
    assert cert_identity({"transport_security_type": [b"ssl"]}) is None


def test_a_raw_call_without_a_token_cannot_slip_past_as_an_island(token_run):
    """No metadata at all: the interceptor refuses it (UNAUTHENTICATED) before any handler."""
    running = token_run[0]
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(running.address))
    with pytest.raises(grpc.RpcError) as e:
        stub.Heartbeat(pb.HeartbeatRequest(island_id="a-0"), timeout=5, metadata=auth_metadata(None))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


# -- dtrain simulate with an identity per island ---------------------------------------------------------------


def test_simulate_issues_one_token_per_island_and_parses_a_borrowed_credential(tmp_path):
    """``dtrain simulate --island-tokens``: the driver issues a token per island and writes only their hashes
    (owner-only) as the coordinator's island_tokens, under security.identity = token; ``--island
    NAME:credential=OTHER`` (the Sybil case) names an island of the run and needs --island-tokens; a run without
    token_env, or with a token identity whose tokens the driver cannot hand out, is refused before anything
    starts."""
    from dtrain_cli.island_spec import parse_islands
    from dtrain_cli.simulate import issue_island_tokens, run_simulation

    cfg = load_config("tiny")
    out, tokens = issue_island_tokens(cfg, tmp_path, 3)
    assert sorted(tokens) == ["island-0", "island-1", "island-2"] and len(set(tokens.values())) == 3
    path = tmp_path / "island-tokens"
    assert (out.security.identity, out.security.island_tokens) == ("token", str(path))
    assert path.stat().st_mode & 0o777 == 0o600
    read = IslandTokens.read(str(path))
    assert all(read.name_of(t) == n for n, t in tokens.items()) and tokens["island-0"] not in path.read_text()
    specs = parse_islands(["island-2:credential=island-1", "island-1:credential=island-1"], 3, cfg)
    assert specs["island-2"].credential == "island-1" and specs["island-1"].credential == ""
    assert specs["island-2"].describe()["credential"] == "island-1"
    with pytest.raises(ConfigError, match="credential must name an island of this run"):
        parse_islands(["island-2:credential=island-7"], 3, cfg)
    with pytest.raises(ConfigError, match=r"credential=\.\.\.: needs --island-tokens"):
        run_simulation(cfg, 3, island_specs=specs)
    with pytest.raises(ConfigError, match="token_env, which is empty"):
        run_simulation(replace(cfg, security={"token_env": ""}), 2, own_tokens=True)
    with pytest.raises(ConfigError, match="pass --island-tokens"):
        run_simulation(out, 2)
