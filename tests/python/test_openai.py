"""OpenAI wire compatibility, checked with the official `openai` Python client."""
import base64
import json
import threading
import time
import re
import struct
import subprocess

import openai
import pytest

CAPITAL = "Question: What is the capital of France?\nAnswer:"


def test_models_lists_every_model_with_its_template_source(client):
    models = {m.id: m for m in client.models.list().data}
    bases = {"tiny", "tiny-emb", "gemma", "smollm2", "smollm2-native"}
    assert {i for i, m in models.items() if not getattr(m, "parent", None)} == bases
    # LoRA adapters are listed as models of their own, each after its base (test_adapters.py).
    assert {m.parent for m in models.values() if getattr(m, "parent", None)} == {"smollm2", "smollm2-native"}
    assert models["gemma"].owned_by == "gantry"
    # Gemma from PyPI is a base model without a template: the default is reported.
    assert models["gemma"].model_extra["chat_template"] == "default-chatml"
    assert models["tiny"].model_extra["chat_template"] == "model"
    assert models["smollm2-native"].model_extra["chat_template"] == "model"
    # SmolLM2-Instruct carries its own (ChatML) template.
    assert models["smollm2"].model_extra["chat_template"] == "model"


def test_chat_non_streaming(client):
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_chat_streaming_sends_one_event_per_token_and_usage(client):
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=10, temperature=0,
            stream=True, stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    token_chunks = [c for c in chunks if c.choices and c.choices[0].finish_reason is None][1:]
    assert len(token_chunks) == 10
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    assert final.choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=10, temperature=0
    )
    assert streamed == plain.choices[0].message.content


def test_completions_streaming_and_not(client):
    plain = client.completions.create(model="gemma", prompt=CAPITAL, max_tokens=6, temperature=0)
    assert plain.object == "text_completion"
    assert plain.choices[0].text.startswith(" Paris")
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(model="gemma", prompt=CAPITAL, max_tokens=6, temperature=0, stream=True)
        if c.choices
    )
    assert streamed == plain.choices[0].text


def test_gemma_chat_answers_through_the_default_template(client):
    r = client.chat.completions.create(
        model="gemma", messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=16, temperature=0
    )
    assert r.choices[0].message.content
    assert r.usage.prompt_tokens > 5


def gemma_vocabulary() -> tuple[list[str], int]:
    """Gemma's token strings and BOS id, read from the GGUF file itself (not through the node)."""
    from conftest import TARGET, _gemma
    out = subprocess.run([TARGET / "gantry-testkit", "metadata", _gemma()], check=True, capture_output=True, text=True)
    meta = json.loads(out.stdout)
    return meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.bos_token_id"]


def spell(ids: list[int], vocab: list[str]) -> str:
    """SentencePiece pieces back to text: `▁` is a space, `<0xHH>` a raw byte."""
    out = bytearray()
    for i in ids:
        piece = vocab[i]
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        out += bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode()
    return out.decode()


def test_usage_matches_the_tokenizer(client, http):
    r = client.completions.create(model="gemma", prompt=CAPITAL, max_tokens=5, temperature=0)
    tokens = http.post("/v1/tokenize", {"model": "gemma", "content": CAPITAL, "add_special": True})["tokens"]
    assert r.usage.prompt_tokens == len(tokens)
    # The ids are a real tokenization of the prompt in the model's own vocabulary: BOS, then
    # pieces that spell the prompt exactly.
    vocab, bos = gemma_vocabulary()
    assert tokens[0] == bos
    assert spell(tokens[1:], vocab) == CAPITAL
    assert 1 < len(tokens) < len(CAPITAL)
    events = [c for c in client.completions.create(model="gemma", prompt=CAPITAL, max_tokens=5, temperature=0, stream=True,
                                                   stream_options={"include_usage": True})]
    token_events = [c for c in events if c.choices and c.choices[0].finish_reason is None]
    assert events[-1].usage.completion_tokens == len(token_events) == 5
    assert events[-1].usage.prompt_tokens == len(tokens)


def test_stop_sequences_end_generation_and_are_not_emitted(client):
    r = client.completions.create(model="gemma", prompt=CAPITAL, max_tokens=40, temperature=0, stop=["\n"])
    assert r.choices[0].finish_reason == "stop"
    assert "\n" not in r.choices[0].text
    assert r.choices[0].text.startswith(" Paris")
    # Across token boundaries: a two-token stop string.
    r2 = client.completions.create(model="gemma", prompt=CAPITAL, max_tokens=40, temperature=0, stop=["aris"])
    assert r2.choices[0].text == " P" and r2.choices[0].finish_reason == "stop"


