"""The Helm chart (deploy/helm/racer) checked without a cluster.

Helm itself renders and lints the chart: ``helm-python-sdk`` binds Helm's Go SDK (a shared library
in the wheel), so neither a ``helm`` binary nor a cluster is needed, and a render validates the
values against values.schema.json as ``helm install`` does. Every rendered document is parsed by a
YAML loader that refuses duplicate keys, its names and labels checked against Kubernetes' limits,
and validated (strictly: no unknown field) against the Kubernetes OpenAPI schemas bundled in
``kubernetes-validate``, for the oldest and the newest version the tests name; the two custom
resources (ServiceMonitor, PrometheusRule), which those schemas lack, are checked field by field.

Nothing in the chart is a placeholder: every ``racer`` command line it renders is parsed by that
command's own argparse parser (each flag spelt out in full, no abbreviation), and every ``RACER_*``
variable it sets is a control-plane Settings field or is read by the source of the process it is
set on.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from dataclasses import fields
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from .conftest import REPO

CHART = REPO / "deploy" / "helm" / "racer"
ALERT_RULES = REPO / "deploy" / "prometheus" / "racer-alerts.yml"
DOCS = REPO / "docs" / "deploy.md"
RELEASE, NAMESPACE = "demo", "racer"
#: the oldest Kubernetes the schemas are checked against, and the newest kubernetes-validate bundles
K8S_VERSIONS = ("1.29", kubernetes_validate.latest_version())

SECRET_NAMES = {"adminToken": "racer-admin", "secretKey": "racer-secret-key", "fleetToken": "racer-fleet",
                "routerToken": "racer-router", "nodeTokens": "racer-node-tokens"}
DB_SECRET = "racer-database"
BASE = {"image": {"repository": "registry.internal/racer", "tag": "0.1.0"},
        "secrets": {k: {"name": v} for k, v in SECRET_NAMES.items()}}

#: value combinations rendered, linted and validated (each merged over BASE)
COMBOS: dict[str, dict] = {
    "gpu": {},
    "gpu-multi": {
        "nodeAgent": {"gpu": {"agentsPerNode": 2, "stateHostPath": "/var/lib/racer"},
                      "extraArgs": ["--num-pages", "8192", "--profile", "/etc/racer/node_profile.json"]},
        "trace": {"kind": "taobao", "path": "/var/lib/racer/data/UserBehavior.csv",
                  "dataVolume": {"persistentVolumeClaim": {"claimName": "racer-traces", "readOnly": True}}},
    },
    "emulated": {"nodeAgent": {"mode": "emulated",
                               "emulated": {"replicas": 3, "timeScale": 10, "persistence": {"enabled": True}}}},
    "postgresql-ha": {
        "controlPlane": {"replicas": 2,
                         "database": {"type": "postgresql", "postgresql": {"existingSecret": DB_SECRET}},
                         "settings": {"raw_retention_s": 259200, "node_burst_report_bytes": 67108864,
                                      "slo_objective": 0.995, "weights_rel_change": 0.1, "scheduler": True}},
        "gateway": {"advertise": True},
    },
    "postgresql-jobs": {
        "controlPlane": {"replicas": 2, "jobsProcess": {"enabled": True, "replicas": 2},
                         "database": {"type": "postgresql", "postgresql": {"existingSecret": DB_SECRET}}},
        "metrics": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}},
    },
    "gateways-hpa": {"gateway": {"replicas": 3, "extraArgs": ["--slo-ms", "50"],
                                 "autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 12,
                                                 "targetCPUUtilizationPercentage": 60}}},
    "monitoring": {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
                               "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}}},
}

#: the sources each process reads its environment in (besides the control plane's Settings)
ENV_SOURCES = {
    "control-plane": ["common/http_server.py"],
    "gateway": ["gateway/cli.py", "common/secrets_args.py", "workloads/loaders.py", "common/http_server.py"],
    "node-agent": ["node_agent/cli.py", "common/secrets_args.py", "workloads/loaders.py", "common/http_server.py"],
    "dashboard": ["dashboard/cli.py", "dashboard/app.py", "common/http_server.py"],
}

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


# ------------------------------------------------------------------------------------ helpers ---
class UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that refuses a mapping with the same key twice (PyYAML keeps the last one
    silently; so would the API server's decoder for some fields, and kubectl apply for others)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark, f"found duplicate key {key!r}",
                        key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)


def merged(*layers: dict) -> dict:
    out: dict = {}
    for layer in layers:
        _merge_into(out, copy.deepcopy(layer))
    return out


def _merge_into(a: dict, b: dict) -> None:
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(a.get(k), dict):
            _merge_into(a[k], v)
        else:
            a[k] = v


def render(values: dict, *, name: str = RELEASE) -> dict[str, str]:
    with helm.Chart.load(CHART) as chart:
        return chart.render(values, name=name, namespace=NAMESPACE, is_install=True)


def documents(rendered: dict[str, str]) -> list[dict]:
    docs = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.load_all(text, Loader=UniqueKeyLoader):
            if doc is not None:
                docs.append(doc)
    return docs


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet")]


def containers(docs: list[dict]):
    """(workload, pod spec, container) for every container the chart renders."""
    for w in workloads(docs):
        spec = w["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            yield w, spec, c


def component(w: dict) -> str:
    return w["metadata"]["labels"]["app.kubernetes.io/component"]


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def arg_value(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict[str, str]]:
    return {combo: render(merged(BASE, patch)) for combo, patch in COMBOS.items()}


@pytest.fixture(scope="module")
def docs(rendered) -> dict[str, list[dict]]:
    return {combo: documents(out) for combo, out in rendered.items()}


@pytest.fixture(scope="module")
def parsers():
    """racer's own parser for each command the chart runs (racer.cli.build_parser builds them)."""
    from racer.cli import build_parser

    return {cmd: build_parser([cmd]) for cmd in ("control-plane", "gateway", "node-agent", "dashboard", "token")}


