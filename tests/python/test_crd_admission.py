"""OpenAPI admission of Gantry's custom resources, as the API server validates a new object
against a CRD's `openAPIV3Schema` (types, enums, patterns, ranges, required), before any
reconcile. The CRDs are the chart's generated ones (operator/tests/operator/crds.rs checks
that they match the Rust types), through k8s.py's `validate_custom` (the reference `jsonschema`
implementation; unknown fields refused, as the API server prunes them). The CEL rules
(`x-kubernetes-validations`) are checked in crds.rs with kube's CEL validator.
"""
import copy

import jsonschema
import pytest

from k8s import ROOT, crd_schemas, docs, validate_custom

SCHEMAS = crd_schemas()
EXAMPLES = ROOT / "docs/examples"
FIXTURES = ROOT / "operator/tests/fixtures/models"


def errors(obj):
    """The first schema violation of `obj` (a list, empty when it is admitted)."""
    try:
        validate_custom(obj, SCHEMAS)
    except jsonschema.ValidationError as e:
        return [f"/{'/'.join(map(str, e.absolute_path))}: {e.message}"]
    return []


def example(name):
    return docs((EXAMPLES / name).read_text())[0]


def set_at(obj, pointer, value):
    """A copy of `obj` with `value` at the JSON pointer (the last segment may be new)."""
    out = copy.deepcopy(obj)
    *parents, key = pointer.strip("/").split("/")
    node = out
    for p in parents:
        node = node[p]
    node[key] = value
    return out


def test_the_examples_and_fixtures_pass_admission():
    assert errors(example("model-gemma-3-270m.yaml")) == []
    assert errors(example("engineplugin-llama-cpp-cpu.yaml")) == []
    pool_docs = docs((EXAMPLES / "modelpool-small.yaml").read_text())
    assert [d["kind"] for d in pool_docs].count("Model") == 3
    for d in pool_docs:
        assert errors(d) == [], d["metadata"]["name"]
    for case in ["cpu", "gpu", "pvc-cache", "image-volume", "pinned"]:
        assert errors(docs((FIXTURES / f"{case}.yaml").read_text())[0]) == [], case


@pytest.mark.parametrize("pointer,value", [
    ("/spec/format", "tflite"),
    ("/spec/source/uri", "ftp://example.com/model.gguf"),
    ("/spec/source/uri", "hf://just-an-org"),
    ("/spec/source/uri", "s3://"),
    ("/spec/resources/memory", "lots"),
    ("/spec/replicas/min", -1),
    ("/spec/load", "sometimes"),
    ("/spec/engine", "Not An Id"),
])
def test_a_model_with_a_bad_enum_pattern_or_range_is_refused(pointer, value):
    bad = set_at(example("model-gemma-3-270m.yaml"), pointer, value)
    assert errors(bad), f"{pointer} = {value!r} should be refused"


@pytest.mark.parametrize("pointer,value", [
    ("/spec/gpuBackend", "metal"),
    ("/spec/version", "1.0"),
    ("/spec/image", "Not An Image"),
    ("/spec/formats", []),
    ("/spec/architectures", []),
    ("/spec/mountStrategy", "Magic"),
    ("/spec/isolation", "sandbox"),
    ("/spec/isolation", "Process"),
])
def test_an_engine_plugin_with_a_bad_enum_pattern_or_range_is_refused(pointer, value):
    bad = set_at(example("engineplugin-llama-cpp-cpu.yaml"), pointer, value)
    assert errors(bad), f"{pointer} = {value!r} should be refused"


def test_digest_pinned_images_and_both_isolation_modes_are_admitted():
    pinned = set_at(example("engineplugin-llama-cpp-cpu.yaml"), "/spec/image",
                    "ghcr.io/gantry-dev/engine-llama-cpp-cpu@sha256:" + "0123456789abcdef" * 4)
    assert errors(pinned) == []
    for mode in ["inProcess", "process"]:
        assert errors(set_at(pinned, "/spec/isolation", mode)) == [], mode


@pytest.mark.parametrize("rollout,ok", [
    ({}, True),
    ({"strategy": "Surge"}, True),
    ({"maxSurge": 2}, True),
    ({"strategy": "Surge", "maxSurge": 1}, True),
    ({"strategy": "InPlace"}, True),
    ({"strategy": "InPlace", "maxUnavailable": 2}, True),
    ({"strategy": "Recreate"}, False),
    ({"maxSurge": 0}, False),
    ({"strategy": "InPlace", "maxUnavailable": 0}, False),
    ({"maxSurge": 101}, False),
])
def test_rollout_knobs_are_typed_and_ranged(rollout, ok):
    m = set_at(example("model-gemma-3-270m.yaml"), "/spec/rollout", rollout)
    found = errors(m)
    assert (found == []) == ok, f"{rollout}: {found}"
