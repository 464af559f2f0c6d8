"""The docs, tried as a new user would: the quickstart's cluster-free commands run as written,
every YAML example parses and validates (Gantry kinds against the CRD schemas, built-in kinds
against their k8s-openapi types), and the reference pages cover every reason and rule."""
import os
import re
import subprocess
import tempfile

import pytest
import yaml

from k8s import ROOT, TARGET, binary, crd_schemas, k8s_check, validate_custom

DOCS = ROOT / "docs"


def fenced(text: str, lang: str) -> list[tuple[int, str, str]]:
    """(line, preceding line, body) of every ```lang block."""
    out = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == f"```{lang}":
            start, before = i, (lines[i - 1].strip() if i else "")
            body = []
            i += 1
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            out.append((start + 1, before, "\n".join(body) + "\n"))
        i += 1
    return out


RUN_BLOCKS = [(f.name, line, body) for f in sorted(DOCS.glob("*.md"))
              for line, before, body in fenced(f.read_text(), "sh") if before == "<!-- test: run -->"]


def test_the_quickstart_marks_commands_to_run():
    assert any(name == "quickstart.md" for name, _, _ in RUN_BLOCKS)


@pytest.mark.parametrize("name,line,body", RUN_BLOCKS, ids=[f"{n}:{l}" for n, l, _ in RUN_BLOCKS])
def test_marked_commands_run_as_written(name, line, body):
    binary("gantry-operator")
    env = dict(os.environ, PATH=f"{TARGET}:{os.environ['PATH']}")
    with tempfile.TemporaryDirectory() as tmp:
        run = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=tmp, env=env,
                             capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"{name}:{line} failed:\n{body}\n{run.stdout}\n{run.stderr}"


def yaml_examples():
    for f in sorted(DOCS.glob("*.md")):
        for line, _, body in fenced(f.read_text(), "yaml"):
            yield f"{f.name}:{line}", body
    for f in sorted((DOCS / "examples").glob("*.yaml")):
        yield f"examples/{f.name}", f.read_text()


EXAMPLES = list(yaml_examples())


def test_there_are_gantry_examples_to_check():
    kinds = {d.get("kind") for _, body in EXAMPLES for d in yaml.safe_load_all(body) if isinstance(d, dict)}
    assert {"Model", "EnginePlugin"} <= kinds


@pytest.mark.parametrize("where,body", EXAMPLES, ids=[w for w, _ in EXAMPLES])
def test_every_yaml_example_parses_and_validates(where, body):
    objects = [d for d in yaml.safe_load_all(body) if d is not None]
    assert objects, f"{where}: empty YAML block"
    schemas = crd_schemas()
    for obj in objects:
        if not isinstance(obj, dict) or "kind" not in obj:
            continue  # a values fragment, not an object
        if obj["apiVersion"].startswith("gantry.dev/"):
            validate_custom(obj, schemas)
        else:
            [verdict] = k8s_check([obj])
            assert verdict["result"] == "ok", f"{where}: {verdict}"


def test_troubleshooting_has_a_section_for_every_condition_reason():
    text = (DOCS / "troubleshooting.md").read_text()
    conditions = (ROOT / "crd/src/conditions.rs").read_text().split("pub mod reason")[1]
    reasons = re.findall(r'pub const [A-Z_]+: &str = "([A-Za-z]+)";', conditions)
    assert len(reasons) > 15
    headings = set(re.findall(r"^### (\w+)$", text, re.M))
    assert set(reasons) - headings == set()


def test_troubleshooting_lists_every_node_refusal_reason():
    text = (DOCS / "troubleshooting.md").read_text()
    labels = set()
    for src in ("formats/src/manifest.rs", "engine-host/src/plugin.rs"):
        labels |= set(re.findall(r'=> "([a-z0-9_]+)",', (ROOT / src).read_text()))
    assert {"abi_mismatch", "sha256_mismatch", "binary_not_found"} <= labels
    assert {l for l in labels if f"`{l}`" not in text} == set()


def test_security_prints_the_operators_rbac_table():
    table = subprocess.run([binary("gantry-operator"), "rbac", "--format", "markdown"],
                           capture_output=True, text=True, check=True, timeout=30).stdout
    assert table.strip() in (DOCS / "security.md").read_text()


def test_readme_links_every_doc():
    readme = (ROOT / "README.md").read_text()
    for doc in ("quickstart", "engines", "security", "troubleshooting", "gitops"):
        assert f"docs/{doc}.md" in readme, doc
