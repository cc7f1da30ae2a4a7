"""What a request asks its answer to be (a JSON schema, any JSON object, a strict or forced
tool call) as one llguidance grammar, checked before the request queues.

The grammar follows the prompt it answers: with thinking on, the reasoning is free text up
to `</think>` and the grammar starts after it; a forced tool call continues the markup the
server put after the generation prompt (chat.render); with tools offered, free text may
still become a call, whose arguments then follow the tool's parameters. A schema the
grammar engine cannot follow is a 400 naming the field and what it refuses.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping

import attrs
import trio

from ..events import Request
from ..text.constraint import Grammars
from .chat import ChatPrompt, ToolChoice
from .errors import bad_request
from .state import ServerState

# How the engine writes JSON: as json.dumps does by default, the spacing models learned
# (llguidance's default allows any whitespace, which small models fill up to max_tokens).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_GRAMMAR_CHARS = 200_000  # all of a request's schemas together, as JSON text
ANY_OBJECT = {"type": "object"}

_WS = r"/[ \n]*/"
AUTO = ToolChoice()
PLAIN = ChatPrompt("", reasoning=False, in_reasoning=False, tools_offered=False, forced_prefix=None)


@attrs.frozen
class AnswerSchema:
    """The answer must be JSON following `schema`. strict: a keyword the grammar engine
    cannot enforce is a 400 (else it is ignored, and the rest enforced)."""

    schema: dict
    strict: bool
    field: str  # the request field it came from, for errors


def _json_rule(schema: dict, strict: bool) -> str:
    options = {**JSON_STYLE, "lenient": not strict}
    return "%json " + json.dumps({**schema, "x-guidance": options}, ensure_ascii=False)


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a Lark string: JSON's escapes


def _tool_rules(
    tools: list[dict], follow: Collection[str], lark_inputs: Mapping[str, str], defuse
) -> list[str]:
    """`body`: a call's JSON as chat.TOOL_PROMPT asks for it, one alternative per tool, and
    `args_i`: tool i's arguments, following its parameters where its name is in `follow`
    (else any object); a custom tool's `input` string following its Lark grammar where
    `lark_inputs` has it (rewritten over JSON-escaped text: text/lark_in_json.py)."""
    rules, alternatives = [], []
    for i, tool in enumerate(tools):
        function = tool.get("function") or {}
        name = function.get("name", "")
        head = '{"name": ' + json.dumps(defuse(name)) + ', "arguments": '
        rules.append(f"body_{i}: {_literal(head)} args_{i} " + _literal("}"))
        if name in follow and name in lark_inputs:
            opening, closing = _literal('{"input": "'), _literal('"}')
            rules.append(f"args_{i}: {opening} input_{i} {closing}")
            rules.append(f"input_{i}: %lark {{\n{lark_inputs[name]}}}")
        else:
            schema = _parameters(function) if name in follow else ANY_OBJECT
            rules.append(f"args_{i}: " + _json_rule(schema, strict=False))
        alternatives.append(f"body_{i}")
    return [f"body: {' | '.join(alternatives)}", *rules]


def _parameters(function: dict) -> dict:
    parameters = function.get("parameters")
    return parameters if isinstance(parameters, dict) and parameters else ANY_OBJECT


def _calls(first: str, parallel: bool) -> str:
    """One call starting at `first` (a rule's text), and more after it where `parallel`."""
    close = f'{_WS} "</tool_call>"'
    more = f' ({_WS} "<tool_call>" {_WS} body {close})*' if parallel else ""
    return f"{first} {close}{more}"


def _forced_call(tools: list[dict], choice: ToolChoice, parallel: bool) -> str:
    """The rest of a call chat.render started in the prompt: after '{"name": "f",
    "arguments":' for a named tool, after '<tool_call>\n' for any."""
    if choice.name is None:
        return _calls("body", parallel)
    names = [(t.get("function") or {}).get("name") for t in tools]
    return f'" "? args_{names.index(choice.name)} ' + _literal("}") + f' {_WS} "</tool_call>"'


def _free_answer(answer: AnswerSchema | None, tools: list[dict] | None, parallel: bool):
    """The answer where no call is forced: JSON following `answer`'s schema, or any text
    without a call's opening tag; with tools, or calls (after that text)."""
    if answer:
        rules = ["answer: " + _json_rule(answer.schema, answer.strict)]
        opening = f'{_WS} "<tool_call>"'
    else:
        rules = ["answer: PLAIN", r"PLAIN: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/"]
        opening = "before"
        if tools:
            rules.append(r"before[lazy]: /(?s:.*)<tool_call>/")
    if not tools:
        return "answer", rules
    return f"answer | {_calls(f'{opening} {_WS} body', parallel)}", rules


def grammar_for(
    prompt: ChatPrompt | None,
    *,
    answer: AnswerSchema | None = None,
    tools: list[dict] | None = None,
    choice: ToolChoice = AUTO,
    parallel: bool = True,
    strict: Collection[str] | None = None,
    lark_inputs: Mapping[str, str] | None = None,
    defuse=lambda s: s,
) -> str:
    """The request's grammar, or "" when nothing constrains the answer. strict: the names of
    the tools whose calls must follow their parameters (default: those marked strict); a
    forced call always does. prompt None: plain completions (no chat markup, no thinking)."""
    prompt = prompt or PLAIN
    tools = tools if prompt.tools_offered else None
    functions = [t.get("function") or {} for t in tools or ()]
    if strict is None:
        strict = [f.get("name") for f in functions if f.get("strict") is True]
    forced = prompt.forced_prefix is not None
    follow = {f.get("name") for f in functions if forced or f.get("name") in strict}
    if not (answer or follow):
        return ""
    rules = _tool_rules(tools, follow, lark_inputs or {}, defuse) if tools else []
    if forced:
        inner = _forced_call(tools, choice, parallel)
    else:
        inner, free_rules = _free_answer(answer, tools, parallel)
        rules += free_rules
    if prompt.reasoning and not forced:  # free reasoning first (chat.render: never if forced)
        rules.append(r"think[lazy]: /(?s:.*)<\/think>/")
        start = f"think {_WS} inner" if prompt.in_reasoning else f'("<think>" think {_WS})? inner'
        rules = [f"start: {start}", f"inner: {inner}", *rules]
    else:
        rules = [f"start: {inner}", *rules]
    return "\n".join(rules) + "\n"


async def check(state: ServerState, grammar: str, field: str) -> None:
    """A 400 naming `field` unless the engine can follow `grammar` (compiled off the event
    loop, once per text: a repeated schema is a lookup)."""
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise bad_request(
            f"{field}: the schemas are {len(grammar)} characters as JSON; at most "
            f"{MAX_GRAMMAR_CHARS}",
            field,
        )
    if state.grammars is None:
        state.grammars = await trio.to_thread.run_sync(Grammars, state.tokenizer)
    error = await trio.to_thread.run_sync(state.grammars.error, grammar, limiter=COMPILING)
    if error:
        raise bad_request(
            f"{field}: the grammar engine cannot follow it: {_first_line(error)}", field
        )


def _first_line(error: str) -> str:
    """llguidance's reason without the grammar text it quotes: "at 2(9): failed to compile
    JSON schema: Unimplemented keys: ["not"]" -> 'failed to ... ["not"]'."""
    line = error.strip().splitlines()[0] if error.strip() else error
    return re.sub(r"^at \d+\(\d+\): ", "", line)


# Grammars being compiled at once: one tenant's flood of new schemas waits here, not on the
# event loop (each compile is bounded by constraint.LIMITS).
COMPILING = trio.CapacityLimiter(2)


def constrained(request: Request, grammar: str) -> Request:
    """The request with its answer held to `grammar`."""
    if not grammar:
        return request
    return attrs.evolve(request, params=attrs.evolve(request.params, grammar=grammar))


def answer_schema(fmt, field: str, *, strict_default: bool = False) -> AnswerSchema | None:
    """OpenAI's `response_format` and `text.format`, Anthropic's `output_config.format`:
    text (None), json_object (any object) or json_schema, whose schema sits under
    `json_schema` in chat and beside `type` elsewhere."""
    if fmt is None:
        return None
    kind = fmt.raw("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return AnswerSchema(ANY_OBJECT, True, field)
    if kind != "json_schema":
        raise bad_request(f"{field}.type must be text, json_object or json_schema", field)
    spec = fmt.object("json_schema") or fmt
    schema = spec.raw("schema")
    if not isinstance(schema, dict):
        raise bad_request(f"{field}: json_schema needs a schema (a JSON object)", field)
    strict = spec.raw("strict", strict_default)
    if not isinstance(strict, bool):
        raise bad_request(f"{field}: strict must be a boolean", field)
    return AnswerSchema(schema, strict, field)


async def constrain(
    state: ServerState, request: Request, prompt: ChatPrompt | None, **asked
) -> Request:
    """`request` with the grammar its answer must follow, checked (a 400 if it cannot be);
    `asked`: what grammar_for takes (answer, tools, choice, parallel, strict, lark_inputs)."""
    grammar = grammar_for(prompt, defuse=state.tokenizer.defuse, **asked)
    answer = asked.get("answer")
    if not grammar:
        return request
    await check(state, grammar, answer.field if answer else "tools")
    return constrained(request, grammar)
