"""Reading a decision's answers: the labels a tokenizer can read after the generation prompt,
each question's branch (its suffix and one leaf per label), and the labels' log-probs turned
into an answer and its confidence (TypeSafe's formula, `/v1/systemone`)."""

from __future__ import annotations

import functools
import math
import string
from typing import TYPE_CHECKING

import attrs

from ..protocol import Branch
from ..text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from .decisions import Question

# --- labels ------------------------------------------------------------------------------


@attrs.frozen
class Label:
    text: str
    tokens: tuple[int, ...]  # one token, or two read by the chain rule


@functools.lru_cache(maxsize=8)
def labels_for(tokenizer: Tokenizer, tail: str) -> Labels:
    """Verified labels, kept per generation prompt (it is the same for every request)."""
    return Labels(tokenizer, tail)


class Labels:
    """The labels one tokenizer can read after one generation prompt, verified in context:
    the label's text right after the prompt adds exactly these tokens."""

    def __init__(self, tokenizer: Tokenizer, tail: str):
        self.tokenizer = tokenizer
        self.tail = tail
        self.base = tokenizer.encode(tail)

    def _tokens(self, text: str) -> tuple[int, ...] | None:
        ids = self.tokenizer.encode(self.tail + text)
        if ids[: len(self.base)] != self.base:
            return None
        extra = tuple(ids[len(self.base) :])
        return extra if 1 <= len(extra) <= 2 else None

    def _singles(self, texts) -> list[Label]:
        out = []
        for text in texts:
            tokens = self._tokens(text)
            if tokens is not None and len(tokens) == 1:
                out.append(Label(text, tokens))
        return out

    @functools.cached_property
    def single_letters(self) -> list[Label]:
        """A-Z, then two-letter labels, each one token."""
        pairs = [label for label in self.two_letters if len(label.tokens) == 1]
        return self._singles(string.ascii_uppercase) + pairs

    @functools.cached_property
    def two_letters(self) -> list[Label]:
        """AA-ZZ, each one or two tokens: for more options than single tokens can label."""
        letters = string.ascii_uppercase
        out = []
        for text in (a + b for a in letters for b in letters):
            tokens = self._tokens(text)
            if tokens is not None:
                out.append(Label(text, tokens))
        return out

    def for_question(self, q: Question) -> list[Label] | None:
        n = len(q.keys)
        if q.kind == "noul":
            yes_no = self._singles(["Yes", "No"])
            if len(yes_no) == 2:
                return yes_no
        if q.kind == "score" and n <= 10:
            digits = self._singles(str(i) for i in range(n))
            if len(digits) == n:
                return digits
        if n <= len(self.single_letters):
            return self.single_letters[:n]
        # Two-letter labels only: no label's first token is another label (chain rule).
        if n <= len(self.two_letters):
            return self.two_letters[:n]
        return None


def branch_for(suffix: list[int], labels: list[Label]) -> Branch:
    """The branch that reads every label: first tokens after the suffix, and the second
    token of each two-token label after its first (a leaf)."""
    firsts = list(dict.fromkeys(label.tokens[0] for label in labels))
    leaves = list(dict.fromkeys(label.tokens[0] for label in labels if len(label.tokens) == 2))
    seconds = [
        tuple(dict.fromkeys(lb.tokens[1] for lb in labels if lb.tokens[:1] == (leaf,)))
        for leaf in leaves
    ]
    return Branch(tuple(suffix), (tuple(firsts), *seconds), tuple(leaves))


def label_logprobs(branch: Branch, labels: list[Label], reads) -> list[float]:
    """Each label's log-probability from a branch's reads (chain rule for two tokens)."""
    first = dict(zip(branch.candidates[0], reads[0], strict=True))
    after = {
        leaf: dict(zip(branch.candidates[1 + i], reads[1 + i], strict=True))
        for i, leaf in enumerate(branch.leaves)
    }
    out = []
    for label in labels:
        lp = first[label.tokens[0]]
        if len(label.tokens) == 2:
            lp += after[label.tokens[0]][label.tokens[1]]
        out.append(lp)
    return out


# --- answers -----------------------------------------------------------------------------


def softmax(logprobs: list[float]) -> list[float]:
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    total = sum(weights)
    return [w / total for w in weights]


def _unit(x: float) -> float:
    return min(1.0, max(0.0, x))


def entropy_confidence(p: list[float]) -> float:
    """1 minus the entropy normalized by its maximum (seed 004's confidence)."""
    h = -sum(x * math.log(x) for x in p if x > 0)
    return _unit(1 - h / math.log(len(p)))


def choice_confidence(p: list[float]) -> float:
    """TypeSafe's reference: how far the top probability is above uniform, in [0, 1]."""
    k = len(p)
    return _unit((max(p) - 1 / k) / (1 - 1 / k))


def score_confidence(p: list[float]) -> float:
    """TypeSafe's reference: 1 - expected distance from the mode over the mean distance
    from the middle level, floored at 0."""
    n = len(p)
    mode = max(range(n), key=lambda i: p[i])
    spread = sum(abs(i - (n - 1) / 2) for i in range(n)) / n
    return _unit(1 - sum(pi * abs(i - mode) for i, pi in enumerate(p)) / spread)


def answer(q: Question, p: list[float]) -> dict:
    if q.kind == "noul":
        return {"type": "noul", "noul": _unit(p[0])}
    best = max(range(len(p)), key=lambda i: p[i])
    probabilities = {key: _unit(pi) for key, pi in zip(q.keys, p, strict=True)}
    if q.kind == "choice":
        return {
            "type": "choice",
            "choice": q.keys[best],
            "probabilities": probabilities,
            "confidence": choice_confidence(p),
            "x_confidence_entropy": entropy_confidence(p),
        }
    return {
        "type": "score",
        "score": min(float(len(p) - 1), sum(i * pi for i, pi in enumerate(p))),
        "legend": dict(zip(q.keys, q.descriptions, strict=True)),
        "probabilities": probabilities,
        "confidence": score_confidence(p),
        "x_confidence_entropy": entropy_confidence(p),
    }
