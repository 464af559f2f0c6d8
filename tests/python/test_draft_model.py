"""Speculative decoding with a draft model, through the official `openai` client: a node whose
models draft with another model of the node (`speculation: {method: draftModel}`).

- `smollm2-native` (native engine, f32 safetensors) drafts with `smollm2` (llama.cpp, Q4_1 GGUF
  of the same model): two engines, one tokenizer;
- `smollm2-spec` (llama.cpp) drafts with `smollm2` too;
- `gemma` names `smollm2` as well, whose tokenizer differs: it serves without drafts and its
  status says why.

At temperature 0 the text is the same with and without drafts (`speculation: false` on the
request), drafted tokens are verified and some kept (`gantry_speculative_*_tokens_total`), and
`/v1/status` reports each draft and what it holds.
"""
import json
import tempfile
import urllib.request
from pathlib import Path

import openai
import pytest

from conftest import _gemma, _smollm2, _smollm2_st, serving
from test_speculation import counters

TEXT = ("The comittee met on tuesday to discus the new budjet. Most members agred that the "
        "libary needs more funding, but some argued that the park shoud come first.")
PROMPTS = [
    f"Rewrite this paragraph with the spelling fixed:\n\n{TEXT}",
    "Write a short poem about the sea.",
    "Explain what a compiler does.",
]
TARGETS = ["smollm2-native", "smollm2-spec"]


@pytest.fixture(scope="module")
def draft_node():
    work = Path(tempfile.mkdtemp(prefix="gantry-draft-"))
    config = work / "node.yaml"
    draft = "speculation: {method: draftModel, draftModel: smollm2}"
    config.write_text(
        "models:\n"
        f"  - {{id: smollm2, path: {_smollm2()}, format: gguf, contextLength: 1024, maxBatchSize: 2}}\n"
        f"  - {{id: smollm2-native, path: {_smollm2_st()}, format: safetensors, contextLength: 1024,\n"
        f"      maxBatchSize: 2, {draft}}}\n"
        f"  - {{id: smollm2-spec, path: {_smollm2()}, format: gguf, contextLength: 1024, maxBatchSize: 2,\n"
        f"      {draft}}}\n"
        f"  - {{id: gemma, path: {_gemma()}, format: gguf, contextLength: 512, maxBatchSize: 1, {draft}}}\n"
        "scheduler: {responseCacheRamFraction: 0.0}\n"
    )
    with serving(config, work) as base:
        yield base


@pytest.fixture(scope="module")
def draft_client(draft_node):
    return openai.OpenAI(base_url=f"{draft_node}/v1", api_key="unused", max_retries=0, timeout=120)


def status(node):
    with urllib.request.urlopen(f"{node}/v1/status", timeout=30) as r:
        return {m["id"]: m for m in json.load(r)["models"]}


def greedy(client, model, prompt, **extra):
    # A seed makes both runs evaluate the whole prompt (no prefix from a warm slot).
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=48,
        temperature=0, seed=0, extra_body=extra or None)
    c = r.choices[0]
    return c.message.content, c.finish_reason, r.usage.completion_tokens


@pytest.mark.parametrize("model", TARGETS)
def test_greedy_text_is_the_same_with_and_without_a_draft_model(draft_client, draft_node, model):
    drafted0, accepted0 = counters(draft_node, model)
    for prompt in PROMPTS:
        on = greedy(draft_client, model, prompt)
        off = greedy(draft_client, model, prompt, speculation=False)
        assert on == off, f"{model}: {prompt[:40]!r}\nwith:    {on}\nwithout: {off}"
        assert on[2] > 0
    drafted, accepted = counters(draft_node, model)
    assert drafted > drafted0, f"{model}: nothing was drafted"
    # The draft is the same model (another engine, or another quantization): most drafts hold.
    rate = (accepted - accepted0) / (drafted - drafted0)
    assert rate > 0.5, f"{model}: {accepted - accepted0:.0f} of {drafted - drafted0:.0f} kept"


def test_a_request_that_opts_out_drafts_nothing(draft_client, draft_node):
    before = counters(draft_node, "smollm2-spec")
    greedy(draft_client, "smollm2-spec", PROMPTS[1], speculation=False)
    assert counters(draft_node, "smollm2-spec") == before


def test_sampled_requests_draft_too_and_finish(draft_client, draft_node):
    drafted0, _ = counters(draft_node, "smollm2-native")
    r = draft_client.chat.completions.create(
        model="smollm2-native", messages=[{"role": "user", "content": PROMPTS[0]}],
        max_tokens=32, temperature=0.7, seed=7)
    assert r.choices[0].message.content and r.usage.completion_tokens > 0
    assert r.choices[0].finish_reason in ("stop", "length")
    assert counters(draft_node, "smollm2-native")[0] > drafted0


def test_status_reports_each_draft_and_a_refused_one_with_its_reason(draft_client, draft_node):
    models = status(draft_node)
    for model in TARGETS:
        d = models[model]["draft"]
        assert d["model"] == "smollm2" and d["active"] is True, d
        assert d["bytesUsed"] > 0
        # The draft instance counts in the model's memory.
        assert models[model]["load"]["bytesUsed"] > d["bytesUsed"]
    assert "draft" not in models["smollm2"], "the draft model itself drafts with nothing"
    g = models["gemma"]["draft"]
    assert g["active"] is False and g["bytesUsed"] == 0
    assert "tokenizes differently" in g["message"], g
    # Without its draft, gemma serves as before, and drafts nothing.
    before = counters(draft_node, "gemma")
    r = draft_client.completions.create(model="gemma", prompt="The capital of France is",
                                        max_tokens=8, temperature=0)
    assert r.usage.completion_tokens > 0
    assert counters(draft_node, "gemma") == before
