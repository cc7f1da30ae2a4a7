"""The shipped default model, fetched and served for real, through the official SDK."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(default_server):
    return openai.OpenAI(base_url=default_server.url + "/v1", api_key="any", max_retries=0)


def test_paris_whole(client):
    r = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=QUESTION, max_tokens=30, temperature=0
    )
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


def test_paris_streamed(client):
    stream = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=QUESTION, max_tokens=30, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert "Paris" in text


def test_text_completion(client):
    r = client.completions.create(
        model="smollm2-135m-instruct", prompt="The capital of France is", max_tokens=5
    )
    assert "Paris" in r.choices[0].text


def test_embeddings_place_a_paraphrase_nearer_than_an_unrelated_sentence(default_server):
    texts = [
        "The cat is sleeping on the sofa.",
        "A cat naps on the couch.",
        "Interest rates rose sharply in the third quarter.",
    ]
    r = httpx.post(default_server.url + "/v1/embeddings", json={"input": texts}, timeout=120)
    a, b, c = (d["embedding"] for d in r.json()["data"])

    def cos(x, y):
        return sum(p * q for p, q in zip(x, y, strict=True))  # unit vectors

    assert cos(a, b) > cos(a, c)


def test_typed_decisions_on_the_real_model(default_server):
    """The TypeSafe client against the real model; a question's answer is the same bits
    whatever other questions share its request (dimensions where small-batch matmuls round
    differently, unlike the tiny test models)."""
    from typesafe_sdk import Choice, Noul, RetryPolicy, Score, TypeSafeClient

    state = "Order 1182: the customer was charged twice and asks for a refund of the duplicate."
    questions = {
        "refund": Noul(instructions="Does the customer ask for a refund?"),
        "team": Choice(
            instructions="Which team handles this?",
            criteria={"billing": "Payments and refunds", "shipping": "Deliveries", "tech": None},
        ),
        "urgency": Score(instructions="How urgent is it?", criteria=["low", "medium", "high"]),
    }
    with TypeSafeClient(
        api_key="k", base_url=default_server.url, retry=RetryPolicy(max_retries=0), timeout=300
    ) as client:
        first = client.system_one(state=state, questions=questions)
        others = {f"extra{i}": Noul(instructions=f"Is point {i} about shipping?") for i in range(7)}
        mixed = client.system_one(
            state=state, questions={**others, "u": questions["urgency"], "r": questions["refund"]}
        )
    assert first.usage.output_tokens == 4
    assert sum(first.choices["team"].probabilities.values()) == pytest.approx(1.0)
    assert mixed.scores["u"] == first.scores["urgency"]
    assert mixed.nouls["r"] == first.nouls["refund"]


def test_tokenize_answers_pieces_for_at_most_131072_tokens(default_server):
    """A 2,048-token context and SmolLM2's longest token (81 characters) let a text of
    150,000 tokens through /tokenize; its ids come back, its pieces (made on the event loop,
    ~1 us each) are a 400 naming with_pieces."""
    text = "\U0001f600" * 50000  # three tokens each
    url = default_server.url + "/tokenize"
    r = httpx.post(url, json={"content": text}, timeout=120)
    assert r.status_code == 200 and r.json()["count"] == 150000
    r = httpx.post(url, json={"content": text, "with_pieces": True}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "with_pieces"
    assert "150000 tokens" in r.json()["error"]["message"]
    r = httpx.post(url, json={"content": text[:40000], "with_pieces": True}, timeout=120)
    assert r.status_code == 200 and len(r.json()["tokens"]) == 120000
