"""Hostile input, against the node and through the gateway: malformed and oversized requests,
wrong methods and media types, requests cut by their deadline, and the wire details a client
relies on (request ids, one error shape for every refusal). Every case is bounded in time.

Connection limits (slowloris, idle connections, the cap) are in test_connections.py, against
a node and a gateway started with small limits.
"""
import json
import os
import re
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from conftest import TARGET, _free_port, wait_ready

MAX_BODY = 8 << 20  # gantry_edge::DEFAULT_MAX_BODY_BYTES, the node's and the gateway's default


@pytest.fixture(params=["node", "gateway"])
def base(request, node, gateway):
    return node if request.param == "node" else gateway


def raw(base, method, path, body=b"", headers=None, timeout=60):
    """One HTTP call; returns (status, headers, parsed JSON or text)."""
    req = urllib.request.Request(base + path, data=body if method != "GET" else None, method=method)
    for k, v in (headers or {"content-type": "application/json"}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, hdrs, data = r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        status, hdrs, data = e.code, e.headers, e.read()
    try:
        return status, hdrs, json.loads(data)
    except ValueError:
        return status, hdrs, data.decode("utf-8", "replace")


def send_while_reading(base, path, body):
    """POST `body` on a raw socket, sending from a thread while the answer is read: a server
    may answer (413) and close before the whole body is sent, which urllib reports as a broken
    pipe instead of the answer."""
    host, port = base.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.settimeout(30)
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()

    def send():
        try:
            s.sendall(head + body)
        except OSError:
            pass

    t = threading.Thread(target=send, daemon=True)
    t.start()
    data = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
            if b"\r\n\r\n" in data:
                hdr, _, rest = data.partition(b"\r\n\r\n")
                m = re.search(rb"content-length: (\d+)", hdr, re.I)
                if m and len(rest) >= int(m.group(1)):
                    break
    except (ConnectionResetError, socket.timeout):
        pass
    s.close()
    hdr, _, rest = data.partition(b"\r\n\r\n")
    status = int(hdr.split(b" ")[1]) if hdr else 0
    return status, json.loads(rest) if rest else None


def assert_openai_error(status, body, want_status, param=None, code=None, contains=None):
    assert status == want_status, body
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    if contains is not None:
        assert contains in err["message"], err


def chat_body(**kw):
    b = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    b.update(kw)
    return json.dumps(b).encode()


# --- malformed requests (these passed before; kept as regressions) ---------------------------

def test_a_megabyte_prompt_is_refused_naming_the_field(base):
    status, _, body = raw(base, "POST", "/v1/completions",
                          json.dumps({"model": "tiny", "prompt": "a " * 500_000}).encode())
    assert_openai_error(status, body, 400, param="prompt", code="context_length_exceeded")


def test_invalid_utf8_deep_nesting_and_nan_are_400(base):
    for payload in (b'{"model": "tiny", "prompt": "\xff\xfe"}',
                    b'{"model": "tiny", "x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
                    b'{"model": "tiny", "prompt": "x", "temperature": NaN}'):
        status, _, body = raw(base, "POST", "/v1/completions", payload)
        assert_openai_error(status, body, 400)


def test_ten_thousand_stop_strings_unknown_roles_and_images_are_refused(base):
    status, _, body = raw(base, "POST", "/v1/chat/completions", chat_body(stop=["x"] * 10_000))
    assert_openai_error(status, body, 400, param="stop")
    status, _, body = raw(base, "POST", "/v1/chat/completions",
                          chat_body(messages=[{"role": "wizard", "content": "hi"}]))
    assert_openai_error(status, body, 400)
    assert body["error"]["param"].startswith("messages"), body
    image = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    status, _, body = raw(base, "POST", "/v1/chat/completions",
                          chat_body(messages=[{"role": "user", "content": image}]))
    assert status == 400 and body["error"]["param"].startswith("messages"), body


# --- wire details ----------------------------------------------------------------------------

def test_every_response_carries_a_request_id_and_a_callers_id_is_echoed(base):
    _, hdrs, _ = raw(base, "GET", "/v1/models")
    generated = hdrs.get("x-request-id")
    assert generated and re.fullmatch(r"[0-9a-f]{32}", generated), generated
    _, hdrs2, _ = raw(base, "GET", "/v1/models")
    assert hdrs2.get("x-request-id") != generated
    mine = f"trace-{time.time_ns()}"
    status, hdrs, _ = raw(base, "POST", "/v1/chat/completions", chat_body(),
                          {"content-type": "application/json", "x-request-id": mine})
    assert status == 200 and hdrs.get("x-request-id") == mine
    # Refusals carry it too, and an unusable id (spaces) is replaced, not echoed.
    _, hdrs, _ = raw(base, "GET", "/v1/nope", headers={"x-request-id": "has spaces"})
    assert hdrs.get("x-request-id") and hdrs.get("x-request-id") != "has spaces"


def test_the_request_id_is_in_the_logs_of_the_node_and_the_gateway(node, gateway):
    mine = f"log-trace-{time.time_ns()}"
    status, _, _ = raw(gateway, "POST", "/v1/chat/completions", chat_body(),
                       {"content-type": "application/json", "x-request-id": mine})
    assert status == 200
    deadline = time.time() + 5
    logs = {}
    while time.time() < deadline:
        logs = {k: Path(os.environ[k]).read_text() for k in ("GANTRY_TEST_NODE_LOG", "GANTRY_TEST_GATEWAY_LOG")}
        if all(mine in text for text in logs.values()):
            break
        time.sleep(0.1)
    for name, text in logs.items():
        assert mine in text, f"{mine} not in {name}"


def test_wrong_method_unknown_route_and_non_json_bodies_answer_in_openai_shape(base):
    status, hdrs, body = raw(base, "GET", "/v1/chat/completions")
    assert_openai_error(status, body, 405, code="method_not_allowed")
    assert "POST" in (hdrs.get("allow") or "")
    status, _, body = raw(base, "DELETE", "/v1/models")
    assert_openai_error(status, body, 405, code="method_not_allowed")
    status, _, body = raw(base, "GET", "/v1/no-such-route")
    assert_openai_error(status, body, 404, code="not_found")
    status, _, body = raw(base, "POST", "/v1/chat/completions", b"model=tiny",
                          {"content-type": "application/x-www-form-urlencoded"})
    assert_openai_error(status, body, 415, code="unsupported_media_type", contains="application/json")
    status, _, body = raw(base, "POST", "/v1/chat/completions", chat_body(),
                          {"content-type": "text/plain"})
    assert_openai_error(status, body, 415, code="unsupported_media_type")
    # JSON with a charset, and a +json type, are JSON.
    status, _, _ = raw(base, "POST", "/v1/chat/completions", chat_body(),
                       {"content-type": "application/json; charset=utf-8"})
    assert status == 200


def test_the_body_limit_is_one_setting_for_the_node_and_the_gateway(base):
    over = b'{"model": "tiny", "prompt": "x", "pad": "' + b"a" * MAX_BODY + b'"}'
    status, body = send_while_reading(base, "/v1/completions", over)
    assert_openai_error(status, body, 413, code="request_too_large", contains=str(MAX_BODY))
    # Just under the limit: both accept it (whitespace keeps parsing cheap), so the gateway
    # never buffers a body the node then refuses.
    head = chat_body()[:-1]
    under = head + b" " * (MAX_BODY - len(head) - 64) + b"}"
    assert len(under) < MAX_BODY
    status, _, body = raw(base, "POST", "/v1/chat/completions", under)
    assert status == 200, body


def test_logit_bias_outside_the_vocabulary_is_refused_naming_the_key(base):
    status, _, body = raw(base, "POST", "/v1/chat/completions", chat_body(logit_bias={"99999999": 5}))
    assert_openai_error(status, body, 400, param="logit_bias", contains="99999999")


def test_max_tokens_is_reported_as_given(base):
    status, _, body = raw(base, "POST", "/v1/chat/completions", chat_body(max_tokens=1_000_000_000_000))
    assert_openai_error(status, body, 400, param="max_tokens", contains="1000000000000")
    assert "4294967295" not in body["error"]["message"]


def test_a_completions_context_error_names_prompt_and_a_chat_one_names_messages(base):
    status, _, body = raw(base, "POST", "/v1/completions",
                          json.dumps({"model": "tiny", "prompt": "word " * 600}).encode())
    assert_openai_error(status, body, 400, param="prompt", code="context_length_exceeded")
    status, _, body = raw(base, "POST", "/v1/chat/completions",
                          chat_body(messages=[{"role": "user", "content": "word " * 600}]))
    assert_openai_error(status, body, 400, param="messages", code="context_length_exceeded")


def test_the_gateway_lists_models_with_created_and_the_nodes_fields(gateway):
    status, _, body = raw(gateway, "GET", "/v1/models")
    assert status == 200
    models = {m["id"]: m for m in body["data"]}
    gemma = models["gemma"]
    assert gemma["object"] == "model" and gemma["owned_by"] == "gantry"
    assert abs(gemma["created"] - time.time()) < 24 * 3600, gemma
    assert gemma["format"] == "gguf" and gemma["architecture"] == "gemma3", gemma
    assert gemma["ready"] is True and gemma["engine"], gemma
    assert gemma["replicas_ready"] == 1


def test_a_corrupt_gguf_says_why_in_the_status_document(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + b"\x00" * 9)  # truncated header
    port = _free_port()
    config = tmp_path / "node.yaml"
    config.write_text(f"models:\n  - {{id: bad, path: {bad}, format: gguf}}\n")
    proc = subprocess.Popen(
        [TARGET / "gantry-node", "serve", "--config", config, "--listen", f"127.0.0.1:{port}",
         "--plugins-dir", TARGET / "engines"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, artifact = time.time() + 20, None
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status", timeout=1) as r:
                    artifact = json.load(r)["models"][0]["artifact"]
                if artifact["state"] == "failed":
                    break
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        assert artifact and artifact["state"] == "failed", artifact
        assert artifact["message"] and "bad.gguf" in artifact["message"], artifact
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# --- deadlines: honest endings -----------------------------------------------------------------

# Gemma 3's end-of-generation tokens (<eos> 1, <end_of_turn> 106), biased away so a completion
# runs until something else ends it. (Chat would stop at once: the test model has no template of
# its own, and through the default ChatML it writes `<|im_end|>` first, which ends the reply.)
NO_EOS = {"1": -100, "106": -100}
STORY = "Once upon a time, in a small village by the sea,"


def test_a_stream_cut_by_its_deadline_ends_with_an_error_event_not_length(base):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0, timeout=60)
    stream = client.completions.create(
        model="gemma", prompt=STORY, max_tokens=900, temperature=0, logit_bias=NO_EOS, stream=True,
        extra_body={"timeout": 1})
    chunks, finish = 0, []
    with pytest.raises(openai.APIError) as e:
        for c in stream:
            chunks += 1
            finish += [ch.finish_reason for ch in c.choices if ch.finish_reason]
    assert finish == [], "a cut stream must not say it finished"
    assert chunks > 1, "the stream started before the deadline"
    assert e.value.code == "deadline_exceeded", e.value.body
    assert "deadline" in e.value.message


def test_a_plain_request_cut_by_its_deadline(base):
    kw = dict(model="gemma", prompt=STORY, temperature=0, logit_bias=NO_EOS, timeout=1)
    # With max_tokens: the client asked for a length that did not fit, so it is an error that
    # says how far it got.
    status, _, body = raw(base, "POST", "/v1/completions", json.dumps({**kw, "max_tokens": 900}).encode())
    assert_openai_error(status, body, 504, code="deadline_exceeded", contains="generated tokens")
    # Without max_tokens the node chose the length; the deadline bounds it and the work is kept.
    status, hdrs, body = raw(base, "POST", "/v1/completions", json.dumps(kw).encode())
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] > 0 and body["choices"][0]["text"]
    assert hdrs.get("x-gantry-truncated") == "deadline"


def test_a_request_still_queued_at_its_deadline_gets_504_before_any_byte(node):
    # Fill gemma's 4 sequences with long completions, then queue one with a 1 s deadline.
    client = openai.OpenAI(base_url=f"{node}/v1", api_key="k", max_retries=0, timeout=60)
    long = dict(model="gemma", prompt=STORY, max_tokens=150, temperature=0, logit_bias=NO_EOS,
                extra_body={"timeout": 30})
    fillers = [threading.Thread(target=lambda: client.completions.create(**long)) for _ in range(4)]
    for t in fillers:
        t.start()
    time.sleep(0.5)
    try:
        for stream in (True, False):
            t0 = time.time()
            with pytest.raises(openai.APIStatusError) as e:
                r = client.completions.create(model="gemma", prompt="hi", max_tokens=5, stream=stream,
                                              extra_body={"timeout": 1})
                if stream:
                    list(r)
            assert e.value.status_code == 504
            assert e.value.body["code"] == "queue_timeout", e.value.body
            assert "queue" in e.value.body["message"]
            assert time.time() - t0 < 5
    finally:
        for t in fillers:
            t.join(timeout=60)
    with urllib.request.urlopen(f"{node}/metrics", timeout=5) as r:
        metrics = r.read().decode()
    assert re.search(r'gantry_request_finish_total\{model="gemma",reason="queue_timeout"\} [1-9]', metrics)
    assert re.search(r'gantry_request_queue_seconds_count\{model="gemma"\} [1-9]', metrics)


# --- the chat template's end of turn -------------------------------------------------------------

def test_the_templates_end_of_turn_marker_stops_generation(tmp_path):
    """Gemma served through the default ChatML template (as a model without a template of its
    own would be): `<|im_end|>` ends the reply as text, as llama-server stops on it."""
    gemma = Path(os.environ.get("GANTRY_GEMMA_GGUF", Path.home() / ".cache/gantry/models/gemma-3-270m-q4_k_m.gguf"))
    chatml = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    config = tmp_path / "node.yaml"
    config.write_text(f"models:\n  - id: g\n    path: {gemma}\n    format: gguf\n    contextLength: 1024\n"
                      f"    chatTemplate: {json.dumps(chatml)}\n")
    port = _free_port()
    proc = subprocess.Popen(
        [TARGET / "gantry-node", "serve", "--config", config, "--listen", f"127.0.0.1:{port}",
         "--threads", "2", "--plugins-dir", TARGET / "engines"],
        stdout=open(tmp_path / "node.log", "w"), stderr=subprocess.STDOUT)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, tmp_path / "node.log", "gantry-node (ChatML)")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, timeout=60)
        r = client.chat.completions.create(model="g", messages=[{"role": "user", "content": "Say hi"}],
                                           temperature=0, max_tokens=300, logit_bias=NO_EOS)
        text = r.choices[0].message.content
        assert "<|im_end|>" not in text and "<|im_start|>" not in text, text
        assert r.choices[0].finish_reason == "stop", (r.choices[0].finish_reason, text)
        assert r.usage.completion_tokens < 300
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# --- secure by default: tokens and keys ------------------------------------------------------

