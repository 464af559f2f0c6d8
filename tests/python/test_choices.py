"""`n` > 1 through the official `openai` client: the choices come back in order with their
`index`, the prompt is evaluated once and counted once, a seeded request's streamed choices
reassemble to its plain ones, every choice of a constrained request follows the grammar, and
the gateway passes `n` through.

The prompt is evaluated once because the other choices start from the first one's evaluated
prompt (ABI 1.5 `seq_fork`): the node's `gantry_prompt_tokens_evaluated_total` grows by one
prompt, and the request takes about as long as one choice would.
"""
import json
import re
import time
import urllib.request
import uuid

import openai
import pytest

MODELS = ["smollm2", "gemma", "smollm2-native"]


def metric(node, name, model):
    with urllib.request.urlopen(f"{node}/metrics", timeout=30) as r:
        text = r.read().decode()
    m = re.search(rf'^{name}\{{model="{re.escape(model)}"\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.parametrize("model", MODELS)
def test_n_choices_come_back_in_order_with_the_prompt_counted_once(client, model):
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a fruit."}],
        n=4, max_tokens=8, temperature=1.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    assert all(c.message.role == "assistant" for c in r.choices)
    one = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=1)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens, "the prompt is counted once"
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.completion_tokens <= 4 * 8
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1, f"four seeded samples at temperature 1 were all {texts[0]!r}"


@pytest.mark.parametrize("model,n", [("smollm2", 4), ("smollm2-native", 2)])
def test_the_prompt_is_evaluated_once_for_all_choices(client, node, model, n):
    # `n` within the model's `maxBatchSize` (4 and 2 in conftest): choices beyond the free
    # sequences wait and evaluate the prompt on their own.
    # A long prompt no earlier request left in a cache (its first words are new).
    words = " ".join(f"w{i}" for i in range(380))
    prompt = f"{uuid.uuid4().hex} Repeat the last word of this list: {words}"

    def ask(n):
        before = metric(node, "gantry_prompt_tokens_evaluated_total", model)
        t = time.monotonic()
        r = client.completions.create(model=model, prompt=f"{uuid.uuid4().hex} {prompt}", n=n,
                                      max_tokens=1, temperature=0)
        took = time.monotonic() - t
        evaluated = metric(node, "gantry_prompt_tokens_evaluated_total", model) - before
        return r, took, evaluated

    one, t1, e1 = ask(1)
    many, tn, en = ask(n)
    # (Each request starts with its own random hex, which tokenizes to a few tokens more or less.)
    assert len(many.choices) == n and abs(many.usage.prompt_tokens - one.usage.prompt_tokens) < 8
    prompt_tokens = many.usage.prompt_tokens
    assert prompt_tokens > 1000
    assert e1 <= one.usage.prompt_tokens and en <= prompt_tokens, (
        f"{n} choices evaluated {en} prompt tokens for a prompt of {prompt_tokens}")
    assert en >= prompt_tokens - 64, f"the prompt was new, yet only {en} tokens were evaluated"
    # Evaluating it n times would take about n times as long; once, about as long as n = 1.
    # The bound is halfway between (for n = 2: 1.5 x), so timing noise on a shared machine
    # cannot pass the one or fail the other.
    assert tn < 0.5 * (1 + n) * t1, f"n={n} took {tn:.2f} s, n=1 {t1:.2f} s"


@pytest.mark.parametrize("model", MODELS)
def test_greedy_choices_are_all_the_same_text(client, model):
    # Every choice is evaluated the same way (the prompt but its last token once, then the last
    # token per choice), so at temperature 0 they cannot differ.
    for prompt in ["Repeat the last word: a b c", "Count to five:"]:
        r = client.completions.create(model=model, prompt=prompt, n=3, max_tokens=8, temperature=0)
        texts = [c.text for c in r.choices]
        assert texts == [texts[0]] * 3, texts


@pytest.mark.parametrize("model", MODELS)
def test_streamed_choices_reassemble_to_the_plain_ones_with_a_seed(client, model):
    body = dict(model=model, messages=[{"role": "user", "content": "Write one line about the sea."}],
                n=3, max_tokens=16, temperature=0.9, seed=1234)
    plain = client.chat.completions.create(**body)
    texts, finishes, usage = {}, {}, None
    for chunk in client.chat.completions.create(**body, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert sorted(texts) == [0, 1, 2]
    assert [texts[i] for i in range(3)] == [c.message.content for c in plain.choices]
    assert [finishes[i] for i in range(3)] == [c.finish_reason for c in plain.choices]
    assert usage.completion_tokens == plain.usage.completion_tokens
    assert usage.prompt_tokens == plain.usage.prompt_tokens


def test_legacy_completions_take_n_and_an_equal_best_of(client):
    r = client.completions.create(model="smollm2", prompt="The sky is", n=2, best_of=2,
                                  max_tokens=6, temperature=0.8, seed=3)
    assert [c.index for c in r.choices] == [0, 1]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt="x", n=2, best_of=3, max_tokens=2)
    assert e.value.body["param"] == "best_of"
    assert "must be 1 or equal to `n` (2), got 3" in e.value.body["message"]


def test_every_choice_of_a_constrained_request_follows_its_schema(client):
    schema = {"type": "object", "properties": {"fruit": {"type": "string", "maxLength": 20},
                                               "count": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["fruit", "count"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "A fruit and a count, as JSON."}],
        n=3, max_tokens=40, temperature=1.0, seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": schema, "strict": True}})
    assert len(r.choices) == 3
    for c in r.choices:
        v = json.loads(c.message.content)
        assert set(v) == {"fruit", "count"} and 1 <= v["count"] <= 9


def test_the_gateway_passes_n_through(gateway):
    c = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=120)
    r = c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                  n=2, max_tokens=4, temperature=1.0, seed=9)
    assert [ch.index for ch in r.choices] == [0, 1]
