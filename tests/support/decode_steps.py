"""Decode steps of an Engine's prefilled slots, fused (DecodeStack) or through the torch ops,
leaving its KV caches as they were: what the kernel tests compare."""

from __future__ import annotations

import torch

PROMPTS = {0: [5, 17, 3, 88, 42, 7, 19], 2: [9, 8, 7], 3: list(range(20, 60))}
FED = [11, 23, 5, 70, 2]  # tokens fed to every slot, one a step


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


def decode(engine, slots: list[int], fused: bool) -> torch.Tensor:
    """The hidden states of decode_with_caches alone."""
    return decode_with_caches(engine, slots, fused)[0]
