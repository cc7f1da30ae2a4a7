"""/v1/systemone (typed decisions), /v1/limits and /health/live against a real server, driven
by TypeSafe's official client (`typesafe-sdk`) unchanged, and by raw HTTP for the errors."""

from __future__ import annotations

import gzip
import json
import math
import re

import httpx
import pytest
from backports import zstd
from typesafe_sdk import Choice, Noul, RetryPolicy, Score, TypeSafeClient
from typesafe_sdk._core.errors import TypeSafeUnprocessableEntityError

from mashbox.server import decision_labels
from support.serverproc import serving

ROUTE = "/v1/systemone"
STATE = "I was charged twice for my order. Please refund the duplicate payment today."


@pytest.fixture(scope="module")
def decision_server(tiny_llama, tmp_path_factory):
    """The tiny Llama with room for 255 labelled options in one question."""
    with serving(
        str(tiny_llama), "--ctx", "4096", "--slots", "2", "--threads", "1",
        log=tmp_path_factory.mktemp("systemone") / "server.log",
    ) as proc:  # fmt: skip
        yield proc


@pytest.fixture
def client(decision_server):
    with TypeSafeClient(
        api_key="sk-local", base_url=decision_server.url, retry=RetryPolicy(max_retries=0),
        timeout=120,
    ) as c:  # fmt: skip
        yield c


def post(server, body, **kwargs) -> httpx.Response:
    return httpx.post(server.url + ROUTE, json=body, timeout=120, **kwargs)


def expected_choice_confidence(p: list[float]) -> float:
    k = len(p)
    return (max(p) - 1 / k) / (1 - 1 / k)


def expected_score_confidence(p: list[float]) -> float:
    n = len(p)
    mode = p.index(max(p))
    spread = sum(abs(i - (n - 1) / 2) for i in range(n)) / n
    return max(0.0, 1 - sum(pi * abs(i - mode) for i, pi in enumerate(p)) / spread)


def check_distribution(probabilities: dict, keys) -> list[float]:
    assert list(probabilities) == list(keys)
    values = list(probabilities.values())
    assert all(0 <= v <= 1 and math.isfinite(v) for v in values)
    assert math.fsum(values) == pytest.approx(1.0, abs=1e-9)
    return values


# --- the official client -------------------------------------------------------------------


def test_the_sdk_gets_every_question_type(client):
    response = client.system_one(
        state=STATE,
        questions={
            "refund": Noul(instructions="Does the user ask for a refund?"),
            "spam": Noul(
                instructions="Is this spam?",
                criteria={"true": "Unsolicited advertising", "false": "A real request"},
            ),
            "department": Choice(
                instructions="Which department should handle this?",
                criteria={"billing": "Payments and refunds", "technical": None, "sales": None},
            ),
            "urgency": Score(
                instructions="How urgent is this?",
                criteria=["Routine", "Urgent", {"level": "Emergency", "within": "1 hour"}],
            ),
            "raw": {"type": "choice", "criteria": {"yes": None, "no": None}},
        },
    )
    assert response.model == "jev-latest"
    assert set(response.nouls) == {"refund", "spam"}
    assert 0 <= response.nouls["refund"].noul <= 1
    choice = response.choices["department"]
    p = check_distribution(choice.probabilities, ["billing", "technical", "sales"])
    assert choice.choice == max(choice.probabilities, key=choice.probabilities.get)
    assert choice.confidence == pytest.approx(expected_choice_confidence(p))
    score = response.scores["urgency"]
    p = check_distribution(score.probabilities, [0, 1, 2])
    assert score.score == pytest.approx(sum(i * pi for i, pi in enumerate(p)))
    assert score.legend == {
        0: "Routine",
        1: "Urgent",
        2: '{"level": "Emergency", "within": "1 hour"}',
    }
    assert score.confidence == pytest.approx(expected_score_confidence(p))
    assert response.choices["raw"].choice in ("yes", "no")
    assert response.usage.output_tokens == 6  # N + 1
    assert response.usage.input_tokens > 0
    # The entropy form rides along for clients that want it.
    raw = response.raw_http_response.json()["answers"]
    for name in ("department", "urgency", "raw"):
        probabilities = list(raw[name]["probabilities"].values())
        h = -sum(x * math.log(x) for x in probabilities if x > 0)
        entropy = 1 - h / math.log(len(probabilities))
        assert raw[name]["x_confidence_entropy"] == pytest.approx(entropy)
    assert raw["refund"] == {"type": "noul", "noul": response.nouls["refund"].noul}


