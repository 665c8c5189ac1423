"""The Kubernetes manifests in deploy/, checked without a cluster.

Every manifest is parsed (PyYAML), each of the three kustomizations a cluster applies (coordinator/, gpu-worker/,
tpu-worker/) is resolved as kustomize would list its resources, and within each: kinds and apiVersions, selectors
against pod labels, Services against container ports, volumes and the Secrets/ConfigMaps/claims they name, probes,
and every container's ``dtrain`` command line through the real argument parser (a renamed flag fails here) with the
run's config loaded from the ConfigMap the pod mounts. The image and what its coordinator does in a pod (the exec
probe, a restart after the run) are in test_deploy_image.py.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from coordinator.loading import has_checkpoint
from dtrain.config.load import load_config, replace
from dtrain.config.sections import Config, ConfigError, CoordinatorConfig
from dtrain.net.wire import PLACEHOLDER, read_token
from dtrain_cli import probe
from dtrain_cli.main import build_parser
from dtrain_cli.main import main as cli_main
from service_helpers import Running
from workers.client import CoordinatorClient, CoordinatorError

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
# The kustomizations applied one per cluster (each must be complete on its own), and the base they share.
CLUSTERS = ("coordinator", "gpu-worker", "tpu-worker", "coordinator-sharded")  # the last: instead of the first
KINDS = {
    "Kustomization": "kustomize.config.k8s.io/v1beta1",
    "Namespace": "v1",
    "ConfigMap": "v1",
    "Secret": "v1",
    "PersistentVolumeClaim": "v1",
    "Service": "v1",
    "Deployment": "apps/v1",
    "StatefulSet": "apps/v1",
    "JobSet": "jobset.x-k8s.io/v1alpha2",
}
Doc = dict[str, Any]
POD_NAME_LABEL = "statefulset.kubernetes.io/pod-name"


def _docs(path: Path) -> list[Doc]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert all(isinstance(d, dict) for d in docs), f"{path}: every document must be a mapping"
    return docs


def _kustomization(folder: Path) -> Doc:
    (doc,) = _docs(folder / "kustomization.yaml")
    return doc


def build(folder: Path) -> list[Doc]:
    """The objects ``kubectl apply -k FOLDER`` creates, as kustomize lists them: each resource file's documents and
    each resource folder's own build, with the kustomization's namespace set on every namespaced object."""
    k = _kustomization(folder)
    assert set(k) <= {"apiVersion", "kind", "namespace", "resources"}, (
        f"{folder}/kustomization.yaml: only resources and namespace are resolved by this test, got {sorted(k)}")
    out: list[Doc] = []
    for entry in k["resources"]:
        target = (folder / entry).resolve()
        assert target.is_relative_to(DEPLOY), f"{folder}: resource {entry} is outside deploy/"
        out += build(target) if target.is_dir() else _docs(target)
    if "namespace" in k:
        for doc in out:
            if doc["kind"] != "Namespace":
                doc.setdefault("metadata", {})["namespace"] = k["namespace"]
    return out


def pod_templates(doc: Doc) -> list[Doc]:
    """The pod templates of a workload: a Deployment's or a StatefulSet's, or each replicated Job's in a JobSet."""
    if doc["kind"] in ("Deployment", "StatefulSet"):
        return [doc["spec"]["template"]]
    if doc["kind"] == "JobSet":
        return [rj["template"]["spec"]["template"] for rj in doc["spec"]["replicatedJobs"]]
    return []


