"""Decode steps of an Engine's prefilled slots, fused (DecodeStack) or through the torch ops,
leaving its KV caches as they were: what the kernel tests compare. And greedy decoding's
logits on a real model, what its decode weights or KV dtype are measured by."""

from __future__ import annotations

import torch

from mashbox.engine import weights
from mashbox.engine.model import DECODE_MATRICES
from mashbox.engine.sampling import DecodeLogits

PROMPTS = {0: [5, 17, 3, 88, 42, 7, 19], 2: [9, 8, 7], 3: list(range(20, 60))}
FED = [11, 23, 5, 70, 2]  # tokens fed to every slot, one a step


def file_matrix(path, layer: int, name: str) -> torch.Tensor:
    """A model file's float32 weights of layer `layer`'s decode matrix `name` (its parts
    merged, as Model merges them): what a decode weight must read back."""
    tensors = weights.load(path).tensors
    return torch.cat([tensors[f"blk.{layer}.{part}"] for part in DECODE_MATRICES[name]])


def prefill(engine, prompts: dict = PROMPTS) -> None:
    """Each slot of `prompts` prefilled with its prompt."""
    with torch.inference_mode():
        for slot, ids in prompts.items():
            engine.model.prefill(engine.cache, slot, 0, torch.tensor(ids))


@torch.inference_mode()
def decode_with_caches(engine, slots: list[int], fused: bool, prompts: dict = PROMPTS):
    """Hidden states of len(FED) decode steps of `slots` from the prefilled caches, and the
    caches after them (the engine's caches are left as they were)."""
    model, cache = engine.model, engine.cache
    saved = cache.k.clone(), cache.v.clone()
    stack, model.decode_stack = model.decode_stack, model.decode_stack if fused else None
    try:
        hidden = []
        for i, token in enumerate(FED):
            positions = torch.tensor([len(prompts[s]) + i for s in slots])
            hidden.append(model.decode(cache, slots, torch.tensor([token] * len(slots)), positions))
        return torch.stack(hidden), cache.k.clone(), cache.v.clone()
    finally:
        model.decode_stack = stack
        cache.k.copy_(saved[0])
        cache.v.copy_(saved[1])


@torch.inference_mode()
def assert_one_call_is_two(engine, slots: list[int], tokens: list[int]) -> None:
    """One step of prefilled `slots` fed `tokens`: the logits of `decode_logits` (what an
    engine step calls) have the bits of `decode`, then `logits`, and its greedy picks and
    finiteness are numpy's (`DecodeLogits.of`); the caches are left as they were."""
    model, cache = engine.model, engine.cache
    assert model.fused_rows >= len(slots)
    positions = [len(PROMPTS[s]) for s in slots]
    saved = cache.k.clone(), cache.v.clone()
    try:
        one = model.decode_logits(cache, slots, tokens, positions)
        cache.k.copy_(saved[0])
        cache.v.copy_(saved[1])
        hidden = model.decode(cache, slots, torch.tensor(tokens), torch.tensor(positions))
        two = model.logits(hidden)
    finally:
        cache.k.copy_(saved[0])
        cache.v.copy_(saved[1])
    assert one.values.dtype == torch.float32
    assert one.values.shape == (len(slots), engine.cfg.vocab_size)
    assert torch.equal(one.values, two)
    assert (one.best, one.finite) == DecodeLogits.of(two)[1:]


def decode(engine, slots: list[int], fused: bool) -> torch.Tensor:
    """The hidden states of decode_with_caches alone."""
    return decode_with_caches(engine, slots, fused)[0]


TEXT_PROMPTS = [  # for a real model's tokenizer
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Water boils at",
]
STEPS = 32


@torch.inference_mode()
def greedy_logits(engine, prompts: list[list[int]], forced=None) -> torch.Tensor:
    """Logits [prompts, STEPS, vocab] of greedy decoding, all prompts as one decode batch;
    with `forced` [prompts, STEPS], feed those tokens instead of the engine's own."""
    model, cache = engine.model, engine.cache
    first = [
        model.logits(model.prefill(cache, s, 0, torch.tensor(p))[None])[0]
        for s, p in enumerate(prompts)
    ]
    rows = [torch.stack(first)]
    slots = list(range(len(prompts)))
    for i in range(STEPS - 1):
        ids = forced[:, i] if forced is not None else rows[-1].argmax(-1)
        positions = torch.tensor([len(p) + i for p in prompts])
        rows.append(model.logits(model.decode(cache, slots, ids, positions)))
    return torch.stack(rows, dim=1)
