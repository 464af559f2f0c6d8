"""The Argo CD health checks (deploy/argocd/*.lua) run in a real Lua 5.1 (lupa's bundled `lupa.lua51`;
Argo CD's gopher-lua is a Lua 5.1) on sample statuses that use the operator's real condition
types and reasons (read from crd/src/conditions.rs, so a renamed reason fails here)."""
import re

import lupa.lua51 as lupa
import pytest

from k8s import ROOT

CONDITIONS_RS = (ROOT / "crd/src/conditions.rs").read_text()
REASONS = dict(re.findall(r'pub const ([A-Z_]+): &str = "([A-Za-z]+)";', CONDITIONS_RS.split("pub mod reason")[1]))


def reason(const: str) -> str:
    assert const in REASONS, f"{const} is not a reason in conditions.rs"
    return REASONS[const]


def run_health(script: str, obj: dict) -> dict:
    lua = lupa.LuaRuntime(unpack_returned_tuples=True)

    def to_lua(v):
        if isinstance(v, dict):
            return lua.table_from({k: to_lua(x) for k, x in v.items()})
        if isinstance(v, list):
            return lua.table_from([to_lua(x) for x in v])
        return v

    lua.globals().obj = to_lua(obj)
    src = (ROOT / "deploy/argocd" / script).read_text()
    hs = lua.execute(src)
    return {"status": hs["status"], "message": hs["message"]}


def cond(t, status, r, msg="m"):
    return {"type": t, "status": status, "reason": r, "message": msg, "observedGeneration": 2}


def model(*conditions, observed=2):
    return {"apiVersion": "gantry.dev/v1alpha1", "kind": "Model", "metadata": {"name": "m", "generation": 2},
            "status": {"observedGeneration": observed, "conditions": list(conditions)}}


def not_degraded():
    return cond("Degraded", "False", reason("AS_EXPECTED"))


MODEL_CASES = [
    ("ready", model(cond("Ready", "True", reason("READY")), cond("EngineResolved", "True", reason("RESOLVED")), not_degraded()), "Healthy"),
    ("scaled to zero", model(cond("Ready", "True", reason("SCALED_TO_ZERO")), not_degraded()), "Suspended"),
    ("rolling out", model(cond("Ready", "False", reason("REPLICAS_NOT_READY")), cond("Progressing", "True", reason("ROLLING_OUT")), not_degraded()), "Progressing"),
    ("downloading", model(cond("Ready", "False", reason("REPLICAS_NOT_READY")), cond("ArtifactReady", "False", reason("DOWNLOADING")), not_degraded()), "Progressing"),
    ("architecture pending", model(cond("EngineResolved", "Unknown", reason("ARCHITECTURE_PENDING")), not_degraded()), "Progressing"),
    ("old generation", model(cond("Ready", "True", reason("READY")), observed=1), "Progressing"),
    ("no status yet", {"metadata": {"name": "m", "generation": 1}}, "Progressing"),
    ("no engine", model(cond("Ready", "False", reason("ENGINE_UNRESOLVED")), cond("EngineResolved", "False", reason("NO_MATCHING_ENGINE")), cond("Degraded", "True", reason("ENGINE_UNRESOLVED"))), "Degraded"),
    ("rejected by node", model(cond("EngineResolved", "False", reason("REJECTED_BY_NODE")), not_degraded()), "Degraded"),
    ("download failed", model(cond("ArtifactReady", "False", reason("DOWNLOAD_FAILED")), cond("Degraded", "True", reason("DOWNLOAD_FAILED"))), "Degraded"),
    ("invalid spec", model(cond("Degraded", "True", reason("INVALID_SPEC"))), "Degraded"),
    ("stuck rollout", model(cond("Progressing", "False", reason("PROGRESS_DEADLINE_EXCEEDED")), cond("Degraded", "True", reason("PROGRESS_DEADLINE_EXCEEDED"))), "Degraded"),
]


