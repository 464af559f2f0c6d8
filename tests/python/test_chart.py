"""The Helm chart, rendered and linted with Helm's own Go code (helm-python-sdk, offline).

Every rendered object must round-trip through its k8s-openapi type with no field lost
(gantry-testkit k8s-check), Gantry custom objects must validate against the generated CRDs, and
the RBAC rules must equal the operator's table (operator/src/rbac.rs) exactly.
"""
import base64
import json
import re
import subprocess

import helm_python as helm
import pytest

from k8s import CHART, ROOT, binary, docs, k8s_check, validate_custom

NS = "gantry-system"
DIGEST = "sha256:" + "ab" * 32

OVERRIDES = {
    "defaults": {},
    "gateway-only": {"controller": {"enabled": False}},
    "controller-only": {"gateway": {"enabled": False}},
    "no-default-engines": {"engines": {"llamaCpp": {"cpu": {"enabled": False}, "cuda": {"enabled": False}},
                                       "native": {"cpu": {"enabled": False}, "cuda": {"enabled": False}},
                                       "onnx": {"cpu": {"enabled": False}}}},
    "network-policies": {"networkPolicy": {"metricsNamespace": "monitoring",
                                           "nodeDownloadCidrs": ["10.20.0.0/16", "192.0.2.0/24"]}},
    "no-network-policies": {"networkPolicy": {"enabled": False}},
    "auth-none": {"gateway": {"auth": {"mode": "none"}}},
    "own-secrets": {"nodeToken": {"existingSecret": "my-node-token"}, "gateway": {"apiKeysSecret": "my-keys"}},
    "service-monitor-and-dashboard": {"metrics": {"serviceMonitor": {"enabled": True},
                                                  "dashboard": {"enabled": True}}},
    "digests": {"image": {"operator": {"digest": DIGEST}, "node": {"digest": DIGEST}},
                "engines": {"llamaCpp": {"cpu": {"digest": DIGEST, "sha256": "cd" * 32},
                                         "cuda": {"digest": DIGEST}}}},
    "split-gateway": {"gateway": {"replicas": 3, "apiKeysSecret": "gantry-api-keys"}, "controller": {"replicas": 2}},
}


def render_files(values: dict) -> dict[str, str]:
    with helm.Chart.load(CHART) as chart:
        return chart.render(values, name="gantry", namespace=NS, is_install=True)


def render(values: dict) -> list[dict]:
    objects = []
    for path, text in sorted(render_files(values).items()):
        if path.endswith(".yaml"):
            objects.extend(docs(text))
    return objects


def notes(values: dict) -> str:
    [text] = [t for p, t in render_files(values).items() if p.endswith("NOTES.txt")]
    return text


def env_of(deploy: dict) -> dict:
    """name -> the whole env entry of the operator container."""
    return {e["name"]: e for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]}


def secret(objects, name) -> dict:
    [s] = [o for o in of_kind(objects, "Secret") if o["metadata"]["name"] == name]
    return {k: base64.b64decode(v).decode() for k, v in s["data"].items()}


def of_kind(objects, kind):
    return [o for o in objects if o["kind"] == kind]


@pytest.mark.parametrize("case", sorted(OVERRIDES))
def test_renders_and_every_object_matches_its_kubernetes_type(case):
    objects = render(OVERRIDES[case])
    assert objects, "nothing rendered"
    verdicts = k8s_check(objects)
    bad = [v for v in verdicts if v["result"] == "invalid"]
    assert not bad, json.dumps(bad, indent=1)
    for obj, v in zip(objects, verdicts):
        if v["result"] == "custom":
            if obj["apiVersion"].startswith("gantry.dev/"):
                validate_custom(obj)
            else:
                assert obj["kind"] == "ServiceMonitor", f"unchecked custom object {obj['kind']}"
                check_service_monitor(obj)


def check_service_monitor(obj):
    # The prometheus-operator CRD is not available offline; check the fields we use by hand.
    spec = obj["spec"]
    assert set(spec) == {"selector", "namespaceSelector", "endpoints"}
    for ep in spec["endpoints"]:
        assert set(ep) <= {"port", "path", "interval"}
        assert re.fullmatch(r"[0-9]+(ms|s|m|h)", ep["interval"])


@pytest.mark.parametrize("case", sorted(OVERRIDES))
def test_lint_is_clean_in_strict_mode(case):
    report = helm.lint(CHART, OVERRIDES[case], strict=True, namespace=NS)
    assert report["errors"] == [] and report["messages"] == [], report


