"""Structured outputs, checked with the official `openai` client and with LangChain:
`response_format` (text, json_object, json_schema), the vLLM-style extras (`guided_*`,
`structured_outputs`), the refusals, and the constraint's mask-time histogram. Tool calls are
in test_tool_calls.py.

Both chat models run every schema. `tiny` has random weights, so whatever it writes inside a
constraint is arbitrary: it shows that the constraint alone makes the output valid. Every schema
used on it is bounded (strings with a maxLength, integers with both bounds, arrays with
maxItems, no free-form numbers), so a valid document always ends well inside `max_tokens`.
`gemma` is a real small model and writes plausible values.
"""
import json
import re
import urllib.error
import urllib.request
from datetime import date
from enum import Enum
from typing import Annotated, Literal, Optional, Union
from uuid import UUID

import openai
import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field, conint, conlist, constr

from conftest import langchain_model
from json_checks import assert_compact, validate

MODELS = ["tiny", "gemma"]
# Room for the longest document any schema below allows, with margin for JSON escapes
# (`tiny` writes about one character per token). `tiny`'s context is 512 tokens.
MAX_TOKENS = {"tiny": 300, "gemma": 300}


# --- helpers ---------------------------------------------------------------------------------

def post(base, body, path="/v1/chat/completions"):
    """One JSON POST; returns (status, parsed body or text)."""
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, data = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, data = e.code, e.read()
    try:
        return status, json.loads(data)
    except ValueError:
        return status, data.decode("utf-8", "replace")


def assert_openai_error(status, body, param=None, param_prefix=None, contains=None):
    assert status == 400, (status, body)
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error", err
    assert isinstance(err["message"], str) and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    if param_prefix is not None:
        assert isinstance(err["param"], str) and err["param"].startswith(param_prefix), err
    if contains is not None:
        assert contains in err["message"], err
    return err


@pytest.fixture(scope="module")
def via_gateway(gateway):
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(params=["node", "gateway"])
def base(request, node, gateway):
    return node if request.param == "node" else gateway


# --- the schemas: every one bounded ------------------------------------------------------------

Short = Annotated[str, Field(min_length=1, max_length=20)]


class Person(BaseModel):
    name: Short
    age: Annotated[int, Field(ge=0, le=120)]


class Address(BaseModel):
    street: Annotated[str, Field(max_length=24)]
    city: Annotated[str, Field(min_length=1, max_length=16)]
    zip: Annotated[str, Field(pattern=r"^[0-9]{5}$")]


class Contact(BaseModel):
    name: Short
    address: Address


