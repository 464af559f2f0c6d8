"""Prompt tokens an engine takes from its prefix cache (ABI 1.4 `seq_cached_tokens`), on the
real Gemma 3 270M through the llama.cpp plugin.

The node is this module's own, so its cache starts cold. The same long prompt goes in twice:
the first time every prompt token is evaluated, the second time all but the last come from
the warm slot the first one left (the last is evaluated again for its logits). The response's
`usage.prompt_tokens_details.cached_tokens` and the node's `gantry_prompt_tokens_cached_total`
and `gantry_prompt_tokens_evaluated_total` say so, and /metrics stays valid for promtool. The
llama.cpp plugin's own counters (ABI 1.12) reach /metrics as `gantry_engine_events_total`:
every ubatch's graph built or reused, and a generation's decode steps reusing it.
"""
import json
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import _gemma, serving

# About 700 Gemma tokens, the same every time.
SYSTEM = " ".join(
    f"Rule {i}: answer in one short sentence, name the source, and never guess about item {i}."
    for i in range(36)
)


@pytest.fixture(scope="module")
def gemma_node():
    work = Path(tempfile.mkdtemp(prefix="gantry-prompt-cache-"))
    # One prefill chunk holds the whole prompt: an engine binds its cached prefix on a
    # sequence's first chunk, so the default 512-token chunk would cap what it can reuse.
    (work / "node.yaml").write_text(
        f"models:\n  - {{id: gemma, path: {_gemma()}, format: gguf, contextLength: 2048, maxBatchSize: 2}}\n"
        "scheduler: {responseCacheRamFraction: 0.0, prefillChunkTokens: 1024}\n"
    )
    with serving(work / "node.yaml", work) as base:
        yield base


def post(base, path, body):
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return r.read().decode()


def metrics(base):
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        return r.read().decode()


def counter(text, name):
    m = re.search(rf'^{name}{{model="gemma"}} (\S+)$', text, re.M)
    assert m, f"{name} missing from /metrics"
    return int(float(m.group(1)))


def completion(base, stream=False):
    """One greedy completion of the long prompt: (usage, evaluated, cached) with the counters'
    increase over the request."""
    before = metrics(base)
    body = {"model": "gemma", "prompt": SYSTEM, "max_tokens": 4, "temperature": 0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    raw = post(base, "/v1/completions", body)
    if stream:
        events = [json.loads(line[6:]) for line in raw.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        usage = events[-1]["usage"]
    else:
        usage = json.loads(raw)["usage"]
    after = metrics(base)
    delta = {n: counter(after, n) - counter(before, n)
             for n in ("gantry_prompt_tokens_total", "gantry_prompt_tokens_evaluated_total",
                       "gantry_prompt_tokens_cached_total")}
    assert delta["gantry_prompt_tokens_total"] == usage["prompt_tokens"], (delta, usage)
    return usage, delta["gantry_prompt_tokens_evaluated_total"], delta["gantry_prompt_tokens_cached_total"]


def test_a_repeated_long_prompt_is_evaluated_once_and_then_taken_from_the_cache(gemma_node):
    usage, evaluated, cached = completion(gemma_node)
    prompt = usage["prompt_tokens"]
    assert prompt > 600, usage
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert (evaluated, cached) == (prompt, 0), "a cold cache: every prompt token evaluated"

    usage, evaluated, cached = completion(gemma_node)
    assert usage["prompt_tokens"] == prompt
    assert usage["prompt_tokens_details"] == {"cached_tokens": prompt - 1}
    assert (evaluated, cached) == (1, prompt - 1), "only the last token, for its logits"

    # A streamed answer's usage chunk says the same.
    usage, evaluated, cached = completion(gemma_node, stream=True)
    assert usage["prompt_tokens_details"] == {"cached_tokens": prompt - 1}
    assert evaluated == 1


def test_metrics_with_the_prompt_cache_counters_pass_promtool(gemma_node):
    completion(gemma_node)
    text = metrics(gemma_node)
    for name in ("gantry_prompt_tokens_cached_total", "gantry_prompt_tokens_evaluated_total"):
        assert f"# TYPE {name} counter" in text and f"# HELP {name} " in text, name
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool missing: scripts/setup.sh installs Debian's prometheus package")
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    # vLLM's endpoint-picker names carry a ':' that promtool's linter flags; nothing else may.
    complaints = [line for line in (out.stdout + out.stderr).splitlines()
                  if line.strip() and not (line.startswith("vllm:") and "should not contain ':'" in line)]
    assert not complaints, "\n".join(complaints)


def engine_events(text):
    """`gantry_engine_events_total` of the gemma model, by event."""
    out = {}
    for line in text.splitlines():
        if line.startswith("gantry_engine_events_total{") and 'model="gemma"' in line:
            event = re.search(r'event="([^"]+)"', line).group(1)
            out[event] = int(float(line.rsplit(" ", 1)[1]))
    return out


@pytest.fixture(scope="module")
def gemma_worker_node():
    """The same model in a worker process: the counters cross the worker's pipe."""
    work = Path(tempfile.mkdtemp(prefix="gantry-engine-events-"))
    (work / "node.yaml").write_text(
        f"models:\n  - {{id: gemma, path: {_gemma()}, format: gguf, contextLength: 2048, maxBatchSize: 2}}\n"
        "scheduler: {responseCacheRamFraction: 0.0}\n"
        "isolation: {default: process}\n"
    )
    with serving(work / "node.yaml", work) as base:
        yield base


@pytest.mark.parametrize("where", ["in_process", "worker"])
def test_the_engine_counts_the_graphs_it_built_and_reused(where, request):
    gemma_node = request.getfixturevalue("gemma_node" if where == "in_process" else "gemma_worker_node")
    # The scheduler reads the engine's counters about once a second, between steps.
    # Without speculation: verifying drafts of varying length gives each step another shape.
    body = {"model": "gemma", "prompt": "1, 2, 3, 4, 5,", "max_tokens": 24, "temperature": 0,
            "speculation": False}
    time.sleep(1.5)
    before = engine_events(metrics(gemma_node))
    n = json.loads(post(gemma_node, "/v1/completions", body))["usage"]["completion_tokens"]
    assert n >= 16, n
    deadline = time.monotonic() + 10
    while True:
        after = engine_events(metrics(gemma_node))
        grew = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        if grew.get("ubatches", 0) >= n or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    print(f"engine events over one {n}-token completion:", grew)
    # One prefill and a decode step of one token for each token after the first.
    assert grew["ubatches"] >= n, grew
    assert after["ubatches"] == after["graph_builds"] + after["graph_reuses"], after
    # The decode steps have one shape: llama.cpp builds their graph once (again where its KV
    # view grows) and reuses it.
    assert grew["graph_reuses"] >= n - 4, grew
    text = metrics(gemma_node)
    assert "# TYPE gantry_engine_events_total counter" in text