def test_the_sdk_lists_the_models(client, decision_server):
    names = [m.name for m in client.models.list().models]
    assert names == [decision_server_model(decision_server), "jev-latest"]
    body = httpx.get(decision_server.url + "/v1/models").json()
    assert body["data"][0]["id"] == names[0]  # the OpenAI shape is still there
    assert all(isinstance(v, str) for m in body["models"] for v in m.values())


def decision_server_model(server) -> str:
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


def test_the_served_model_id_works_and_is_echoed(decision_server):
    model = decision_server_model(decision_server)
    body = {
        "model": model,
        "state": STATE,
        "questions": {"q": {"type": "noul", "instructions": "?"}},
    }
    r = post(decision_server, body)
    assert r.status_code == 200 and r.json()["model"] == model


def test_large_bodies_go_zstd_compressed_and_still_work(decision_server):
    seen = []

    def record(request):
        seen.append(request.headers.get("content-encoding"))

    http = httpx2_client(record)
    with TypeSafeClient(
        api_key="k", base_url=decision_server.url, http_client=http, timeout=120
    ) as c:
        long_state = "Order history: " + "; ".join(f"order {i} shipped" for i in range(150))
        response = c.system_one(
            state=long_state, questions={"q": Noul(instructions="Is there an order?")}
        )
    assert seen == ["zstd"]
    assert 0 <= response.nouls["q"].noul <= 1


def httpx2_client(on_request):
    import httpx2

    return httpx2.Client(event_hooks={"request": [on_request]}, timeout=120)


# --- the limits, at their edges ------------------------------------------------------------


def test_limits_report_what_is_enforced(decision_server):
    limits = httpx.get(decision_server.url + "/v1/limits").json()
    assert limits["max_answers_per_question"] == 255
    assert limits["max_questions"] == 64
    assert limits["max_input_tokens"] == 4096
    assert limits["max_concurrent_requests"] == 2
    assert limits["max_body_bytes"] == 16 * 1024 * 1024
    assert limits["top_n"] > 0


def test_2_and_255_options(client):
    many = {f"option{i}": None for i in range(255)}
    response = client.system_one(
        state=STATE,
        questions={
            "two": Choice(instructions="Pick one.", criteria={"a": None, "b": None}),
            "many": Choice(instructions="Pick one.", criteria=many),
        },
    )
    check_distribution(response.choices["two"].probabilities, ["a", "b"])
    check_distribution(response.choices["many"].probabilities, list(many))


def test_2_and_64_levels(client):
    levels = [f"level {i}" for i in range(64)]
    response = client.system_one(
        state=STATE,
        questions={
            "two": Score(instructions="Rate it.", criteria=["low", "high"]),
            "many": Score(instructions="Rate it.", criteria=levels),
        },
    )
    check_distribution(response.scores["two"].probabilities, [0, 1])
    p = check_distribution(response.scores["many"].probabilities, range(64))
    assert 0 <= response.scores["many"].score <= 63
    assert response.scores["many"].score == pytest.approx(sum(i * x for i, x in enumerate(p)))


def test_64_questions(client):
    questions = {f"q{i}": Noul(instructions=f"Is claim {i} true?") for i in range(64)}
    response = client.system_one(state=STATE, questions=questions)
    assert list(response.answers) == list(questions)
    assert response.usage.output_tokens == 65


