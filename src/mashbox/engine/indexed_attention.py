"""Decode attention that reads each row's keys and values where its slot holds them.

A fixed-shape decode step (graph_decode.py) cannot view a row's slot of the cache: slots are
a device tensor, so that one CUDA graph serves every batch. Its default attention copies the
rows' keys and values out with `index_select` and runs torch's SDPA over the copy. On an
H200 (8B shape, batch 1, 512 keys) the two copies took 5.8 us each beside SDPA's 13.7, each
layer; at an agent's long contexts a copy reads and writes a slot's keys before SDPA reads
them again, three passes where one would do.

Here the same attention is written as sums of products, which torch.compile turns into
reductions whose loads go through the slot index (Triton on a GPU, C++ on a CPU): keys and
values are read once, where they lie, and the step's own K/V are written in the same
compiled graph. Only compiled: run eagerly, the products would exist whole in memory
([rows, kv_heads, keys, groups, head_dim]).
"""

from __future__ import annotations

import os
import types

import torch
from torch import Tensor

ENV = "MASHBOX_DECODE_ATTENTION"  # "indexed": this module's; anything else: gathered + SDPA


def wanted() -> bool:
    """Whether fixed-shape decode attends through `indexed_attention` ($MASHBOX_DECODE_ATTENTION).
    Off by default until a GPU has timed it against the gathered copies (bench/gpu_check.py
    runs both)."""
    return os.environ.get(ENV, "") == "indexed"


def indexed_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cache_k: Tensor,
    cache_v: Tensor,
    slot_index: Tensor,
    positions: Tensor,
    mask: Tensor,
) -> Tensor:
    """Write this step's k and v ([B, kv_heads, hd]) at each row's (slot, position) of one
    layer's cache ([slots, kv_heads, ctx, hd]), then attend q ([B, heads, hd]) over the first
    L keys of each row's slot, mask [B, 1, 1, L] (additive) saying which it sees. Returns
    [B, heads * hd] in q's dtype; scores, softmax and sums in float32."""
    batch, kv_heads, head_dim = k.shape
    cache_k[slot_index, :, positions] = k.to(cache_k.dtype)
    cache_v[slot_index, :, positions] = v.to(cache_v.dtype)
    length = mask.shape[-1]
    keys = cache_k[slot_index, :, :length].float()  # [B, kv_heads, L, hd], never materialized
    values = cache_v[slot_index, :, :length].float()
    # Each KV head with the query heads that share it, the groups innermost: the query heads
    # of one key are neighbours in the reduction, so the key is read once for all of them.
    groups = q.shape[1] // kv_heads
    queries = q.float().reshape(batch, kv_heads, 1, groups, head_dim)
    scores = (queries * keys[:, :, :, None]).sum(-1) * head_dim**-0.5  # [B, kv_heads, L, groups]
    weights = (scores + mask.reshape(batch, 1, length, 1)).softmax(dim=2)
    out = (weights[..., None] * values[:, :, :, None]).sum(2)  # [B, kv_heads, groups, hd]
    return out.reshape(batch, -1).to(q.dtype)


def compiled():
    """indexed_attention through torch.compile, the batch and the context length dynamic
    from the first call on: four compiles serve every bucket (a batch of one, and a context
    of the whole cache, are specialised). The other dimensions are static: with all of them
    dynamic, a batch the size of the head count shares its symbol, and 32 slots of an 8B
    model compiled 6 times, near torch's limit of 8 (past it, fullgraph fails)."""
    # A code object of its own: torch.compile keeps compiles per code object and fails
    # past 8 of them under fullgraph, and a process may hold decoders of several shapes.
    own = types.FunctionType(indexed_attention.__code__.replace(), indexed_attention.__globals__)
    fn = torch.compile(own, fullgraph=True)

    def run(q, k, v, cache_k, cache_v, slot_index, positions, mask):
        for t in (q, k, v, slot_index, positions, mask):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(mask, 3)
        return fn(q, k, v, cache_k, cache_v, slot_index, positions, mask)

    return run
