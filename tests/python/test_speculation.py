"""Speculative decoding (prompt lookup) through the official `openai` client, on both engines:
at temperature 0 the text is the same with and without it (on llama.cpp, but for a near tie), drafts are really verified (the
node's `gantry_speculative_*_tokens_total` grow, and some drafted tokens are kept), a request
can opt out (`speculation: false`, nothing is drafted for it), and a wrong value is a 400
naming the field.

Speculation is on by default in the test node (the models' configs say nothing), so every other
suite runs with it too; `bench/speculation.py` measures what it gains.
"""
import re
import urllib.request

import openai
import pytest

MODELS = ["gemma", "smollm2", "smollm2-native"]
TEXT = ("The comittee met on tuesday to discus the new budjet. Most members agred that the "
        "libary needs more funding, but some argued that the park shoud come first.")
CODE = ("def total(items):\n    result = 0\n    for item in items:\n"
        "        result = result + item.price * item.quantity\n    return result\n")
PROMPTS = [
    f"Rewrite this paragraph with the spelling fixed:\n\n{TEXT}",
    f"Copy this code and rename `total` to `order_total`:\n\n{CODE}",
    f"Repeat this text word for word:\n\n{TEXT}",
    "Write a short poem about the sea.",
    "Explain what a compiler does.",
]


def counters(node, model):
    with urllib.request.urlopen(f"{node}/metrics", timeout=30) as r:
        text = r.read().decode()

    def val(name):
        m = re.search(rf'^{name}\{{model="{re.escape(model)}"\}} (\S+)$', text, re.M)
        return float(m.group(1)) if m else 0.0

    return val("gantry_speculative_draft_tokens_total"), val("gantry_speculative_accepted_tokens_total")


# llama.cpp's CPU kernels round a verification batch of several tokens differently from one
# token at a time, so where the two best tokens are this close (in log-probability) a greedy
# choice may go either way with speculation (docs/engines.md): the most two runs may differ by.
NEAR_TIE = 0.1


def greedy(client, model, prompt, **extra):
    # A `seed` makes the node evaluate the whole prompt (no prefix from a warm slot), so both
    # runs start from the same numbers: a prefix evaluated in another batch shape can change a
    # near tie at temperature 0 on its own, with or without speculation (docs/node.md).
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=64,
        temperature=0, seed=0, logprobs=True, top_logprobs=2, extra_body=extra or None)
    c = r.choices[0]
    return (c.message.content, c.finish_reason, r.usage.completion_tokens), c.logprobs.content


def first_divergence(on, off):
    """The first position where the two runs' tokens differ, and the gap between the two best
    log-probabilities there in the run without drafts (None when the runs agree)."""
    for i, (a, b) in enumerate(zip(on, off)):
        if a.token != b.token:
            top = sorted((t.logprob for t in b.top_logprobs), reverse=True)
            named = {t.token for t in b.top_logprobs}
            return i, (top[0] - top[1]) if a.token in named and len(top) > 1 else float("inf")
    return None


@pytest.mark.parametrize("model", MODELS)
def test_greedy_text_is_the_same_with_and_without_speculation(client, node, model):
    drafted0, accepted0 = counters(node, model)
    ties = 0
    for prompt in PROMPTS:
        (on, on_lp), (off, off_lp) = greedy(client, model, prompt), greedy(client, model, prompt, speculation=False)
        if on == off:
            continue
        where = first_divergence(on_lp, off_lp)
        # The native engine verifies exactly; on llama.cpp only a near tie may part them, and
        # only once in the five prompts.
        assert model != "smollm2-native" and where is not None and where[1] < NEAR_TIE, \
            f"{model}: {prompt[:40]!r} parts at {where}\nwith:    {on}\nwithout: {off}"
        print(f"{model}: {prompt[:40]!r} parts at token {where[0]}, a near tie ({where[1]:.4f})")
        ties += 1
    assert ties <= 1, f"{model}: {ties} of {len(PROMPTS)} prompts parted at near ties"
    drafted, accepted = counters(node, model)
    assert drafted > drafted0, f"{model}: nothing was drafted"
    assert accepted > accepted0, f"{model}: no drafted token was ever kept"
    assert accepted - accepted0 <= drafted - drafted0


def step_sizes(node, model):
    """`gantry_engine_step_tokens` of one model: steps of at most 4 tokens, and all steps."""
    with urllib.request.urlopen(f"{node}/metrics", timeout=30) as r:
        text = r.read().decode()
    m = re.escape(model)
    small = re.search(rf'^gantry_engine_step_tokens_bucket\{{model="{m}",le="4"\}} (\S+)$', text, re.M)
    count = re.search(rf'^gantry_engine_step_tokens_count\{{model="{m}"\}} (\S+)$', text, re.M)
    return float(small.group(1)), float(count.group(1))


def test_copied_text_verifies_long_drafts(client, node):
    # Adaptive draft lengths (the default): text that copies its prompt keeps its drafts, and
    # the native engine's CPU step of many tokens costs little more than one of a few, so the
    # scheduler verifies drafts longer than the 3 a fixed length would (steps of 5+ tokens).
    model = "smollm2-native"
    small0, all0 = step_sizes(node, model)
    drafted0, accepted0 = counters(node, model)
    text, _ = greedy(client, model, PROMPTS[1])
    small, steps = step_sizes(node, model)
    drafted, accepted = counters(node, model)
    long_steps = (steps - all0) - (small - small0)
    assert long_steps >= 2, f"steps of more than 4 tokens: {long_steps} of {steps - all0}; {text}"
    assert accepted > accepted0, f"no drafted token kept ({drafted - drafted0} drafted)"


@pytest.mark.parametrize("model", ["gemma", "smollm2-native"])
def test_a_request_that_opts_out_drafts_nothing(client, node, model):
    before = counters(node, model)
    greedy(client, model, PROMPTS[2], speculation=False)
    assert counters(node, model) == before


def test_sampling_with_speculation_stays_seeded_and_streams_alike(client):
    # Sampling verifies drafts too: a seeded request gives the same text plain and streamed.
    body = dict(model="smollm2", messages=[{"role": "user", "content": PROMPTS[2]}],
                max_tokens=48, temperature=0.7, seed=21)
    plain = client.chat.completions.create(**body).choices[0].message.content
    streamed = "".join(ch.choices[0].delta.content or ""
                       for ch in client.chat.completions.create(**body, stream=True) if ch.choices)
    assert plain == streamed


def test_speculation_must_be_a_boolean(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2, extra_body={"speculation": "sometimes"})
    assert e.value.body["param"] == "speculation"