def _named(docs: list[Doc], kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _containers(docs: list[Doc]) -> Iterator[tuple[str, Doc, Doc]]:
    """(where, pod spec, container) for every container of every workload."""
    for doc in docs:
        for template in pod_templates(doc):
            spec = template["spec"]
            for c in spec.get("initContainers", []) + spec["containers"]:
                yield f"{doc['kind']}/{doc['metadata']['name']}/{c['name']}", spec, c


def _builds() -> dict[str, list[Doc]]:
    return {name: build(DEPLOY / name) for name in CLUSTERS}


ALL = [(cluster, where) for cluster, docs in _builds().items() for where, _, _ in _containers(docs)]


def _container(cluster: str, where: str) -> tuple[list[Doc], Doc, Doc]:
    docs = build(DEPLOY / cluster)
    for w, spec, c in _containers(docs):
        if w == where:
            return docs, spec, c
    raise AssertionError(f"{cluster}: no container {where}")


# -- the files and the kustomizations ---------------------------------------------------------------------------


def test_every_manifest_parses_and_is_applied_by_some_cluster():
    files = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))
    assert files, "deploy/ has no manifests"
    listed = {DEPLOY / name / "kustomization.yaml" for name in CLUSTERS}
    for folder in [DEPLOY / name for name in CLUSTERS] + [DEPLOY / "base"]:
        listed.add(folder / "kustomization.yaml")
        listed |= {(folder / r).resolve() for r in _kustomization(folder)["resources"]}
    for path in files:
        for doc in _docs(path):
            kind = doc.get("kind")
            assert kind in KINDS, f"{path.relative_to(ROOT)}: unexpected kind {kind!r} (known: {sorted(KINDS)})"
            assert doc.get("apiVersion") == KINDS[kind], (
                f"{path.relative_to(ROOT)}: {kind} needs apiVersion {KINDS[kind]}, got {doc.get('apiVersion')!r}")
        assert path in listed, f"{path.relative_to(ROOT)} is in no kustomization's resources: it is never applied"


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_each_cluster_builds_with_unique_names(cluster):
    docs = build(DEPLOY / cluster)
    keys = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys)), f"{cluster}: an object is listed twice: {keys}"
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"dtrain"}
    assert _named(docs, "Namespace").keys() == {"dtrain"}, f"{cluster}: the namespace is not created"
    assert any(pod_templates(d) for d in docs), f"{cluster}: no workload"


def test_the_three_clusters_run_a_coordinator_a_gpu_island_and_a_tpu_island():
    builds = _builds()
    (deployment,) = _named(builds["coordinator"], "Deployment").values()
    assert deployment["spec"]["replicas"] == 1, "one coordinator: the only writer of its run folder"
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}, "never two coordinators on the volume at once"
    gpu = [c for _, _, c in _containers(builds["gpu-worker"])]
    tpu_specs = [(s, c) for _, s, c in _containers(builds["tpu-worker"])]
    assert [c["resources"]["limits"].get("nvidia.com/gpu") for c in gpu] == [8]
    (gpu_spec,) = [s for _, s, _ in _containers(builds["gpu-worker"])]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in gpu_spec["tolerations"]
    ((tpu_spec, tpu),) = tpu_specs
    assert tpu["resources"]["limits"].get("google.com/tpu") == 4
    tpu_pool = {"cloud.google.com/gke-tpu-accelerator", "cloud.google.com/gke-tpu-topology"}
    assert tpu_pool <= tpu_spec["nodeSelector"].keys(), "the TPU slice's node selectors"
    for cluster in ("gpu-worker", "tpu-worker"):
        (jobset,) = _named(builds[cluster], "JobSet").values()
        assert jobset["spec"]["network"]["enableDNSHostnames"] is True, f"{cluster}: process 0 needs a DNS name"
        (rj,) = jobset["spec"]["replicatedJobs"]
        job = rj["template"]["spec"]
        assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"], cluster
        # --num-processes is the number of pods, and --jax-coordinator is pod 0's JobSet hostname
        (_, _, c) = next(_containers(builds[cluster]))
        args = c["args"]
        assert int(args[args.index("--num-processes") + 1]) == job["parallelism"], cluster
        host = f"{jobset['metadata']['name']}-{rj['name']}-0-0.{jobset['metadata']['name']}"
        jax_host, jax_port = args[args.index("--jax-coordinator") + 1].rsplit(":", 1)
        assert jax_host == host, f"{cluster}: --jax-coordinator must name process 0's pod, {host}"
        assert int(jax_port) in {p["containerPort"] for p in c["ports"]}, f"{cluster}: {jax_port} is not declared"


