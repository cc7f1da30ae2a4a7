"""Typed decisions (/v1/systemone): questions validated, and rendered as one shared prompt
and a suffix per question (decision_labels.py reads the answers).

The state is rendered once through the chat template and ends at a special token; each
question is a suffix after it (its own user turn and the generation prompt) whose answer is
read from the next-token probabilities of its option labels. A suffix depends on nothing but
its question, so renaming, reordering or adding questions cannot change an answer.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import attrs

from ..text.chat_template import ChatTemplate, ChatTemplateError
from ..text.tokenizer import Tokenizer
from .content import ContentError, text_of
from .errors import invalid

if TYPE_CHECKING:
    from .decision_labels import Label

MAX_QUESTIONS = 64
MAX_OPTIONS = 255  # choice
MAX_LEVELS = 64  # score
TYPESAFE_MODEL = "jev-latest"  # the model name TypeSafe's clients send

SYSTEM = (
    "You answer questions about the input the user gives you. Reply with the label of exactly "
    "one answer and nothing else."
)
SENTINEL = "\u27e6mashbox-question\u27e7"  # marks where each question goes in the render
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


@attrs.frozen
class Question:
    """A validated question: what the model is asked and the answers it may give."""

    kind: str  # noul, choice or score
    text: str  # the instructions, or a default that never names the question's id
    keys: tuple[str, ...]  # answer keys in order: option names, "0".."n-1", or true/false
    descriptions: tuple[str, ...]  # what the model reads for each key


# --- validation --------------------------------------------------------------------------


def _as_text(value) -> str:
    """Instructions and descriptions: strings as they are, objects and arrays as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _content(value, loc: tuple, *, null: bool = False):
    """A string, object or array (or null where allowed); anything else is a 422."""
    if value is None and null:
        return None
    if not isinstance(value, str | dict | list):
        allowed = "a string, an object or an array" + (" (or null)" if null else "")
        raise invalid(loc, f"must be {allowed}", "type_error")
    return value


def parse_questions(value) -> dict[str, Question]:
    if not isinstance(value, dict):
        raise invalid(("questions",), "must be an object of questions keyed by id", "dict_type")
    if not 1 <= len(value) <= MAX_QUESTIONS:
        raise invalid(("questions",), f"must hold 1 to {MAX_QUESTIONS} questions", "too_long")
    questions = {}
    for qid, raw in value.items():
        if not qid:
            raise invalid(("questions",), "question ids must be non-empty strings")
        questions[qid] = parse_question(raw, ("questions", qid))
    return questions


_FIELDS = frozenset({"type", "instructions", "criteria"})


def parse_question(raw, loc: tuple) -> Question:
    if not isinstance(raw, dict):
        raise invalid(loc, "must be an object", "dict_type")
    kind = raw.get("type")
    if kind not in ("noul", "choice", "score"):
        hint = " (box questions need images, which this server does not read)"
        raise invalid((*loc, "type"), "must be noul, choice or score" + hint * (kind == "box"))
    unknown = sorted(set(raw) - _FIELDS)
    if unknown:
        raise invalid((*loc, unknown[0]), "is not a field of a question", "extra_forbidden")
    instructions = _content(raw.get("instructions"), (*loc, "instructions"), null=True)
    text = None if instructions is None else _as_text(instructions)
    criteria = raw.get("criteria")
    where = (*loc, "criteria")
    if kind == "noul":
        return _noul(text, criteria, where)
    if kind == "choice":
        return _choice(text, criteria, where)
    return _score(text, criteria, where)


def _noul(text, criteria, loc) -> Question:
    if criteria is not None and not isinstance(criteria, dict):
        raise invalid(loc, "must be an object with true and/or false", "dict_type")
    criteria = criteria or {}
    for key in criteria:
        if key not in ("true", "false"):
            raise invalid((*loc, key), "noul criteria take only true and false", "extra_forbidden")
    meaning = [_content(criteria.get(k), (*loc, k), null=True) for k in ("true", "false")]
    if text is None and meaning == [None, None]:
        raise invalid(loc[:-1], "a noul question needs instructions or criteria", "missing")
    return Question(
        "noul",
        text or "Decide whether the input fits the description of Yes.",
        ("true", "false"),
        tuple("" if m is None else _as_text(m) for m in meaning),
    )


def _choice(text, criteria, loc) -> Question:
    if isinstance(criteria, list):
        raise invalid(loc, "must be an object of option names to descriptions", "dict_type")
    if not isinstance(criteria, dict):
        raise invalid(loc, "is required: an object of option names to descriptions", "missing")
    if not 2 <= len(criteria) <= MAX_OPTIONS:
        raise invalid(loc, f"must hold 2 to {MAX_OPTIONS} options", "too_long")
    if "" in criteria:
        raise invalid(loc, "option names must be non-empty strings")
    descriptions = tuple(
        name if d is None else _as_text(d)
        for name, d in ((n, _content(v, (*loc, n), null=True)) for n, v in criteria.items())
    )
    return Question("choice", text or "Which option fits best?", tuple(criteria), descriptions)


def _score(text, criteria, loc) -> Question:
    if isinstance(criteria, dict):
        raise invalid(loc, "must be an ordered list of levels (the map form is not supported)",
                      "list_type")  # fmt: skip
    if not isinstance(criteria, list):
        raise invalid(loc, "is required: an ordered list of levels, lowest first", "missing")
    if not 2 <= len(criteria) <= MAX_LEVELS:
        raise invalid(loc, f"must hold 2 to {MAX_LEVELS} levels", "too_long")
    levels = tuple(_as_text(_content(c, (*loc, i))) for i, c in enumerate(criteria))
    keys = tuple(str(i) for i in range(len(levels)))
    return Question("score", text or "Which level fits best?", keys, levels)


