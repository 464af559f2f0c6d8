"""The cluster's one OpenAI endpoint, checked with the official `openai` client: the same node
as test_openai.py, reached through `gantry-operator run --components gateway` with static
discovery (no cluster). Every answer must be the node's own, passed through unchanged."""
import openai
import pytest



@pytest.fixture(scope="session")
def via_gateway(gateway):
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_through_the_gateway(via_gateway):
    listed = {m.id: m for m in via_gateway.models.list().data}
    # smollm2's LoRA adapters come from the node's reports, the refused ones left out.
    assert set(listed) == {"tiny", "tiny-emb", "gemma", "smollm2", "smollm2:pirate", "smollm2:formal"}
    assert listed["smollm2:pirate"].parent == "smollm2"


def test_an_adapter_through_the_gateway_equals_the_node(via_gateway, client):
    kw = dict(model="smollm2:pirate", messages=[{"role": "user", "content": "Write one sentence about the sea."}],
              max_tokens=16, temperature=0, seed=0)
    through = via_gateway.chat.completions.create(**kw)
    direct = client.chat.completions.create(**kw)
    assert through.model == "smollm2:pirate"
    assert through.choices[0].message.content == direct.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        via_gateway.chat.completions.create(**{**kw, "model": "smollm2:bad-shape"})
    assert e.value.body["code"] == "adapter_refused"


def test_chat_through_the_gateway_equals_the_node(via_gateway, client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0)
    through = via_gateway.chat.completions.create(**kw)
    direct = client.chat.completions.create(**kw)
    assert through.object == "chat.completion"
    assert through.choices[0].message.content == direct.choices[0].message.content
    assert through.usage.completion_tokens == 8


def test_streaming_through_the_gateway_keeps_every_event(via_gateway, client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=10, temperature=0,
              stream=True, stream_options={"include_usage": True})
    through = list(via_gateway.chat.completions.create(**kw))
    direct = list(client.chat.completions.create(**kw))
    assert len(through) == len(direct)
    text = lambda chunks: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text(through) == text(direct)
    assert through[-1].choices == [] and through[-1].usage.completion_tokens == 10


def test_completions_and_embeddings_through_the_gateway(via_gateway):
    r = via_gateway.completions.create(
        model="gemma", prompt="Question: What is the capital of France?\nAnswer:", max_tokens=6, temperature=0
    )
    assert r.choices[0].text.startswith(" Paris")
    e = via_gateway.embeddings.create(model="tiny-emb", input=["a", "b"])
    assert len(e.data) == 2 and len(e.data[0].embedding) > 0


def test_gateway_errors_are_openai_shaped(via_gateway):
    with pytest.raises(openai.NotFoundError) as nf:
        via_gateway.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert nf.value.body["code"] == "model_not_found"
    assert "nope" in nf.value.body["message"]
    # A node-side validation error passes through unchanged, field and limit named.
    with pytest.raises(openai.BadRequestError) as bad:
        via_gateway.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], temperature=3.5
        )
    assert bad.value.body["param"] == "temperature"
    assert "2" in bad.value.body["message"]
