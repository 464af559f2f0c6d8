"""Tool calling, checked with the official `openai` client: forced tool calls (`required` and
named, streamed and not, on an open schema, with strict numbers), raw tool-call streams,
`parse` with pydantic tools, parallel calls, `tool_choice` none and auto, histories with
tool calls and results, and a LangChain agent loop.

Both chat models run every case. `tiny` has random weights, so whatever it writes inside a
constraint is arbitrary: it shows that the constraint alone makes the call valid. `gemma` is a
real small model and writes plausible arguments.
"""
import json
import re
from typing import Annotated, Literal

import openai
import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field, conint

from conftest import langchain_model
from json_checks import assert_compact, validate

MODELS = ["tiny", "gemma"]


WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 16},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"},
                   "hour24": {"type": "boolean"}},
    "required": ["zone", "hour24"], "additionalProperties": False,
}
DIAL_PARAMS = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "boolean"}},
    "required": ["n", "b"], "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time in a time zone.",
                                      "parameters": TIME_PARAMS}},
]
# A template without tool support (tiny's ChatML, Gemma's default) gets the tool list written
# into the system message, and tiny spends about a token per character of it: the two tools
# above would not fit its 512-token context, so tiny gets one small tool.
TINY_TOOLS = [{"type": "function", "function": {"name": "d", "parameters": DIAL_PARAMS}}]
TOOLS_FOR = {"tiny": TINY_TOOLS, "gemma": TOOLS}
NAMED = {"tiny": "d", "gemma": "get_time"}
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS, "d": DIAL_PARAMS}
CONTEXT = {"tiny": 512, "gemma": 1024}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def named(name):
    return {"type": "function", "function": {"name": name}}


def fit(client, model, messages, tools, want=200):
    """`want` tokens, or what the context leaves after this prompt with its tools written in;
    the worst-case forced call on these tools needs well under 48."""
    used = client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=1,
                                          temperature=0).usage.prompt_tokens
    room = CONTEXT[model] - used
    assert room >= 48, f"{model}: the prompt with its tools takes {used} of {CONTEXT[model]} tokens"
    return min(want, room)


def assert_valid_calls(message, want_name=None, exactly_one=True, streamed=False):
    """The calls of a forced tool call: `call_` ids, each unique; known names; arguments that
    are compact JSON validating against the tool's parameters; no text beside them (null in a
    plain reply; a stream may have sent an empty string with the role). Returns the calls."""
    calls = message.tool_calls
    assert calls, message
    if exactly_one:
        assert len(calls) == 1, calls
    if streamed:
        assert not message.content, message
    else:
        assert message.content is None, message
    for call in calls:
        assert call.type == "function"
        assert call.id.startswith("call_") and len(call.id) > len("call_"), call.id
        assert call.function.name in PARAMS, call
        if want_name:
            assert call.function.name == want_name
        validate(json.loads(call.function.arguments), PARAMS[call.function.name])
        assert_compact(call.function.arguments)
    assert len({c.id for c in calls}) == len(calls), calls
    return calls


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("kind", ["required", "named"])
def test_a_forced_tool_call_validates_against_the_tool(client, model, kind):
    tools = TOOLS_FOR[model]
    choice, want = ("required", None) if kind == "required" else (named(NAMED[model]), NAMED[model])
    r = client.chat.completions.create(model=model, messages=ASK, tools=tools, tool_choice=choice,
                                       parallel_tool_calls=False, max_tokens=fit(client, model, ASK, tools),
                                       temperature=0)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    assert r.choices[0].message.role == "assistant"
    assert_valid_calls(r.choices[0].message, want_name=want)


# A tool whose schema leaves other keys unsaid (no `additionalProperties`), as most tools are
# written: arguments are still closed to the declared keys unless the tool says strict: false.
OPEN_PARAMS = {"type": "object",
               "properties": {"city": {"type": "string", "maxLength": 16},
                              "days": {"type": "integer", "minimum": 1, "maximum": 7},
                              "hours": {"type": "integer"}},
               "required": ["city"]}
OPEN_TOOL = {"type": "function", "function": {"name": "forecast", "parameters": OPEN_PARAMS}}


