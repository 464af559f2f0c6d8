#!/usr/bin/env python3
"""Gateway overhead benchmark: latency added by the Gantry gateway vs nginx, in one run.

One `gantry-node` serves the tiny test model; the same fixed request is sent at a fixed
open-loop rate (default 1,000/s for 10 s, after 2 s of warm-up) three ways, one after the
other: straight to the node, through the Gantry gateway (`gantry-operator run --components
gateway` on a static endpoints file), and through nginx as a plain reverse proxy with a
keep-alive upstream. The request is a temperature-0 `/v1/completions` call with
`max_tokens: 1` that the node answers from its response cache after the first time, so the
node's part is small and fixed and the proxy dominates the difference.

Added latency at a percentile = that percentile through the proxy minus the same percentile
direct. Writes bench/results/gateway-overhead.json.

Needs: `cargo build --release --workspace --all-targets`, and nginx (bench/setup-nginx.sh).
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from common import free_port, wait_http

ROOT = Path(__file__).resolve().parent.parent
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release"
RATE = int(os.environ.get("GANTRY_BENCH_RATE", "1000"))
# Interleaved rounds: each target gets ROUNDS slices of SLICE seconds, in turn, so that drift in
# the machine's other load falls on all three alike; the slices are pooled per target.
ROUNDS = int(os.environ.get("GANTRY_BENCH_ROUNDS", "5"))
SLICE = int(os.environ.get("GANTRY_BENCH_SLICE_SECONDS", "2"))
DURATION = ROUNDS * SLICE
BODY = json.dumps(
    {"model": "tiny", "prompt": "The gateway benchmark", "max_tokens": 1, "temperature": 0}
)


def post(url: str) -> dict:
    req = urllib.request.Request(url, BODY.encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def loadgen(label: str, url: str, raw: Path) -> dict:
    out = subprocess.run(
        [str(TARGET / "gantry-loadgen"), "--url", url, "--body", BODY, "--rate", str(RATE),
         "--duration", str(SLICE), "--warmup", "1", "--label", label, "--raw", str(raw)],
        check=True, capture_output=True, text=True, timeout=SLICE + 60,
    )
    return json.loads(out.stdout)


def pct(sorted_us: list, p: float) -> int:
    rank = max(1, min(len(sorted_us), -(-len(sorted_us) * p // 100)))
    return sorted_us[int(rank) - 1]


def pooled(label: str, slices: list, raws: list) -> dict:
    lat = sorted(int(x) for r in raws for x in r.read_text().split())
    summary = {
        "label": label,
        "ok": len(lat),
        "errors": sum(s["errors"] for s in slices),
        "min_send_rate": min(s["achieved_send_rate"] for s in slices),
        "latency_us": {"p50": pct(lat, 50), "p90": pct(lat, 90), "p99": pct(lat, 99),
                       "p99_9": pct(lat, 99.9), "max": lat[-1],
                       "mean": sum(lat) / len(lat)},
        "slices_p99_us": [s["latency_us"]["p99"] for s in slices],
    }
    lat_s = summary["latency_us"]
    print(f"{label:>8}: p50 {lat_s['p50']} us  p99 {lat_s['p99']} us  p99.9 {lat_s['p99_9']} us  "
          f"errors {summary['errors']}", file=sys.stderr)
    return summary


def nginx_conf(tmp: Path, listen: int, node_port: int) -> Path:
    conf = tmp / "nginx.conf"
    conf.write_text(f"""