def test_default_install_runs_both_components_in_one_pod_with_the_gateway_service():
    objects = render({})
    [deploy] = of_kind(objects, "Deployment")
    env = {e["name"]: e.get("value") for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["GANTRY_COMPONENTS"] == "controller,gateway"
    assert env["GANTRY_NODE_IMAGE"] == "ghcr.io/gantry-dev/node:0.1.0"
    svc = next(s for s in of_kind(objects, "Service") if s["metadata"]["name"] == "gantry-gateway")
    assert svc["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    assert {p["metadata"]["name"] for p in of_kind(objects, "EnginePlugin")} == {"llama-cpp-cpu", "llama-cpp-cuda", "native-cpu",
                                                                          "native-cuda", "onnx-cpu"}
    assert not of_kind(objects, "ServiceMonitor")


def test_more_than_one_gateway_replica_splits_the_deployments_and_accounts():
    objects = render(OVERRIDES["split-gateway"])
    deploys = {d["metadata"]["name"]: d for d in of_kind(objects, "Deployment")}
    assert set(deploys) == {"gantry-controller", "gantry-gateway"}
    gw = deploys["gantry-gateway"]["spec"]
    assert gw["replicas"] == 3
    assert gw["template"]["spec"]["serviceAccountName"] == "gantry-gateway"
    env = {e["name"]: e.get("value") for e in gw["template"]["spec"]["containers"][0]["env"]}
    assert env["GANTRY_COMPONENTS"] == "gateway" and env["GANTRY_GATEWAY_API_KEYS_SECRET"] == "gantry-api-keys"
    assert "GANTRY_NODE_IMAGE" not in env
    assert {p["metadata"]["name"] for p in of_kind(objects, "PodDisruptionBudget")} == {"gantry-controller", "gantry-gateway"}
    assert {s["metadata"]["name"] for s in of_kind(objects, "ServiceAccount")} == {"gantry-controller", "gantry-gateway"}


def test_gateway_only_grants_no_controller_rules_and_no_engines_renders_no_plugins():
    objects = render(OVERRIDES["gateway-only"])
    names = {o["metadata"]["name"] for o in objects if o["kind"] in ("ClusterRole", "Role")}
    assert names == {"gantry-gateway"}
    assert not of_kind(render(OVERRIDES["no-default-engines"]), "EnginePlugin")


def test_digests_pin_every_image():
    objects = render(OVERRIDES["digests"])
    [deploy] = of_kind(objects, "Deployment")
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == f"ghcr.io/gantry-dev/operator@{DIGEST}"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["GANTRY_NODE_IMAGE"] == f"ghcr.io/gantry-dev/node@{DIGEST}"
    plugins = {p["metadata"]["name"]: p["spec"] for p in of_kind(objects, "EnginePlugin")}
    assert plugins["llama-cpp-cpu"]["image"].endswith(f"@{DIGEST}")
    assert plugins["llama-cpp-cpu"]["sha256"] == "cd" * 32
    assert "sha256" not in plugins["llama-cpp-cuda"]


def test_network_policies_are_on_by_default_for_the_operator_pods_and_every_models_node_pods():
    objects = render({})
    [policy] = of_kind(objects, "NetworkPolicy")
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    assert spec["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "gantry",
                                                  "app.kubernetes.io/instance": "gantry"}
    # Egress: DNS, the apiserver, node pods on 8080 in any namespace; nothing else.
    assert len(spec["egress"]) == 3
    [to_nodes] = [e for e in spec["egress"] if e.get("to", [{}])[0].get("podSelector")]
    assert to_nodes["to"][0]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "gantry-node"}
    assert to_nodes["ports"] == [{"port": 8080, "protocol": "TCP"}]
    # Node pods' policies are the operator's to write, per Model: the controller is told to, with
    # labels that select exactly the pods this policy covers (the gateway and the controller).
    [deploy] = of_kind(objects, "Deployment")
    env = env_of(deploy)
    assert env["GANTRY_NODE_NETWORK_POLICY"]["value"] == "true"
    labels = dict(kv.split("=") for kv in env["GANTRY_NETWORK_POLICY_PEER_LABELS"]["value"].split(","))
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert labels.items() <= pod_labels.items() and labels == spec["podSelector"]["matchLabels"]
    assert "GANTRY_NETWORK_POLICY_METRICS_NAMESPACE" not in env


