"""A Lark grammar rewritten to match its language as it reads inside a JSON string.

A custom tool's input (Codex's `apply_patch`) travels in the call's JSON as a string: the
model writes `\\n` where the patch has a newline and `\\"` for a quote. To hold that input to
the tool's Lark grammar, string literals become their JSON-escaped selves and each regex in a
rule becomes rules over two kinds of lexeme: runs of characters JSON writes as they are, and
single escapes. (A regex rewritten as one lexeme would not do: llguidance's lexer is greedy
and never backtracks, so after `x\\` a filename that may go on with `\\"` and a newline `\\n`
could not be told apart.) What cannot be carried over faithfully (regexes in terminal
definitions, anchors, back-references, look-around, case folding) raises `Unsupported`:
such a grammar is described to the model, not enforced.
"""

from __future__ import annotations

import ast
import json
import re
import re._constants as sre
import re._parser as sre_parse

# `%import common.X` that are plain strings (regex ones are not supported).
COMMON = {"LF": "\n", "CR": "\r"}

_STATEMENT = re.compile(r"^(?P<indent>[ \t|]*)(?P<head>[?!]?[A-Za-z_][A-Za-z0-9_]*(\.\d+)?\s*:)?")
_TOKEN = re.compile(
    r'(?P<string>"(?:\\.|[^"\\])*"i?)'
    r"|(?P<regex>/(?:\\.|[^/\\\n])+/[imslux]*)"
    r"|(?P<comment>(?://|#)[^\n]*)"
    r"|(?P<other>[^\"/#]+|.)",
    re.S,
)
_SPECIAL = [chr(c) for c in range(0x20)] + ['"', "\\"]  # what JSON writes escaped


class Unsupported(ValueError):
    """A grammar this rewrite cannot carry into a JSON string faithfully."""


def json_string_lark(grammar: str) -> str:
    """`grammar` over the text a JSON string holds for its language (without the quotes)."""
    rewrite = _Rewrite()
    lines, terminal = [], False
    for line in grammar.splitlines():
        stripped = line.strip()
        imported = re.fullmatch(r"%import\s+common\.([A-Z_]+)(?:\s*->\s*([A-Z_]+))?", stripped)
        if imported:
            if imported[1] not in COMMON:
                raise Unsupported(f"%import common.{imported[1]}")
            lines.append(f"{imported[2] or imported[1]}: {_string(COMMON[imported[1]])}")
            continue
        if stripped.startswith("%") and not stripped.startswith("%ignore"):
            raise Unsupported(stripped.split()[0])
        head = _STATEMENT.match(line)["head"]
        if head:
            terminal = head.lstrip("?!")[0].isupper()
        lines.append(rewrite.line(line, terminal))
    return "\n".join([*lines, *rewrite.terminals]) + "\n"


def _string(text: str) -> str:
    """A Lark string literal for the JSON-escaped form of text."""
    return json.dumps(_escaped(text), ensure_ascii=False)


