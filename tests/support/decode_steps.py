"""Decode steps of an Engine's prefilled slots, fused (DecodeStack) or through the torch ops,
leaving its KV caches as they were: what the kernel tests compare."""

from __future__ import annotations

import torch

PROMPTS = {0: [5, 17, 3, 88, 42, 7, 19], 2: [9, 8, 7], 3: list(range(20, 60))}
FED = [11, 23, 5, 70, 2]  # tokens fed to every slot, one a step


def prefill(engine) -> None:
    """Each slot of PROMPTS prefilled with its prompt."""
    with torch.inference_mode():
        for slot, ids in PROMPTS.items():
            engine.model.prefill(engine.cache, slot, 0, torch.tensor(ids))


@torch.inference_mode()
def decode(engine, slots: list[int], fused: bool) -> torch.Tensor:
    """Hidden states of len(FED) decode steps of `slots` (the caches are left as they were)."""
    model, cache = engine.model, engine.cache
    saved = cache.k.clone(), cache.v.clone()
    stack, model.decode_stack = model.decode_stack, model.decode_stack if fused else None
    try:
        hidden = []
        for i, token in enumerate(FED):
            positions = torch.tensor([len(PROMPTS[s]) + i for s in slots])
            hidden.append(model.decode(cache, slots, torch.tensor([token] * len(slots)), positions))
        return torch.stack(hidden)
    finally:
        model.decode_stack = stack
        cache.k.copy_(saved[0])
        cache.v.copy_(saved[1])
