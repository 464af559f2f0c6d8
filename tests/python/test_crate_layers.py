"""The workspace's crates in layers: a crate depends only on crates of lower layers.

Read from `cargo metadata`, so a new dependency between two crates that breaks the order, or
a new crate left out of the table, fails here. Normal and build dependencies count; a test
may use any crate (dev-dependencies: a plugin's tests start the real node), so those do not.
docs/architecture.md draws the same table.
"""
import json
import subprocess

from conftest import ROOT

# Bottom to top. Keep docs/architecture.md's "Crates" table in the same order.
LAYERS = [
    # contracts and leaves: no workspace dependency
    {"gantry-engine-abi", "gantry-build-pins", "gantry-copy", "gantry-chat"},
    # rules and parsers shared by node, operator and gateway; the engine plugins (ABI only)
    {"gantry-api", "gantry-formats", "gantry-engine-llama-cpp", "gantry-engine-native", "gantry-engine-onnx",
     "gantry-fault-faulty", "gantry-fault-no-entry", "gantry-fault-wrong-abi"},
    # the pieces the node and the control plane are built from
    {"gantry-crd", "gantry-edge", "gantry-engine-host", "gantry-model-store", "gantry-scheduler",
     "gantry-testkit"},
    # the OpenAI surface (above the scheduler, whose events it shapes)
    {"gantry-openai"},
    # the two servers of the request path
    {"gantry-node", "gantry-gateway"},
    # the control plane (its binary also starts the gateway)
    {"gantry-operator"},
    # workspace-level tests
    {"gantry-tests"},
]


def workspace_graph() -> dict[str, set[str]]:
    out = subprocess.run(["cargo", "metadata", "--offline", "--format-version", "1", "--no-deps"], cwd=ROOT,
                         capture_output=True, text=True, check=True, timeout=120).stdout
    packages = json.loads(out)["packages"]
    names = {p["name"] for p in packages}
    return {p["name"]: {d["name"] for d in p["dependencies"]
                        if d["name"] in names and d["kind"] in (None, "build")}
            for p in packages}


def test_every_crate_has_a_layer():
    placed = set().union(*LAYERS)
    graph = workspace_graph()
    assert set(graph) == placed, (
        f"not in a layer: {sorted(set(graph) - placed)}; no such crate: {sorted(placed - set(graph))}")


def test_no_crate_depends_on_its_own_layer_or_one_above():
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    upward = sorted(f"{crate} (layer {layer[crate]}) -> {dep} (layer {layer[dep]})"
                    for crate, deps in workspace_graph().items() for dep in deps
                    if layer[dep] >= layer[crate])
    assert not upward, "dependencies that do not point down:\n" + "\n".join(upward)