def test_network_policy_options_reach_the_operator_and_can_be_turned_off():
    objects = render(OVERRIDES["network-policies"])
    env = env_of(of_kind(objects, "Deployment")[0])
    assert env["GANTRY_NETWORK_POLICY_METRICS_NAMESPACE"]["value"] == "monitoring"
    assert env["GANTRY_NODE_DOWNLOAD_CIDRS"]["value"] == "10.20.0.0/16,192.0.2.0/24"
    [policy] = of_kind(objects, "NetworkPolicy")
    assert {"ports": [{"port": "metrics", "protocol": "TCP"}],
            "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]} \
        in policy["spec"]["ingress"]
    off = render(OVERRIDES["no-network-policies"])
    assert not of_kind(off, "NetworkPolicy")
    assert "GANTRY_NODE_NETWORK_POLICY" not in env_of(of_kind(off, "Deployment")[0])
    assert "networkPolicy.enabled=false" in notes(OVERRIDES["no-network-policies"])


def test_default_install_generates_the_node_token_and_an_api_key_and_requires_keys():
    objects = render({})
    token = secret(objects, "gantry-node-token")["token"]
    assert re.fullmatch(r"[A-Za-z0-9]{64}", token), "a 64-character random install token"
    key = json.loads(secret(objects, "gantry-api-keys")["default"])
    assert set(key) == {"key"} and re.fullmatch(r"sk-gantry-[A-Za-z0-9]{40}", key["key"])
    [deploy] = of_kind(objects, "Deployment")
    env = env_of(deploy)
    # Both components get the install token by reference, never by value.
    assert env["GANTRY_NODE_TOKEN"] == {"name": "GANTRY_NODE_TOKEN", "valueFrom": {
        "secretKeyRef": {"name": "gantry-node-token", "key": "token"}}}
    assert token not in json.dumps(deploy)
    # The gateway requires keys from the generated Secret and may read that Secret alone.
    assert env["GANTRY_GATEWAY_API_KEYS_SECRET"]["value"] == "gantry-api-keys"
    [role] = [r for r in of_kind(objects, "Role") if r["metadata"]["name"] == "gantry-gateway"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["secrets"],
                              "resourceNames": ["gantry-api-keys"], "verbs": ["get"]}]
    text = notes({})
    assert (f"kubectl -n {NS} get secret gantry-api-keys -o jsonpath='{{.data.default}}' | base64 -d"
            in text), text
    assert "WARNING" not in text


