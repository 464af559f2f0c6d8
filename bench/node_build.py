#!/usr/bin/env python3
"""How long the node's own crates take to build: from nothing (every dependency already
compiled) and again after one source file of the OpenAI surface changed, at one or more
commits.

Each commit is checked out into a git worktree under a temporary directory; all worktrees
share one target directory, so third-party dependencies (and llama.cpp, which the node does
not link) are compiled once and every figure is the workspace's own crates. The command is
the serve build of the node (`cargo build -p gantry-node`, what `scripts/serve.sh` compiles
apart from the engine plugins).

  bench/node_build.py --at 61b186a:node-pod/src/http/validate.rs \\
                      --at HEAD:openai/src/validate.rs --out bench/results/node-build.json

`--at COMMIT:FILE` names the commit and the file edited for the incremental figure (a file of
the OpenAI surface: where it lives differs between commits; the edit adds a private function).
`--repeat N` times the rebuild after an edit N times and keeps every figure. The machine should be otherwise idle.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list[str], cwd: Path, env: dict[str, str]) -> float:
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=3600)
    return time.monotonic() - t0


def measure(commit: str, touched: str, target: Path, repeat: int) -> dict:
    sha = subprocess.run(["git", "rev-parse", "--short", commit], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix=f"node-build-{sha}-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha], cwd=ROOT,
                       check=True, capture_output=True)
        try:
            env = dict(os.environ, CARGO_TARGET_DIR=str(target), CARGO_TERM_COLOR="never")
            build = ["cargo", "build", "--offline", "-p", "gantry-node"]
            lines = sum(len(p.read_text(errors="replace").splitlines())
                        for p in (tree / "node-pod" / "src").rglob("*.rs"))
            fresh = run(build, tree, env)
            rebuilds = []
            path = tree / touched
            original = path.read_text()
            for i in range(repeat):
                # A real edit, not a touch (an unchanged file is mostly answered from the
                # incremental cache): a new private function, different each time.
                path.write_text(original + f"\n#[allow(dead_code)]\nfn bench_edit() -> u32 {{\n    {i}\n}}\n")
                rebuilds.append(run(build, tree, env))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                           check=False, capture_output=True)
    return {
        "commit": sha,
        "edited": touched,
        "node_pod_src_lines": lines,
        "workspace_crates_from_nothing_s": round(fresh, 1),
        "after_edit_s": [round(r, 1) for r in rebuilds],
        "after_edit_median_s": round(statistics.median(rebuilds), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--at", action="append", required=True, metavar="COMMIT:FILE")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--target-dir", type=Path,
                    default=Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")))
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    results = []
    for spec in a.at:
        commit, _, touched = spec.partition(":")
        if not touched:
            sys.exit(f"--at {spec}: give COMMIT:FILE")
        r = measure(commit, touched, a.target_dir.resolve(), a.repeat)
        print(json.dumps(r), flush=True)
        results.append(r)
    out = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "command": "cargo build --offline -p gantry-node",
        "results": results,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