def subparser(parser, cmd: str):
    import argparse

    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[cmd]


# ------------------------------------------------------------------------- lint and structure ---
def test_the_yaml_loader_refuses_duplicate_keys():
    with pytest.raises(yaml.constructor.ConstructorError, match="duplicate key 'image'"):
        yaml.load("name: a\nimage: x\nimage: y\n", Loader=UniqueKeyLoader)
    with pytest.raises(yaml.constructor.ConstructorError, match="duplicate key"):
        yaml.load("spec:\n  containers:\n    - name: a\n      args: []\n      args: [x]\n", Loader=UniqueKeyLoader)
    assert yaml.load("a: 1\nb: {c: 2}\n", Loader=UniqueKeyLoader) == {"a": 1, "b": {"c": 2}}


@pytest.mark.parametrize("combo", COMBOS)
def test_helm_lint_strict_finds_nothing(combo):
    report = helm.lint(CHART, merged(BASE, COMBOS[combo]), strict=True, kube_version="v1.29.0", namespace=NAMESPACE)
    assert report["errors"] == [], report
    # 1 is info ("icon is recommended"); strict lint fails on warnings (2) and errors (3)
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


def test_helm_lint_of_the_bare_chart_names_each_required_value():
    report = helm.lint(CHART, None, strict=True)
    text = "\n".join(report["errors"])
    assert "/image/repository" in text
    for key in SECRET_NAMES:
        assert f"/secrets/{key}/name" in text, text


@pytest.mark.parametrize("combo", COMBOS)
def test_documents_parse_and_names_and_labels_fit(docs, combo):
    names = set()
    assert docs[combo], "nothing rendered"
    for d in docs[combo]:
        meta = d["metadata"]
        name = meta["name"]
        assert len(name) <= 63 and DNS_LABEL.match(name), name
        if d["kind"] in ("StatefulSet", "DaemonSet"):
            # the controller-revision-hash label is the name, '-' and 10 characters
            assert len(name) <= 52, name
        assert (d["kind"], name) not in names, f"two {d['kind']} named {name}"
        names.add((d["kind"], name))
        label_sets = [meta.get("labels", {})]
        if "template" in d.get("spec", {}):
            label_sets.append(d["spec"]["template"]["metadata"]["labels"])
            label_sets.append(d["spec"]["selector"]["matchLabels"])
        for labels in label_sets:
            for key, value in labels.items():
                prefix, _, key_name = key.rpartition("/")
                assert len(key_name) <= 63 and LABEL_NAME.match(key_name), key
                assert len(prefix) <= 253, key
                assert isinstance(value, str) and len(value) <= 63 and LABEL_VALUE.match(value), (key, value)
        for key in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component",
                    "app.kubernetes.io/version", "app.kubernetes.io/managed-by"):
            assert key in meta["labels"], (d["kind"], name, key)
        assert meta["labels"]["app.kubernetes.io/instance"] == RELEASE
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "Helm"


