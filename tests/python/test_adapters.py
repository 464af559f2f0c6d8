"""LoRA adapters through the official `openai` client, on both engines: the session node serves
SmolLM2 with rank-8 adapters made by the test setup (`pirate`, `formal`; GGUF LoRA on llama.cpp,
PEFT safetensors on the native engine) and adapters each engine must refuse.

An adapter is its own model id (`<model>:<adapter>`), listed in `/v1/models` with its base as
`parent`; at temperature 0 it answers with its own text, the same alone as in a batch that mixes
it with the base and the other adapter; a refused adapter is a 400 naming why, in `/v1/status`
too, and the base keeps serving.
"""
import concurrent.futures
import json
import re
import time
import urllib.error
import urllib.request

import openai
import pytest

ENGINES = {"smollm2": "llama_cpp", "smollm2-native": "native"}
REFUSED = {"smollm2": {"bad-shape": "blk.0.attn_q.weight", "other-base": "gemma3"},
           "smollm2-native": {"bad-shape": "q_proj", "bad-target": "qkv_proj"}}
PROMPTS = ["Write one sentence about the sea.", "What is the capital of France?"]


def greedy(client, model, prompt, max_tokens=24):
    # `seed` makes the node evaluate the whole prompt (no warm prefix), so runs alone and in a
    # batch start from the same numbers (docs/node.md).
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, seed=0)
    assert r.model == model
    return r.choices[0].message.content


def get_json(node, path):
    with urllib.request.urlopen(f"{node}{path}", timeout=30) as r:
        return json.loads(r.read())


def adapter_status(node, model):
    m = next(m for m in get_json(node, "/v1/status")["models"] if m["id"] == model)
    return {a["name"]: a for a in m.get("adapters", [])}


@pytest.fixture(scope="module", autouse=True)
def settled(node):
    """The node loads a model's adapters in the background once the model is ready: wait until
    each has loaded or been refused."""
    deadline = time.time() + 60
    while time.time() < deadline:
        states = [a["state"] for base in ENGINES for a in adapter_status(node, base).values()]
        if len(states) == 8 and all(s in ("loaded", "refused") for s in states):
            return
        time.sleep(0.2)
    pytest.fail(f"adapters did not settle in 60 s: {[adapter_status(node, b) for b in ENGINES]}")


def test_adapters_are_listed_with_their_base_as_parent(node):
    listed = {m["id"]: m for m in get_json(node, "/v1/models")["data"]}
    for base in ENGINES:
        for name in ("pirate", "formal"):
            entry = listed[f"{base}:{name}"]
            assert entry["parent"] == base
            assert entry["adapter"]["name"] == name
        assert "parent" not in listed[base]
        for name in REFUSED[base]:
            assert listed[f"{base}:{name}"]["ready"] is False


@pytest.mark.parametrize("base", ENGINES)
def test_each_adapter_answers_with_its_own_text(client, base):
    for prompt in PROMPTS[:1]:
        plain = greedy(client, base, prompt)
        pirate = greedy(client, f"{base}:pirate", prompt)
        formal = greedy(client, f"{base}:formal", prompt)
        assert pirate != plain, f"{base}: pirate answered like the base: {plain!r}"
        assert formal != pirate, f"{base}: formal answered like pirate: {pirate!r}"
        assert formal != plain, f"{base}: formal answered like the base: {plain!r}"
        # Deterministic, and the base is untouched by having served the adapters.
        assert greedy(client, f"{base}:pirate", prompt) == pirate
        assert greedy(client, base, prompt) == plain


