"""Decode steps of fixed shape, captured once as CUDA graphs and replayed.

A decode batch is padded to a batch bucket B (1, 2, 4, ... up to the slot count) and attends
over the first L positions of the cache only, L a context bucket (a power of two from 256 up
to ctx): attention costs what the batch's longest row needs, never the whole context. Padding
rows write their keys into the cache's scratch slot, which no sequence owns. Small buckets
attend over a gathered copy of their rows' keys, large ones over every slot in place
(`reads_in_place`). On CUDA every (B, L) pair is captured at startup (with ctx 8192 and 32
slots, 6 x 6 = 36 graphs) and a step replays the smallest that fits; elsewhere, and if
capture fails, the same function runs eagerly, which is what the CPU tests check against
`Model.decode`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from . import indexed_attention
from .kv_cache import KVCache
from .model import Model, compile_failure
from .sampling import DecodeLogits

log = logging.getLogger("mashbox")

captures = 0  # CUDA graphs this process has captured: engine.compiles_so_far counts them

ENV = "MASHBOX_GRAPH_DECODE"  # "1" forces fixed-shape decode (also on the CPU), "0" turns it off
MIN_CONTEXT_BUCKET = 256
WARMUP_RUNS = 2  # eager runs on a side stream before each capture, as torch's docs ask
CHECK_TOLERANCE = 1e-2  # replay vs eager, relative (norm) error: bf16 rounding is ~1e-3


def wanted(requested: bool | None, model: Model) -> bool:
    """Whether decode runs as fixed-shape steps: as requested, else as $MASHBOX_GRAPH_DECODE
    says, else on CUDA where decode reads the float weights (no CPU decode stack)."""
    if requested is None and os.environ.get(ENV) in ("0", "1"):
        requested = os.environ[ENV] == "1"
    if requested is not None:
        return requested
    return (
        model.device.type == "cuda" and model.decode_stack is None and model.decode_kind == "float"
    )


def batch_buckets(slots: int) -> tuple[int, ...]:
    """Powers of two from 1 up to the slot count, rounded up."""
    buckets = [1]
    while buckets[-1] < slots:
        buckets.append(buckets[-1] * 2)
    return tuple(buckets)


def context_buckets(ctx: int) -> tuple[int, ...]:
    """Powers of two from 256 (or ctx, if smaller) up to ctx, ctx itself the last."""
    buckets = [min(MIN_CONTEXT_BUCKET, ctx)]
    while buckets[-1] < ctx:
        buckets.append(min(buckets[-1] * 2, ctx))
    return tuple(buckets)


def smallest_fitting(buckets: tuple[int, ...], n: int) -> int:
    for bucket in buckets:
        if bucket >= n:
            return bucket
    raise ValueError(f"{n} is larger than the largest bucket, {buckets[-1]}")


def reads_in_place(batch: int, cache_slots: int) -> bool:
    """Whether a batch bucket attends over every slot of the cache in place rather than over
    a gathered copy of its own rows: a copy reads, writes and reads again B slots' keys, in
    place reads all of them once, so past a third of the slots in place reads less."""
    return 3 * batch >= cache_slots


def decode_step(
    model: Model,
    cache: KVCache,
    token_ids: Tensor,
    positions: Tensor,
    slot_index: Tensor,
    length: int,
    indexed=None,
) -> Tensor:
    """One token per row at fixed shapes ([B] inputs, context bucket `length`); returns the
    final hidden states [B, d_model]. Each row writes its K/V at its position and attends
    over keys 0..position of its slot: through `indexed` (indexed_attention's, compiled)
    where given, else over gathered copies or every slot in place. Nothing here reads a
    tensor's value on the host, so it can be captured as a CUDA graph. Rows must be in
    distinct slots, except padding rows, which all sit at position 0 of the scratch slot."""
    cfg, batch = model.cfg, token_ids.shape[0]
    groups = cfg.n_heads // cfg.n_kv_heads
    in_place = indexed is None and reads_in_place(batch, cache.k.shape[1])
    keys = torch.arange(length, device=token_ids.device)
    if in_place:  # a row per slot of the cache: the batch's rows where they are, 0 elsewhere
        slot_positions = torch.zeros(cache.k.shape[1], dtype=positions.dtype, device=keys.device)
        visible = keys <= slot_positions.index_put((slot_index,), positions)[:, None]
    else:
        visible = keys <= positions[:, None]
    # Additive, in the activation dtype (what the fused CUDA kernels want), shared by every
    # layer and broadcast over heads: [rows, 1, 1, length].
    zero = torch.zeros((), dtype=model.dtype, device=keys.device)
    mask = torch.where(visible, zero, float("-inf"))[:, None, None]

    def attend_indexed(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return indexed(q, k, v, cache.k[layer], cache.v[layer], slot_index, positions, mask)

    def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        cache.k[layer, slot_index, :, positions] = k
        cache.v[layer, slot_index, :, positions] = v
        # Query heads grouped under the KV head they share, as the query-length dimension:
        # plain attention over [kv_heads, groups] queries, so keys are never repeated.
        q = q.reshape(batch, cfg.n_kv_heads, groups, cfg.head_dim)
        keys_k, keys_v = cache.k[layer, :, :, :length], cache.v[layer, :, :, :length]
        if in_place:
            q_all = q.new_zeros(cache.k.shape[1], *q.shape[1:]).index_put((slot_index,), q)
            out = F.scaled_dot_product_attention(q_all, keys_k, keys_v, attn_mask=mask)
            out = out[slot_index]
        else:
            keys_k, keys_v = keys_k.index_select(0, slot_index), keys_v.index_select(0, slot_index)
            out = F.scaled_dot_product_attention(q, keys_k, keys_v, attn_mask=mask)
        return out.reshape(batch, -1)

    return model.forward(token_ids, positions, attend if indexed is None else attend_indexed)


class _StaticInputs:
    """One batch bucket's input buffers: every graph of that bucket reads these addresses."""

    def __init__(self, batch: int, scratch_slot: int, device):
        self.token_ids = torch.zeros(batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)
        self.slot_index = torch.full((batch,), scratch_slot, dtype=torch.long, device=device)
        self.scratch_slot = scratch_slot

    def fill(self, slots: list[int], token_ids: Tensor, positions: Tensor) -> None:
        """The batch's rows first, then padding rows at position 0 of the scratch slot."""
        n = len(slots)
        self.token_ids[:n].copy_(token_ids)
        self.token_ids[n:].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:].zero_()
        self.slot_index[:n].copy_(torch.tensor(slots, dtype=torch.long))
        self.slot_index[n:].fill_(self.scratch_slot)


