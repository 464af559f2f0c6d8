"""A real instruct model through the OpenAI API: SmolLM2-135M-Instruct (Q4_1 GGUF with its own
ChatML template, installed by scripts/setup.sh) on the llama.cpp plugin, with the official
`openai` client, against the node and the gateway.

- Chat goes through the model's own template (its default system prompt included) and answers
  (a 135M model at 4 bits: a greeting, not general knowledge).
- `tool_choice: "required"` calls and `response_format` answers validate over seeds (forced
  calls over 20 seeds x 5 tools on both models: test_tool_matrix.py).
- A small agent loop (two tools, three turns: a call, the tool's result, the answer)
  completes through the gateway.
- LangChain: `bind_tools` with a tool made from a Python signature, forced, over seeds
  (`with_structured_output` in both modes on both models: test_tool_matrix.py).
"""
import json

import jsonschema
import openai

from conftest import closed, streamed_parts

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


def test_smollm2_chats_with_its_own_template(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                       max_tokens=40, temperature=0)
    text = r.choices[0].message.content
    assert "hello" in text.lower(), text
    assert r.choices[0].finish_reason in ("stop", "length")
    # The template's own default system prompt is part of the prompt: far more than the
    # three words of the question.
    assert r.usage.prompt_tokens > 20, r.usage


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


def test_the_hermes_parser_reads_the_calls_smollm2_writes_itself(client):
    """SmolLM2's template has no tool support, so the node inlines the tools and asks for the
    Hermes syntax (`<tool_call>...</tool_call>`), the family `Family::detect` gives it. The 135M
    model does not write a call on its own in `tool_choice: "auto"` (none in 8 tries, none in 10
    with two worked examples in the history: it answers in prose or imitates the tool's
    response), so a Lark grammar (a vLLM-style extra) holds its output to the Hermes envelope
    and the call's JSON; the auto parser must then find the call in what the model wrote,
    plain and streamed alike."""
    call = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": "get_weather"}, "arguments": closed(WEATHER)}}
    grammar = 'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json ' + json.dumps(call)
    for seed in range(3):
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "What is the weather in Oslo?"}], tools=TOOLS,
                  tool_choice="auto", max_tokens=64, temperature=0.7, seed=seed, extra_body={"guided_grammar": grammar})
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls", (seed, r.choices[0])
        assert not r.choices[0].message.content, (seed, r.choices[0].message.content)
        (c,) = r.choices[0].message.tool_calls
        assert c.function.name == "get_weather" and c.id.startswith("call_")
        jsonschema.validate(json.loads(c.function.arguments), closed(WEATHER))
        text, calls, finish, _ = streamed_parts(client, kw)
        assert (text, calls, finish) == ("", [(c.function.name, c.function.arguments)], "tool_calls"), seed


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

    for seed in range(5):
        ai = chat_model(node, seed=seed, temperature=0.5).bind_tools([get_weather], tool_choice="get_weather") \
            .invoke("What is the weather in Oslo?")
        assert ai.invalid_tool_calls == [], (seed, ai.invalid_tool_calls)
        assert ai.response_metadata.get("finish_reason") == "tool_calls", (seed, ai.response_metadata)
        (call,) = ai.tool_calls
        assert call["name"] == "get_weather"
        assert set(call["args"]) <= {"city", "unit"}, (seed, call["args"])
        assert isinstance(call["args"].get("city"), str), (seed, call["args"])


# --- the native engine on the same model --------------------------------------------------------
# scripts/setup.sh converts the GGUF to a Hugging Face directory (testkit/python/gguf_to_hf.py:
# the Q4_1 weights dequantized to f32, the tokenizer as tokenizer.json); the node serves it with
# the native engine as `smollm2-native`.

NATIVE = "smollm2-native"


def test_the_native_engine_tokenizes_smollm2_as_llama_cpp_does(http):
    for text in ["Hello, world!", "café naïve 12345 3.14159", "東京の天気は？", "<|im_start|>user\nhi<|im_end|>\n",
                 "def f(x):\n\treturn x**2  # 🙂", "  leading spaces and\r\nCRLF"]:
        ids = [http.post("/v1/tokenize", {"model": m, "content": text, "add_special": False})["tokens"]
               for m in (MODEL, NATIVE)]
        assert ids[0] == ids[1], (text, ids)


def test_the_native_engine_chats_calls_tools_and_answers_in_json_on_smollm2(client):
    r = client.chat.completions.create(model=NATIVE, messages=[{"role": "user", "content": "Say hello."}],
                                       max_tokens=40, temperature=0)
    assert "hello" in r.choices[0].message.content.lower(), r.choices[0].message.content
    assert r.usage.prompt_tokens > 20, "the template's own system prompt is part of the prompt"
    ask = [{"role": "user", "content": "What is the weather in Lisbon, and what are 120 euros in dollars?"}]
    for tool in PARAMS:
        for seed in range(3):
            r = client.chat.completions.create(model=NATIVE, messages=ask, tools=TOOLS,
                                               tool_choice={"type": "function", "function": {"name": tool}},
                                               max_tokens=96, temperature=1.0, seed=seed)
            assert r.choices[0].finish_reason == "tool_calls", (tool, seed, r.choices[0])
            call = r.choices[0].message.tool_calls[0]
            assert call.function.name == tool
            jsonschema.validate(json.loads(call.function.arguments), closed(PARAMS[tool]))
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": WEATHER}}
    for seed in range(3):
        r = client.chat.completions.create(model=NATIVE, messages=[{"role": "user", "content": "Name a city."}],
                                           response_format=fmt, max_tokens=64, temperature=1.0, seed=seed)
        jsonschema.validate(json.loads(r.choices[0].message.content), closed(WEATHER))
