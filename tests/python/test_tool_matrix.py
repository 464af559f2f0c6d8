"""Forced tool calls over seeds and tools: on both test models (Gemma 3 270M through the default
ChatML template, SmolLM2-135M-Instruct through its own), against the node and the gateway, with
the official `openai` client and with LangChain.

Five tools of one to four parameters (strings with and without enums, numbers with and without
bounds, a nested object, an array), written as most tools are: no `additionalProperties`. Each
request declares the forced tool and forces it by name, at temperature 1.0 with a seed, through
the official client or LangChain's `bind_tools`, to the node or through the gateway. A seeded
request evaluates its whole prompt (docs/node.md, "Reproducible sampling"), which is most of
the time these tests take on two cores. Over 20 seeds x 5 tools per model, at least 99 % must
end with `finish_reason: "tool_calls"` well inside `max_tokens` (three quarters of it); every
call that ends must parse and validate against the tool's schema read strictly, so no key
outside the schema ever appears.
"""
import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from conftest import closed

MODELS = ["gemma", "smollm2"]
SEEDS = range(20)
MAX_TOKENS = 128
WELL_INSIDE = MAX_TOKENS * 3 // 4
WEEKDAYS = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]
CURRENCIES = ["EUR", "USD", "JPY", "GBP"]

# name: (parameters, description, the user's question)
TOOLS = {
    "get_time": (
        {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 32}},
         "required": ["timezone"]},
        "Look up the current time in a timezone.",
        "What time is it in Tokyo right now?"),
    "get_weather": (
        {"type": "object", "properties": {"city": {"type": "string", "maxLength": 32},
                                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
         "required": ["city"]},
        "Current weather in a city.",
        "Is it raining in Lisbon? Answer in celsius."),
    "convert_currency": (
        {"type": "object", "properties": {"amount": {"type": "number", "minimum": 0},
                                          "from": {"type": "string", "enum": CURRENCIES},
                                          "to": {"type": "string", "enum": CURRENCIES}},
         "required": ["amount", "from", "to"]},
        "Convert an amount of money between currencies.",
        "How many yen are 120.50 euros?"),
    "set_thermostat": (
        {"type": "object",
         "properties": {"room": {"type": "string", "enum": ["kitchen", "bedroom", "office"]},
                        "temperature": {"type": "number"},
                        "schedule": {"type": "object",
                                     "properties": {"start_hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                                    "end_hour": {"type": "integer", "minimum": 0, "maximum": 23}},
                                     "required": ["start_hour", "end_hour"]},
                        "days": {"type": "array", "items": {"type": "string", "enum": WEEKDAYS}, "maxItems": 7}},
         "required": ["room", "temperature"]},
        "Set a room's thermostat, optionally on a schedule.",
        "Keep the office at 21.5 degrees from 8 to 18 on weekdays."),
    "search_places": (
        {"type": "object",
         "properties": {"query": {"type": "string", "maxLength": 48},
                        "near": {"type": "object",
                                 "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                                "lon": {"type": "number", "minimum": -180, "maximum": 180}},
                                 "required": ["lat", "lon"]},
                        "limit": {"type": "integer", "minimum": 1, "maximum": 20}},
         "required": ["query", "near"]},
        "Find places near a point.",
        "Find three coffee shops near 38.7223, -9.1393."),
}
NAMES = list(TOOLS)


def spec(name):
    params, description, _ = TOOLS[name]
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


def fraction_digits(value):
    """The longest run of digits after a decimal point in a parsed JSON value's numbers."""
    if isinstance(value, dict):
        return max((fraction_digits(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return max((fraction_digits(v) for v in value), default=0)
    if isinstance(value, float):
        return len(repr(value).partition(".")[2])
    return 0


def via_openai(base, model, name, seed):
    """One forced call with the official client: (finish_reason, completion tokens, calls)."""
    c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=180)
    r = c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": TOOLS[name][2]}], tools=[spec(name)],
        tool_choice={"type": "function", "function": {"name": name}}, max_tokens=MAX_TOKENS,
        temperature=1.0, seed=seed)
    ch = r.choices[0]
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in ch.message.tool_calls or []]
    return ch.finish_reason, r.usage.completion_tokens, calls


def via_langchain(base, model, name, seed):
    """The same with LangChain's `bind_tools` (an OpenAI-format tool dict, forced by name)."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{base}/v1", api_key="unused", model=model, temperature=1.0, seed=seed,
                     max_retries=0, max_tokens=MAX_TOKENS, timeout=180)
    ai = llm.bind_tools([spec(name)], tool_choice=name).invoke(TOOLS[name][2])
    assert ai.invalid_tool_calls == [], (model, name, seed, ai.invalid_tool_calls)
    calls = [(t["name"], t["args"]) for t in ai.tool_calls]
    return ai.response_metadata.get("finish_reason"), ai.usage_metadata["output_tokens"], calls


@pytest.mark.parametrize("model", MODELS)
def test_forced_calls_over_twenty_seeds_and_five_tools(node, gateway, model):
    """Seed s of each tool goes through the official client (s % 4 < 2) or LangChain, to the
    node (s even) or through the gateway: every cell of 20 seeds x 5 tools once, both clients
    and both targets five times per tool."""
    def one(job):
        name, seed = job
        send = via_openai if seed % 4 < 2 else via_langchain
        return (name, seed, *send((node, gateway)[seed % 2], model, name, seed))

    jobs = [(name, seed) for name in NAMES for seed in SEEDS]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, jobs))
    ended = []
    for name, seed, finish, tokens, calls in results:
        if finish == "tool_calls":
            # Every call that ends parses, validates, and has no key the tool did not declare.
            assert len(calls) == 1 and calls[0][0] == name, (model, name, seed, calls)
            jsonschema.validate(calls[0][1], closed(TOOLS[name][0]))
            assert fraction_digits(calls[0][1]) <= 16, (model, name, seed, calls)
        ended.append(finish == "tool_calls" and tokens <= WELL_INSIDE)
    print(f"{model}: {sum(ended)} of {len(jobs)} forced calls ended inside {WELL_INSIDE} tokens; "
          f"longest {max(r[3] for r in results)} tokens")
    assert sum(ended) >= 0.99 * len(jobs), (model, [(n, s, f, t) for (n, s, f, t, _), ok in zip(results, ended)
                                                   if not ok])


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output_against_node_and_gateway(node, gateway, model, method):
    from typing import Annotated

    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    # Every string is bounded, so the grammar ends the object within the token budget whatever
    # the sampler draws: at temperature 1 a 270M model may otherwise fill an unbounded string
    # with digits until `max_tokens` (seed-dependent, and the CPU's kernels decide the draw).
    class Thermostat(BaseModel):
        room: str = Field(max_length=16)
        temperature: float = Field(ge=5, le=30)
        days: list[Annotated[str, Field(max_length=12)]] = Field(max_length=7)

    for seed, base in enumerate((node, gateway)):
        llm = ChatOpenAI(base_url=f"{base}/v1", api_key="unused", model=model, temperature=1.0, seed=seed,
                         max_retries=0, max_tokens=2 * MAX_TOKENS, timeout=180)
        got = llm.with_structured_output(Thermostat, method=method) \
            .invoke("Keep the office at 21.5 degrees on weekdays.")
        assert isinstance(got, Thermostat), (model, method, seed, got)