# -- selectors, Services, volumes, references -------------------------------------------------------------------


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_selectors_match_pod_labels_and_services_reach_container_ports(cluster):
    docs = build(DEPLOY / cluster)
    for doc in docs:
        for template in pod_templates(doc):
            labels = template["metadata"]["labels"]
            assert labels, f"{doc['metadata']['name']}: pod template without labels"
            selector = doc["spec"].get("selector", {}).get("matchLabels")
            if doc["kind"] in ("Deployment", "StatefulSet"):
                assert selector, f"{doc['metadata']['name']}: a {doc['kind']} needs spec.selector.matchLabels"
            if selector is not None:
                assert selector.items() <= labels.items(), (
                    f"{doc['kind']}/{doc['metadata']['name']}: selector {selector} does not match labels {labels}")
    templates = [t for d in docs for t in pod_templates(d)]
    pods = {f"{d['metadata']['name']}-{i}" for d in docs if d["kind"] == "StatefulSet"
            for i in range(d["spec"]["replicas"])}
    for name, svc in _named(docs, "Service").items():
        selector = dict(svc["spec"]["selector"])
        pod = selector.pop(POD_NAME_LABEL, None)  # a StatefulSet's pod: the label its controller gives each pod
        assert pod is None or pod in pods, f"Service/{name}: selects pod {pod}, which no StatefulSet runs"
        matched = [t for t in templates if selector.items() <= t["metadata"]["labels"].items()]
        assert matched, f"Service/{name}: selector {selector} matches no pod template"
        ports = [p for t in matched for c in t["spec"]["containers"] for p in c.get("ports", [])]
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            key = "name" if isinstance(target, str) else "containerPort"
            assert any(p.get(key) == target for p in ports), f"Service/{name}: targetPort {target} is on no container"


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_volumes_are_mounted_and_what_they_name_exists(cluster):
    docs = build(DEPLOY / cluster)
    secrets, configmaps = _named(docs, "Secret"), _named(docs, "ConfigMap")
    claims = _named(docs, "PersistentVolumeClaim")
    claim_templates = {t["metadata"]["name"]: t for d in docs if d["kind"] == "StatefulSet"
                       for t in d["spec"].get("volumeClaimTemplates", [])}  # each pod's own claim
    for where, spec, c in _containers(docs):
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        volumes |= {name: {} for name in claim_templates if where.startswith("StatefulSet/")}
        mounts = c.get("volumeMounts", [])
        for m in mounts:
            assert m["name"] in volumes, f"{where}: volumeMount {m['name']} has no volume"
        for name, v in volumes.items():
            mounted = [m["name"] for _, s, c2 in _containers(docs) if s is spec for m in c2.get("volumeMounts", [])]
            assert name in mounted, f"{where}: volume {name} is mounted by no container"
            if "secret" in v:
                secret = v["secret"]["secretName"]
                assert secret in secrets, f"{where}: Secret {secret} not in {cluster}"
            if "configMap" in v:
                configmap = v["configMap"]["name"]
                assert configmap in configmaps, f"{where}: ConfigMap {configmap} not in {cluster}"
            if "persistentVolumeClaim" in v:
                claim = v["persistentVolumeClaim"]["claimName"]
                assert claim in claims, f"{where}: PersistentVolumeClaim {claim} not in {cluster}"
        for env in c.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref is not None:
                assert ref["name"] in secrets, f"{where}: env {env['name']}: Secret {ref['name']} not in {cluster}"
                assert ref["key"] in _data(secrets[ref["name"]]), f"{where}: env {env['name']}: no key {ref['key']}"


