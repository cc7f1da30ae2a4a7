"""The server's fast encodings say exactly what the plain ones say.

Stream token events are rendered once per stream with the text left open (OneFieldFrame), and
the scheduler's steps pickle as (class, field values); both must round-trip to the same
bytes or values as the slow, obvious way."""

from __future__ import annotations

import json
import pickle

import pytest

from mashbox import protocol as p
from mashbox.server.driver import OneFieldFrame, frame

TEXTS = ["hi", "", ' "quoted" \\ back', "é ☃ 🙂", "\x00open\x00", "\n\t\x1f", "</s>"]


@pytest.mark.parametrize("model", ["m", "\x00open\x00", 'a"b'])
def test_one_field_frame_renders_what_json_renders(model):
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": model}

    def render(text):
        return frame({**base, "choices": [{"index": 0, "delta": {"content": text}}]}, "chunk")

    event = OneFieldFrame(render)
    for text in TEXTS:
        assert event(text) == render(text)
        assert event(text).sse() == render(text).sse()
        data = json.loads(event(text).json)
        assert data["choices"][0]["delta"]["content"] == text


def test_protocol_messages_round_trip_through_pickle():
    params = p.SamplingParams(temperature=0.7, seed=3)
    branch = p.Branch((1, 2), ((3,), (4, 5)), (0,))
    messages = [
        p.Step(
            7,
            admits=(p.Admit(0, params, (1, 2, 3)),),
            prefills=(p.Prefill(0, 0, (1, 2, 3), True),),
            decodes=tuple(p.Decode(i, p.PREVIOUS, 10 + i) for i in range(8)),
            saves=(p.Save(1, 2, 3),),
            restores=(p.Restore(1, 2, 3),),
            shares=(p.Share(0, 3, 40),),
            drops=(4,),
            decides=(p.Decide(2, 5, (branch,)),),
        ),
        p.StepResult({0: 5, 3: 9}, 0.01, {1: (0.5,)}, {2: (((-0.1, -2.0),),)}, 2, 1),
        p.Step(8, decodes=(p.Decode(0, p.PREVIOUS, 4),), repeat=3),
        p.StepResult({0: 5}, 0.01, more=(p.StepResult({0: 6}, 0.01),)),
        p.Shutdown(),
        p.WorkerFailed("boom"),
    ]
    for message in messages:
        assert pickle.loads(pickle.dumps(message)) == message
    decode_only = p.Step(1, decodes=tuple(p.Decode(i, p.PREVIOUS, i) for i in range(8)))
    assert len(pickle.dumps(decode_only)) < 250  # attrs' own per-field state: ~370 bytes