@pytest.mark.parametrize("base", ENGINES)
def test_a_batch_mixing_base_and_two_adapters_gives_each_its_own_text(client, base):
    # One sequence per adapter: llama.cpp's CPU kernels for the f32 adapter tensors round
    # differently for one row and for several, which two sequences of one adapter in a step
    # would make a difference of (docs/node.md, LoRA adapters).
    jobs = [(m, PROMPTS[0]) for m in (base, f"{base}:pirate", f"{base}:formal")]
    alone = {job: greedy(client, *job) for job in jobs}
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        together = dict(zip(jobs, pool.map(lambda job: greedy(client, *job), jobs)))
    for job in jobs:
        assert together[job] == alone[job], f"{job}: alone {alone[job]!r}, in a batch {together[job]!r}"


@pytest.mark.parametrize("base", ENGINES)
def test_a_streamed_adapter_reply_is_the_plain_one(client, base):
    model = f"{base}:pirate"
    plain = greedy(client, model, PROMPTS[1])
    text = ""
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=24,
            temperature=0, seed=0, stream=True):
        assert chunk.model == model
        for ch in chunk.choices:
            text += ch.delta.content or ""
    assert text == plain


@pytest.mark.parametrize("base", ENGINES)
def test_refused_adapters_say_why_and_the_base_keeps_serving(client, node, base):
    before = greedy(client, base, PROMPTS[0])
    for name, named in REFUSED[base].items():
        with pytest.raises(openai.BadRequestError) as e:
            greedy(client, f"{base}:{name}", PROMPTS[0])
        err = e.value.body
        assert err["code"] == "adapter_refused" and err["param"] == "model", err
        assert named in err["message"], err["message"]
        st = adapter_status(node, base)[name]
        assert st["state"] == "refused" and st["reason"] == "mismatch", st
        assert named in st["message"]
    good = adapter_status(node, base)
    assert good["pirate"]["state"] == "loaded" and good["pirate"]["bytes"] > 0, good["pirate"]
    assert greedy(client, base, PROMPTS[0]) == before


def test_an_unknown_adapter_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        greedy(client, "smollm2:nope", PROMPTS[0])
    assert e.value.body["code"] == "model_not_found"


def test_adapter_events_are_counted(client, node):
    greedy(client, "smollm2:pirate", PROMPTS[0])
    with urllib.request.urlopen(f"{node}/metrics", timeout=30) as r:
        text = r.read().decode()
    loaded = re.search(r'^gantry_adapter_events_total\{adapter="smollm2:pirate",event="loaded"\} (\S+)$',
                       text, re.M)
    refused = re.search(r'^gantry_adapter_events_total\{adapter="smollm2:bad-shape",event="refused"\} (\S+)$',
                        text, re.M)
    assert loaded and float(loaded.group(1)) >= 1, "no load of smollm2:pirate counted"
    assert refused and float(refused.group(1)) == 1, "the refusal of smollm2:bad-shape is not counted once"


def lora_requests_info(node):
    """`vllm:lora_requests_info`'s one sample: its labels and value."""
    with urllib.request.urlopen(f"{node}/metrics", timeout=30) as r:
        text = r.read().decode()
    samples = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(samples) == 1, samples
    labels = dict(re.findall(r'(\w+)="([^"]*)"', samples[0]))
    return labels, float(samples[0].rsplit(" ", 1)[1])


def test_the_endpoint_picker_sees_the_adapters_with_requests_in_flight(client, node):
    # vLLM's series, which the Gateway API Inference Extension's picker reads for LoRA affinity.
    labels, stamp = lora_requests_info(node)
    assert labels == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "8"}
    assert stamp > 1.7e9, "the value is the scrape's Unix time, as vLLM sets it"
    stream = client.chat.completions.create(
        model="smollm2:pirate", messages=[{"role": "user", "content": PROMPTS[0]}],
        max_tokens=48, temperature=0, stream=True)
    chunks = iter(stream)
    next(chunks)  # the request is in flight until its last chunk
    during, _ = lora_requests_info(node)
    assert during["running_lora_adapters"] == "smollm2:pirate", during
    for _ in chunks:
        pass
    after, _ = lora_requests_info(node)
    assert after["running_lora_adapters"] == "", after
