"""Shared helpers for the chart and docs tests: paths, the CRD schemas, YAML streams and the
k8s-openapi checker (`gantry-testkit k8s-check`)."""
import json
import os
import subprocess
from pathlib import Path

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release"
CHART = ROOT / "charts" / "gantry"


def binary(name: str) -> Path:
    p = TARGET / name
    assert p.is_file(), f"{p} is missing: build first (cargo build --release --workspace --all-targets)"
    return p


def docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> openAPIV3Schema of every served version of the generated CRDs."""
    out = {}
    for f in sorted((CHART / "crds").glob("*.yaml")):
        for crd in docs(f.read_text()):
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for v in crd["spec"]["versions"]:
                out[(f"{group}/{v['name']}", kind)] = v["schema"]["openAPIV3Schema"]
    return out


def _strip_k8s_extensions(schema):
    """jsonschema does not know `x-kubernetes-*` keys; they are dropped (CEL rules are checked
    by the operator's Rust tests). `int-or-string` is widened to what it means, keeping the
    node's other keywords (a quantity's `pattern` still applies to its string form)."""
    if isinstance(schema, dict):
        out = {k: _strip_k8s_extensions(v) for k, v in schema.items() if not k.startswith("x-kubernetes")}
        if schema.get("x-kubernetes-int-or-string"):
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        return out
    if isinstance(schema, list):
        return [_strip_k8s_extensions(v) for v in schema]
    return schema


def validate_custom(obj: dict, schemas=None) -> None:
    """Validate a Model or EnginePlugin against its CRD schema (unknown kinds fail)."""
    schemas = schemas or crd_schemas()
    key = (obj.get("apiVersion"), obj.get("kind"))
    assert key in schemas, f"{key} is not a Gantry kind ({sorted(schemas)})"
    schema = _strip_k8s_extensions(schemas[key])
    # The apiserver supplies these at the root of every CRD schema.
    props = schema.setdefault("properties", {})
    props.setdefault("apiVersion", {"type": "string"})
    props.setdefault("kind", {"type": "string"})
    props.setdefault("metadata", {"type": "object"})
    # The apiserver prunes unknown fields of a structural schema; reject them here instead.
    _close_objects(schema)
    jsonschema.validate(obj, schema)


def _close_objects(schema):
    if isinstance(schema, dict):
        if schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        for k, v in schema.items():
            if k == "metadata" and isinstance(v, dict) and not v.get("properties"):
                continue
            _close_objects(v)
    elif isinstance(schema, list):
        for v in schema:
            _close_objects(v)


def k8s_check(objects: list[dict]) -> list[dict]:
    """Run every object through `gantry-testkit k8s-check`; returns its verdicts."""
    stream = "".join("---\n" + yaml.safe_dump(o) for o in objects)
    run = subprocess.run([binary("gantry-testkit"), "k8s-check"], input=stream, capture_output=True, text=True, timeout=60)
    verdicts = [json.loads(line) for line in run.stdout.splitlines() if line.strip()]
    assert len(verdicts) == len(objects), run.stderr
    return verdicts