NODE_TOKEN = "t" * 20 + "0123456789abcdef"  # >= 32 characters, as the node requires


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """A node that requires its token and a gateway with API keys in front, as the chart
    installs them (static discovery: the gateway sends the install token as is)."""
    work = tmp_path_factory.mktemp("secured")
    subprocess.run([TARGET / "gantry-testkit", "tiny-gguf", "--out", work / "tiny.gguf"], check=True)
    (work / "node.yaml").write_text(f"models:\n  - {{id: tiny, path: {work / 'tiny.gguf'}, format: gguf}}\n")
    (work / "keys.yaml").write_text("team: {key: sk-team-1234, models: [tiny]}\n")
    node_port, gw_port = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GANTRY_")}
    env["GANTRY_NODE_TOKEN"] = NODE_TOKEN
    node = subprocess.Popen(
        [TARGET / "gantry-node", "serve", "--config", work / "node.yaml", "--listen", f"127.0.0.1:{node_port}",
         "--threads", "1", "--plugins-dir", TARGET / "engines"],
        stdout=open(work / "node.log", "w"), stderr=subprocess.STDOUT, env=env)
    node_base = f"http://127.0.0.1:{node_port}"
    wait_ready(node_base, node, work / "node.log", "gantry-node (token)")
    (work / "endpoints.yaml").write_text(f"models:\n  tiny: ['{node_base}']\n")
    gw = subprocess.Popen(
        [TARGET / "gantry-operator", "run", "--components", "gateway", "--endpoints-file", work / "endpoints.yaml",
         "--gateway-addr", f"127.0.0.1:{gw_port}", "--probe-interval-ms", "200",
         "--api-keys-file", work / "keys.yaml"],
        stdout=open(work / "gateway.log", "w"), stderr=subprocess.STDOUT, env=env)
    gw_base = f"http://127.0.0.1:{gw_port}"
    wait_ready(gw_base, gw, work / "gateway.log", "gateway (keys)")
    deadline = time.time() + 20
    while time.time() < deadline:  # a probe with the token found the replica ready
        status, _, _ = raw(gw_base, "POST", "/v1/chat/completions", chat_body(),
                           {"content-type": "application/json", "authorization": "Bearer sk-team-1234"})
        if status == 200:
            break
        time.sleep(0.2)
    yield node_base, gw_base
    for p in (gw, node):
        p.terminate()
        p.wait(timeout=30)