def _escaped(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _rx_char(c: str) -> str:
    """One character in a regex class: ASCII punctuation and controls as hex escapes."""
    return c if c.isalnum() or not c.isascii() else f"\\x{{{ord(c):x}}}"


class _Rewrite:
    """Rewrites a grammar's lines, collecting the terminals its regexes become."""

    def __init__(self):
        self.terminals: list[str] = []

    def line(self, line: str, terminal: bool) -> str:
        out = []
        for m in _TOKEN.finditer(line):
            if m["string"]:
                if m["string"].endswith("i"):
                    raise Unsupported("case-insensitive strings")
                out.append(_string(ast.literal_eval(m["string"])))
            elif m["regex"]:
                if terminal:
                    raise Unsupported("a regex in a terminal definition")
                body, flags = m["regex"][1:].rsplit("/", 1)
                out.append("(" + self.regex(body.replace("\\/", "/"), flags) + ")")
            elif m["other"]:
                out.append(m["other"])
        return "".join(out)

    def regex(self, pattern: str, flags: str) -> str:
        """Rule text for the JSON-escaped forms of what `pattern` matches."""
        if set(flags) - {"s"}:
            raise Unsupported(f"regex flags {flags!r}")
        try:
            tree = sre_parse.parse(pattern, re.S if "s" in flags else 0)
        except re.error as exc:
            raise Unsupported(f"regex {pattern!r}: {exc}") from None
        return self._seq(list(tree), "s" in flags)

    def _seq(self, nodes, dotall: bool) -> str:
        parts, text = [], ""
        for op, av in nodes:
            if op is sre.LITERAL:
                text += chr(av)
                continue
            if text:
                parts.append(_string(text))
                text = ""
            parts.append(self._node(op, av, dotall))
        if text:
            parts.append(_string(text))
        return " ".join(parts) or '""'

    def _node(self, op, av, dotall: bool) -> str:
        if op in (sre.NOT_LITERAL, sre.ANY, sre.IN):
            return self._chars(_member(op, av, dotall), run=False)
        if op is sre.BRANCH:
            return "(" + " | ".join(self._seq(list(alt), dotall) for alt in av[1]) + ")"
        if op is sre.SUBPATTERN:
            _, add, remove, sub = av
            if add & ~re.S or remove:
                raise Unsupported("inline regex flags")
            return "(" + self._seq(list(sub), dotall or bool(add & re.S)) + ")"
        if op in (sre.MAX_REPEAT, sre.MIN_REPEAT):
            return self._repeat(*av, dotall)
        raise Unsupported(f"regex construct {op}")

    def _repeat(self, low: int, high, sub, dotall: bool) -> str:
        sub = list(sub)
        single = len(sub) == 1 and sub[0][0] in (sre.NOT_LITERAL, sre.ANY, sre.IN)
        if single and high is sre.MAXREPEAT and low <= 1:
            # Any string over a set: runs of its plain characters and its escapes.
            body = self._chars(_member(*sub[0], dotall), run=True)
            return f"({body}){'*' if low == 0 else '+'}"
        body = self._seq(sub, dotall)
        bound = "" if high is sre.MAXREPEAT else str(high)
        return f"({body}){{{low},{bound}}}"

    def _chars(self, member, run: bool) -> str:
        """One character of a set (a run of them where `run`): its plain characters as one
        new terminal, each special one it holds as its escape."""
        alternatives = []
        plain = [c for c in map(chr, range(0x20, 0x80)) if c not in '"\\' and member(c)]
        if plain or member("\u00e9"):  # non-ASCII: by what the set says of a sample
            name = f"JSONSTR_{len(self.terminals)}"
            cls = "".join(_rx_char(c) for c in plain)
            if member("\u00e9"):
                cls += "\\x{80}-\\x{10ffff}"
            self.terminals.append(f"{name}: /[{cls}]{'+' if run else ''}/")
            alternatives.append(name)
        alternatives += [_string(c) for c in _SPECIAL if member(c)]
        if not alternatives:
            raise Unsupported("an empty character set")
        return "(" + " | ".join(alternatives) + ")"


def _codes(item, value) -> tuple[int, ...]:
    return (value,) if item is sre.LITERAL else value


_CATEGORIES = {
    sre.CATEGORY_DIGIT: lambda c: c.isdigit(),
    sre.CATEGORY_NOT_DIGIT: lambda c: not c.isdigit(),
    sre.CATEGORY_SPACE: lambda c: c in " \t\n\r\f\v",
    sre.CATEGORY_NOT_SPACE: lambda c: c not in " \t\n\r\f\v",
    sre.CATEGORY_WORD: lambda c: c.isalnum() or c == "_",
    sre.CATEGORY_NOT_WORD: lambda c: not (c.isalnum() or c == "_"),
}


def _member(op, av, dotall: bool):
    """Whether a character is in the set a regex node matches."""
    if op is sre.ANY:
        return lambda c: dotall or c != "\n"
    if op is sre.NOT_LITERAL:
        return lambda c: c != chr(av)
    negate, tests = False, []
    for item, value in av:
        if item is sre.NEGATE:
            negate = True
        elif item in (sre.LITERAL, sre.RANGE) and max(_codes(item, value)) > 0x7F:
            raise Unsupported("non-ASCII characters in a regex class")
        elif item is sre.LITERAL:
            tests.append(lambda c, v=value: c == chr(v))
        elif item is sre.RANGE:
            tests.append(lambda c, v=value: v[0] <= ord(c) <= v[1])
        elif item is sre.CATEGORY and value in _CATEGORIES:
            tests.append(_CATEGORIES[value])
        else:
            raise Unsupported(f"regex class item {item}")
    return lambda c: any(t(c) for t in tests) != negate
