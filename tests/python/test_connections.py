"""Connection limits at the edge, on the node and on the gateway, with raw sockets: a slowloris
client is cut at the header-read timeout, an idle connection at the idle timeout, the
connection cap closes idle connections to make room and refuses with a 503 in OpenAI's shape
only when every connection is busy, and the descriptor limit is raised at start.

Both servers run here with small limits (1 s header read, 2 s idle, 2 s body, 16 connections) so every
case ends in seconds. The full-size measurement (20,000 idle connections and 50 slowloris
clients) is bench/connections.py; its numbers are in docs/benchmarks.md.
"""
import json
import os
import re
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import TARGET, _free_port, wait_ready

LIMITS = ["--max-connections", "16", "--header-read-timeout-seconds", "1", "--idle-timeout-seconds", "2",
          "--body-read-timeout-seconds", "2"]


@pytest.fixture(scope="module")
def limited():
    """A node serving the tiny model and a gateway in front of it, both with small limits."""
    work = Path(tempfile.mkdtemp(prefix="gantry-conn-"))
    subprocess.run([TARGET / "gantry-testkit", "tiny-gguf", "--out", work / "tiny.gguf"], check=True)
    (work / "node.yaml").write_text(
        f"models:\n  - {{id: tiny, path: {work / 'tiny.gguf'}, format: gguf, contextLength: 256, maxBatchSize: 2}}\n")
    node_port, gw_port = _free_port(), _free_port()
    node_log, gw_log = work / "node.log", work / "gateway.log"
    node = subprocess.Popen(
        [TARGET / "gantry-node", "serve", "--config", work / "node.yaml", "--listen", f"127.0.0.1:{node_port}",
         "--threads", "1", "--plugins-dir", TARGET / "engines", *LIMITS],
        stdout=open(node_log, "w"), stderr=subprocess.STDOUT)
    node_base = f"http://127.0.0.1:{node_port}"
    wait_ready(node_base, node, node_log, "gantry-node")
    (work / "endpoints.yaml").write_text(f"models:\n  tiny: ['{node_base}']\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GANTRY_")}
    gw = subprocess.Popen(
        [TARGET / "gantry-operator", "run", "--components", "gateway", "--endpoints-file", work / "endpoints.yaml",
         "--gateway-addr", f"127.0.0.1:{gw_port}", "--probe-interval-ms", "200", *LIMITS],
        stdout=open(gw_log, "w"), stderr=subprocess.STDOUT, env=env)
    gw_base = f"http://127.0.0.1:{gw_port}"
    wait_ready(gw_base, gw, gw_log, "gateway")
    yield {"node": (node_base, node), "gateway": (gw_base, gw)}
    for p in (gw, node):
        p.terminate()
        p.wait(timeout=30)


@pytest.fixture(params=["node", "gateway"])
def server(request, limited):
    return limited[request.param]


def _addr(base):
    host, port = base.removeprefix("http://").split(":")
    return host, int(port)


def _closed_within(sock, seconds):
    """Seconds until the peer closed `sock` (reads until EOF or reset), or None."""
    sock.settimeout(0.2)
    t0 = time.time()
    while time.time() - t0 < seconds:
        try:
            if sock.recv(4096) == b"":
                return time.time() - t0
        except socket.timeout:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return time.time() - t0
    return None


def _get(base, path="/v1/models", timeout=5):
    with urllib.request.urlopen(base + path, timeout=timeout) as r:
        return r.status, r.read()


def _metric(base, name, labels=""):
    _, text = _get(base, "/metrics")
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text.decode(), re.M)
    return float(m.group(1)) if m else 0.0


def test_a_slowloris_client_is_cut_at_the_header_read_timeout(server):
    base, _ = server
    s = socket.create_connection(_addr(base))
    t0 = time.time()
    cut_at = None
    for ch in b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
        try:
            s.send(bytes([ch]))
        except (BrokenPipeError, ConnectionResetError):
            cut_at = time.time() - t0
            break
        if _closed_within(s, 0.25) is not None:
            cut_at = time.time() - t0
            break
    s.close()
    assert cut_at is not None, "a client trickling its headers was never cut"
    assert 0.9 < cut_at < 3.0, cut_at