def test_a_node_pod_ip_is_not_an_unauthenticated_model_endpoint(secured):
    node, _ = secured
    status, _, body = raw(node, "POST", "/v1/chat/completions", chat_body())
    assert_openai_error(status, body, 401, code="node_token_required")
    status, _, body = raw(node, "POST", "/v1/chat/completions", chat_body(),
                          {"content-type": "application/json", "x-gantry-node-token": NODE_TOKEN[:-1] + "x"})
    assert_openai_error(status, body, 401, code="invalid_node_token")
    for path in ("/v1/models", "/v1/status"):
        status, _, body = raw(node, "GET", path)
        assert_openai_error(status, body, 401, code="node_token_required")
    # Probes and metrics stay open for the kubelet and Prometheus.
    for path in ("/healthz", "/readyz", "/metrics"):
        assert raw(node, "GET", path)[0] == 200, path
    status, _, _ = raw(node, "POST", "/v1/chat/completions", chat_body(),
                       {"content-type": "application/json", "x-gantry-node-token": NODE_TOKEN})
    assert status == 200


def test_the_gateway_requires_a_key_and_never_forwards_a_clients_node_token(secured):
    _, gw = secured
    status, _, body = raw(gw, "POST", "/v1/chat/completions", chat_body())
    assert_openai_error(status, body, 401)
    status, _, body = raw(gw, "POST", "/v1/chat/completions", chat_body(),
                          {"content-type": "application/json", "authorization": "Bearer sk-wrong"})
    assert_openai_error(status, body, 401)
    # A client's own (wrong) node token is dropped; the gateway sends the real one.
    status, _, body = raw(gw, "POST", "/v1/chat/completions", chat_body(),
                          {"content-type": "application/json", "authorization": "Bearer sk-team-1234",
                           "x-gantry-node-token": "forged"})
    assert status == 200, body