def test_logprobs_in_chat_and_completions(client):
    r = client.chat.completions.create(
        model="gemma", messages=[{"role": "user", "content": "Say hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for t in content:
        assert t.logprob <= 0
        assert len(t.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token
    c = client.completions.create(model="gemma", prompt=CAPITAL, max_tokens=3, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert lp.tokens[0] == " Paris"


def _in_flight(client, n, seconds):
    """`n` other streams on gemma, running for about `seconds` while the caller works."""
    def run(i):
        deadline = time.time() + seconds
        while time.time() < deadline:
            s = client.chat.completions.create(
                model="gemma", messages=[{"role": "user", "content": f"Other request {i}: count to fifty."}],
                max_tokens=24, temperature=0.7, stream=True)
            for _ in s:
                pass
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def test_seeded_sampling_is_reproducible_whatever_is_cached(client):
    """docs/node.md, "Reproducible sampling": with `seed`, the same request gives the same text on
    a cold and on a warm node (a seeded request takes no cached prefix: ABI 1.1
    GANTRY_STEP_FRESH), streamed or not, for chat and completions. With other requests in the
    same batches it is not guaranteed (llama.cpp's CPU kernels are not batch-invariant); what is
    guaranteed is that such a run still completes and leaves nothing behind that changes the
    next run's text."""
    # The test model has no template: through the default ChatML it would write `<|im_end|>` and
    # stop at once, so `<` (236820) is biased away to get a reply worth comparing.
    chat = dict(model="gemma", messages=[{"role": "user", "content": "Tell me a short story about a fox."}],
                max_tokens=32, temperature=0.8, seed=4242, logit_bias={"236820": -100})
    comp = dict(model="gemma", prompt="The old lighthouse keeper opened the door and", max_tokens=32,
                temperature=0.8, seed=4242)

    def chat_text(stream=False):
        if stream:
            return "".join(c.choices[0].delta.content or ""
                           for c in client.chat.completions.create(**chat, stream=True) if c.choices)
        return client.chat.completions.create(**chat).choices[0].message.content

    def comp_text(stream=False):
        if stream:
            return "".join(c.choices[0].text for c in client.completions.create(**comp, stream=True) if c.choices)
        return client.completions.create(**comp).choices[0].text

    first_chat, first_comp = chat_text(), comp_text()   # the prompts are new to the node here
    assert first_chat and first_comp
    for _ in range(2):                                   # now their prefixes are warm in free slots
        assert chat_text() == first_chat
        assert comp_text() == first_comp
    assert chat_text(stream=True) == first_chat
    assert comp_text(stream=True) == first_comp
    # Other prompts leave other warm cells behind: still the same text.
    for i in range(3):
        client.chat.completions.create(model="gemma", messages=[{"role": "user", "content": f"Warm {i}: ships."}],
                                       max_tokens=16, temperature=0.7)
    assert chat_text() == first_chat and comp_text() == first_comp
    # With other requests in flight: it completes (same length budget), and afterwards the
    # seeded request gives its text again.
    others = _in_flight(client, 3, 4)
    try:
        time.sleep(0.3)
        busy = client.chat.completions.create(**chat)
        assert busy.choices[0].message.content and busy.usage.completion_tokens <= 32
    finally:
        for t in others:
            t.join(timeout=60)
    assert chat_text() == first_chat and comp_text(stream=True) == first_comp
    # A different seed samples differently (the seed is used at all).
    assert client.completions.create(**{**comp, "seed": 7}).choices[0].text != first_comp


def test_embeddings_float_and_base64(client):
    r = client.embeddings.create(model="tiny-emb", input=["hello there", "something else"], encoding_format="float")
    assert len(r.data) == 2 and len(r.data[0].embedding) == 64
    assert r.data[0].embedding != r.data[1].embedding
    assert r.usage.prompt_tokens > 0
    b = client.embeddings.create(model="tiny-emb", input="hello there", encoding_format="base64")
    raw = b.data[0].embedding
    vec = list(struct.unpack("<64f", base64.b64decode(raw))) if isinstance(raw, str) else raw
    assert vec == pytest.approx(r.data[0].embedding, rel=1e-6)


def test_a_text_model_refuses_embeddings_and_an_embedding_model_refuses_chat(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="tiny", input="x")
    assert "does not produce embeddings" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-emb", messages=[{"role": "user", "content": "x"}])
    assert "embedding model" in e.value.message


VALIDATION_CASES = [
    (dict(temperature=3), "temperature", "`temperature` must be within [0, 2], got 3"),
    (dict(top_p=1.5), "top_p", "`top_p` must be within [0, 1], got 1.5"),
    (dict(presence_penalty=-3), "presence_penalty", "`presence_penalty` must be within [-2, 2], got -3"),
    (dict(frequency_penalty=2.5), "frequency_penalty", "`frequency_penalty` must be within [-2, 2], got 2.5"),
    (dict(n=0), "n", "`n` must be within [1, 128], got 0"),
    (dict(n=129), "n", "`n` must be within [1, 128], got 129"),
    (dict(max_tokens=0), "max_tokens", "`max_tokens` must be >= 1, got 0"),
    (dict(max_tokens=100000), "max_tokens", "`max_tokens` must be <= "),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs", "`top_logprobs` must be within [0, 20], got 21"),
    (dict(stop=["a", "b", "c", "d", "e"]), "stop", "`stop` may hold at most 4 sequences, got 5"),
    (dict(response_format={"type": "xml"}), "response_format.type", "`response_format.type` must be \"text\", \"json_object\" or \"json_schema\", got \"xml\""),
    (dict(logit_bias={"5": 200}), "logit_bias", "`logit_bias[5]` must be within [-100, 100], got 200"),
    (dict(extra_body={"top_k": -1}), "top_k", "`top_k` must be >= 0, got -1"),
    (dict(extra_body={"min_p": 2}), "min_p", "`min_p` must be within [0, 1], got 2"),
    (dict(extra_body={"mystery": 1}), "mystery", "unknown parameter `mystery`"),
]


@pytest.mark.parametrize("kwargs,param,message", VALIDATION_CASES, ids=[c[1] for c in VALIDATION_CASES])
def test_every_validation_error_names_the_field_and_limit(client, kwargs, param, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], **kwargs)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param
    assert message in e.value.message


def test_empty_prompts_images_and_unknown_models_are_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "   "}])
    assert "empty" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="")
    assert "empty" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
        )
    assert "text-only" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found"


def test_a_prompt_over_the_context_is_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="word " * 2000, max_tokens=5)
    assert e.value.body["code"] == "context_length_exceeded"
    assert "context length is 512" in e.value.message