class Colour(str, Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Paint(BaseModel):
    colour: Colour
    coats: conint(ge=1, le=3)


class Ticket(BaseModel):
    priority: Literal["low", "medium", "high"]
    open: bool


class Tagged(BaseModel):
    tags: conlist(constr(min_length=1, max_length=10), min_length=1, max_length=3)


class Profile(BaseModel):
    nickname: Optional[constr(max_length=12)] = None
    age: Optional[conint(ge=0, le=99)] = None
    verified: bool


class Flight(BaseModel):
    code: constr(pattern=r"^[A-Z]{2}[0-9]{3}$")
    gate: Annotated[str, Field(pattern=r"^[A-F][0-9]$")]


class LineItem(BaseModel):
    sku: constr(pattern=r"^[A-Z]{3}-[0-9]{3}$")
    qty: conint(ge=1, le=9)


class Order(BaseModel):
    items: conlist(LineItem, min_length=1, max_length=3)


class Point(BaseModel):
    x: conint(ge=-100, le=100)
    y: conint(ge=-100, le=100)


class Route(BaseModel):
    """`Point` three times: one `$defs` entry, three `$ref`s."""
    start: Point
    end: Point
    via: conlist(Point, max_length=2)


class Envelope(BaseModel):
    version: Literal["v1"]          # a one-value Literal is `const`
    kind: Literal["event"]
    seq: conint(ge=0, le=999)


class Switches(BaseModel):
    wifi: bool
    bluetooth: bool
    airplane_mode: bool


class Word(BaseModel):
    word: constr(min_length=3, max_length=8, pattern=r"^[a-z]+$")


class Grid(BaseModel):
    rows: conlist(conlist(conint(ge=0, le=9), min_length=2, max_length=2), min_length=2, max_length=2)


class Meeting(BaseModel):
    title: Short
    # format: date. The pattern keeps to years 2000-2099 outside February: the format's grammar
    # admits 29 February of any year and the year 0000, which Python's date refuses.
    day: Annotated[date, Field(json_schema_extra={"pattern": r"^20[0-9]{2}-(0[13-9]|1[0-2])-"})]


class Record(BaseModel):
    id: UUID                        # format: uuid
    label: constr(max_length=12)


class Circle(BaseModel):
    kind: Literal["circle"]
    radius: conint(ge=1, le=10)


class Square(BaseModel):
    kind: Literal["square"]
    side: conint(ge=1, le=10)


class Drawing(BaseModel):
    shape: Union[Circle, Square]    # anyOf of two $refs


class Reading(BaseModel):
    celsius: conint(ge=-40, le=50)
    delta: conint(gt=-5, lt=5)      # exclusiveMinimum / exclusiveMaximum


class Review(BaseModel):
    stars: Literal[1, 2, 3, 4, 5]   # an integer enum
    recommend: bool


class Company(BaseModel):
    ceo: Person
    hq: Address
    founded: conint(ge=1800, le=2024)


class Shipment(BaseModel):
    tracking: constr(pattern=r"^TRK[0-9]{4}$")
    address: Optional[Address] = None


class Batch(BaseModel):
    size: conint(ge=0, le=100, multiple_of=5)
    label: constr(min_length=1, max_length=10)


class Pixel(BaseModel):
    position: tuple[conint(ge=0, le=9), conint(ge=0, le=9)]   # prefixItems
    on: bool


class Team(BaseModel):
    """`Person` reused in two places, one of them a list."""
    lead: Person
    members: conlist(Person, min_length=1, max_length=2)


SCHEMA_CASES = [
    (Person, "Invent a person: a name and an age."),
    (Contact, "Give a contact with a postal address."),
    (Paint, "Pick a paint colour and a number of coats."),
    (Ticket, "A printer is on fire. Triage the ticket."),
    (Tagged, "Give up to three tags for a post about baking bread."),
    (Profile, "Make a user profile; nickname and age are optional."),
    (Flight, "Give a flight code like AB123 and a gate like C4."),
    (Order, "Order two items by SKU, like ABC-123."),
    (Route, "A route between two points on a grid."),
    (Envelope, "Wrap event number 42 in an envelope."),
    (Switches, "Which phone radios are on in flight mode?"),
    (Word, "Give one lowercase word for a fruit."),
    (Grid, "A 2x2 grid of digits."),
    (Meeting, "Plan a team meeting for a date next year."),
    (Record, "Create a record with an id and a label."),
    (Drawing, "Draw a circle or a square."),
    (Reading, "A thermometer reading and its change."),
    (Review, "Review a good pizza place."),
    (Company, "Describe a small company."),
    (Shipment, "Track a parcel with a tracking number."),
    (Batch, "A batch size, a multiple of five."),
    (Pixel, "One pixel on a 10x10 screen."),
    (Team, "A small team with a lead and members."),
]


# --- response_format ---------------------------------------------------------------------------

@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("schema,prompt", SCHEMA_CASES, ids=[c[0].__name__ for c in SCHEMA_CASES])
def test_parse_returns_an_instance_that_validates(client, model, schema, prompt):
    r = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": prompt}], response_format=schema,
        max_tokens=MAX_TOKENS[model], temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    message = choice.message
    assert isinstance(message.parsed, schema), message
    data = json.loads(message.content)
    validate(data, schema.model_json_schema())
    # What the client sent (every property required, no others): the output has exactly those.
    validate(data, to_strict_json_schema(schema))
    assert schema.model_validate(data) == message.parsed
    assert_compact(message.content)
    assert 0 < r.usage.completion_tokens <= MAX_TOKENS[model]


@pytest.mark.parametrize("model", MODELS)
def test_a_streamed_parse_equals_the_plain_one(client, model):
    kw = dict(model=model, messages=[{"role": "user", "content": "Describe a small company."}],
              response_format=Company, max_tokens=MAX_TOKENS[model], temperature=0)
    plain = client.chat.completions.parse(**kw).choices[0].message
    with client.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "stop"
    streamed = final.choices[0].message
    assert isinstance(streamed.parsed, Company)
    assert streamed.content == plain.content
    assert streamed.parsed == plain.parsed


def test_json_schema_is_enforced_without_strict_too(client):
    """`strict: false` is not a hint: the random model's output still validates."""
    schema = {"type": "object",
              "properties": {"word": {"type": "string", "maxLength": 12},
                             "count": {"type": "integer", "minimum": 0, "maximum": 50},
                             "ok": {"type": "boolean"}},
              "required": ["word", "count", "ok"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Count something."}], temperature=0,
        max_tokens=MAX_TOKENS["tiny"],
        response_format={"type": "json_schema", "json_schema": {"name": "counted", "schema": schema, "strict": False}})
    assert r.choices[0].finish_reason == "stop"
    validate(json.loads(r.choices[0].message.content), schema)
    assert_compact(r.choices[0].message.content)


def test_response_format_text_is_plain_generation(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=12, temperature=0)
    plain = client.chat.completions.create(**kw)
    text = client.chat.completions.create(**kw, response_format={"type": "text"})
    assert text.choices[0].message.content == plain.choices[0].message.content
    assert text.choices[0].finish_reason == "length" and text.usage.completion_tokens == 12


def test_json_object_mode_returns_one_object(client):
    r = client.chat.completions.create(
        model="gemma", temperature=0, max_tokens=200, response_format={"type": "json_object"},
        # Without an example, greedy Gemma 270M adds keys until max_tokens in any JSON layout; one
        # example turn shows it where an object ends. String values and a presence penalty keep
        # it from running a number's digits (`3.000…`), which it does on some CPU builds' numerics
        # (the grammar allows any number); the test is about the mode, not the model's taste.
        presence_penalty=1.0,
        messages=[{"role": "user", "content": "Give a dog as JSON with name and color."},
                  {"role": "assistant", "content": '{"name": "Rex", "color": "brown"}'},
                  {"role": "user", "content": "Now a cat, same keys."}])
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    content = r.choices[0].message.content
    assert isinstance(json.loads(content), dict), content
    assert_compact(content)


def test_structured_output_through_the_gateway_equals_the_node(client, via_gateway):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Order two items."}], response_format=Order,
              max_tokens=MAX_TOKENS["tiny"], temperature=0)
    direct = client.chat.completions.parse(**kw).choices[0].message
    through = via_gateway.chat.completions.parse(**kw).choices[0].message
    assert isinstance(through.parsed, Order)
    assert through.content == direct.content


# --- vLLM-style extras -------------------------------------------------------------------------


REGEX = r"\d{3}-[a-z]{2}"
CHOICE = ["alpha", "beta", "gamma"]
YES_NO = 'start: "yes" | "no"'
GREETING = 'start: GREETING " " NAME\nGREETING: "hello" | "hi"\nNAME: /[A-Z][a-z]{1,7}/'
SMALL = {"type": "object",
         "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}, "ok": {"type": "boolean"},
                        "tag": {"type": "string", "maxLength": 8}},
         "required": ["n", "ok", "tag"], "additionalProperties": False}