class GraphDecoder:
    """Decode for one Model and KVCache through fixed-shape steps: replayed CUDA graphs where
    they were captured and checked, the same function run eagerly elsewhere."""

    def __init__(
        self,
        model: Model,
        cache: KVCache,
        *,
        capture: bool | None = None,
        indexed: bool | None = None,
    ):
        """capture: record CUDA graphs now (default: on CUDA). indexed: attend through
        indexed_attention, compiled now (default: as $MASHBOX_DECODE_ATTENTION says). Needs
        a cache with a scratch slot, where padding rows write."""
        if cache.scratch_slot is None:
            raise ValueError("fixed-shape decode needs a KVCache with a scratch slot")
        self.model, self.cache = model, cache
        self.batches = batch_buckets(cache.slots)
        self.lengths = context_buckets(cache.ctx)
        self.inputs = {b: _StaticInputs(b, cache.scratch_slot, model.device) for b in self.batches}
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.eager_reason = "not captured"  # why decode runs eagerly, while it does
        self.indexed = None  # indexed_attention, compiled, where it is used
        if capture is None:
            capture = model.device.type == "cuda"
        if indexed if indexed is not None else indexed_attention.wanted():
            self._compile_indexed(captured=capture)
        if capture:
            self._capture_all()

    def bucket(self, rows: int, longest: int) -> tuple[int, int]:
        """The smallest (B, L) for `rows` rows whose longest attends over `longest` keys."""
        return smallest_fitting(self.batches, rows), smallest_fitting(self.lengths, longest)

    def decode(
        self, slots: list[int], token_ids: Tensor, positions: Tensor, *, eager: bool = False
    ) -> Tensor:
        """Feed one token per slot; return hidden states [len(slots), d_model]. eager: run
        the function itself even where its graph was captured (to compare the two)."""
        longest = int(positions.max()) + 1  # one tiny read back: it picks the graph
        batch, length = self.bucket(len(slots), longest)
        return self._run(batch, length, slots, token_ids, positions, eager=eager)

    def logits(self, slots: list[int], token_ids: list[int], positions: list[int]) -> DecodeLogits:
        """Feed one token per slot; return float32 logits [len(slots), vocab], each row's
        greedy pick and finiteness."""
        device = self.model.device
        ids, at = (torch.tensor(v, device=device) for v in (token_ids, positions))
        return DecodeLogits.of(self.model.logits(self.decode(slots, ids, at)))

    def _run(self, batch: int, length: int, slots, token_ids, positions, *, eager=False):
        inputs = self.inputs[batch]
        inputs.fill(slots, token_ids, positions)
        graph = None if eager else self.graphs.get((batch, length))
        if graph is None:
            return self._eager(batch, length)[: len(slots)]
        graph[0].replay()
        return graph[1][: len(slots)].clone()  # the next replay overwrites graph[1]

    def _eager(self, batch: int, length: int) -> Tensor:
        inputs = self.inputs[batch]
        with torch.no_grad():
            return decode_step(
                self.model, self.cache,
                inputs.token_ids, inputs.positions, inputs.slot_index, length, self.indexed,
            )  # fmt: skip

    def _compile_indexed(self, *, captured: bool) -> None:
        """Compile indexed_attention for every bucket now, before the server is ready: one
        eager step of each (B, L) on the idle inputs, which write only the scratch slot, as
        the steps will run (torch.compile guards on inference tensors): captured next, in
        the caller's mode, or eagerly in the worker's inference mode. Where it does not
        compile, warn and attend over gathered copies instead."""
        log.info("compiling decode attention over slots in place (cached once built)")
        self.indexed = indexed_attention.compiled()
        try:
            with torch.inference_mode(not captured or torch.is_inference_mode_enabled()):
                for batch, length in self._buckets_largest_first():
                    self._eager(batch, length)
        except Exception as e:
            self.indexed = None
            log.warning("decode attention over slots in place did not compile (%s): "
                        "attending over gathered copies", compile_failure(e))  # fmt: skip

    def _buckets_largest_first(self):
        """Every (B, L), the largest first (captures then reuse the first's memory)."""
        for batch in reversed(self.batches):
            for length in reversed(self.lengths):
                yield batch, length

    def _capture_all(self) -> None:
        """Capture every (B, L), then check two replays against eager runs; on any failure
        log why and decode eagerly (slower, never wrong). Graph memory: all graphs share one
        pool, captured largest first so the smaller ones reuse its blocks, so it holds about
        the largest temporaries of one step (for an 8B model at ctx 8192: one layer's
        gathered K/V at B=8, 256 MiB; activations are a few MB) plus each graph's output
        rows. Replays must not overlap: each one's output is copied before the next."""
        global captures
        try:
            pool = torch.cuda.graph_pool_handle()
            for batch, length in self._buckets_largest_first():
                self.graphs[batch, length] = self._capture(batch, length, pool)
                captures += 1
            self._check()
            self.eager_reason = ""
        except Exception as e:  # a failed capture or check must not stop the server
            self.graphs.clear()
            self.eager_reason = f"{type(e).__name__}: {e}".splitlines()[0]
            log.warning("CUDA graph decode off, decoding eagerly: %s", self.eager_reason)

    def _capture(self, batch: int, length: int, pool) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        # Warm-up and capture run on the idle inputs: every row at the scratch slot.
        run = functools.partial(self._eager, batch, length)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = run()
        return graph, out

    def _check(self) -> None:
        """Replay the first and the last bucket on random tokens and positions and compare
        with the eager function; the cache entries they write are put back afterwards."""
        generator = torch.Generator().manual_seed(0)
        first, last = (self.batches[0], self.lengths[0]), (self.batches[-1], self.lengths[-1])
        for batch, length in (first, last):
            rows = min(batch, self.cache.slots)
            slots = list(range(rows))
            device = self.model.device
            positions = torch.randint(0, length, (rows,), generator=generator).to(device)
            token_ids = torch.randint(0, self.model.cfg.vocab_size, (rows,), generator=generator)
            args = (slots, token_ids.to(device), positions)
            with _entries_kept(self.cache, slots, positions):
                eager = self._run(batch, length, *args, eager=True).float()
                replay = self._run(batch, length, *args).float()
            error = float((replay - eager).norm() / eager.norm().clamp_min(1e-6))
            if not error <= CHECK_TOLERANCE:
                raise RuntimeError(
                    f"replay of (B={batch}, L={length}) differs from eager: relative error "
                    f"{error:.2e} > {CHECK_TOLERANCE:.0e}"
                )


@contextlib.contextmanager
def _entries_kept(cache: KVCache, slots: list[int], positions: Tensor):
    """Put back, afterwards, the K/V of every layer at each (slot, position)."""
    where = (torch.tensor(slots, device=cache.k.device), positions.to(cache.k.device))
    k, v = cache.k[:, where[0], :, where[1]].clone(), cache.v[:, where[0], :, where[1]].clone()
    try:
        yield
    finally:
        cache.k[:, where[0], :, where[1]] = k
        cache.v[:, where[0], :, where[1]] = v
