"""Token sampling whose randomness is a pure function of (seed, position).

No generator state is shared between requests: each row draws Gumbel noise from a hash of
its seed, the position of the token being sampled and the vocabulary index, so a seeded
request gives the same tokens in any slot, whatever else is in the batch.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from ..protocol import SamplingParams

_MASK32 = 0xFFFFFFFF
_MIX = (0x7FEB352D, 0x446CA68B, 0x2C1B3C6D)
# A repetition penalty's range in float32: the API takes any number > 0 (as vLLM), and one
# past float32's range became infinity or 0 there, then 0 * infinity a NaN (fuzzing: the
# sampler raised and took the engine process down with it).
_FINITE_POSITIVE = (float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max))


def _mix32(x):
    """A 32-bit integer hash (lowbias32-style): of a Python int, or elementwise of a uint32
    array (numpy's uint32 products wrap modulo 2**32, as the hash wants)."""
    for shift, multiplier in zip((16, 15, 16), _MIX, strict=True):
        x = x ^ (x >> shift)
        x = x * multiplier & _MASK32 if isinstance(x, int) else x * np.uint32(multiplier)
    return x ^ (x >> 16)


def _uniforms(seed: int, position: int, indices: np.ndarray) -> np.ndarray:
    """float64 uniforms in (0, 1) for the given vocabulary indices at (seed, position)."""
    seed &= (1 << 64) - 1
    k = _mix32((seed & _MASK32) ^ 0x9E3779B9)
    k = _mix32(k ^ (seed >> 32) ^ 0x85EBCA6B)
    k = _mix32(k ^ position & _MASK32)
    bits = _mix32(_mix32(indices.astype(np.uint32) ^ np.uint32(k)) ^ np.uint32(0x6A09E667))
    return (bits.astype(np.float64) + 0.5) / 4294967296.0


def uniforms(seed: int, position: int, n: int, device="cpu") -> Tensor:
    """n float64 uniforms in (0, 1), one per vocabulary index, for (seed, position)."""
    return torch.from_numpy(_uniforms(seed, position, np.arange(n))).to(device)


def _gumbel(u):
    return -np.log(-np.log(u))


# Gumbel noise lies within these bounds (the uniforms' extremes), so a token whose scaled
# logit is more than their spread below the largest one can never win: only the others get
# noise, and the pick is the one a draw over the whole vocabulary makes (a margin of 1e-6
# against float64 rounding of sums near 1e2, whose error is ~1e-13).
_SPREAD = float(_gumbel(1 - 0.5 / 2**32) - _gumbel(0.5 / 2**32)) + 1e-6


def apply_logit_bias(logits: Tensor, params: SamplingParams) -> Tensor:
    """The request's logit_bias added to its tokens' logits, in float32 (numpy, one thread);
    the logits as they are where it has none."""
    if not params.logit_bias:
        return logits
    ids, bias = zip(*params.logit_bias, strict=True)
    x = logits.float().cpu().numpy().copy()
    x[list(ids)] += np.asarray(bias, dtype=np.float32)
    return torch.from_numpy(x)


def apply_penalties(
    logits: Tensor, params: SamplingParams, prompt_mask: Tensor, counts: Tensor
) -> Tensor:
    """Repetition (prompt and output, as vLLM), frequency and presence (output) penalties:
    float32 arithmetic in numpy on one thread (see `sample`), the result on the CPU."""
    repetition = params.repetition_penalty != 1.0
    if not (repetition or params.frequency_penalty or params.presence_penalty):
        return logits
    x, c = logits.float().cpu().numpy(), counts.cpu().numpy()
    if repetition:
        rp = np.float32(np.clip(params.repetition_penalty, *_FINITE_POSITIVE))
        seen = prompt_mask.cpu().numpy() | (c > 0)
        with np.errstate(over="ignore", under="ignore"):  # -infinity: banned
            x = np.where(seen, np.where(x > 0, x / rp, x * rp), x)
        if rp < 1 and x.max() == np.inf:  # divided past float32's range: those alone, alike
            x = np.where(np.isposinf(x), np.float32(0.0), np.float32(-np.inf))
    if params.frequency_penalty or params.presence_penalty:
        c = c.astype(np.float32)
        x = x - np.float32(params.frequency_penalty) * c
        x = x - np.float32(params.presence_penalty) * (c > 0)
    return torch.from_numpy(x)


def log_probs(logits: Tensor, token: int, top: int) -> tuple[float, tuple]:
    """The token's log-prob under logits [V] (float32 log-softmax), and the `top` likeliest
    tokens' as (token, log-prob), likeliest first (ties: the lower id). In numpy on one
    thread, and only at the entries asked for: log-softmax is monotone, so the likeliest
    logits are the likeliest log-probs."""
    x = logits.float().cpu().numpy()
    m = x.max()
    lse = np.log(np.exp(x - m).sum(dtype=np.float64))
    alternatives = ()
    if top:
        top = min(top, x.shape[0])
        ids = np.argpartition(-x, top - 1)[:top] if top < x.shape[0] else np.arange(top)
        ids = ids[np.lexsort((ids, -x[ids]))]
        values = (x[ids] - m).astype(np.float64) - lse
        alternatives = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return float((x[token] - m) - lse), alternatives


def finite_rows(logits: Tensor) -> list[bool]:
    """Whether each row of [rows, V] is free of NaN and +infinity: its max is finite (NaN
    propagates through max; -infinity alone, a masked logit, is no overflow). On the CPU
    through numpy, one thread: a torch reduction this size wakes OpenMP's threads, which
    then spin through the next step beside the kernels' pool (qwen2.5's 152k logits: 17 ->
    22-25 ms a decode step through HTTP)."""
    if logits.device.type == "cpu":
        return np.isfinite(logits.numpy().max(-1)).tolist()
    return torch.isfinite(logits.amax(-1)).tolist()


def greedy(logits: Tensor) -> list[int]:
    """The first largest logit's index of each row of [rows, V]. On the CPU through numpy:
    torch's argmax takes ~130 us for one 49k row here, numpy's 7."""
    if logits.device.type == "cpu":
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


class DecodeLogits(NamedTuple):
    """A decode step's float32 logits [rows, vocab], with what every step reads of them: each
    row's first largest logit's index (`greedy`) and whether the row is finite
    (`finite_rows`). The decode stack computes both in its own call (Model.decode_logits)."""

    values: Tensor
    best: list[int]
    finite: list[bool]

    @classmethod
    def of(cls, values: Tensor) -> DecodeLogits:
        return cls(values, greedy(values), finite_rows(values))


def sample(logits: Tensor, params: SamplingParams, position: int) -> int:
    """Pick one token from float32 logits [V] (penalties already applied): Gumbel-max over
    the logits scaled by temperature and filtered by top_k, min_p and top_p, its noise a pure
    function of (seed, position, token). In numpy on one thread: torch's ops over a
    vocabulary wake OpenMP's threads, which then spin beside the next step's kernels, and a
    full sort of the vocabulary for top_p took 5 ms a token on SmolLM2's 49k, 16 on qwen's
    152k (now ~0.1-0.5 ms)."""
    temperature = np.float32(params.temperature)
    if temperature == 0.0:  # also a temperature below float32's range
        return greedy(logits[None])[0]
    with np.errstate(over="ignore"):
        x = logits.float().cpu().numpy() / temperature
    if x.max() == np.inf:  # so small a temperature that logits over it overflow: its limit
        return greedy(logits[None])[0]
    n = x.shape[0]
    if 0 < params.top_k < n:
        kth = np.partition(x, n - params.top_k)[n - params.top_k]
        x = np.where(x < kth, np.float32(-np.inf), x)
    if params.top_p < 1.0 or params.min_p > 0.0:
        e = np.exp(x - x.max())
        probs = e / e.sum()
        if params.min_p > 0.0:
            x = np.where(probs < params.min_p * probs.max(), np.float32(-np.inf), x)
        if params.top_p < 1.0:
            x = np.where(_nucleus(probs, params.top_p), x, np.float32(-np.inf))
    top = x.max()
    if top == -np.inf:
        return 0  # nothing allowed: torch's argmax of all -inf, as before
    scaled = x.astype(np.float64)
    candidates = np.flatnonzero(scaled >= top - _SPREAD)
    noise = _gumbel(_uniforms(params.seed, position, candidates))
    return int(candidates[np.argmax(scaled[candidates] + noise)])


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Which tokens are in the smallest set of the likeliest whose mass reaches top_p
    (always the first): the likeliest k sorted, k growing until their mass reaches it, so
    the vocabulary is never sorted whole."""
    n, k = probs.shape[0], 64
    while True:
        k = min(k, n)
        top = np.argpartition(-probs, k - 1)[:k] if k < n else np.arange(n)
        order = top[np.argsort(-probs[top], kind="stable")]
        mass = np.cumsum(probs[order], dtype=np.float64)
        if mass[-1] >= top_p or k == n:
            kept = np.zeros(n, dtype=bool)
            kept[order[mass - probs[order] < top_p]] = True
            return kept
        k *= 8