def _json_ok(text):
    validate(json.loads(text), SMALL)
    assert_compact(text)
    return True


EXTRAS = [
    ("guided_regex", {"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
    ("guided_choice", {"guided_choice": CHOICE}, lambda t: t in CHOICE),
    ("guided_grammar", {"guided_grammar": YES_NO}, lambda t: t in ("yes", "no")),
    ("guided_grammar-terminals", {"guided_grammar": GREETING}, lambda t: re.fullmatch(r"(hello|hi) [A-Z][a-z]{1,7}", t)),
    ("guided_json", {"guided_json": SMALL}, _json_ok),
    ("structured_outputs.regex", {"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
    ("structured_outputs.choice", {"structured_outputs": {"choice": CHOICE}}, lambda t: t in CHOICE),
    ("structured_outputs.grammar", {"structured_outputs": {"grammar": YES_NO}}, lambda t: t in ("yes", "no")),
    ("structured_outputs.json", {"structured_outputs": {"json": SMALL}}, _json_ok),
]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("extra,check", [e[1:] for e in EXTRAS], ids=[e[0] for e in EXTRAS])
def test_vllm_extras_constrain_the_whole_output(client, model, extra, check):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Answer."}],
                                       max_tokens=64, temperature=0, extra_body=extra)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", (r.choices[0].finish_reason, text)
    assert check(text), text


def test_a_grammar_output_that_contains_the_end_of_turn_marker_is_not_cut(client):
    """Gemma runs through the default ChatML template, whose `<|im_end|>` ends a plain reply
    even when written as text. Under a grammar that text is part of the output (here forced
    into it, as a 270M model once wrote it inside a tool call's string argument): the reply
    must be the grammar's whole output, not the part before the marker."""
    marked = "done<|im_end|>really"
    for extra in ({"guided_choice": [marked]},
                  {"guided_json": {"type": "object", "properties": {"s": {"const": marked}}, "required": ["s"]}}):
        r = client.chat.completions.create(model="gemma", messages=[{"role": "user", "content": "Answer."}],
                                           max_tokens=48, temperature=0, extra_body=extra)
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", (extra, r.choices[0])
        assert marked in text, (extra, text)


# --- refusals ----------------------------------------------------------------------------------

def chat(**kw):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    body.update(kw)
    return body


def json_schema(schema=None, name="answer", **extra):
    inner = {"name": name, "schema": schema, **extra}
    return {"type": "json_schema", "json_schema": {k: v for k, v in inner.items() if v is not None}}


SCHEMA_PARAM = "response_format.json_schema.schema"
OK_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}
NAMELESS_TOOL = [{"type": "function", "function": {"description": "no name", "parameters": {"type": "object"}}}]

REFUSALS = [
    ("type-not-a-string", chat(response_format=json_schema({"type": 5})), dict(param=SCHEMA_PARAM)),
    ("properties-not-an-object", chat(response_format=json_schema({"type": "object", "properties": []})),
     dict(param=SCHEMA_PARAM)),
    ("schema-not-an-object", chat(response_format=json_schema("a string")), dict(param=SCHEMA_PARAM)),
    ("no-name", chat(response_format={"type": "json_schema", "json_schema": {"schema": OK_SCHEMA}}),
     dict(param_prefix="response_format.json_schema")),
    ("no-json_schema", chat(response_format={"type": "json_schema"}), dict(param_prefix="response_format")),
    ("unknown-type", chat(response_format={"type": "xml"}), dict(param_prefix="response_format")),
    ("tool-without-name", chat(tools=NAMELESS_TOOL), dict(param="tools[0].function.name")),
    ("tool_choice-unknown-function", chat(tools=[{"type": "function", "function": {"name": "d", "parameters": {"type": "object"}}}],
                                           tool_choice={"type": "function", "function": {"name": "get_stock"}}), dict(param="tool_choice")),
    ("tool_choice-required-without-tools", chat(tool_choice="required"), dict(param="tool_choice")),
    ("invalid-regex", chat(guided_regex="([a-z"), dict(param="guided_regex")),
]


@pytest.mark.parametrize("body,expect", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_bad_constraints_are_refused_naming_the_field(base, body, expect):
    status, reply = post(base, body)
    assert_openai_error(status, reply, **expect)


UNSUPPORTED = [
    ("if", {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
            "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["a"]}, "else": {}}),
    ("dependentSchemas", {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                          "dependentSchemas": {"a": {"required": ["a"]}}}),
]


@pytest.mark.parametrize("keyword,schema", UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_an_unsupported_schema_keyword_is_named(base, keyword, schema):
    status, reply = post(base, chat(response_format=json_schema(schema)))
    err = assert_openai_error(status, reply, param=SCHEMA_PARAM)
    # The keyword itself, quoted, not a word that happens to contain it.
    assert re.search(rf"[\"'`]{keyword}[\"'`]", err["message"]), err


TWO_AT_ONCE = [
    ("regex+choice", chat(guided_regex="[a-z]{3}", guided_choice=["x", "y"])),
    ("json_schema+guided_json", chat(response_format=json_schema(OK_SCHEMA), guided_json=OK_SCHEMA)),
    ("structured_outputs+guided_regex", chat(structured_outputs={"choice": ["x"]}, guided_regex="[a-z]")),
    ("structured_outputs-two-keys", chat(structured_outputs={"choice": ["x"], "regex": "[a-z]"})),
]


@pytest.mark.parametrize("body", [t[1] for t in TWO_AT_ONCE], ids=[t[0] for t in TWO_AT_ONCE])
def test_two_constraints_in_one_request_are_refused(base, body):
    status, reply = post(base, body)
    assert_openai_error(status, reply)


TWO_AT_ONCE_REFUSALS = [(name, body, {}) for name, body in TWO_AT_ONCE]
UNSUPPORTED_REFUSALS = [(kw, chat(response_format=json_schema(schema)), {}) for kw, schema in UNSUPPORTED]


def test_a_bad_schema_is_refused_before_a_stream_starts(base):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True,
            response_format=json_schema({"type": "object", "properties": []}))
        list(stream)
    assert e.value.status_code == 400
    assert e.value.body["param"] == SCHEMA_PARAM


def test_the_server_keeps_serving_after_the_refusals(base):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    for _ in range(2):
        for body, _expect in [r[1:] for r in REFUSALS + TWO_AT_ONCE_REFUSALS + UNSUPPORTED_REFUSALS]:
            status, reply = post(base, body)
            assert status < 500, reply   # each case's own status and field are asserted above
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
                                       temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Pick."}], max_tokens=16,
                                       temperature=0, extra_body={"guided_choice": CHOICE})
    assert c.choices[0].message.content in CHOICE
    p = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "Invent a person."}],
                                      response_format=Person, max_tokens=MAX_TOKENS["tiny"], temperature=0)
    assert isinstance(p.choices[0].message.parsed, Person)


# --- LangChain ---------------------------------------------------------------------------------

def test_langchain_with_structured_output(node):
    llm = langchain_model(node)
    person = llm.with_structured_output(Person, method="json_schema").invoke("Invent a person: a name and an age.")
    assert isinstance(person, Person)
    validate(person.model_dump(), Person.model_json_schema())


# --- metrics -----------------------------------------------------------------------------------

MASK = "gantry_constraint_mask_seconds"


def mask_histogram(node, model="gemma"):
    """(buckets {le: cumulative count}, count, sum) of the mask-time histogram for `model`."""
    with urllib.request.urlopen(f"{node}/metrics", timeout=10) as r:
        text = r.read().decode()
    buckets, count, total = {}, None, None
    for line in text.splitlines():
        m = re.match(rf'{MASK}_(bucket|count|sum)\{{([^}}]*)\}} (\S+)$', line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if labels.get("model") != model:
            continue
        value = float(m.group(3))
        if m.group(1) == "bucket":
            buckets[labels["le"]] = value
        elif m.group(1) == "count":
            count = value
        else:
            total = value
    return buckets, count, total


def test_the_mask_time_histogram_counts_constrained_tokens_only(client, node):
    # At least one constrained request on gemma first, so its series exists.
    client.chat.completions.create(model="gemma", messages=[{"role": "user", "content": "Pick one."}], max_tokens=16,
                                   temperature=0, extra_body={"guided_choice": CHOICE})
    buckets, before, sum_before = mask_histogram(node)
    assert before is not None and before > 0, "gantry_constraint_mask_seconds_count{model=\"gemma\"} is missing or 0"
    finite = sorted(float(le) for le in buckets if le != "+Inf")
    assert len(finite) >= 10 and finite[0] <= 1e-4 and finite[-1] >= 0.1, finite
    assert buckets["+Inf"] == before

    client.chat.completions.create(model="gemma", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8,
                                   temperature=0)
    assert mask_histogram(node)[1] == before, "an unconstrained request computed masks"

    r = client.chat.completions.create(model="gemma", messages=[{"role": "user", "content": "Name a colour."}],
                                       max_tokens=32, temperature=0, extra_body={"guided_regex": "[a-z]{3,12}"})
    assert r.choices[0].finish_reason == "stop"
    _, after, sum_after = mask_histogram(node)
    # One observation per constrained token (the last one allows only the end).
    assert 1 <= after - before <= r.usage.completion_tokens + 1, (before, after, r.usage)
    assert sum_after > sum_before
