"""The two README commands share one build, and serve.sh serves a model the user names.

- `scripts/build.sh serve` (scripts/serve.sh) is a subset of `scripts/build.sh all`
  (scripts/test.sh), unit for unit: run after the full build, in serve's own environment, cargo
  reports every unit fresh. A dependency that the two builds resolved with different features
  would be compiled again under another hash (and the node with it), and the check names it.
  The same equality is what lets test.sh reuse everything after serve.sh in the other order.
- build-pins/Cargo.toml, which makes that so, is what scripts/feature_pins.py computes now.
- `scripts/serve.sh --model PATH` (the README's second example) serves a GGUF file and a
  safetensors directory the user gives, and sets up no test model for it.
"""
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import openai
import pytest

from conftest import ROOT, _free_port, wait_ready

SERVE_PACKAGES = ["gantry-node", "gantry-engine-llama-cpp", "gantry-engine-native"]


def serve_env(cache: str | None = None) -> dict[str, str]:
    """The environment a user's shell has before scripts/serve.sh: none of the test setup's
    exports, no test virtualenv or cargo-fuzz on PATH."""
    test_cache = os.environ.get("GANTRY_CACHE", str(Path.home() / ".cache/gantry"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GANTRY_") and k != "VIRTUAL_ENV"}
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if p and not p.startswith(test_cache)
    )
    env["GANTRY_CACHE"] = cache or test_cache
    env["CARGO_TERM_COLOR"] = "never"
    return env


def test_each_readme_command_builds_through_build_sh():
    # serve.sh and test.sh build only through scripts/build.sh, whose serve build names the
    # packages the feature pins are computed for.
    build = (ROOT / "scripts/build.sh").read_text()
    cargo = [l.strip() for l in build.splitlines() if re.match(r"\s*(exec\s+)?cargo\s+build", l)]
    assert cargo == [
        'exec cargo build --release ' + " ".join(f"-p {p}" for p in SERVE_PACKAGES) + ' "$@"',
        'exec cargo build --release --workspace --all-targets "$@"',
    ], cargo
    pins = runpy.run_path(str(ROOT / "scripts/feature_pins.py"))  # main() runs only as a script
    assert pins["SERVE_PACKAGES"] == SERVE_PACKAGES
    for script, scope in (("serve.sh", "serve"), ("test.sh", "all")):
        code = [l for l in (ROOT / "scripts" / script).read_text().splitlines()
                if not l.lstrip().startswith("#")]
        assert any(l.strip() == f"scripts/build.sh {scope}" for l in code), f"{script} does not run scripts/build.sh {scope}"
        assert not any(re.search(r"\bcargo\s+build\b", l) for l in code), f"{script} builds on its own"


def test_feature_pins_are_current():
    r = subprocess.run([sys.executable, ROOT / "scripts/feature_pins.py", "--check"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_serve_build_is_part_of_the_full_build():
    # In serve's environment, as scripts/serve.sh runs it: setup (cached), then the build.
    script = 'eval "$(scripts/setup.sh serve)" && scripts/build.sh serve --message-format=json'
    r = subprocess.run(["bash", "-c", script], cwd=ROOT, env=serve_env(),
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-4000:]
    artifacts = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    artifacts = [a for a in artifacts if a.get("reason") == "compiler-artifact"]
    names = {a["target"]["name"].replace("_", "-") for a in artifacts}
    # What serving needs was in the build (the check would pass vacuously on an empty one).
    assert {"gantry-node", "gantry-engine-llama-cpp", "gantry-engine-native", "llama-cpp-sys-2"} <= names, names
    stale = sorted(a["package_id"] for a in artifacts if not a["fresh"])
    assert not stale, (
        "scripts/build.sh serve compiled units scripts/build.sh all had not (different features "
        "or environment: run scripts/feature_pins.py, and see docs):\n" + "\n".join(stale)
    )


@pytest.mark.parametrize("kind", ["gguf", "safetensors"])
def test_serve_sh_serves_the_users_model(kind):
    source = {
        "gguf": os.environ.get("GANTRY_GEMMA_GGUF"),
        "safetensors": os.environ.get("GANTRY_GEMMA_ST_DIR"),
    }[kind]
    if not source or not Path(source).exists():
        pytest.fail(f"the {kind} model is missing ({source!r}): run scripts/setup.sh (scripts/test.sh does)")
    work = Path(tempfile.mkdtemp(prefix="gantry-serve-"))
    cache = work / "cache"  # empty: serve.sh must not need the test model for the user's
    # The user's model under a name of their own: the model id follows from it.
    mine = work / ("my-model.gguf" if kind == "gguf" else "my-model")
    mine.symlink_to(source)
    port = _free_port()
    log_path = work / "serve.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        ["scripts/serve.sh", "--model", str(mine), "--listen", f"127.0.0.1:{port}", "--threads", "2"],
        cwd=ROOT, env=serve_env(str(cache)), stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, proc, log_path, "scripts/serve.sh", 300)
        with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as r:
            models = json.load(r)
        assert [m["id"] for m in models["data"]] == ["my-model"], models
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        out = client.completions.create(model="my-model", prompt="The capital of France is",
                                        max_tokens=4, temperature=0)
        assert out.usage.completion_tokens > 0 and out.choices[0].text.strip(), out
        # Nothing of the test setup was made for it: no model assembled, no virtualenv.
        made = sorted(p.name for p in cache.iterdir()) if cache.exists() else []
        assert "models" not in made and "venv" not in made, made
        text = log_path.read_text()
        assert "assembling Gemma" not in text and "set up and built in" in text, text[-2000:]
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
        log.close()
        shutil.rmtree(work, ignore_errors=True)