def test_forced_calls_on_an_open_schema_use_only_the_declared_keys(client):
    ask = [{"role": "user", "content": "Forecast for Paris for three days, please."}]
    choice = named("forecast")
    budget = fit(client, "gemma", ask, [OPEN_TOOL])
    for seed in range(6):
        r = client.chat.completions.create(model="gemma", messages=ask, tools=[OPEN_TOOL], tool_choice=choice,
                                           max_tokens=budget, temperature=1.0, seed=seed)
        choice0 = r.choices[0]
        assert choice0.finish_reason == "tool_calls", (seed, choice0)
        args = json.loads(choice0.message.tool_calls[0].function.arguments)
        assert set(args) <= {"city", "days", "hours"}, (seed, args)
        validate(args, {**OPEN_PARAMS, "additionalProperties": False})
        # An integer without bounds stays within I-JSON's range: no endless digit run.
        assert abs(args.get("hours", 0)) <= 2**53 - 1, (seed, args)
    # A response format without additionalProperties is strict the same way.
    fmt = {"type": "json_schema", "json_schema": {"name": "f", "schema": OPEN_PARAMS}}
    for seed in range(3):
        r = client.chat.completions.create(model="gemma", messages=ask, response_format=fmt, max_tokens=64,
                                           temperature=1.0, seed=seed)
        out = json.loads(r.choices[0].message.content)
        assert set(out) <= {"city", "days", "hours"}, (seed, out)
    # strict: false keeps the permissive reading: accepted (what the model then writes is its own).
    permissive = {"type": "function", "function": {**OPEN_TOOL["function"], "strict": False}}
    r = client.chat.completions.create(model="gemma", messages=ask, tools=[permissive], tool_choice=choice,
                                       max_tokens=32, temperature=0)
    assert r.choices[0].finish_reason in ("tool_calls", "length"), r.choices[0]


def test_a_strict_number_stops_after_sixteen_fraction_digits_and_strict_false_does_not(client, http):
    """A number's fraction has no bound JSON Schema can state; a strict schema gets one (16
    digits, on the mask). The digits 1-9 and the point are biased up so Gemma writes digits for
    as long as it may: 16 under the default, until `max_tokens` with `strict: false`."""
    ids = lambda text: http.post("/v1/tokenize", {"model": "gemma", "content": text, "add_special": False})["tokens"]
    bias = {str(t): 100 for t in ids("123456789") + ids(".")}
    assert len(bias) == 10, bias   # one token per digit and one for the point
    schema = {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "exclusiveMaximum": 1}},
              "required": ["x"]}

    def answer(strict):
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}}
        r = client.chat.completions.create(model="gemma", messages=[{"role": "user", "content": "A number."}],
                                           response_format=fmt, max_tokens=48, temperature=0, logit_bias=bias)
        text = r.choices[0].message.content
        return r.choices[0].finish_reason, text, len(re.search(r"\.(\d*)", text).group(1))

    finish, text, digits = answer(True)
    assert finish == "stop" and digits == 16, text
    assert 0 <= json.loads(text)["x"] < 1
    finish, text, digits = answer(False)
    assert finish == "length" and digits > 30, text


@pytest.mark.parametrize("model", MODELS)
def test_a_streamed_tool_call_equals_the_plain_one_with_a_seed(client, model):
    tools = TOOLS_FOR[model]
    kw = dict(model=model, messages=ASK, tools=tools, tool_choice="required", parallel_tool_calls=False,
              max_tokens=fit(client, model, ASK, tools), temperature=0.7, seed=4242)
    plain = client.chat.completions.create(**kw)
    assert plain.choices[0].finish_reason == "tool_calls"
    [p] = assert_valid_calls(plain.choices[0].message)
    with client.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    [s] = assert_valid_calls(final.choices[0].message, streamed=True)
    assert s.function.name == p.function.name
    assert json.loads(s.function.arguments) == json.loads(p.function.arguments)
    assert s.id != p.id, "every call gets its own id"


@pytest.mark.parametrize("model", MODELS)
def test_a_raw_tool_call_stream_names_the_call_once_then_sends_argument_fragments(client, model):
    tools = TOOLS_FOR[model]
    name = tools[0]["function"]["name"]
    kw = dict(model=model, messages=ASK, tools=tools, tool_choice=named(name), parallel_tool_calls=False,
              max_tokens=fit(client, model, ASK, tools), temperature=0)
    plain = client.chat.completions.create(**kw)
    [p] = assert_valid_calls(plain.choices[0].message, want_name=name)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    calls, fragments, finish = {}, 0, []
    for chunk in chunks:
        for ch in chunk.choices:
            assert not ch.delta.content, f"text in a forced tool call: {ch.delta.content!r}"
            if ch.finish_reason:
                finish.append(ch.finish_reason)
            for tc in ch.delta.tool_calls or []:
                if tc.index not in calls:
                    # The first delta of a call carries its id, type and name.
                    assert tc.id and tc.id.startswith("call_"), tc
                    assert tc.type == "function", tc
                    assert tc.function and tc.function.name == name, tc
                    calls[tc.index] = {"id": tc.id, "arguments": tc.function.arguments or ""}
                else:
                    # Later deltas only add argument text (clients concatenate every string field).
                    assert tc.id is None and (tc.function is None or tc.function.name is None), tc
                    calls[tc.index]["arguments"] += (tc.function.arguments or "") if tc.function else ""
                    fragments += 1
    assert finish == ["tool_calls"]
    assert list(calls) == [0]
    assert fragments >= 1, "arguments arrive as fragments after the first delta"
    assert calls[0]["arguments"] == p.function.arguments
    validate(json.loads(calls[0]["arguments"]), PARAMS[name])
    assert calls[0]["id"] != p.id
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


class GetWeather(BaseModel):
    """Current weather in a city."""
    city: Annotated[str, Field(min_length=1, max_length=16)]
    unit: Literal["celsius", "fahrenheit"]


