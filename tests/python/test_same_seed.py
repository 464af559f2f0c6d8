"""Same seed, same bytes: 50 seeded requests, each sent plain and streamed with the official
`openai` client, on both test models, through the node and the gateway, give the same text,
the same tool-call name and argument bytes, the same `finish_reason` and the same completion
token count. The budgets are small on purpose, so most replies are cut by `max_tokens`, some in
the middle of a multi-byte character or of a tool call's arguments: the last partial token must
be handled the same way in both shapes.

Each request runs alone (one after another), which is what docs/node.md's "Reproducible
sampling" promises: a seeded request evaluates its whole prompt, and one that starts on an idle
model clears the model's KV cache first, so what earlier requests left there does not change its
text.
"""
import openai
import pytest

from conftest import reply_parts, streamed_parts

PROMPTS = [
    "Tell me a short story about a fox.",
    "Write a haiku in Japanese about rain.",
    "List five French words with accents, like café and naïve.",
    "Describe the sea in three sentences, with an emoji after each.",
    "What is the capital of Portugal, and why is it famous?",
    "Écris une phrase sur la neige à Montréal.",
    "Give me a recipe for pancakes.",
    "Count from one to twenty in German.",
]
TOOL = {"type": "function", "function": {
    "name": "search_places", "description": "Find places near a point.",
    "parameters": {"type": "object",
                   "properties": {"query": {"type": "string", "maxLength": 48},
                                  "near": {"type": "object",
                                           "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                                          "lon": {"type": "number", "minimum": -180, "maximum": 180}},
                                           "required": ["lat", "lon"]}},
                   "required": ["query", "near"]}}}
CITY = {"type": "json_schema", "json_schema": {"name": "city", "schema": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                     "country": {"type": "string", "maxLength": 40},
                                     "population": {"type": "integer", "minimum": 0}},
    "required": ["name", "country", "population"]}}}


def case(i):
    """The i-th request: a model, a kind (text, a forced tool call, a JSON document) and a small
    budget that cuts most replies."""
    model = ("gemma", "smollm2")[i % 2]
    kind = ("text", "text", "tool", "json")[(i // 2) % 4]
    body = dict(model=model, temperature=0.9, seed=1000 + i, max_tokens=6 + (i * 7) % 30)
    if model == "gemma":
        # Through the default ChatML Gemma may write `<|im_end|>` at once; `<` is biased away
        # (as in test_openai.py) so there is a reply worth comparing.
        body["logit_bias"] = {"236820": -100}
    if kind == "text":
        body["messages"] = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
    elif kind == "tool":
        body["messages"] = [{"role": "user", "content": "Find coffee shops near 38.7223, -9.1393."}]
        body["tools"] = [TOOL]
        body["tool_choice"] = {"type": "function", "function": {"name": "search_places"}}
        body.pop("logit_bias", None)
    else:
        body["messages"] = [{"role": "user", "content": "Name a city with its country and population."}]
        body["response_format"] = CITY
        body.pop("logit_bias", None)
    return body


@pytest.fixture(scope="module")
def both(node, gateway):
    return [openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
            for base in (node, gateway)]


def test_fifty_seeded_requests_stream_the_same_bytes_as_they_answer(both):
    cut, non_ascii, cut_calls, differ = 0, 0, 0, []
    for i in range(50):
        body = case(i)
        c = both[i % 3 == 2]   # a third through the gateway
        p, s = reply_parts(c, body), streamed_parts(c, body)
        if p != s:
            differ.append((i, body["model"], p, s))
        cut += p[2] == "length"
        non_ascii += any(ord(ch) > 127 for ch in p[0])
        cut_calls += p[2] == "length" and bool(p[1])
    assert differ == [], differ
    # The comparison covered what it is for: cuts, characters of several bytes, cut calls.
    # (Which seeded replies hold characters of several bytes depends on the machine's kernels:
    # 2 to 5 of these 50 on the machines measured.)
    assert cut >= 20 and non_ascii >= 2 and cut_calls >= 2, (cut, non_ascii, cut_calls)