def _data(obj: Doc) -> dict[str, str]:
    """A Secret's or ConfigMap's keys and text (stringData as written; data is base64, decoded)."""
    import base64

    out = dict(obj.get("stringData", {}))
    out.update({k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
               if obj["kind"] == "Secret" else obj.get("data", {}))
    return out


def _token_secret(c: Doc) -> str:
    """The Secret a container's security.token_env variable comes from."""
    envs = {e["name"]: e for e in c.get("env", [])}
    return str(envs[load_config(None).security.token_env]["valueFrom"]["secretKeyRef"]["name"])


def test_each_island_has_its_own_token_and_the_operators_stays_with_the_coordinator():
    """One credential per island (security.identity = "token" on the coordinator, docs/security.md): each island's
    security.token_env comes from a Secret of its own cluster named for its --island, the coordinator reads the
    islands' token hashes from a mounted Secret, and the operator's token (dtrain-token) is the coordinator's only:
    no island cluster holds it."""
    docs = build(DEPLOY / "coordinator")
    token_env = load_config(None).security.token_env
    island_secrets = {}
    for cluster in CLUSTERS:
        cluster_docs = build(DEPLOY / cluster)
        for where, _, c in _containers(cluster_docs):
            assert token_env in {e["name"] for e in c.get("env", [])}, f"{where}: no {token_env} (security.token_env)"
            if c["args"][0] == "worker":
                island = c["args"][c["args"].index("--island") + 1]
                island_secrets[island] = _token_secret(c)
                assert _token_secret(c) == f"dtrain-island-token-{island}", where
                assert "dtrain-token" not in _named(cluster_docs, "Secret"), f"{cluster} holds the operator's token"
            else:
                assert _token_secret(c) == "dtrain-token", where
                overrides = _parse(build_parser(), _expand(_dtrain_argv(c, where), c, where), where).overrides
                assert "security.identity=token" in overrides, f"{where}: islands would share one identity"
    assert len(set(island_secrets.values())) == len(island_secrets) == 2, island_secrets
    assert _named(docs, "Secret")["dtrain-coordinator-tls"]["type"] == "kubernetes.io/tls"


def test_the_documented_commands_issue_one_token_per_island_that_acts_only_as_it(net_cfg, tmp_path, monkeypatch):
    """docs/deploy.md step 4, for the islands deploy/ launches: its `dtrain admin issue-token` lines run here (the
    real command line), its kubectl lines write the Secret each island's pod reads; a coordinator with the issued
    file (the deployed security settings, on the tiny model) lets each island's token join as its island only."""
    page = (ROOT / "docs" / "deploy.md").read_text()
    islands = {}
    for cluster in CLUSTERS:
        for _, _, c in _containers(build(DEPLOY / cluster)):
            if c["args"][0] == "worker":
                islands[c["args"][c["args"].index("--island") + 1]] = cluster
    listing = tmp_path / "tokens" / "island-tokens"
    listing.parent.mkdir()
    lines = []
    for island, cluster in islands.items():
        issue = f"dtrain admin issue-token {island} --out tokens/{island}.token >> tokens/island-tokens"
        secret = (f"kubectl create secret generic dtrain-island-token-{island} --from-file=token=tokens/{island}.token"
                  f" \\\n  --dry-run=client -o yaml > deploy/{cluster}/secret-island-token.yaml")
        assert issue in page and secret in page, f"docs/deploy.md step 4 lacks {island}'s commands"
        out, token_file = io.StringIO(), tmp_path / "tokens" / f"{island}.token"
        with contextlib.redirect_stdout(out):
            assert cli_main(["admin", "issue-token", island, "--out", str(token_file)]) == 0
        lines.append(out.getvalue())
    assert ("kubectl create secret generic dtrain-island-tokens --from-file=island-tokens=tokens/island-tokens \\\n"
            "  --dry-run=client -o yaml > deploy/coordinator/secret-island-tokens.yaml") in page
    listing.write_text("".join(lines))
    ((where, _, c),) = list(_containers(build(DEPLOY / "coordinator")))
    overrides = _parse(build_parser(), _dtrain_argv(c, where), where).overrides
    assert "security.identity=token" in overrides, where
    cfg = replace(net_cfg, security={"identity": "token", "island_tokens": str(listing)})
    monkeypatch.setenv("DTRAIN_TOKEN", "the-operators")
    running = Running(cfg, tmp_path / "run")
    try:
        clients = {}
        for island in islands:  # the pod's variable holds the token file's bytes (kubectl --from-file)
            env = "TOKEN_" + island.replace("-", "_")
            monkeypatch.setenv(env, (tmp_path / "tokens" / f"{island}.token").read_text())
            clients[island] = CoordinatorClient(running.address, replace(cfg, security={"token_env": env}))
        first, second = list(islands)
        assert clients[first].join(first, "cpu", 1).island_id.startswith(first)
        with pytest.raises(CoordinatorError) as e:
            clients[first].join(second, "cpu", 1)
        assert e.value.code.name == "PERMISSION_DENIED"
        assert clients[second].join(second, "cpu", 1).island_id.startswith(second)
        for client in clients.values():
            client.close()
    finally:
        running.stop()


# -- probes -----------------------------------------------------------------------------------------------------


def test_coordinator_probes_ask_its_health_service_on_a_declared_port():
    docs = build(DEPLOY / "coordinator")
    ((where, spec, c),) = list(_containers(docs))
    ports = {p["containerPort"] for p in c["ports"]}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = c[kind]
        for action in ("grpc", "tcpSocket", "httpGet"):
            if action in p:
                assert p[action]["port"] in ports | {q["name"] for q in c["ports"]}, f"{where}: {kind} port"
        command = p["exec"]["command"]
        assert command[:3] == ["python", "-m", "dtrain_cli.probe"], f"{where}: {kind} is not the health probe"
        args = _parse(probe.build_parser(), command[3:], f"{where} {kind}")
        assert int(args.address.rsplit(":", 1)[1]) in ports, f"{where}: {kind} asks an undeclared port"
        files = _mounted_files(docs, spec, c)
        cfg = _load(files, args.config, args.overrides, where)
        assert cfg.security.ca in files, f"{where}: {kind}: security.ca {cfg.security.ca} is not mounted"
        assert p["timeoutSeconds"] > args.timeout, f"{where}: {kind} would be killed before its own deadline"


# -- the dtrain command lines -----------------------------------------------------------------------------------


def _parse(parser: argparse.ArgumentParser, argv: list[str], where: str) -> argparse.Namespace:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: {shlex.join(argv)}\nis refused by {parser.prog}: {err.getvalue().strip()}")


def _expand(argv: list[str], container: Doc, where: str) -> list[str]:
    """``$(VAR)`` as the kubelet expands it from the container's env; a downward-API or secret value becomes a
    stand-in (the completion index: 0). A reference to an undefined variable fails: the kubelet would pass it on
    literally."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
        elif any(index in e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "")
                 for index in ("job-completion-index", "apps.kubernetes.io/pod-index")):
            env[e["name"]] = "0"
        else:
            env[e["name"]] = "stand-in"

    def sub(m: re.Match[str]) -> str:
        assert m.group(1) in env, f"{where}: $({m.group(1)}) is not in the container's env"
        return env[m.group(1)]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, a) for a in argv]


def _mounted_files(docs: list[Doc], spec: Doc, c: Doc) -> dict[str, str]:
    """Path -> text of every file the container sees from its mounted Secrets and ConfigMaps."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    sources = {("secret", n): d for n, d in _named(docs, "Secret").items()}
    sources |= {("configMap", n): d for n, d in _named(docs, "ConfigMap").items()}
    files: dict[str, str] = {}
    for m in c.get("volumeMounts", []):
        v = volumes.get(m["name"], {})  # none: a StatefulSet's volumeClaimTemplate (no files to read)
        for kind, key in (("secret", "secretName"), ("configMap", "name")):
            if kind in v:
                for name, text in _data(sources[(kind, v[kind][key])]).items():
                    files[f"{m['mountPath'].rstrip('/')}/{name}"] = text
    return files


def _load(files: dict[str, str], config: str, overrides: list[str], where: str) -> Config:
    assert config in files, f"{where}: --config {config} is not a file of a mounted ConfigMap"
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / Path(config).name
        path.write_text(files[config])
        return load_config(path, overrides)


def _dtrain_argv(c: Doc, where: str) -> list[str]:
    """The container's dtrain arguments: the image's ENTRYPOINT is dtrain (tini -- dtrain) unless command says
    otherwise."""
    command = c.get("command")
    assert command in (None, ["dtrain"]), f"{where}: runs {command}, not the image's dtrain entry point"
    return [str(a) for a in c["args"]]


@pytest.mark.parametrize("cluster,where", ALL)
def test_container_command_is_accepted_by_the_dtrain_parser(cluster, where):
    docs, spec, c = _container(cluster, where)
    argv = _expand(_dtrain_argv(c, where), c, where)
    args = _parse(build_parser(), argv, where)
    assert args.command in ("coordinator", "worker"), f"{where}: runs dtrain {args.command}"
    files = _mounted_files(docs, spec, c)
    cfg = _load(files, args.config, args.overrides, where)
    for field in ("ca", "server_cert", "server_key", "client_cert", "client_key", "island_tokens"):
        path = getattr(cfg.security, field)
        assert not path or path in files, f"{where}: security.{field} = {path} is no file of a mounted Secret"
    writable = [m["mountPath"] for m in c.get("volumeMounts", []) if not m.get("readOnly")]
    assert any(Path(args.run_dir).is_relative_to(p) for p in writable), f"{where}: --run-dir is on no writable volume"
    ports = {p["containerPort"] for p in c.get("ports", [])}
    if args.command == "coordinator":
        assert cfg.coordinator.host == "0.0.0.0", f"{where}: a coordinator on loopback is unreachable from the Service"
        assert {cfg.coordinator.port, cfg.coordinator.dashboard_port} <= ports, f"{where}: ports not declared"
        assert cfg.coordinator.dashboard_address == "127.0.0.1", (
            f"{where}: the dashboard must bind loopback (coordinator.dashboard_host), reached by kubectl port-forward")
        assert cfg.security.server_cert and cfg.security.server_key, f"{where}: the coordinator must serve TLS"
        assert args.resume == "auto", f"{where}: a restarted pod must resume (and a first start must start)"
        assert args.after_finish == "serve", f"{where}: an exited coordinator would be restarted, resume, exit: a loop"
    else:
        assert cfg.security.ca, f"{where}: the island must verify the coordinator (security.ca)"
        assert args.coordinator.rsplit(":", 1)[1] == str(CoordinatorConfig().port), where


def test_no_service_exposes_the_dashboard_which_binds_loopback():
    """The dashboard is reached with kubectl port-forward (docs/deploy.md), never through the LoadBalancer."""
    docs = build(DEPLOY / "coordinator")
    dash = CoordinatorConfig().dashboard_port
    for name, svc in _named(docs, "Service").items():
        for port in svc["spec"]["ports"]:
            assert port["port"] != dash and port.get("targetPort") not in (dash, "dashboard"), (
                f"Service/{name} exposes the dashboard: it binds loopback (coordinator.dashboard_host)")
    assert "port-forward deployment/dtrain-coordinator 8051" in (ROOT / "docs" / "deploy.md").read_text()


def test_the_configmap_is_the_repos_config_for_the_islands_deployed(tmp_path):
    """The ConfigMap's TOML loads, equals configs/NAME.toml but for outer.islands, and that is the number of islands
    deploy/ launches (the coordinator cuts the data into that many shards, one per island)."""
    (cm,) = _named(build(DEPLOY / "base"), "ConfigMap").values()
    islands = {c["args"][c["args"].index("--island") + 1] for cluster in CLUSTERS
               for _, _, c in _containers(build(DEPLOY / cluster)) if c["args"][0] == "worker"}
    assert islands == {"gpu-a", "tpu-a"}
    for name, text in cm["data"].items():
        (tmp_path / name).write_text(text)
        deployed, repo = load_config(tmp_path / name).to_dict(), load_config(ROOT / "configs" / name).to_dict()
        assert deployed["outer"].pop("islands") == len(islands), f"ConfigMap {name}: outer.islands"
        repo["outer"].pop("islands")
        assert deployed == repo, f"ConfigMap {name} differs from configs/{name} beyond outer.islands"


def test_has_checkpoint_decides_resume_auto(tmp_path):
    cfg = load_config("tiny")
    assert not has_checkpoint(cfg, tmp_path / "new")  # a first start: no run folder yet
    (tmp_path / "run" / "coordinator").mkdir(parents=True)
    assert not has_checkpoint(cfg, tmp_path / "run")  # started, nothing merged yet: start again from θ_0
    (tmp_path / "run" / "coordinator" / "3").mkdir()
    assert has_checkpoint(cfg, tmp_path / "run")
    assert not has_checkpoint(replace(cfg, coordinator={"checkpoint": False}), tmp_path / "run")
    assert build_parser().parse_args(["coordinator", "--config", "tiny", "--resume"]).resume == "always"
    assert build_parser().parse_args(["coordinator", "--config", "tiny"]).resume is None


# -- the placeholder secrets ------------------------------------------------------------------------------------


def test_every_secret_in_deploy_is_a_placeholder_the_code_refuses():
    """deploy/ ships no secret, only placeholders that start with dtrain.net.wire.PLACEHOLDER, the mark the coordinator
    and the islands refuse (the next test): manifests applied unedited fail at once, never run with a known token."""
    secrets = {name: s for cluster in CLUSTERS for name, s in _named(build(DEPLOY / cluster), "Secret").items()}
    assert set(secrets) == {"dtrain-token", "dtrain-ca", "dtrain-coordinator-tls", "dtrain-island-tokens",
                            "dtrain-island-token-gpu-a", "dtrain-island-token-tpu-a", "dtrain-shard-secret"}
    for name, secret in secrets.items():
        assert "data" not in secret, f"Secret {name}: deploy/ ships placeholders (stringData), never a real secret"
        for key, value in secret["stringData"].items():
            assert value.startswith(PLACEHOLDER), f"Secret {name}: {key} = {value!r} lacks the mark {PLACEHOLDER}"


_MULTI_HOST_FLAGS = ("--num-processes", "--process-id", "--jax-coordinator")


@pytest.mark.parametrize("cluster,where", ALL)
def test_unedited_placeholders_stop_the_container_with_one_line(cluster, where, tmp_path, monkeypatch, capsys, certs):
    """The container's own dtrain command (its files under tmp_path; one process standing for a multi-host island's
    every process, which each read the secrets first) with deploy/'s Secrets as the kubelet mounts them: exit 2 and
    one line naming the placeholder's file and the command that makes the real one, before anything is written.
    The coordinator reads the token first: with a real one it refuses the TLS placeholder the same way, and with
    real TLS files the islands' token hashes' placeholder."""
    docs, spec, c = _container(cluster, where)
    root = str(tmp_path)
    for path, text in _mounted_files(docs, spec, c).items():
        (tmp_path / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path.lstrip("/")).write_text(text)
    argv = [re.sub(r"(^|=)/", lambda m: f"{m.group(1)}{root}/", a) for a in _expand(_dtrain_argv(c, where), c, where)]
    for flag in _MULTI_HOST_FLAGS:
        if flag in argv:
            del argv[argv.index(flag):argv.index(flag) + 2]
    run_dir = Path(argv[argv.index("--run-dir") + 1])
    token = _data(_named(docs, "Secret")[_token_secret(c)])["token"]
    monkeypatch.setenv("DTRAIN_TOKEN", token)

    def refused() -> str:
        assert cli_main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1, err
        assert err.startswith(f"dtrain {argv[0]}: config error: [security] ") and "placeholder" in err, err
        assert not run_dir.exists() or not any(run_dir.iterdir()), f"{where}: refused after writing {run_dir}"
        return err

    if argv[0] == "coordinator":
        err = refused()
        assert "$DTRAIN_TOKEN" in err and "deploy/coordinator/secret-token.yaml" in err, err
        assert 'kubectl create secret generic dtrain-token --from-literal=token="$(openssl rand -hex 32)"' in err
        assert "dtrain admin issue-token NAME" in err, err  # an island's token: the same placeholder mark
        monkeypatch.setenv("DTRAIN_TOKEN", "0123456789abcdef" * 4)
        err = refused()
        assert f"{root}/etc/dtrain/tls/tls." in err and "kubectl create secret tls dtrain-coordinator-tls" in err, err
        for src, dst in (("server.pem", "tls/tls.crt"), ("server.key", "tls/tls.key"), ("ca.pem", "ca/ca.crt")):
            (tmp_path / "etc/dtrain" / dst).write_bytes((certs / src).read_bytes())
        err = refused()
        assert f"{root}/etc/dtrain/island-tokens/island-tokens holds the placeholder of " \
               "deploy/coordinator/secret-island-tokens.yaml" in err and "dtrain admin issue-token NAME" in err, err
    else:
        err = refused()  # its channel's CA is read first
        assert f"{root}/etc/dtrain/ca/ca.crt" in err and "--from-file=ca.crt=tls/ca.crt" in err, err
        monkeypatch.setenv("DTRAIN_TOKEN", "0123456789abcdef" * 4)
        (tmp_path / "etc/dtrain/ca/ca.crt").write_text("not pem\n")  # not the placeholder: a plainer refusal
        assert cli_main(argv) == 2
        err = capsys.readouterr().err
        assert err.strip().endswith(f"{root}/etc/dtrain/ca/ca.crt is not a PEM file (no '-----BEGIN' line): name a "
                                    "PEM file in security.ca"), err


def test_the_placeholder_token_is_refused_wherever_it_is_read(monkeypatch):
    """read_token, the one reader of the token (the coordinator's serve and run_coordinator, every client): the
    placeholder (even with the whitespace a copy may add) is refused; a real token, or none, passes."""
    sec = load_config(None).security
    for placeholder in ("REPLACE-ME-with-openssl-rand-hex-32", f" {PLACEHOLDER}\n"):
        monkeypatch.setenv(sec.token_env, placeholder)
        with pytest.raises(ConfigError, match=r"^\[security\] token_env: \$DTRAIN_TOKEN holds the placeholder"):
            read_token(sec)
    monkeypatch.setenv(sec.token_env, "s3cret")  # no minimum length: short tokens in use stay accepted
    assert read_token(sec) == "s3cret"
    monkeypatch.delenv(sec.token_env)
    assert read_token(sec) is None