def test_split_deployments_both_get_the_install_token():
    for d in of_kind(render(OVERRIDES["split-gateway"]), "Deployment"):
        ref = env_of(d)["GANTRY_NODE_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "gantry-node-token", "key": "token"}, d["metadata"]["name"]


def test_auth_mode_none_opens_the_gateway_explicitly():
    objects = render(OVERRIDES["auth-none"])
    assert "gantry-api-keys" not in {s["metadata"]["name"] for s in of_kind(objects, "Secret")}
    env = env_of(of_kind(objects, "Deployment")[0])
    assert "GANTRY_GATEWAY_API_KEYS_SECRET" not in env
    assert not [r for r in of_kind(objects, "Role") if r["metadata"]["name"] == "gantry-gateway"]
    # Node pods stay closed: the install token does not depend on the gateway's auth mode.
    assert "GANTRY_NODE_TOKEN" in env
    assert "gateway.auth.mode=none" in notes(OVERRIDES["auth-none"])


def test_named_secrets_replace_the_generated_ones():
    objects = render(OVERRIDES["own-secrets"])
    assert not of_kind(objects, "Secret")
    env = env_of(of_kind(objects, "Deployment")[0])
    assert env["GANTRY_NODE_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "my-node-token"
    assert env["GANTRY_GATEWAY_API_KEYS_SECRET"]["value"] == "my-keys"
    assert "from the Secret my-keys" in notes(OVERRIDES["own-secrets"])


@pytest.mark.parametrize("case", sorted(OVERRIDES))
def test_every_pod_is_restricted(case):
    for d in of_kind(render(OVERRIDES[case]), "Deployment"):
        pod = d["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"] == {"drop": ["ALL"]} and sc["runAsNonRoot"] is True
            assert sc["seccompProfile"]["type"] == "RuntimeDefault"
            assert "limits" in c["resources"] and "requests" in c["resources"]


def rbac_table() -> dict:
    run = subprocess.run([binary("gantry-operator"), "rbac"], capture_output=True, text=True, timeout=30, check=True)
    return json.loads(run.stdout)


def test_rbac_rules_are_exactly_the_operators_table():
    values = {"gateway": {"apiKeysSecret": "gantry-api-keys"}, "controller": {"leaseName": "gantry-operator"}}
    table = rbac_table()
    assert table["leaseName"] == "gantry-operator"
    names = {"any": None, "leaderLease": "gantry-operator", "apiKeysSecret": "gantry-api-keys"}
    want = set()
    for r in table["rules"]:
        kind = "ClusterRole" if r["scope"] == "cluster" else "Role"
        for verb in r["verbs"]:
            want.add((r["component"], kind, r["group"], r["resource"], names[r["names"]], verb))
    got = set()
    for role in render(values):
        if role["kind"] not in ("ClusterRole", "Role"):
            continue
        component = role["metadata"]["name"].removeprefix("gantry-")
        for rule in role["rules"]:
            for g in rule["apiGroups"]:
                for res in rule["resources"]:
                    for verb in rule["verbs"]:
                        for name in rule.get("resourceNames", [None]):
                            got.add((component, role["kind"], g, res, name, verb))
    assert got - want == set(), f"the chart grants more than the operator needs: {sorted(got - want)}"
    assert want - got == set(), f"the chart lacks rules the operator needs: {sorted(want - got)}"


def test_bindings_bind_each_role_to_the_account_of_the_pods_that_run_the_component():
    for values in ({}, OVERRIDES["split-gateway"]):
        objects = render(values)
        accounts = {d["metadata"]["name"]: d["spec"]["template"]["spec"]["serviceAccountName"]
                    for d in of_kind(objects, "Deployment")}
        runs = {}
        for d in of_kind(objects, "Deployment"):
            env = {e["name"]: e.get("value") for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}
            for c in env["GANTRY_COMPONENTS"].split(","):
                runs[c] = accounts[d["metadata"]["name"]]
        for b in of_kind(objects, "ClusterRoleBinding") + of_kind(objects, "RoleBinding"):
            component = b["roleRef"]["name"].removeprefix("gantry-")
            assert [s["name"] for s in b["subjects"]] == [runs[component]], b


@pytest.mark.parametrize("bad", [
    {"gateway": {"replicas": 0}},
    {"gateway": {"replicas": "two"}},
    {"controller": {"enable": True}},
    {"image": {"operator": {"digest": "sha256:nothex"}}},
    {"engines": {"llamaCpp": {"mountStrategy": "Copy"}}},
    {"engines": {"llamaCpp": {"cpu": {"sha256": "ABC"}}}},
    {"networkPolicy": {"modelNamespaces": ["team-a"]}},
    {"networkPolicy": {"metricsNamespace": "Monitoring"}},
    {"gateway": {"auth": {"mode": "open"}}},
    {"gateway": {"auth": {"required": False}}},
    {"nodeToken": {"existingSecret": "My_Secret"}},
    {"metrics": {"serviceMonitor": {"interval": "soon"}}},
])
def test_values_schema_rejects_wrong_values(bad):
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmError):
            chart.validate_schema(chart.merge_values(bad))
        with pytest.raises(helm.HelmError):
            chart.render(bad, name="gantry", namespace=NS)


def test_default_plugins_list_the_architectures_of_the_plugin_manifest():
    manifests = {m["id"]: m for m in (json.loads((ROOT / f"engines/{d}/manifest.json").read_text())
                                      for d in ("llama-cpp", "native", "onnx"))}
    # The native engine's CUDA build drops what only its CPU backend runs (engines/native/build.rs).
    build_rs = (ROOT / "engines/native/build.rs").read_text()
    cpu_only = re.search(r"const CPU_ONLY: \[&str; \d+\] = \[(.*?)\];", build_rs, re.S).group(1)
    cpu_only = re.findall(r'"([^"]+)"', cpu_only)
    assert cpu_only, "engines/native/build.rs lists no CPU_ONLY classes"
    cpu_only_modalities = re.findall(r'"([^"]+)"', re.search(
        r"const CPU_ONLY_MODALITIES: \[&str; \d+\] = \[(.*?)\];", build_rs, re.S).group(1))
    rendered = of_kind(render({"engines": {"native": {"cuda": {"enabled": True}},
                                           "llamaCpp": {"cuda": {"enabled": True}}}}), "EnginePlugin")
    assert {p["metadata"]["name"] for p in rendered} >= {"native-cpu", "native-cuda", "onnx-cpu"}
    for p in rendered:
        manifest = manifests[p["spec"]["engineId"]]
        archs, modalities = manifest["architectures"], manifest["modalities"]
        if p["metadata"]["name"] == "native-cuda":
            archs = [a for a in archs if a not in cpu_only]
            modalities = [m for m in modalities if m not in cpu_only_modalities]
        assert p["spec"]["formats"] == manifest["formats"]
        assert p["spec"]["architectures"] == archs, p["metadata"]["name"]
        assert p["spec"]["version"] == manifest["version"]
        assert p["spec"]["abiVersion"] == int(manifest["abi_version"])
        assert p["spec"]["modalities"] == modalities, p["metadata"]["name"]


def test_dashboard_is_shipped_as_a_labelled_config_map():
    # Which metrics its queries may name is checked against the node's, the operator's and the
    # gateway's own registries by tests/tests/dashboard.rs.
    dashboard = json.loads((CHART / "files/grafana-dashboard.json").read_text())
    objects = render(OVERRIDES["service-monitor-and-dashboard"])
    [cm] = [c for c in of_kind(objects, "ConfigMap") if c["metadata"]["name"] == "gantry-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["gantry.json"]) == dashboard


def test_chart_crds_are_the_generated_ones():
    for f in (ROOT / "crds").glob("*.yaml"):
        assert (CHART / "crds" / f.name).read_text() == f.read_text()