# --- the prompt --------------------------------------------------------------------------


def state_messages(state) -> list[dict]:
    """The state as chat messages: a transcript as it is, anything else as one user turn."""
    if isinstance(state, list) and state and all(_is_message(m) for m in state):
        messages = []
        for i, m in enumerate(state):
            messages.append({"role": m["role"], "content": _message_text(m, ("state", i))})
        return messages
    if state is None:
        raise invalid(("state",), "is required", "missing")
    text = state if isinstance(state, str) else json.dumps(state, ensure_ascii=False, indent=2)
    return [{"role": "user", "content": text}]


def _is_message(m) -> bool:
    return isinstance(m, dict) and m.get("role") in _ROLES and "content" in m


def _message_text(m: dict, loc: tuple) -> str:
    try:
        return text_of(m["content"])
    except ContentError as exc:
        if exc.index is None:
            raise invalid((*loc, "content"), "must be a string or a list of text parts",
                          "type_error") from None  # fmt: skip
        at = (*loc, "content", exc.index)
        if exc.media:
            raise invalid(at, "this model reads text only", code="unsupported_content") from None
        raise invalid(at, "must be a text part", "type_error") from None


def render_split(template: ChatTemplate, messages: list[dict]) -> tuple[str, str]:
    """Render the state with a question slot; return (text before it, text after it).

    The question is its own user turn after the state; a template that insists on
    alternating turns gets it at the end of the last user turn, and one without a system
    role gets the instruction inside the first user turn.
    """
    system = SYSTEM
    if messages and messages[0]["role"] in ("system", "developer"):
        system += "\n\n" + messages[0]["content"]
        messages = messages[1:]
    ask = {"role": "user", "content": SENTINEL}
    turns = [[*messages, ask]]
    if messages and messages[-1]["role"] == "user":
        last = {**messages[-1], "content": messages[-1]["content"] + "\n\n" + SENTINEL}
        turns.append([*messages[:-1], last])
    layouts = [[{"role": "system", "content": system}, *t] for t in turns]
    for t in turns:  # no system role: the instruction opens the first user turn
        if t[0]["role"] == "user":
            layouts.append([{**t[0], "content": system + "\n\n" + t[0]["content"]}, *t[1:]])
    error = None
    for layout in layouts:
        try:
            text = template.render(layout, add_generation_prompt=True, enable_thinking=False)
        except ChatTemplateError as exc:
            error = exc
            continue
        if text.count(SENTINEL) == 1:
            before, after = text.split(SENTINEL)
            return before, after
    raise invalid(("state",), f"the model's chat template cannot render it: {error}")


def tokenize_split(
    tokenizer: Tokenizer, before: str, suffixes: list[str]
) -> tuple[list[int], list[list[int]]]:
    """Token ids of the shared prefix and of each suffix, exactly as the whole text of each
    question would tokenize.

    The prefix is cut at its last special token, where tokenization restarts, so each
    suffix is tokenized alone (with the text after that token); one question is checked
    against its whole text, and any mismatch falls back to tokenizing every question whole.
    """
    ids = tokenizer.encode(before, add_bos=tokenizer.add_bos)
    cut = max((i for i, t in enumerate(ids) if tokenizer.is_special(t)), default=-1)
    at = before.rfind(tokenizer.token_text(ids[cut])) if cut >= 0 else -1
    if at >= 0:
        rest = before[at + len(tokenizer.token_text(ids[cut])) :]
        prefix = ids[: cut + 1]
        tails = [tokenizer.encode(rest + s) for s in suffixes]
        whole = tokenizer.encode(before + suffixes[0], add_bos=tokenizer.add_bos)
        if whole == prefix + tails[0]:
            return prefix, tails
    wholes = [tokenizer.encode(before + s, add_bos=tokenizer.add_bos) for s in suffixes]
    n = len(ids)
    for w in wholes:  # the longest prefix all share, leaving each suffix a token
        same = next((i for i, (a, b) in enumerate(zip(ids, w, strict=False)) if a != b), n)
        n = min(n, len(w) - 1, same)
    return ids[:n], [w[n:] for w in wholes]


def question_text(q: Question, labels: list[Label]) -> str:
    """What the model reads for one question (its suffix, before the generation prompt)."""
    names = [label.text for label in labels]
    if q.kind == "noul" and names == ["Yes", "No"]:
        lines = [q.text, ""]
        for name, meaning in zip(names, q.descriptions, strict=True):
            if meaning:
                lines.append(f"{name} means: {meaning}")
        return "\n".join([*lines, "Answer Yes or No."])
    if q.kind == "noul":  # the vocabulary has no single Yes and No: labelled options
        descriptions = [d or name for d, name in zip(q.descriptions, ("Yes", "No"), strict=True)]
        heading = "Options:"
    elif q.kind == "score":
        descriptions, heading = list(q.descriptions), "Levels, from lowest to highest:"
    else:
        descriptions, heading = list(q.descriptions), "Options:"
    lines = [q.text, "", heading]
    lines += [f"{name}. {d}" for name, d in zip(names, descriptions, strict=True)]
    what = "number" if names[0] == "0" else "label"
    return "\n".join([*lines, "", f"Answer with the {what} of one option only."])