worker_processes auto;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    upstream node {{
        server 127.0.0.1:{node_port};
        keepalive 128;
    }}
    server {{
        listen 127.0.0.1:{listen};
        location / {{
            proxy_pass http://node;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
""")
    return conf


def main() -> None:
    for binary in ("gantry-node", "gantry-operator", "gantry-loadgen", "gantry-testkit"):
        if not (TARGET / binary).is_file():
            raise SystemExit(f"{TARGET / binary} missing: cargo build --release --workspace --all-targets")
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).is_file():
        raise SystemExit("nginx missing: run bench/setup-nginx.sh")
    procs = []
    tmp = Path(tempfile.mkdtemp(prefix="gantry-gw-bench-"))
    os.chmod(tmp, 0o777)
    try:
        model = tmp / "tiny.gguf"
        subprocess.run([str(TARGET / "gantry-testkit"), "tiny-gguf", "--out", str(model)], check=True)
        node_port, gw_port, nginx_port = free_port(), free_port(), free_port()
        (tmp / "node.yaml").write_text(json.dumps({
            "models": [{"id": "tiny", "path": str(model), "format": "gguf",
                        "contextLength": 512, "maxBatchSize": 8, "threads": 1}]}))
        procs.append(subprocess.Popen(
            [str(TARGET / "gantry-node"), "serve", "--config", str(tmp / "node.yaml"),
             "--listen", f"127.0.0.1:{node_port}", "--plugins-dir", str(TARGET / "engines")],
            env={**os.environ, "GANTRY_LOG": "warn"}))
        (tmp / "endpoints.yaml").write_text(
            json.dumps({"models": {"tiny": [f"http://127.0.0.1:{node_port}"]}}))
        procs.append(subprocess.Popen(
            [str(TARGET / "gantry-operator"), "run", "--components", "gateway",
             "--endpoints-file", str(tmp / "endpoints.yaml"),
             "--gateway-addr", f"127.0.0.1:{gw_port}"],
            env={**os.environ, "GANTRY_LOG": "warn"}))
        # nginx as a plain user: drop root when the bench runs as root.
        drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
        procs.append(subprocess.Popen(
            drop + [nginx, "-p", str(tmp), "-e", str(tmp / "error.log"),
                    "-c", str(nginx_conf(tmp, nginx_port, node_port)), "-g", "daemon off;"]))
        wait_http(f"http://127.0.0.1:{node_port}/readyz", 30)
        wait_http(f"http://127.0.0.1:{gw_port}/readyz", 30)
        # The gateway probes its replica about once a second before routing to it.
        deadline = time.monotonic() + 10
        while True:
            try:
                post(f"http://127.0.0.1:{gw_port}/v1/completions")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        # Fill the node's response cache, and check nginx answers the same thing.
        first = post(f"http://127.0.0.1:{node_port}/v1/completions")
        wait_http(f"http://127.0.0.1:{nginx_port}/healthz", 30)
        if post(f"http://127.0.0.1:{nginx_port}/v1/completions")["choices"] != first["choices"]:
            raise SystemExit("nginx answered differently from the node")
        targets = {
            "direct": f"http://127.0.0.1:{node_port}/v1/completions",
            "gantry": f"http://127.0.0.1:{gw_port}/v1/completions",
            "nginx": f"http://127.0.0.1:{nginx_port}/v1/completions",
        }
        slices = {name: [] for name in targets}
        raws = {name: [] for name in targets}
        for r in range(ROUNDS):
            for name, url in targets.items():
                raw = tmp / f"{name}-{r}.txt"
                slices[name].append(loadgen(name, url, raw))
                raws[name].append(raw)
        runs = {name: pooled(name, slices[name], raws[name]) for name in targets}
        with urllib.request.urlopen(f"http://127.0.0.1:{node_port}/metrics", timeout=5) as r:
            node_metrics = r.read().decode()
        hits = next((line.split()[-1] for line in node_metrics.splitlines()
                     if line.startswith("gantry_response_cache_hits_total")), "0")
        d = runs["direct"]["latency_us"]
        added = {
            name: {p: runs[name]["latency_us"][p] - d[p] for p in ("p50", "p90", "p99", "p99_9")}
            for name in ("gantry", "nginx")
        }
        result = {
            "benchmark": "gateway-overhead",
            "method": (f"open loop at a fixed rate; {ROUNDS} interleaved rounds of {SLICE} s per target "
                       "(1 s unmeasured warm-up each), pooled; added = percentile through the proxy "
                       "minus the same percentile direct"),
            "request": json.loads(BODY),
            "fast_path": "temperature-0 completion answered from the node's response cache",
            "node_response_cache_hits": float(hits),
            "rate_per_s": RATE,
            "duration_s": DURATION,
            "cpus": os.cpu_count(),
            "nginx": subprocess.run([nginx, "-v"], capture_output=True, text=True).stderr.strip(),
            "runs": runs,
            "added_latency_us": added,
            "targets": {
                "gantry_p99_added_below_1ms": added["gantry"]["p99"] < 1000,
                "gantry_p99_added_le_nginx": added["gantry"]["p99"] <= added["nginx"]["p99"],
            },
        }
        out = ROOT / "bench" / "results" / "gateway-overhead.json"
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps({"added_latency_us": added, "targets": result["targets"]}, indent=2))
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