def test_an_idle_connection_is_closed_after_the_idle_timeout_and_a_keepalive_one_too(server):
    base, _ = server
    s = socket.create_connection(_addr(base))
    waited = _closed_within(s, 6)
    s.close()
    assert waited is not None and 1.5 < waited < 4.0, waited
    # After a complete request, the kept-alive connection is idle again: same timeout.
    s = socket.create_connection(_addr(base))
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    first = s.recv(4096)
    assert first.startswith(b"HTTP/1.1 200")
    waited = _closed_within(s, 6)
    s.close()
    assert waited is not None and 1.5 < waited < 4.0, waited


def test_a_slow_body_is_cut_at_the_body_read_timeout_with_an_answer(server):
    base, _ = server
    s = socket.create_connection(_addr(base))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000\r\n\r\n{\"model\": ")
    t0 = time.time()
    s.settimeout(6)
    answer = b""
    try:
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break
            answer += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    s.close()
    waited = time.time() - t0
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer
    err = json.loads(body)["error"]
    assert "did not arrive within 2 s" in err["message"], err
    assert 1.5 < waited < 5, waited


def test_at_the_cap_idle_connections_make_room_for_a_new_client(server):
    base, _ = server
    before = _metric(base, _prefix(base) + "_connections_closed_total", '{reason="evicted"}')
    idle = [socket.create_connection(_addr(base)) for _ in range(40)]
    try:
        t0 = time.time()
        status, _ = _get(base)
        assert status == 200
        assert time.time() - t0 < 1.0
    finally:
        for s in idle:
            s.close()
    assert _metric(base, _prefix(base) + "_connections_closed_total", '{reason="evicted"}') >= before + 24


def _prefix(base):
    return "gantry_gateway" if _is_gateway(base) else "gantry"


def _is_gateway(base):
    _, text = _get(base, "/metrics")
    return b"gantry_gateway_connections_open" in text


def test_when_every_connection_is_busy_a_new_one_gets_a_503_in_openai_shape(server):
    base, _ = server
    # Busy: each connection sent the headers of a POST and is still sending its body, so a
    # request is in flight on it (not idle, not evictable).
    busy = []
    try:
        for _ in range(16):
            s = socket.create_connection(_addr(base))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100000\r\n\r\n{")
            busy.append(s)
        time.sleep(0.3)
        s = socket.create_connection(_addr(base))
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(3)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = s.recv(4096)
            if not chunk:
                break
            answer += chunk
        s.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), answer
        assert b"retry-after: 1" in head.lower()
        err = json.loads(body)["error"]
        assert err["code"] == "too_many_connections" and "16" in err["message"], err
    finally:
        for s in busy:
            s.close()
    # Once they go, the server serves again.
    deadline = time.time() + 5
    while time.time() < deadline:
        try:
            if _get(base)[0] == 200:
                break
        except (urllib.error.URLError, OSError):
            time.sleep(0.1)
    else:
        pytest.fail("the server did not recover after the busy connections closed")


def test_the_descriptor_limit_is_raised_to_the_hard_limit(server):
    _, proc = server
    limits = Path(f"/proc/{proc.pid}/limits").read_text()
    line = next(l for l in limits.splitlines() if l.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    assert soft == hard, line


def test_a_normal_request_completes_with_many_idle_and_slowloris_connections_open(server):
    base, _ = server
    # More idle connections than the cap, and slowloris clients, then ordinary requests.
    idle = [socket.create_connection(_addr(base)) for _ in range(64)]
    slow = [socket.create_connection(_addr(base)) for _ in range(8)]
    try:
        for s in slow:
            s.send(b"GET / HTTP/1.1\r\nX: ")
        latencies = []
        for _ in range(20):
            t0 = time.time()
            status, _ = _get(base)
            latencies.append(time.time() - t0)
            assert status == 200
        assert max(latencies) < 2.0, latencies
    finally:
        for s in idle + slow:
            s.close()