@pytest.mark.parametrize("name,obj,want", MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_model_health(name, obj, want):
    hs = run_health("health-model.lua", obj)
    assert hs["status"] == want, hs


def plugin(*conditions, observed=2):
    return {"apiVersion": "gantry.dev/v1alpha1", "kind": "EnginePlugin", "metadata": {"name": "p", "generation": 2},
            "status": {"observedGeneration": observed, "conditions": list(conditions)}}


PLUGIN_CASES = [
    ("loaded", plugin(cond("Accepted", "True", reason("VALID")), cond("Loaded", "True", reason("LOADED"))), "Healthy"),
    ("not mounted yet", plugin(cond("Accepted", "True", reason("VALID")), cond("Loaded", "Unknown", reason("NOT_MOUNTED"))), "Healthy"),
    ("abi mismatch", plugin(cond("Accepted", "False", reason("ABI_MISMATCH"))), "Degraded"),
    ("id conflict", plugin(cond("Accepted", "False", reason("ENGINE_ID_CONFLICT"))), "Degraded"),
    ("load errors", plugin(cond("Accepted", "True", reason("VALID")), cond("Loaded", "False", reason("LOAD_ERRORS"))), "Degraded"),
    ("no status yet", {"metadata": {"name": "p", "generation": 1}}, "Progressing"),
    ("old generation", plugin(cond("Accepted", "True", reason("VALID")), observed=1), "Progressing"),
]


@pytest.mark.parametrize("name,obj,want", PLUGIN_CASES, ids=[c[0] for c in PLUGIN_CASES])
def test_engineplugin_health(name, obj, want):
    hs = run_health("health-engineplugin.lua", obj)
    assert hs["status"] == want, hs


def pool(*conditions, observed=2, refused=()):
    return {"apiVersion": "gantry.dev/v1alpha1", "kind": "ModelPool", "metadata": {"name": "p", "generation": 2},
            "status": {"observedGeneration": observed, "conditions": list(conditions), "refused": list(refused)}}


REFUSED = {"name": "big", "reason": reason("DOES_NOT_FIT"), "message": "spec.resources.memory is more than the pool can hold"}

POOL_CASES = [
    ("ready", pool(cond("Ready", "True", reason("READY"))), "Healthy"),
    ("a member refused", pool(cond("Ready", "True", reason("READY")), refused=[REFUSED]), "Degraded"),
    ("pods starting", pool(cond("Ready", "False", reason("REPLICAS_NOT_READY"))), "Progressing"),
    ("scaled to zero", pool(cond("Ready", "True", reason("SCALED_TO_ZERO"))), "Suspended"),
    ("no members", pool(cond("Ready", "False", reason("NO_MEMBERS"))), "Suspended"),
    ("invalid spec", pool(cond("Ready", "False", reason("INVALID_SPEC"))), "Degraded"),
    ("apply refused", pool(cond("Ready", "False", reason("APPLY_FAILED"))), "Degraded"),
    ("old generation", pool(cond("Ready", "True", reason("READY")), observed=1), "Progressing"),
    ("no status yet", {"metadata": {"name": "p", "generation": 1}}, "Progressing"),
    ("plugin delivery under way", pool(cond("Ready", "True", reason("READY")), cond("Progressing", "True", reason("PLUGIN_UPDATING")),
                                       cond("Degraded", "False", reason("AS_EXPECTED"))), "Healthy"),
    ("plugin delivery halted", pool(cond("Ready", "True", reason("READY")), cond("Progressing", "False", reason("PLUGIN_UPDATE_HALTED")),
                                    cond("Degraded", "True", reason("PLUGIN_UPDATE_HALTED"), "plugin llama-cpp halted on 1 pod")), "Degraded"),
]


@pytest.mark.parametrize("name,obj,want", POOL_CASES, ids=[c[0] for c in POOL_CASES])
def test_modelpool_health(name, obj, want):
    hs = run_health("health-modelpool.lua", obj)
    assert hs["status"] == want, hs
    if name == "a member refused":
        assert "big: DoesNotFit" in hs["message"], hs
    if name == "plugin delivery halted":
        assert hs["message"].startswith("PluginUpdateHalted: plugin llama-cpp halted"), hs


def test_the_lua_runtime_is_lua_5_1():
    # Argo CD embeds gopher-lua (Lua 5.1): run the checks on the same language version.
    assert lupa.LuaRuntime().eval("_VERSION") == "Lua 5.1"