class Dial(BaseModel):
    n: conint(ge=0, le=9)
    b: bool


@pytest.mark.parametrize("model,schema,name", [("tiny", Dial, "d"), ("gemma", GetWeather, "get_weather")])
def test_parse_fills_parsed_arguments_for_a_pydantic_tool(client, model, schema, name):
    tools = [openai.pydantic_function_tool(schema, name=name)]
    r = client.chat.completions.parse(model=model, messages=ASK, tools=tools, tool_choice=named(name),
                                      parallel_tool_calls=False, max_tokens=fit(client, model, ASK, tools),
                                      temperature=0)
    assert r.choices[0].finish_reason == "tool_calls"
    [call] = r.choices[0].message.tool_calls
    assert call.id.startswith("call_") and call.function.name == name
    assert isinstance(call.function.parsed_arguments, schema)
    validate(json.loads(call.function.arguments), to_strict_json_schema(schema))


def test_parallel_tool_calls_allowed_gives_distinct_valid_calls(client):
    # Greedy Gemma 270M may repeat its last call until max_tokens (it does on the AVX-512 build's
    # numerics); a presence penalty makes repeating cost, so it stops after its calls.
    r = client.chat.completions.create(
        model="gemma", tools=TOOLS, tool_choice="required", parallel_tool_calls=True, max_tokens=300, temperature=0,
        presence_penalty=1.0, messages=[{"role": "user", "content": "What is the weather in Paris and in Tokyo?"}])
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    calls = assert_valid_calls(r.choices[0].message, exactly_one=False)
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("model", MODELS)
def test_tool_choice_none_answers_in_text(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS_FOR[model], tool_choice="none",
                                       max_tokens=16, temperature=0)
    message = r.choices[0].message
    assert not message.tool_calls, message
    assert isinstance(message.content, str)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_tool_choice_auto_gives_text_or_valid_calls(client):
    r = client.chat.completions.create(model="gemma", messages=ASK, tools=TOOLS, tool_choice="auto",
                                       max_tokens=64, temperature=0)
    choice = r.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        assert_valid_calls(choice.message, exactly_one=False)
    else:
        assert isinstance(choice.message.content, str)
        assert choice.finish_reason in ("stop", "length")


def history(tool_result="22 degrees and sunny.", call_city="Paris"):
    return ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_w1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": call_city, "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_w1", "content": tool_result},
    ]


@pytest.mark.parametrize("model", MODELS)
def test_a_history_with_tool_calls_and_results_is_rendered(client, model):
    r = client.chat.completions.create(model=model, messages=history(), max_tokens=24, temperature=0)
    assert isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason in ("stop", "length")

    # The tool's result and the call's arguments reach the prompt: longer ones, more tokens.
    def prompt_tokens(**kw):
        return client.chat.completions.create(model=model, messages=history(**kw), max_tokens=1,
                                              temperature=0).usage.prompt_tokens

    short = prompt_tokens()
    assert short > client.chat.completions.create(model=model, messages=ASK, max_tokens=1,
                                                  temperature=0).usage.prompt_tokens
    assert prompt_tokens(tool_result="22 degrees and sunny, with a light wind from the west.") > short
    assert prompt_tokens(call_city="Llanfairpwllgwyngyll") > short


def test_a_forced_call_follows_a_tool_history(client):
    messages = history() + [{"role": "user", "content": "And what time is it in Tokyo?"}]
    r = client.chat.completions.create(model="gemma", messages=messages, tools=TOOLS, max_tokens=24, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    r = client.chat.completions.create(model="gemma", messages=messages, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=200, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(r.choices[0].message)


# --- LangChain ---------------------------------------------------------------------------------

class WeatherQuery(BaseModel):
    city: str = Field(min_length=1, max_length=24, description="The city")
    unit: Literal["celsius", "fahrenheit"] = Field(description="Temperature unit")


@pytest.mark.parametrize("target", ["node", "gateway"])
def test_langchain_agent_loop(node, gateway, target):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool

    ran = []

    @tool(args_schema=WeatherQuery)
    def get_weather(city: str, unit: str) -> str:
        """Current weather in a city."""
        ran.append((city, unit))
        return f"It is 22 degrees {unit} and sunny in {city}."

    llm = langchain_model(node if target == "node" else gateway)
    messages = [HumanMessage("What is the weather in Paris? Use the tool.")]
    ai = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(messages)
    assert isinstance(ai, AIMessage)
    assert ai.invalid_tool_calls == [], ai.invalid_tool_calls
    assert ai.tool_calls, ai
    assert ai.response_metadata.get("finish_reason") == "tool_calls", ai.response_metadata
    messages.append(ai)
    for call in ai.tool_calls:
        assert call["name"] == "get_weather"
        assert call["id"].startswith("call_")
        validate(call["args"], WeatherQuery.model_json_schema())
        messages.append(ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]))
    assert len(ran) == len(ai.tool_calls)
    final = llm.invoke(messages)
    assert isinstance(final, AIMessage) and not final.tool_calls
    assert isinstance(final.content, str) and final.content.strip(), final