@pytest.mark.parametrize(
    ("questions", "loc"),
    [
        ({f"q{i}": {"type": "noul", "instructions": "?"} for i in range(65)}, ["questions"]),
        ({}, ["questions"]),
        ({"q": {"type": "choice", "criteria": {f"o{i}": None for i in range(256)}}},
         ["questions", "q", "criteria"]),
        ({"q": {"type": "choice", "criteria": {"only": None}}}, ["questions", "q", "criteria"]),
        ({"q": {"type": "score", "criteria": [str(i) for i in range(65)]}},
         ["questions", "q", "criteria"]),
        ({"q": {"type": "score", "criteria": ["one"]}}, ["questions", "q", "criteria"]),
        ({"q": {"type": "score", "criteria": {"0": "low", "1": "high"}}},
         ["questions", "q", "criteria"]),
        ({"q": {"type": "box", "instructions": "find it"}}, ["questions", "q", "type"]),
        ({"q": {"type": "noul"}}, ["questions", "q"]),
        ({"q": {"type": "noul", "instructions": 3}}, ["questions", "q", "instructions"]),
        ({"q": {"type": "noul", "criteria": {"maybe": "x"}}},
         ["questions", "q", "criteria", "maybe"]),
        ({"q": {"type": "noul", "instructions": "?", "extra": 1}}, ["questions", "q", "extra"]),
        ({"q": {"type": "choice", "criteria": {"a": 1, "b": None}}},
         ["questions", "q", "criteria", "a"]),
        ({"q": "not a question"}, ["questions", "q"]),
    ],
    ids=[
        "65-questions", "no-questions", "256-options", "1-option", "65-levels", "1-level",
        "score-map-form", "box", "noul-without-instructions-or-criteria", "bad-instructions",
        "noul-unknown-criterion", "unknown-question-field", "numeric-description",
        "question-not-an-object",
    ],
)  # fmt: skip
def test_a_bad_question_is_a_422_naming_it(decision_server, questions, loc):
    r = post(decision_server, {"model": "jev-latest", "state": STATE, "questions": questions})
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["error"]["code"] == "validation"
    assert body["detail"][0]["loc"] == ["body", *loc]
    assert ".".join(loc) in body["error"]["message"]


def test_the_sdk_raises_its_422_error_with_the_message(client):
    with pytest.raises(TypeSafeUnprocessableEntityError, match="questions.q.criteria"):
        client.system_one(state=STATE, questions={"q": {"type": "score", "criteria": {"a": 1}}})


# --- invariance ----------------------------------------------------------------------------

QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Does the user ask for a refund?"},
    "department": {
        "type": "choice",
        "instructions": "Which department?",
        "criteria": {"billing": "Payments", "technical": "Bugs", "sales": None},
    },
    "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "mid", "high"]},
}


def answers(server, questions, state=STATE) -> dict:
    r = post(server, {"model": "jev-latest", "state": state, "questions": questions})
    assert r.status_code == 200, r.text
    return r.json()["answers"]


def test_renaming_reordering_or_adding_questions_changes_no_answer(decision_server):
    base = answers(decision_server, QUESTIONS)
    renamed = answers(decision_server, {f"x-{k}": v for k, v in QUESTIONS.items()})
    assert {k.removeprefix("x-"): v for k, v in renamed.items()} == base
    reordered = answers(decision_server, dict(reversed(QUESTIONS.items())))
    assert reordered == base and list(reordered) == list(reversed(QUESTIONS))
    extra = {
        f"other{i}": {"type": "noul", "instructions": f"Is fact {i} stated?"} for i in range(9)
    }
    more = answers(decision_server, {**extra, **QUESTIONS, "tail": QUESTIONS["department"]})
    assert {k: more[k] for k in QUESTIONS} == base
    assert more["tail"] == base["department"]


# --- states --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "state",
    [
        {"ticket": {"subject": "Duplicate charge", "body": STATE}},
        ["a", 1, None],
        [{"role": "user", "content": STATE}, {"role": "assistant", "content": "Let me check."}],
        [{"role": "system", "content": "Support chat."},
         {"role": "user", "content": [{"type": "text", "text": STATE}]}],
        "",
        42,
    ],
    ids=["object", "array", "transcript", "transcript-with-parts", "empty", "number"],
)  # fmt: skip
def test_any_json_state_or_a_transcript(decision_server, state):
    got = answers(decision_server, {"q": QUESTIONS["department"]}, state=state)
    check_distribution(got["q"]["probabilities"], ["billing", "technical", "sales"])


def test_an_image_in_a_transcript_is_unsupported_content(decision_server):
    state = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    r = post(decision_server, {"model": "jev-latest", "state": state, "questions": QUESTIONS})
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "unsupported_content"
    assert r.json()["detail"][0]["loc"] == ["body", "state", 0, "content", 0]


# --- errors --------------------------------------------------------------------------------


def test_another_model_is_unknown_model(decision_server):
    r = post(decision_server, {"model": "gpt-4o", "state": STATE, "questions": QUESTIONS})
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "unknown_model"
    assert "gpt-4o" in r.json()["error"]["message"]
    assert r.json()["detail"][0]["loc"] == ["body", "model"]


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({"state": STATE, "questions": QUESTIONS}, ["body", "model"]),
        ({"model": "jev-latest", "questions": QUESTIONS}, ["body", "state"]),
        ({"model": "jev-latest", "state": None, "questions": QUESTIONS}, ["body", "state"]),
        ({"model": "jev-latest", "state": STATE}, ["body", "questions"]),
        ([1, 2], ["body"]),
    ],
    ids=["no-model", "no-state", "null-state", "no-questions", "not-an-object"],
)
def test_missing_fields_are_422(decision_server, body, loc):
    r = post(decision_server, body)
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == loc


