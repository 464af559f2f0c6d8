#!/usr/bin/env python3
"""A new user's first hour: the README's two commands on a fresh clone, timed.

    bench/cold_start.py serve-first   scripts/serve.sh to its first answer, then scripts/test.sh
    bench/cold_start.py test-first    scripts/test.sh, then scripts/serve.sh to its first answer

Each run clones the repository's HEAD into a new directory and gives it empty caches of its
own: the Gantry cache (GANTRY_CACHE: the virtualenv, the model, s3s-fs, cargo-fuzz), cargo's
home (every crate is downloaded again), pip's cache and the target directory. The Debian
packages the setup installs (cmake, clang, libclang, prometheus) are machine-wide: remove them
first for a fresh machine's figure (--purge-debian; it runs apt-get purge), or the run says
they were already there. "First answer" is the first 200 of a completion request, polled
once a second from the moment serve.sh starts. Writes bench/results/cold-start-ORDER.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEBIAN = ["clang", "clang-14", "cmake", "cmake-data", "libclang1-14", "libclang-common-14-dev",
          "libclang-dev", "libclang-14-dev", "prometheus"]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def fresh_env(work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GANTRY_", "CARGO_TARGET_DIR")) and k != "VIRTUAL_ENV"}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if ".cache/gantry" not in p)
    env["GANTRY_CACHE"] = str(work / "cache")
    env["CARGO_HOME"] = str(work / "cargo-home")
    env["PIP_CACHE_DIR"] = str(work / "pip-cache")
    env["CARGO_TERM_COLOR"] = "never"
    return env


def answered(base: str) -> bool:
    body = json.dumps({"model": "gemma-3-270m", "prompt": "The capital of France is",
                       "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", data=body,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status == 200 and bool(json.load(r)["choices"][0]["text"])
    except (OSError, ValueError, KeyError):
        return False


def serve(clone: Path, env: dict[str, str], log: Path, limit: float) -> dict:
    port = free_port()
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(["scripts/serve.sh", "--listen", f"127.0.0.1:{port}"], cwd=clone,
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while time.monotonic() - t0 < limit:
                if proc.poll() is not None:
                    raise SystemExit(f"serve.sh exited ({proc.returncode}); see {log}")
                if answered(f"http://127.0.0.1:{port}"):
                    break
                time.sleep(1)
            else:
                raise SystemExit(f"no answer in {limit} s; see {log}")
            first = time.monotonic() - t0
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    text = log.read_text()
    built = re.search(r"set up and built in (\d+) s", text)
    return {"first_answer_s": round(first, 1),
            "setup_and_build_s": int(built.group(1)) if built else None,
            "setup_parts": re.findall(r"setup: (.*?): done in (\d+) s", text)}


def test(clone: Path, env: dict[str, str], log: Path) -> dict:
    t0 = time.monotonic()
    with open(log, "w") as out:
        rc = subprocess.run(["scripts/test.sh"], cwd=clone, env=env, stdout=out,
                            stderr=subprocess.STDOUT).returncode
    text = log.read_text()
    return {"rc": rc, "total_s": round(time.monotonic() - t0, 1),
            "phases_s": {m[0]: int(m[1]) for m in re.findall(r"test\.sh: (.+?) took (\d+) s", text)},
            "setup_parts": re.findall(r"setup: (.*?): done in (\d+) s", text),
            "pytest": (re.findall(r"^=* ?(\d+ passed.*?)=*$", text, re.M) or [None])[-1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("order", choices=["serve-first", "test-first"])
    ap.add_argument("--purge-debian", action="store_true", help="apt-get purge the setup's Debian packages first")
    ap.add_argument("--work", type=Path, help="where to clone (default: a new temporary directory)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--first-only", action="store_true", help="stop after the first command")
    args = ap.parse_args()
    out = args.out or ROOT / "bench/results" / f"cold-start-{args.order}.json"
    work = args.work or Path(tempfile.mkdtemp(prefix="gantry-cold-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.purge_debian:
        subprocess.run(["apt-get", "purge", "-y", "-qq", *DEBIAN], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["apt-get", "clean"], check=True)
    present = [p for p in ("cmake", "clang", "promtool") if shutil.which(p)]
    clone = work / "gantry"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True).stdout.strip()
    env = fresh_env(work)
    result = {
        "order": args.order, "commit": commit,
        "machine": f"{os.cpu_count()} cores, {cpu_model()}, "
                   f"{round(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30)} GiB",
        "debian_packages_already_installed": present,
    }
    if args.order == "serve-first":
        result["serve"] = serve(clone, env, work / "serve.log", 3600)
        if not args.first_only:
            result["test_after_serve"] = test(clone, env, work / "test.log")
    else:
        result["test"] = test(clone, env, work / "test.log")
        if not args.first_only:
            result["serve_after_test"] = serve(clone, env, work / "serve.log", 3600)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
