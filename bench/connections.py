#!/usr/bin/env python3
"""Connection-limit benchmark: does an ordinary request still get through quickly while
20,000 idle connections and 50 slowloris clients are open? Node, gateway, and (optional)
llama-server as the peer, each under the same attack in the same run.

For each target: first a baseline (requests with nothing else open), then the attack is
opened (idle connections from worker processes, 10,000 per process so no client process runs
out of descriptors; slowloris clients that send one header byte per second) and the same
requests are timed again while it stays open. A request is a streamed-off chat completion,
`max_tokens: 1`, on the tiny test model, sent on a new connection each time, bounded by a
5 s timeout (a timeout counts as a failure, not as 5 s).

Writes JSON (default bench/results/connections.json): per target, p50/p99/max latency in ms
with and without the attack, failures, and the server's own connection metrics afterwards.

    python3 bench/connections.py [--peer "$(bench/build-llama-server.sh)"] [--idle 20000]

Needs `cargo build --release --workspace --all-targets`. Runs for about a minute per target.
"""

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

# Shared with the gateway benchmark (run as a script, this folder is on the path).
from common import free_port, wait_http

ROOT = Path(__file__).resolve().parent.parent
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release"
BODY = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 1, "temperature": 0}).encode()

WORKER = r"""
import resource, socket, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
socks, failed = [], 0
for _ in range(n):
    try:
        s = socket.socket()
        s.settimeout(2)
        s.connect((host, port))
        socks.append(s)
    except OSError:
        failed += 1
print(f"open {len(socks)} failed {failed}", flush=True)
sys.stdin.read()
"""


def one_request(base):
    req = urllib.request.Request(f"{base}/v1/chat/completions", data=BODY,
                                 headers={"content-type": "application/json", "connection": "close"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            r.read()
            ok = r.status == 200
    except OSError:
        ok = False
    return ok, (time.perf_counter() - t0) * 1e3


def timed(base, n):
    """`n` requests one after the other; stops early after 10 failures in a row (a server that
    stopped answering would otherwise cost n x 5 s)."""
    lat, failures, in_row, sent = [], 0, 0, 0
    for _ in range(n):
        ok, ms = one_request(base)
        sent += 1
        if ok:
            lat.append(ms)
            in_row = 0
        else:
            failures += 1
            in_row += 1
            if in_row >= 10:
                break
        time.sleep(0.02)
    lat.sort()
    pick = lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))], 2) if lat else None
    return {"n": sent, "failures": failures, "p50_ms": pick(0.50), "p99_ms": pick(0.99),
            "max_ms": round(lat[-1], 2) if lat else None}


class Slowloris:
    def __init__(self, host, port, n):
        self.host, self.port, self.n = host, port, n
        self.stop = threading.Event()
        self.reconnects = 0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        socks = [self.connect() for _ in range(self.n)]
        line = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000
        i = 0
        while not self.stop.wait(1.0):
            for k, s in enumerate(socks):
                try:
                    s.send(line[i % len(line):i % len(line) + 1])
                except OSError:
                    # Cut by the server: a real attacker comes back at once.
                    self.reconnects += 1
                    socks[k] = self.connect()
            i += 1
        for s in socks:
            s.close()

    def connect(self):
        s = socket.socket()
        s.settimeout(2)
        try:
            s.connect((self.host, self.port))
        except OSError:
            pass
        return s


def attack_and_measure(name, base, idle, slow, n, metrics_prefix):
    host, port = base.removeprefix("http://").split(":")
    port = int(port)
    result = {"target": name, "baseline": timed(base, n)}
    workers = []
    per = 10_000
    opened = failed = 0
    t0 = time.time()
    for k in range(0, idle, per):
        w = subprocess.Popen([sys.executable, "-c", WORKER, host, str(port), str(min(per, idle - k))],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        workers.append(w)
    for w in workers:
        parts = w.stdout.readline().split()
        opened += int(parts[1])
        failed += int(parts[3])
    loris = Slowloris(host, port, slow)
    loris.thread.start()
    time.sleep(2)
    result["attack"] = {"idle_opened_by_clients": opened, "idle_connect_failures": failed,
                        "slowloris": slow, "seconds_to_open": round(time.time() - t0, 1)}
    result["under_attack"] = timed(base, n)
    loris.stop.set()
    loris.thread.join(timeout=10)
    result["attack"]["slowloris_reconnects"] = loris.reconnects
    if metrics_prefix:
        try:
            with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
                text = r.read().decode()
            result["server_metrics"] = {
                line.split(" ")[0]: float(line.split(" ")[1])
                for line in text.splitlines()
                if line.startswith(f"{metrics_prefix}_connections_")
            }
        except OSError as e:
            result["server_metrics"] = {"error": str(e)}
    for w in workers:
        w.stdin.close()
        w.wait(timeout=30)
    time.sleep(1)
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--idle", type=int, default=20_000)
    ap.add_argument("--slowloris", type=int, default=50)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--peer", help="llama-server binary (optional)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/connections.json"))
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    work = Path(tempfile.mkdtemp(prefix="gantry-bench-conn-"))
    subprocess.run([TARGET / "gantry-testkit", "tiny-gguf", "--out", work / "tiny.gguf"], check=True)
    (work / "node.yaml").write_text(
        f"models:\n  - {{id: tiny, path: {work / 'tiny.gguf'}, format: gguf, contextLength: 256, maxBatchSize: 4}}\n"
        "scheduler: {responseCacheRamFraction: 0.0}\n")
    procs, results = [], []
    try:
        node_port = free_port()
        node = f"http://127.0.0.1:{node_port}"
        procs.append(subprocess.Popen(
            [TARGET / "gantry-node", "serve", "--config", work / "node.yaml", "--listen", f"127.0.0.1:{node_port}",
             "--threads", "1", "--plugins-dir", TARGET / "engines"],
            stdout=subprocess.DEVNULL, stderr=open(work / "node.log", "w")))
        wait_http(f"{node}/readyz")
        gw_port = free_port()
        gw = f"http://127.0.0.1:{gw_port}"
        (work / "endpoints.yaml").write_text(f"models:\n  tiny: ['{node}']\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("GANTRY_")}
        procs.append(subprocess.Popen(
            [TARGET / "gantry-operator", "run", "--components", "gateway", "--endpoints-file", work / "endpoints.yaml",
             "--gateway-addr", f"127.0.0.1:{gw_port}"],
            stdout=subprocess.DEVNULL, stderr=open(work / "gateway.log", "w"), env=env))
        wait_http(f"{gw}/readyz")
        results.append(attack_and_measure("gantry-node", node, args.idle, args.slowloris, args.requests, "gantry"))
        results.append(attack_and_measure("gantry-gateway", gw, args.idle, args.slowloris, args.requests,
                                          "gantry_gateway"))
        for p in procs:
            p.terminate()
            p.wait(timeout=30)
        procs.clear()
        if args.peer:
            peer_port = free_port()
            peer = f"http://127.0.0.1:{peer_port}"
            procs.append(subprocess.Popen(
                [args.peer, "-m", work / "tiny.gguf", "--host", "127.0.0.1", "--port", str(peer_port),
                 "-t", "1", "-c", "1024", "-np", "4", "--alias", "tiny"],
                stdout=subprocess.DEVNULL, stderr=open(work / "peer.log", "w")))
            wait_http(f"{peer}/health")
            results.append(attack_and_measure("llama-server", peer, args.idle, args.slowloris, args.requests, None))
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=30)
    out = {"idle": args.idle, "slowloris": args.slowloris, "requests": args.requests,
           "machine": {"cpus": os.cpu_count(), "nofile_hard": hard}, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
