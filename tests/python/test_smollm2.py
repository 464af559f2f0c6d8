"""A real instruct model through the OpenAI API: SmolLM2-135M-Instruct (Q4_1 GGUF with its own
ChatML template, installed by scripts/setup.sh) on the llama.cpp plugin, with the official
`openai` client, against the node and the gateway.

- Chat goes through the model's own template (its default system prompt included) and answers
  (a 135M model at 4 bits: a greeting, not general knowledge).
- Forced tool calls of tools whose schemas leave other keys unsaid (the usual way tools are
  written) end with `tool_calls` well inside `max_tokens`, parse, and use only declared keys,
  over seeds; `response_format` answers validate.
- A small agent loop (two tools, three turns: a call, the tool's result, the answer)
  completes through the gateway.
- LangChain: `bind_tools` with a forced tool over seeds, `with_structured_output` in
  `json_schema` and `function_calling` modes.
"""
import json

import jsonschema
import openai
import pytest

MODEL = "smollm2"
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 24},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city"]}
CONVERT = {"type": "object",
           "properties": {"amount": {"type": "number", "minimum": 0, "maximum": 1000000},
                          "from": {"type": "string", "maxLength": 3},
                          "to": {"type": "string", "maxLength": 3},
                          "rounding": {"type": "object",
                                       "properties": {"digits": {"type": "integer", "minimum": 0, "maximum": 6}}}},
           "required": ["amount", "from", "to"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "convert_currency", "description": "Convert an amount of money.",
                                      "parameters": CONVERT}},
]
PARAMS = {"get_weather": WEATHER, "convert_currency": CONVERT}


def closed(schema):
    """The schema as the node reads it by default: every object closed."""
    s = json.loads(json.dumps(schema))
    stack = [s]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            stack.extend(node.get("properties", {}).values())
    return s


def test_smollm2_chats_with_its_own_template(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                       max_tokens=40, temperature=0)
    text = r.choices[0].message.content
    assert "hello" in text.lower(), text
    assert r.choices[0].finish_reason in ("stop", "length")
    # The template's own default system prompt is part of the prompt: far more than the
    # three words of the question.
    assert r.usage.prompt_tokens > 20, r.usage


@pytest.mark.parametrize("tool", ["get_weather", "convert_currency"])
def test_forced_calls_end_inside_the_budget_and_use_declared_keys(client, tool):
    ask = [{"role": "user", "content": "What is the weather in Lisbon, and what are 120 euros in dollars?"}]
    finished = 0
    for seed in range(10):
        r = client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": tool}},
                                           max_tokens=96, temperature=1.0, seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (seed, choice)
        assert r.usage.completion_tokens < 96, (seed, r.usage)
        call = choice.message.tool_calls[0]
        assert call.function.name == tool
        jsonschema.validate(json.loads(call.function.arguments), closed(PARAMS[tool]))
        finished += 1
    assert finished == 10


def test_required_calls_and_structured_output_validate(client):
    ask = [{"role": "user", "content": "Convert 15 dollars to yen."}]
    for seed in range(5):
        r = client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=96, temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        call = r.choices[0].message.tool_calls[0]
        jsonschema.validate(json.loads(call.function.arguments), closed(PARAMS[call.function.name]))
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": WEATHER}}
    for seed in range(5):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a city."}],
                                           response_format=fmt, max_tokens=64, temperature=1.0, seed=seed)
        jsonschema.validate(json.loads(r.choices[0].message.content), closed(WEATHER))


def test_an_agent_loop_completes_through_the_gateway(gateway):
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "system", "content": "You are a helpful assistant. Use the tools."},
                {"role": "user", "content": "What is the weather in Oslo?"}]
    # Turn 1: the model calls a tool.
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=96, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    call = r.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, closed(PARAMS[call.function.name]))
    # Turn 2: the tool's result goes back with the call.
    messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]})
    result = {"city": args.get("city", "Oslo"), "temperature": 4, "unit": "celsius", "sky": "cloudy"} \
        if call.function.name == "get_weather" else {"result": 42.0}
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    # Turn 3: the answer, in text.
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                       max_tokens=64, temperature=0)
    answer = r.choices[0].message.content
    assert answer and answer.strip(), r.choices[0]
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason in ("stop", "length")


# --- LangChain ---------------------------------------------------------------------------------

def chat_model(base, seed=None, temperature=0.0):
    from langchain_openai import ChatOpenAI
    return ChatOpenAI(base_url=f"{base}/v1", api_key="unused", model=MODEL, temperature=temperature, seed=seed,
                      max_retries=0, max_tokens=96, timeout=120)


def test_langchain_bind_tools_with_a_forced_tool_over_seeds(node):
    """LangChain's tool schema from a Python signature: `city: str` has no maxLength. At
    temperature 0.5 every seeded call ends with `tool_calls`; at 1.0 the 135M model wrote a
    runaway city name until `max_tokens` in the second seed tried (the grammar bounds a string
    only by its schema's `maxLength`)."""
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str, unit: str = "celsius") -> str:
        """Current weather in a city."""
        return f"4 degrees {unit} in {city}"

    for seed in range(10):
        ai = chat_model(node, seed=seed, temperature=0.5).bind_tools([get_weather], tool_choice="get_weather") \
            .invoke("What is the weather in Oslo?")
        assert ai.invalid_tool_calls == [], (seed, ai.invalid_tool_calls)
        assert ai.response_metadata.get("finish_reason") == "tool_calls", (seed, ai.response_metadata)
        (call,) = ai.tool_calls
        assert call["name"] == "get_weather"
        assert set(call["args"]) <= {"city", "unit"}, (seed, call["args"])
        assert isinstance(call["args"].get("city"), str), (seed, call["args"])


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output_in_both_modes(node, method):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=24)
        population: int = Field(ge=0, le=100_000_000)

    for seed in range(3):
        city = chat_model(node, seed=seed, temperature=1.0).with_structured_output(City, method=method) \
            .invoke("Name a city and its population.")
        assert isinstance(city, City), (seed, city)