def test_unknown_top_level_fields_are_ignored(decision_server):
    body = {"model": "jev-latest", "state": STATE, "questions": QUESTIONS, "x_trace": {"a": 1}}
    assert post(decision_server, body).status_code == 200


def test_a_state_past_the_context_is_too_many_tokens(decision_server):
    body = {"model": "jev-latest", "state": "word " * 5000, "questions": QUESTIONS}
    r = post(decision_server, body)
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "too_many_tokens"


def test_body_errors_in_the_seed_shape(decision_server):
    url = decision_server.url + ROUTE
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "validation"
    assert r.json()["detail"]
    r = httpx.post(url, content=b"{}", headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_content"
    r = httpx.post(url, content=b"x" * (16 * 1024 * 1024 + 1),
                   headers={"content-type": "application/json"}, timeout=60)  # fmt: skip
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    r = httpx.get(url)
    assert r.status_code == 405 and set(r.json()) == {"error", "detail"}


def test_compressed_bodies(decision_server):
    url = decision_server.url + ROUTE
    body = json.dumps({"model": "jev-latest", "state": STATE, "questions": QUESTIONS}).encode()
    for encoding, data in (("gzip", gzip.compress(body)), ("zstd", zstd.compress(body))):
        headers = {"content-type": "application/json", "content-encoding": encoding}
        r = httpx.post(url, content=data, headers=headers, timeout=60)
        assert r.status_code == 200, (encoding, r.text)
    # A bomb: a few KB that would expand past the 16 MiB cap.
    bomb = zstd.compress(b" " * (17 * 1024 * 1024))
    assert len(bomb) < 10_000
    headers = {"content-type": "application/json", "content-encoding": "zstd"}
    r = httpx.post(url, content=bomb, headers=headers)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    r = httpx.post(url, content=b"garbage", headers=headers)
    assert r.status_code == 422 and "zstd" in r.json()["error"]["message"]
    headers["content-encoding"] = "br"
    r = httpx.post(url, content=body, headers=headers)
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_content"


def test_health_live(decision_server):
    r = httpx.get(decision_server.url + "/health/live")
    assert r.status_code == 200


# --- the shared prefix ---------------------------------------------------------------------


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(float(m) for m in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M))


def test_a_repeated_state_is_read_from_the_prefix_cache(decision_server):
    state = "A unique state for the cache test. " * 20
    answers(decision_server, {"q": QUESTIONS["refund"]}, state=state)
    hits = metric(decision_server, "mashbox:prefix_cache_hits_total")
    queries = metric(decision_server, "mashbox:prefix_cache_queries_total")
    again = answers(decision_server, {"other": QUESTIONS["urgency"]}, state=state)
    assert again["other"]["type"] == "score"
    new_hits = metric(decision_server, "mashbox:prefix_cache_hits_total") - hits
    new_queries = metric(decision_server, "mashbox:prefix_cache_queries_total") - queries
    assert new_hits == new_queries > 0  # a decision reads after the prefix: all of it cached


# --- the pure parts ------------------------------------------------------------------------


def test_confidence_formulas():
    assert decision_labels.choice_confidence([0.5, 0.5]) == 0
    assert decision_labels.choice_confidence([1.0, 0.0, 0.0]) == 1
    assert decision_labels.score_confidence([1.0, 0.0, 0.0]) == 1
    assert decision_labels.score_confidence([0.5, 0.0, 0.5]) == 0  # mass far from the mode
    assert decision_labels.entropy_confidence([0.25] * 4) == pytest.approx(0)
    assert decision_labels.entropy_confidence([1.0, 0.0]) == 1


def test_images_are_refused_not_dropped(decision_server):
    """Seed 001's `images` need a vision projector this model lacks: a 422 naming the field,
    not a decision made without them."""
    body = {"model": "jev-latest", "state": STATE, "images": ["data:image/png;base64,AA=="],
            "questions": {"q": {"type": "noul", "instructions": "?"}}}  # fmt: skip
    r = post(decision_server, body)
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "validation"
    assert r.json()["detail"][0]["loc"] == ["body", "images"]
