"""A custom tool's Lark grammar carried into the JSON string its input travels in: what the
rewritten grammar accepts, checked with llguidance on a real vocabulary, is exactly the
JSON-escaped text of what the original accepts."""

from __future__ import annotations

import json

import pytest

from mashbox.text.constraint import Grammars
from mashbox.text.lark_in_json import Unsupported, json_string_lark
from mashbox.text.tokenizer import Tokenizer

# Codex's apply_patch grammar (codex-rs, tool_apply_patch.lark).
APPLY_PATCH = r"""
start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
"""

PATCHES = {
    '*** Begin Patch\n*** Update File: a "quoted" \\ name.py\n@@ def f():\n-    return 1\n'
    '+    return "2"\t# tab\n*** End Patch\n': True,
    "*** Begin Patch\n*** Add File: é.py\n+ünï\n*** End Patch": True,
    "*** Begin Patch\n*** Delete File: x\n*** End Patch\n": True,
    "*** Begin Patch\nnonsense\n*** End Patch\n": False,
    "*** Begin Patch\n*** Add File: x\n*** End Patch\n": False,  # an added file has lines
    "*** Begin Patch\n*** Update File: x\n+a\n": False,  # no end
}


@pytest.fixture(scope="module")
def grammars(tiny_qwen2):
    return Grammars(Tokenizer.for_model(tiny_qwen2))


def accepts(grammars: Grammars, grammar: str, text: str, tok_path) -> bool:
    tok = Tokenizer.for_model(tok_path)
    m = grammars.matcher(grammar)
    if not all(m.consume_token(t) for t in tok.encode(text)):
        return False
    m.compute_bitmask()
    return m.is_accepting()


@pytest.mark.parametrize(("patch", "valid"), PATCHES.items())
def test_the_escaped_grammar_takes_what_the_original_takes(grammars, tiny_qwen2, patch, valid):
    original = APPLY_PATCH
    in_json = 'start: "\\"" inner "\\""\ninner: %lark {\n' + json_string_lark(APPLY_PATCH) + "}\n"
    assert grammars.error(in_json) == ""
    assert accepts(grammars, original, patch, tiny_qwen2) is valid
    assert accepts(grammars, in_json, json.dumps(patch, ensure_ascii=False), tiny_qwen2) is valid


@pytest.mark.parametrize(
    "grammar",
    [
        'start: "a"i',  # case folding
        "start: /^a/",  # an anchor
        "start: WORD\nWORD: /[a-z]+/",  # a regex in a terminal definition
        "start: /[é-ü]/",  # a non-ASCII class
        "start: WS\n%import common.WS",  # an imported regex terminal
        "start: /(a)\\1/",  # a back-reference
    ],
)
def test_what_cannot_be_carried_over_is_refused(grammar):
    with pytest.raises(Unsupported):
        json_string_lark(grammar)