def test_names_stay_within_limits_for_the_longest_release_name():
    long_release = "r" * 53  # Helm's longest release name
    out = documents(render(merged(BASE, COMBOS["gpu-multi"], {"metrics": COMBOS["monitoring"]["metrics"]}),
                           name=long_release))
    names = [(d["kind"], d["metadata"]["name"]) for d in out]
    assert len(names) == len(set(names)), names
    for kind, name in names:
        assert len(name) <= (52 if kind in ("StatefulSet", "DaemonSet") else 63) and DNS_LABEL.match(name), name
    emulated = documents(render(merged(BASE, COMBOS["emulated"], {"fullnameOverride": "x" * 63})))
    for kind, name in ((d["kind"], d["metadata"]["name"]) for d in emulated):
        assert len(name) <= (52 if kind in ("StatefulSet", "DaemonSet") else 63) and DNS_LABEL.match(name), name


# -------------------------------------------------------------------- Kubernetes' own schemas ---
def check_service_monitor(d: dict) -> None:
    assert d["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(d) == {"apiVersion", "kind", "metadata", "spec"}
    spec = d["spec"]
    assert set(spec) <= {"selector", "namespaceSelector", "endpoints", "jobLabel"}
    sel = spec["selector"]
    assert set(sel) <= {"matchLabels", "matchExpressions"} and sel
    for e in sel.get("matchExpressions", []):
        assert set(e) == {"key", "operator", "values"} and e["operator"] in ("In", "NotIn") and e["values"]
    assert set(spec["namespaceSelector"]) == {"matchNames"} and spec["namespaceSelector"]["matchNames"] == [NAMESPACE]
    assert spec["endpoints"]
    for ep in spec["endpoints"]:
        assert set(ep) <= {"port", "path", "interval", "scheme"}
        assert ep["port"] == "http" and ep["path"] == "/metrics"
        assert re.fullmatch(r"([0-9]+(ms|s|m|h))+", ep["interval"])


def check_prometheus_rule(d: dict) -> None:
    assert d["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(d) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(d["spec"]) == {"groups"}
    group_names = [g["name"] for g in d["spec"]["groups"]]
    assert len(group_names) == len(set(group_names))
    for g in d["spec"]["groups"]:
        assert set(g) <= {"name", "interval", "rules"} and g["rules"]
        for r in g["rules"]:
            assert set(r) <= {"alert", "record", "expr", "for", "labels", "annotations", "keep_firing_for"}
            assert ("alert" in r) != ("record" in r) and isinstance(r["expr"], str) and r["expr"].strip()
            if "for" in r:
                assert re.fullmatch(r"([0-9]+(ms|s|m|h|d|w|y))+", r["for"])
            for m in ("labels", "annotations"):
                assert all(isinstance(v, str) for v in r.get(m, {}).values())


CUSTOM = {"ServiceMonitor": check_service_monitor, "PrometheusRule": check_prometheus_rule}


@pytest.mark.parametrize("combo", COMBOS)
def test_objects_validate_against_the_kubernetes_schemas(docs, combo):
    for d in docs[combo]:
        if d["kind"] in CUSTOM:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(d, K8S_VERSIONS[-1], strict=True)
            CUSTOM[d["kind"]](d)
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(d, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{combo}: {d['kind']} {d['metadata']['name']} is not valid Kubernetes {version}: {e}")


def test_the_schema_check_itself_refuses_a_wrong_object():
    bad = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
           "spec": {"selector": {"matchLabels": {"a": "b"}}, "template": {
               "metadata": {"labels": {"a": "b"}},
               "spec": {"containers": [{"name": "c", "image": "i", "ports": [{"containerPort": "8000"}]}]}}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)
    del bad["spec"]["template"]["spec"]["containers"][0]["ports"]
    bad["spec"]["template"]["spec"]["containers"][0]["imagePolicy"] = "Always"  # not a field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)


# ------------------------------------------------------------------------- what each one holds ---
def test_gpu_agents_are_a_daemonset_per_slot_each_given_one_gpu(docs):
    for combo, slots in (("gpu", 1), ("gpu-multi", 2)):
        out = docs[combo]
        assert of_kind(out, "StatefulSet") == []
        ds = of_kind(out, "DaemonSet")
        assert len(ds) == slots
        node_ids = set()
        for d in ds:
            spec = d["spec"]["template"]["spec"]
            (c,) = spec["containers"]
            assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
            assert "nvidia.com/gpu" not in c["resources"].get("requests", {}) or \
                c["resources"]["requests"]["nvidia.com/gpu"] == 1
            assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
            args = c["args"]
            assert arg_value(args, "--device") == "cuda" and "--emulate" not in args
            assert d["spec"]["selector"]["matchLabels"]["racer/gpu-slot"] in {str(i) for i in range(slots)}
            node_ids.add(arg_value(args, "--node-id"))
            env = env_of(c)
            assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
        assert node_ids == {f"$(NODE_NAME)-gpu{i}" for i in range(slots)}
    multi = of_kind(docs["gpu-multi"], "DaemonSet")[0]["spec"]["template"]["spec"]
    assert {"name": "state", "hostPath": {"path": "/var/lib/racer", "type": "DirectoryOrCreate"}} in multi["volumes"]
    (c,) = multi["containers"]
    assert env_of(c)["RACER_DATA_DIR"]["value"] == "/var/lib/racer/data"
    assert arg_value(c["args"], "--path") == "/var/lib/racer/data/UserBehavior.csv"
    assert arg_value(c["args"], "--num-pages") == "8192"


def test_emulated_agents_are_a_statefulset_without_gpus(docs, rendered):
    out = docs["emulated"]
    assert of_kind(out, "DaemonSet") == []
    (sts,) = of_kind(out, "StatefulSet")
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["serviceName"] in {s["metadata"]["name"] for s in of_kind(out, "Service")}
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    assert arg_value(c["args"], "--emulate") == "a100-hstu"
    assert arg_value(c["args"], "--time-scale") == "10"
    assert arg_value(c["args"], "--node-id") == "$(POD_NAME)"
    assert "--device" not in c["args"]
    assert [v["metadata"]["name"] for v in sts["spec"]["volumeClaimTemplates"]] == ["state"]
    assert "nvidia.com/gpu" not in "".join(rendered["emulated"].values())


def test_node_agents_read_their_own_token_bound_to_their_node_id(docs):
    for combo in ("gpu", "gpu-multi", "emulated"):
        for w, spec, c in containers(docs[combo]):
            if component(w) != "node-agent":
                continue
            node_id, token_file = arg_value(c["args"], "--node-id"), arg_value(c["args"], "--token-file")
            mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
            secret_vols = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
            (vol,) = [n for n, s in secret_vols.items() if s == SECRET_NAMES["nodeTokens"]]
            assert token_file == f"{mounts[vol]}/{node_id}", (token_file, node_id)
            assert arg_value(c["args"], "--advertise-url").startswith("http://$(POD_IP):")


def test_sqlite_is_one_replica_on_a_kept_claim(docs):
    out = docs["gpu"]
    (cp,) = [w for w in of_kind(out, "Deployment") if component(w) == "control-plane"]
    assert cp["spec"]["replicas"] == 1 and cp["spec"]["strategy"] == {"type": "Recreate"}
    (c,) = cp["spec"]["template"]["spec"]["containers"]
    url = env_of(c)["RACER_DATABASE_URL"]["value"]
    mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["data"]
    assert url == f"sqlite:///{mount}/racer-control-plane.db"
    (pvc,) = of_kind(out, "PersistentVolumeClaim")
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    claim = next(v for v in cp["spec"]["template"]["spec"]["volumes"] if v["name"] == "data")
    assert claim["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]


def test_postgresql_takes_several_replicas_and_its_url_from_a_secret(docs):
    out = docs["postgresql-ha"]
    assert of_kind(out, "PersistentVolumeClaim") == []
    (cp,) = [w for w in of_kind(out, "Deployment") if component(w) == "control-plane"]
    assert cp["spec"]["replicas"] == 2 and "strategy" not in cp["spec"]
    (c,) = cp["spec"]["template"]["spec"]["containers"]
    env = env_of(c)
    assert env["RACER_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {"name": DB_SECRET, "key": "database-url"}
    assert "volumeMounts" not in c
    # settings as RACER_<NAME>, integers without an exponent
    assert env["RACER_RAW_RETENTION_S"]["value"] == "259200"
    assert env["RACER_NODE_BURST_REPORT_BYTES"]["value"] == "67108864"
    assert env["RACER_SLO_OBJECTIVE"]["value"] == "0.995"
    assert env["RACER_SCHEDULER"]["value"] == "true"
    from control_plane.settings import Settings

    settings = {e[len("RACER_"):].lower(): e2["value"] for e, e2 in env.items()
                if e.startswith("RACER_") and "value" in e2}
    # what the control plane makes of those strings (Settings.from_env's parsing) is what was asked
    import os
    from unittest import mock

    with mock.patch.dict(os.environ, {f"RACER_{k.upper()}": v for k, v in settings.items()}, clear=True):
        s = Settings.from_env()
    assert (s.raw_retention_s, s.node_burst_report_bytes, s.slo_objective, s.weights_rel_change, s.scheduler) == \
        (259200.0, 67108864, 0.995, 0.1, True)
    (gw,) = [w for w in of_kind(out, "Deployment") if component(w) == "gateway"]
    (g,) = gw["spec"]["template"]["spec"]["containers"]
    assert arg_value(g["args"], "--advertise-url") == "http://$(POD_IP):8000"
    assert env_of(g)["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_hpa_only_when_enabled_and_it_scales_the_gateways(docs):
    for combo, out in docs.items():
        hpas = of_kind(out, "HorizontalPodAutoscaler")
        (gw,) = [w for w in of_kind(out, "Deployment") if component(w) == "gateway"]
        if combo != "gateways-hpa":
            assert hpas == [], combo
            assert gw["spec"]["replicas"] == 2
            continue
        (hpa,) = hpas
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                 "name": gw["metadata"]["name"]}
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
        (metric,) = hpa["spec"]["metrics"]
        assert metric["resource"] == {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 60}}
        assert "replicas" not in gw["spec"]  # the HPA owns it
        (c,) = gw["spec"]["template"]["spec"]["containers"]
        assert c["resources"]["requests"]["cpu"]
        assert c["args"][-2:] == ["--slo-ms", "50"]


def test_monitoring_objects_only_when_enabled(docs):
    for combo, out in docs.items():
        kinds = {d["kind"] for d in out}
        assert ("ServiceMonitor" in kinds) == ("PrometheusRule" in kinds) == (combo in ("monitoring", "postgresql-jobs")), combo
    out = docs["monitoring"]
    (rule,) = of_kind(out, "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(ALERT_RULES.read_text())["groups"]
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (sm,) = of_kind(out, "ServiceMonitor")
    (expr,) = sm["spec"]["selector"]["matchExpressions"]
    assert expr["key"] == "app.kubernetes.io/component"
    assert sorted(expr["values"]) == ["control-plane", "gateway", "node-agent"]
    scraped = [s for s in of_kind(out, "Service")
               if s["metadata"]["labels"]["app.kubernetes.io/component"] in expr["values"]]
    assert len(scraped) == 3
    for s in scraped:
        assert all(s["metadata"]["labels"][k] == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
        assert "http" in [p["name"] for p in s["spec"]["ports"]]


def test_the_chart_ships_the_alert_rules_byte_for_byte():
    assert (CHART / "files" / "racer-alerts.yml").read_bytes() == ALERT_RULES.read_bytes(), \
        "deploy/helm/racer/files/racer-alerts.yml must be a copy of deploy/prometheus/racer-alerts.yml"


def test_prometheus_annotations_name_each_process_metrics_port(docs):
    for combo, out in docs.items():
        for w, _spec, c in containers(out):
            ann = w["spec"]["template"]["metadata"].get("annotations", {})
            if component(w) == "dashboard":  # it serves no /metrics
                assert not any(k.startswith("prometheus.io/") for k in ann), combo
                continue
            port = next(p["containerPort"] for p in c["ports"] if p["name"] == "http")
            assert ann == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                           "prometheus.io/path": "/metrics"}, (combo, w["metadata"]["name"])


def test_services_and_probes_are_wired_to_what_exists(docs):
    for combo, out in docs.items():
        pods = [w["spec"]["template"]["metadata"]["labels"] for w in workloads(out)]
        for s in of_kind(out, "Service"):
            sel = s["spec"]["selector"]
            assert any(all(p.get(k) == v for k, v in sel.items()) for p in pods), (combo, s["metadata"]["name"])
        for w in workloads(out):
            labels = w["spec"]["template"]["metadata"]["labels"]
            assert all(labels.get(k) == v for k, v in w["spec"]["selector"]["matchLabels"].items())
        services = {s["metadata"]["name"]: s["spec"]["ports"][0]["port"] for s in of_kind(out, "Service")}
        for w, _spec, c in containers(out):
            ports = {p["name"] for p in c["ports"]}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in c:
                    handler = c[probe].get("httpGet") or c[probe].get("tcpSocket")
                    assert handler["port"] in ports, (combo, probe)
            cp_url = arg_value(c["args"], "--control-plane")
            if cp_url is not None:
                host, port = re.fullmatch(r"http://([-a-z0-9]+):(\d+)", cp_url).groups()
                assert services[host] == int(port), cp_url


# --------------------------------------------------------------------------------- secrets ---
SECRET_ENV = re.compile(r"TOKEN|SECRET|PASSWORD|KEY|DATABASE_URL")


def test_no_secret_value_in_any_manifest(docs, rendered):
    allowed = set(SECRET_NAMES.values()) | {DB_SECRET}
    for combo, out in docs.items():
        assert of_kind(out, "Secret") == [], combo
        for w, spec, c in containers(out):
            for e in c.get("env", []):
                if SECRET_ENV.search(e["name"]) and not (e["name"] == "RACER_DATABASE_URL" and
                                                         e.get("value", "").startswith("sqlite:")):
                    assert "value" not in e and e["valueFrom"]["secretKeyRef"]["name"] in allowed, (combo, e)
            for arg in c["args"]:
                # secrets go in files or the environment, never on a command line (ps shows it)
                assert arg not in ("--token", "--admin-token", "--secret-key", "--db"), (combo, arg)
                assert "postgresql" not in arg, (combo, arg)
            for v in spec.get("volumes", []):
                if "secret" in v:
                    assert v["secret"]["secretName"] in allowed
        text = "".join(rendered[combo].values())
        assert "stringData" not in text and "kind: Secret" not in text


# ------------------------------------------------------------------------- refused values ---
BAD_VALUES = [
    ({"nodeAgent": {"mode": "tpu"}}, "/nodeAgent/mode"),
    ({"controlPlane": {"replicas": 0}}, "/controlPlane/replicas"),
    ({"gateway": {"replicas": 0}}, "/gateway/replicas"),
    ({"nodeAgent": {"emulated": {"replicas": 0}}}, "/nodeAgent/emulated/replicas"),
    ({"gateway": {"port": "8000"}}, "/gateway/port"),
    ({"controlPlane": {"port": 8600.5}}, "/controlPlane/port"),
    ({"nodeAgent": {"port": 70000}}, "/nodeAgent/port"),
    ({"secrets": {"fleetToken": {"name": ""}}}, "/secrets/fleetToken/name"),
    ({"secrets": {"adminToken": {"name": "racer-admin", "value": "s3cret"}}}, "value"),
    ({"controlPlane": {"database": {"type": "postgresql"}}}, "/controlPlane/database/postgresql"),
    ({"controlPlane": {"database": {"type": "mysql"}}}, "/controlPlane/database/type"),
    ({"controlPlane": {"database": {"type": "postgresql", "postgresql": {"existingSecret": DB_SECRET,
                                                                        "url": "postgresql://u:p@h/db"}}}}, "url"),
    ({"controlPlane": {"settings": {"no_such_setting": 1}}}, "no_such_setting"),
    ({"controlPlane": {"settings": {"admin_token": "s3cret"}}}, "admin_token"),
    ({"controlPlane": {"settings": {"weights_period_s": 0}}}, "/controlPlane/settings/weights_period_s"),
    ({"nodeAgent": {"emulated": {"timeScale": 0}}}, "/nodeAgent/emulated/timeScale"),
    ({"nodeAgent": {"gpu": {"agentsPerNode": 0}}}, "/nodeAgent/gpu/agentsPerNode"),
    ({"trace": {"kind": "netflix"}}, "/trace/kind"),
    ({"gateway": {"router": "random"}}, "/gateway/router"),
    ({"gateway": {"replica": 3}}, "replica"),
    ({"image": {"repository": ""}}, "/image/repository"),
]


@pytest.mark.parametrize("patch,where", BAD_VALUES, ids=[json.dumps(p)[:60] for p, _ in BAD_VALUES])
def test_schema_refuses_bad_values(patch, where):
    with pytest.raises(helm.HelmValuesError, match=re.escape(where)):
        render(merged(BASE, patch))


FAILS = [
    ({"controlPlane": {"replicas": 2}},
     "controlPlane.replicas is 2 with controlPlane.database.type sqlite: SQLite is one file on one volume"),
    ({"controlPlane": {"jobsProcess": {"enabled": True}}},
     "controlPlane.jobsProcess.enabled with controlPlane.database.type sqlite"),
    ({"gateway": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
     "gateway.autoscaling.maxReplicas (2) is below gateway.autoscaling.minReplicas (5)"),
    # null removes a default key in Helm's merge of the values
    ({"gateway": {"autoscaling": {"enabled": True}, "resources": {"requests": {"cpu": None}}}},
     "gateway.autoscaling.enabled needs gateway.resources.requests.cpu"),
    ({"metrics": {"prometheusRule": {"enabled": True}}, "controlPlane": {"settings": {"slo_objective": 0.995}}},
     "the shipped alert rules (metrics.prometheusRule) assume 0.99"),
]


@pytest.mark.parametrize("patch,message", FAILS, ids=[m[:40] for _, m in FAILS])
def test_templates_refuse_cross_field_mistakes(patch, message):
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        render(merged(BASE, patch))


def test_a_jobs_process_runs_the_jobs_and_the_api_replicas_do_not(docs):
    out = docs["postgresql-jobs"]
    deps = {component(w): w for w in of_kind(out, "Deployment") if component(w).startswith("control-plane")}
    assert set(deps) == {"control-plane", "control-plane-jobs"}
    api, jobs = deps["control-plane"], deps["control-plane-jobs"]
    assert api["spec"]["replicas"] == 2 and jobs["spec"]["replicas"] == 2
    (a,) = api["spec"]["template"]["spec"]["containers"]
    (j,) = jobs["spec"]["template"]["spec"]["containers"]
    assert "--no-scheduler" in a["args"] and "--jobs-only" not in a["args"]
    assert "--jobs-only" in j["args"] and "--no-scheduler" not in j["args"]
    assert env_of(j)["RACER_DATABASE_URL"] == env_of(a)["RACER_DATABASE_URL"]
    assert env_of(j)["RACER_SECRET_KEY"] == env_of(a)["RACER_SECRET_KEY"]  # it pushes the weights
    assert j["resources"]["requests"]["cpu"] == "250m"
    # its /metrics (the jobs' runs and durations) behind a Service of its own, scraped; no API traffic
    svcs = {component(x): x for x in of_kind(out, "Service")}
    assert svcs["control-plane-jobs"]["spec"]["selector"]["app.kubernetes.io/component"] == "control-plane-jobs"
    (sm,) = of_kind(out, "ServiceMonitor")
    assert "control-plane-jobs" in sm["spec"]["selector"]["matchExpressions"][0]["values"]
    # off by default: one Deployment whose replicas elect the scheduler among themselves
    plain = docs["postgresql-ha"]
    (cp,) = [w for w in of_kind(plain, "Deployment") if component(w).startswith("control-plane")]
    assert "--no-scheduler" not in cp["spec"]["template"]["spec"]["containers"][0]["args"]


def test_postgresql_with_two_replicas_and_the_default_slo_objective_renders():
    render(merged(BASE, COMBOS["postgresql-ha"], {"controlPlane": {"settings": {"slo_objective": 0.99}},
                                                  "metrics": {"prometheusRule": {"enabled": True}}}))


# ---------------------------------------------------------------- nothing is a placeholder ---
def test_every_racer_command_line_parses_with_racers_own_parser(docs, parsers):
    seen = set()
    for combo, out in docs.items():
        for w, _spec, c in containers(out):
            assert c["command"] == ["racer"], c["command"]
            cmd, args = c["args"][0], c["args"][1:]
            assert cmd == component(w).removesuffix("-jobs"), (cmd, component(w))  # control-plane-jobs
            seen.add(cmd)
            sub = subparser(parsers[cmd], cmd)
            for arg in args:
                if arg.startswith("--"):
                    # spelt in full: argparse would also take an abbreviation
                    assert arg in sub._option_string_actions, f"{combo}: racer {cmd} has no option {arg}"
            try:
                ns = parsers[cmd].parse_args([cmd, *args])
            except SystemExit:
                pytest.fail(f"{combo}: racer {cmd} refuses {shlex.join(args)}")
            assert ns.command == cmd and ns.func.__name__.startswith("cmd_")
    assert seen == {"control-plane", "gateway", "node-agent", "dashboard"}


def test_every_racer_variable_is_read_by_the_process_it_is_set_on(docs):
    from control_plane.settings import Settings

    setting_names = {f.name for f in fields(Settings)}
    sources = {cmd: "".join((REPO / p).read_text() for p in paths) for cmd, paths in ENV_SOURCES.items()}
    seen = set()
    for combo, out in docs.items():
        for w, _spec, c in containers(out):
            cmd = c["args"][0]
            for name in env_of(c):
                if name.startswith("RACER_"):
                    seen.add(name)
                    if cmd == "control-plane" and name[len("RACER_"):].lower() in setting_names:
                        continue
                    assert f'"{name}"' in sources[cmd], f"{combo}: racer {cmd} never reads {name}"
                else:
                    # a helper variable (downward API) is used by an argument, or it is a placeholder
                    assert any(f"$({name})" in a for a in c["args"]), f"{combo}: {name} is set and never used"
    assert {"RACER_DATABASE_URL", "RACER_ADMIN_TOKEN", "RACER_SECRET_KEY", "RACER_FLEET_TOKEN",
            "RACER_GATEWAY_TOKEN", "RACER_DATA_DIR"} <= seen


def test_the_schema_agrees_with_the_code(parsers):
    from control_plane.settings import Settings
    from workloads.loaders import LOADERS

    schema = json.loads((CHART / "values.schema.json").read_text())
    props = schema["properties"]
    assert sorted(props["trace"]["properties"]["kind"]["enum"]) == sorted(LOADERS)
    gw = subparser(parsers["gateway"], "gateway")._option_string_actions
    assert sorted(props["gateway"]["properties"]["router"]["enum"]) == sorted(gw["--router"].choices)
    assert sorted(props["gateway"]["properties"]["logLevel"]["enum"]) == sorted(gw["--log-level"].choices)
    na = subparser(parsers["node-agent"], "node-agent")._option_string_actions
    assert sorted(props["nodeAgent"]["properties"]["logLevel"]["enum"]) == sorted(na["--log-level"].choices)
    settings = props["controlPlane"]["properties"]["settings"]
    assert settings["additionalProperties"] is False
    names = {f.name: f for f in fields(Settings)}
    assert set(settings["properties"]) <= set(names)
    # secrets and what the chart sets itself are not settings a value may give
    assert not set(settings["properties"]) & {"database_url", "admin_token", "secret_key", "secret_key_file",
                                               "host", "port"}
    for key, rule in settings["properties"].items():
        kind = names[key].type
        assert rule["type"] == ("boolean" if kind == "bool" else "integer" if kind == "int" else "number"), key
    # the defaults of values.yaml render, and Helm's view of them is the file's
    with helm.Chart.load(CHART) as chart:
        assert chart.values == yaml.safe_load((CHART / "values.yaml").read_text())
        assert chart.metadata["appVersion"] == __import__("racer").__version__


def test_notes_give_token_commands_racer_accepts(rendered, parsers):
    notes = rendered["gpu"]["racer/templates/NOTES.txt"]
    commands = [line.split(" -- ", 1)[1] for line in notes.splitlines() if " -- racer " in line]
    assert len(commands) == 2
    for command in commands:
        words = shlex.split(command)
        assert words[:3] == ["racer", "token", "create"]
        try:
            parsers["token"].parse_args(words[1:])
        except SystemExit:
            pytest.fail(f"racer refuses {command!r}")


def test_docs_create_the_secret_keys_the_chart_reads():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    text = DOCS.read_text()
    for key in ("adminToken", "secretKey", "fleetToken", "routerToken"):
        assert f"--from-literal={values['secrets'][key]['key']}=" in text or \
            f"--from-file={values['secrets'][key]['key']}=" in text, key
    url_key = values["controlPlane"]["database"]["postgresql"]["urlKey"]
    assert f"--from-literal={url_key}=" in text or f"--from-file={url_key}=" in text
