"""A Llama-family decoder over static per-slot KV caches (Llama, Mistral, Qwen2, Qwen3)."""

from __future__ import annotations

import logging
import math
import os
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor

from . import cpu_kernels, int4
from .config import ModelConfig
from .decode_weight import DecodeWeight, decode_weight_for, linear, most_compact_kind, nbytes
from .embedding import Embedding
from .int8_weight import INT8_MAX_ROWS
from .kv_cache import KVCache
from .sampling import DecodeLogits

log = logging.getLogger("mashbox")


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm in float32 whatever the activation dtype, as the reference models do (one
    fused op: decode steps run 61 of these)."""
    return F.rms_norm(x.float(), weight.shape, weight.float(), eps).to(x.dtype)


def rope_tables(cfg: ModelConfig, n_positions: int, device) -> tuple[Tensor, Tensor]:
    """cos/sin for positions 0..n_positions-1, [positions, head_dim // 2]."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
    pos = torch.arange(n_positions, dtype=torch.float64) / cfg.rope_scale
    angles = torch.outer(pos, inv_freq)
    return angles.cos().float().to(device), angles.sin().float().to(device)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE; x is [tokens, heads, head_dim], cos/sin are [tokens, head_dim // 2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up, gate_up holding [gate | up] in its last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def add_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The residual stream after adding `delta`, and its RMSNorm."""
    x = x + delta
    return x, rms_norm(x, weight, eps)


class KernelGlue:
    """rms_norm, apply_rope and silu_mul (and the residual add before a norm) on the CPU
    kernels (decode_layers.cpp's rows_*): the decode step's own arithmetic, one call each,
    for float32 rows on the CPU. torch's ops took ~13% of a 2k-token SmolLM2 prefill here, a
    pass over the chunk per op."""

    def __init__(self, kernels):
        self.kernels = kernels

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return self.kernels.rows_rms_norm(x, weight, eps)

    def apply_rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return self.kernels.rows_rope(x, cos, sin)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        return self.kernels.rows_silu_mul(gate_up)

    def add_rms_norm(self, x: Tensor, delta: Tensor, weight: Tensor, eps: float):
        x = x + delta
        return x, self.kernels.rows_rms_norm(x, weight, eps)


# The same in torch, for every other device and dtype.
TORCH_GLUE = SimpleNamespace(
    rms_norm=rms_norm, apply_rope=apply_rope, silu_mul=silu_mul, add_rms_norm=add_rms_norm
)


def compiled_glue() -> SimpleNamespace:
    """TORCH_GLUE through torch.compile, for CUDA: a decode step there is a CUDA graph of
    small kernels, one per torch op (~30 a layer), which with their gaps took ~45% of an 8B
    model's batch-1 step on an H200. Compiled, each function is one kernel: 1,105 kernels a
    step -> 526, 7.11 -> 5.93 ms (bench/gpu_check.py). Shapes are dynamic, so every batch
    and chunk size shares one compile."""
    return SimpleNamespace(
        **{
            name: torch.compile(op, dynamic=True, fullgraph=True)
            for name, op in vars(TORCH_GLUE).items()
        }
    )


# "0": torch's ops one by one on CUDA too; "1": compiled on any device where the CPU kernels
# do not run (how the tests check a CUDA server's path on a CPU); unset: compiled on CUDA.
GLUE_ENV = "MASHBOX_COMPILED_GLUE"


def wants_compiled_glue(device: torch.device) -> bool:
    """Whether a model without the CPU kernels compiles its glue ($MASHBOX_COMPILED_GLUE)."""
    choice = os.environ.get(GLUE_ENV, "")
    return choice == "1" or (choice != "0" and device.type == "cuda")


def compile_failure(e: Exception) -> str:
    """A failed torch.compile's exception on one short line (inductor's run to many)."""
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]


def warmed_compiled_glue(model: Model) -> SimpleNamespace:
    """compiled_glue, compiled now: a forward of 1 and of 2 tokens in inference mode, as the
    engine's steps run (torch.compile specialises on a size of 1, and guards on strides and
    inference tensors: anything else would compile again at the first request, after ready).
    torch's ops, with a warning, where it does not compile (no Triton, say)."""
    log.info("compiling the norms, RoPE and SiLU with torch.compile (cached once built)")
    glue = model.glue = compiled_glue()  # forward() reads the model's
    try:
        with torch.inference_mode():
            for rows in (1, 2):
                ids = torch.zeros(rows, dtype=torch.long, device=model.device)
                positions = torch.arange(rows, device=model.device)
                model.forward(ids, positions, lambda i, q, k, v: q.reshape(q.shape[0], -1))
    except Exception as e:
        log.warning("torch.compile failed (%s): norms, RoPE and SiLU run as torch's ops one "
                    "by one, a slower decode step (set %s=0 to skip the attempt)",
                    compile_failure(e), GLUE_ENV)  # fmt: skip
        return TORCH_GLUE
    return glue


# CPU sgemm rounds a row differently depending on how many rows share the call (MKL on
# AVX-512: M < 16 and 57..~200 at K = 1536 differ from M = 16), but never on where the row
# sits or what the others hold when M is the same. Decision reads multiply in blocks of
# exactly this many rows, so a row gets the same bits whatever else is in the request;
# 64 costs ~30% over one call of 640 rows here (blocks of 16: 2.8x).
GEMM_ROW_BLOCK = 64


def linear_in_blocks(x: Tensor, w: Tensor | DecodeWeight, bias: Tensor | None = None) -> Tensor:
    """`linear` over blocks of exactly GEMM_ROW_BLOCK rows (the last one padded): every row
    is computed by a call of one shape, so its bits do not depend on the row count."""
    n = x.shape[0]
    padded = F.pad(x, (0, 0, 0, -n % GEMM_ROW_BLOCK))
    return torch.cat([linear(block, w, bias) for block in padded.split(GEMM_ROW_BLOCK)])[:n]


def tensors_in(obj) -> list[Tensor]:
    """The tensors `obj` holds: itself, those in a list, tuple or dict, or in an object's
    attributes that are any of those (a decode weight's, the embedding's)."""
    containers = Tensor | list | tuple | dict
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, list | tuple):
        items = obj
    elif hasattr(obj, "__dict__"):
        items = [v for v in vars(obj).values() if isinstance(v, containers)]
    else:
        return []
    return [t for o in items for t in tensors_in(o)]


# Each decode matrix and the file's tensors it is made of, concatenated along the output dim.
DECODE_MATRICES = {
    "wqkv": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
    "wo": ("attn_output.weight",),
    "w_gate_up": ("ffn_gate.weight", "ffn_up.weight"),
    "w_down": ("ffn_down.weight",),
}


class Model:
    """Weights as plain tensors and a forward pass over flat token batches."""

    def __init__(
        self,
        cfg: ModelConfig,
        tensors: dict,
        device,
        dtype,
        n_positions: int = 0,
        decode_weights: str = "float",
        blocks: dict | None = None,
    ):
        """decode_weights: "float", "int8", "int4" (the file's own Q4_0/Q4_1 or Q8_0 blocks,
        from `blocks`, weights.RawBlocks by GGUF name; int8 for the other matrices), "int4a16"
        or "int4a8" (int4 with activations rounded per block of 32 to int16 or int8 for the
        4-bit ones)."""
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype

        def t(name: str) -> Tensor:
            return tensors[name].to(device=self.device, dtype=dtype)

        def maybe(name: str) -> Tensor | None:
            return t(name) if name in tensors else None

        if decode_weights in int4.BLOCK_KINDS and self.device.type != "cpu":
            raise ValueError(f"{decode_weights} decode weights run on the CPU only")
        blocks = blocks or {}

        def matrix(i: int, name: str) -> Tensor | DecodeWeight:
            """Layer i's decode matrix `name`: its parts' blocks as a decode weight, or one
            float tensor (one matmul for q, k and v), made only where it is multiplied."""
            parts = [f"blk.{i}.{part}" for part in DECODE_MATRICES[name]]

            def floats() -> Tensor:
                return torch.cat([t(part) for part in parts])

            if decode_weights == "float":
                return floats()
            return decode_weight_for([blocks.get(p) for p in parts], decode_weights, floats)

        # The embedding as the file's blocks where it can (float32 rows from them, exactly).
        embed_blocks = blocks.get("token_embd.weight") if dtype == torch.float32 else None
        self.embedding = Embedding.of(embed_blocks, lambda: t("token_embd.weight"))
        head = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
        if decode_weights != "float":
            self.lm_head = decode_weight_for(
                [blocks.get(head)], decode_weights, lambda: t(head), prefill_rows=False
            )
        elif cfg.tied_embeddings:
            self.lm_head = self.embedding.table
        else:
            self.lm_head = t(head)
        self.final_norm = t("output_norm.weight")
        self.layers = []
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            self.layers.append(
                {
                    "attn_norm": t(p + "attn_norm.weight"),
                    "wqkv": matrix(i, "wqkv"),
                    "bqkv": (
                        torch.cat(
                            [t(p + "attn_q.bias"), t(p + "attn_k.bias"), t(p + "attn_v.bias")]
                        )
                        if cfg.qkv_bias
                        else None
                    ),
                    "q_norm": maybe(p + "attn_q_norm.weight"),
                    "k_norm": maybe(p + "attn_k_norm.weight"),
                    "wo": matrix(i, "wo"),
                    "ffn_norm": t(p + "ffn_norm.weight"),
                    "w_gate_up": matrix(i, "w_gate_up"),
                    "w_down": matrix(i, "w_down"),
                }
            )
        self.cos, self.sin = rope_tables(cfg, max(n_positions, cfg.max_context), self.device)
        self.decode_stack = self._decode_stack()
        # Up to how many rows `decode_logits` runs the head inside the stack's own call.
        head = self._kernel_head() if self.decode_stack is not None else None
        self.fused_rows = min(INT8_MAX_ROWS, head.max_rows) if head is not None else 0
        # A prefill chunk's attention as one call into the CPU kernels where the model
        # computes in float32 on the CPU, its cache float32 or float16 (prefill_attention.cpp:
        # 2-3x torch's flash kernel here).
        self.attention_kernels = (
            cpu_kernels.load()
            if self.device.type == "cpu" and dtype == torch.float32 and cfg.head_dim % 8 == 0
            else None
        )
        # And its norms, RoPE and SiLU: with the decode stack's arithmetic there, compiled
        # on CUDA, torch's ops elsewhere.
        kernels = self.attention_kernels
        if kernels is not None:
            self.glue = KernelGlue(kernels)
        elif wants_compiled_glue(self.device):
            self.glue = warmed_compiled_glue(self)
        else:
            self.glue = TORCH_GLUE

    def _decode_stack(self):
        """The whole decode step as one call into the CPU kernels, where every layer matrix
        is a decode weight on mashbox's kernels and activations are float32; None otherwise."""
        cfg, mats = self.cfg, ("wqkv", "wo", "w_gate_up", "w_down")
        usable = (
            self.device.type == "cpu"
            and self.dtype == torch.float32
            and cfg.d_model % 8 == 0
            and cfg.head_dim % 8 == 0
            and cfg.d_ff % 8 == 0
            and all(
                isinstance(w[m], DecodeWeight) and w[m].kernel is not None
                for w in self.layers
                for m in mats
            )
        )
        if not usable:
            return None
        # What the 4-bit matrices multiply (Q8 blocks take int16 whenever this is below 32,
        # int8 ones float32): any layer's, not the first's, which may have none.
        bits = min(w[m].activation_bits for w in self.layers for m in mats)
        absent = torch.empty(0)
        layers = [
            [w["attn_norm"], *w["wqkv"].decode_tensors]
            + [absent if t is None else t for t in (w["bqkv"], w["q_norm"], w["k_norm"])]
            + [*w["wo"].decode_tensors, w["ffn_norm"]]
            + [*w["w_gate_up"].decode_tensors, *w["w_down"].decode_tensors]
            for w in self.layers
        ]
        head = self._kernel_head()  # the stack's `logits` runs it after the layers
        return cpu_kernels.load().DecodeStack(
            layers, self.final_norm, self.cos, self.sin,
            cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps, bits, self.embedding.tensors,
            list(head.decode_tensors) if head else [], head.activation_bits if head else 32,
        )  # fmt: skip

    def _kernel_head(self) -> DecodeWeight | None:
        """The output matrix where it is a decode weight on mashbox's kernels."""
        head = self.lm_head
        return head if isinstance(head, DecodeWeight) and head.kernel is not None else None

    @property
    def batch_invariant(self) -> bool:
        """Whether a row's results have the same bits alone or in any batch: where its layers,
        head and attention all run on mashbox's kernels, each output one float32 sum in a
        fixed order. torch's float matmuls choose their blocking by the number of rows."""
        return (
            self.decode_stack is not None
            and self._kernel_head() is not None
            and self.attention_kernels is not None
        )

    @property
    def decode_kind(self) -> str:
        """What decode steps read, the most compact first: "int4" (or "int4a16", "int4a8",
        by what they multiply) if any layer matrix is the file's own 4-bit blocks, "q8_0" if
        any is its Q8_0 blocks (the rest int8 in all), "int8", or "float"."""
        return most_compact_kind(w for layer in self.layers for w in layer.values())

    @property
    def decode_nbytes(self) -> int:
        """Weight bytes one decode step reads (every layer and the head; the embedding only
        a row per token): what bounds decode speed by memory bandwidth."""
        layers = sum(nbytes(w) for layer in self.layers for w in layer.values() if w is not None)
        return layers + nbytes(self.lm_head) + nbytes(self.final_norm)

    @property
    def held_nbytes(self) -> int:
        """Bytes of weights this model holds: every form each matrix is kept in (a decode
        weight's float copy where it keeps one), the embedding and the norms, each storage
        counted once (a tied head may share the embedding's)."""
        held = [self.embedding, self.lm_head, self.final_norm, self.layers]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in tensors_in(held)}  # fmt: skip
        return sum(storages.values())

    def forward(self, token_ids: Tensor, positions: Tensor, attend, linear=linear) -> Tensor:
        """Run the decoder on flat tokens; `attend(layer, q, k, v)` owns the KV cache.

        token_ids and positions are [T]; returns the final hidden states [T, d_model].
        """
        cfg, glue, eps = self.cfg, self.glue, self.cfg.norm_eps
        x = self.embedding(token_ids)
        cos, sin = self.cos[positions], self.sin[positions]
        nq, nkv, hd = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.head_dim
        h = glue.rms_norm(x, self.layers[0]["attn_norm"], eps)
        for i, w in enumerate(self.layers):
            qkv = linear(h, w["wqkv"], w["bqkv"])
            # q and k heads side by side: one RoPE call for both.
            qk = qkv[:, : nq + nkv].view(-1, cfg.n_heads + cfg.n_kv_heads, hd)
            v = qkv[:, nq + nkv :].view(-1, cfg.n_kv_heads, hd)
            if w["q_norm"] is not None:
                q, k = qk[:, : cfg.n_heads], qk[:, cfg.n_heads :]
                qk = torch.cat([rms_norm(q, w["q_norm"], cfg.norm_eps),
                                rms_norm(k, w["k_norm"], cfg.norm_eps)], dim=1)  # fmt: skip
            qk = glue.apply_rope(qk, cos, sin)
            q, k = qk[:, : cfg.n_heads], qk[:, cfg.n_heads :]
            x, h = glue.add_rms_norm(x, linear(attend(i, q, k, v), w["wo"]), w["ffn_norm"], eps)
            down = linear(glue.silu_mul(linear(h, w["w_gate_up"])), w["w_down"])
            last = i + 1 == len(self.layers)
            x, h = glue.add_rms_norm(
                x, down, self.final_norm if last else self.layers[i + 1]["attn_norm"], eps
            )
        return h

    def logits(self, hidden: Tensor, *, row_invariant: bool = False) -> Tensor:
        """Project hidden states to float32 vocabulary logits. On mashbox's kernels every
        row's bits are those a decode step's head gives it, whatever the row count: the head's
        compact form, in pieces it takes whole (each row one sum in a fixed order; past
        `max_rows` a call would take the float matrix). Elsewhere `row_invariant` asks for
        the same of torch (`linear_in_blocks`)."""
        head = self._kernel_head()
        if head is not None:
            return _joined([head(piece) for piece in hidden.split(head.max_rows)]).float()
        return (linear_in_blocks if row_invariant else linear)(hidden, self.lm_head).float()

    def prefill(
        self, cache: KVCache, slot: int, start: int, token_ids: Tensor, *, all_rows: bool = False
    ) -> Tensor:
        """Write KV for a chunk of one slot at positions start..; return the last hidden state
        (or every row's, for pooling)."""
        hidden = self.prefill_many(cache, [(slot, start, token_ids)])
        return hidden if all_rows else hidden[-1]

    def prefill_many(self, cache: KVCache, chunks: list[tuple[int, int, Tensor]]) -> Tensor:
        """Write KV for chunks (slot, start, token_ids) of several slots in one forward, so
        the weights are read once for all of them: 8 prompts of 40 tokens take 0.67 s as one
        forward and 1.13 s one by one here. Each chunk attends to its own slot only. Returns
        every row's hidden state, chunk after chunk."""
        kernels = (
            self.attention_kernels if cache.k.dtype in (torch.float32, torch.float16) else None
        )
        spans, positions, offset = [], [], 0
        for slot, start, ids in chunks:
            n = ids.shape[0]
            end = start + n
            rows = torch.arange(start, end, device=self.device)
            # Row i (position start + i) sees every key up to and including its own position.
            keys = torch.arange(end, device=self.device)
            mask = None if start == 0 or kernels else keys[None, :] <= rows[:, None]
            spans.append((slot, start, end, offset, mask))
            positions.append(rows)
            offset += n

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            outs = []
            for slot, start, end, offset, mask in spans:
                rows = slice(offset, offset + end - start)
                cache.k[layer, slot, :, start:end] = k[rows].transpose(0, 1)
                cache.v[layer, slot, :, start:end] = v[rows].transpose(0, 1)
                if kernels is not None:
                    keys, values = cache.k[layer, slot], cache.v[layer, slot]
                    outs.append(kernels.prefill_attention(q[rows], keys, values, start))
                    continue
                out = F.scaled_dot_product_attention(
                    q[rows].transpose(0, 1)[None],
                    cache.k[layer, slot, :, :end][None].to(q.dtype),
                    cache.v[layer, slot, :, :end][None].to(q.dtype),
                    attn_mask=mask,
                    is_causal=mask is None,
                    enable_gqa=True,
                )
                outs.append(out[0].transpose(0, 1).reshape(end - start, -1))
            return outs[0] if len(outs) == 1 else torch.cat(outs)

        token_ids = torch.cat([ids for _, _, ids in chunks])
        return self.forward(token_ids, torch.cat(positions), attend)

    def decode_logits(
        self, cache: KVCache, slots: list[int], token_ids: list[int], positions: list[int]
    ) -> DecodeLogits:
        """Feed one token per slot; return float32 logits [len(slots), vocab] with each row's
        greedy pick and finiteness: the stack and the head in one call where both run on the
        kernels (the same bits as `decode`, then `logits`), in pieces of as many rows as
        the call takes (each row's bits what it has alone); else those two."""
        if n := self.fused_rows:
            pieces = [
                self.decode_stack.logits(
                    token_ids[i : i + n], positions[i : i + n], slots[i : i + n], cache.k, cache.v
                )
                for i in range(0, len(slots), n)
            ]
            values, best, finite = zip(*pieces, strict=True)
            return DecodeLogits(_joined(values), sum(best, []), sum(finite, []))
        ids = torch.tensor(token_ids, device=self.device)
        hidden = self.decode(cache, slots, ids, torch.tensor(positions, device=self.device))
        return DecodeLogits.of(self.logits(hidden))

    def decode(self, cache: KVCache, slots: list[int], token_ids: Tensor, positions: Tensor):
        """Feed one token per slot (a batch); return hidden states [len(slots), d_model]."""
        slot_index = torch.tensor(slots, device=self.device)
        if self.decode_stack is not None:  # INT8_MAX_ROWS rows a call: each row's bits alone
            x, n = self.embedding(token_ids), INT8_MAX_ROWS
            return _joined([
                self.decode_stack.forward(
                    x[i : i + n], positions[i : i + n], slot_index[i : i + n], cache.k, cache.v
                )
                for i in range(0, len(slots), n)
            ])  # fmt: skip
        lengths = [int(p) + 1 for p in positions.tolist()]

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            cache.k[layer, slot_index, :, positions] = k.to(cache.k.dtype)
            cache.v[layer, slot_index, :, positions] = v.to(cache.v.dtype)
            # Each row attends over its own filled length only, never over empty cache.
            rows = [
                F.scaled_dot_product_attention(
                    q[b, :, None][None],
                    cache.k[layer, s, :, :n][None].to(q.dtype),
                    cache.v[layer, s, :, :n][None].to(q.dtype),
                    enable_gqa=True,
                )[0, :, 0]
                for b, (s, n) in enumerate(zip(slots, lengths, strict=True))
            ]
            return torch.stack(rows).reshape(len(slots), -1)

        return self.forward(token_ids, positions, attend)

    def branch(
        self, cache: KVCache, slot: int, prefix: int, branches: list[tuple[list[int], list[int]]]
    ) -> Tensor:
        """Run suffixes that follow the first `prefix` positions of `slot` in one forward,
        without writing their KV: each branch is (suffix, leaves), its suffix causal and each
        leaf a one-token continuation of the whole suffix. Returns every row's hidden state,
        branch after branch, leaves after their suffix.

        Each branch attends to the shared prefix in place (a view of the slot, never copied)
        and to its own rows only, so its answer cannot depend on the other branches; the
        matmuls run in blocks of GEMM_ROW_BLOCK rows, so every row gets the same bits
        whatever the batch (tests/test_engine.py and, on the real model,
        tests/test_default_model.py check that).
        """
        spans, ids, positions = [], [], []
        for suffix, leaves in branches:
            n, m = len(suffix), len(leaves)
            spans.append((len(ids), n, m))
            ids += [*suffix, *leaves]
            positions += [*range(prefix, prefix + n), *[prefix + n] * m]
        masks = {(n, m): _tree_mask(n, m, self.device) for _, n, m in spans}
        scale = self.cfg.head_dim**-0.5
        kv_heads, groups = self.cfg.n_kv_heads, self.cfg.n_heads // self.cfg.n_kv_heads

        def grouped(x: Tensor) -> Tensor:
            """[rows, heads, dim] queries -> [1, kv_heads, groups * rows, dim]: each KV head
            with the query heads that share it, so keys are never repeated."""
            return x.float().transpose(0, 1).reshape(1, kv_heads, -1, x.shape[-1])

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            rows = q.shape[0]
            # Every row against the shared prefix at once, read in place from the slot...
            kp = cache.k[layer, slot, :, :prefix].float()[None]
            vp = cache.v[layer, slot, :, :prefix].float()[None]
            out_p, lse_p = _attention(grouped(q), kp, vp, None, scale)
            # ...and each branch against its own rows only.
            own = []
            for start, n, m in spans:
                end = start + n + m
                # Rounded as the cache would hold them: a decision sees what decoding sees.
                kb, vb = (
                    x[start:end].to(cache.k.dtype).float().transpose(0, 1)[None] for x in (k, v)
                )
                mask = masks[n, m].repeat(groups, 1)
                own.append(_attention(grouped(q[start:end]), kb, vb, mask, scale))
            split = (kv_heads, groups, -1)
            out_p, lse_p = out_p.reshape(*split, out_p.shape[-1]), lse_p.reshape(split)
            out_o = torch.cat([o.reshape(*split, o.shape[-1]) for o, _ in own], dim=2)
            lse_o = torch.cat([lse.reshape(split) for _, lse in own], dim=2)
            # One softmax over both key sets: weight each part by its share of the mass.
            lse = torch.logaddexp(lse_p, lse_o)
            out = out_p * (lse_p - lse).exp()[..., None] + out_o * (lse_o - lse).exp()[..., None]
            return (
                out.reshape(self.cfg.n_heads, rows, -1)
                .transpose(0, 1)
                .reshape(rows, -1)
                .to(q.dtype)
            )

        token_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return self.forward(token_ids, pos, attend, linear=linear_in_blocks)


def _joined(pieces) -> Tensor:
    """The pieces' rows as one tensor; one piece as it is. torch.cat of a vocabulary's logits
    wakes OpenMP's threads, which then spin beside the next step's kernels: a decode step
    of one row went from ~7 to ~10 ms through HTTP."""
    return pieces[0] if len(pieces) == 1 else torch.cat(list(pieces))


def _tree_mask(n: int, m: int, device) -> Tensor:
    """An additive mask over a branch's own rows: the suffix causal, each leaf seeing the
    whole suffix and itself."""
    rows = n + m
    sees = torch.ones(rows, rows, dtype=torch.bool, device=device).tril()
    sees[n:, n:] = torch.eye(m, dtype=torch.bool, device=device)
    return torch.zeros(rows, rows, device=device).masked_fill(~sees, -math.inf)


def _attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float):
    """Attention output and each row's log-sum-exp (float32, [1, heads, rows, ...]): the
    fused CPU kernel where there is one, plain math elsewhere."""
    if q.device.type == "cpu":
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        return flash(q, k, v, attn_mask=mask, scale=scale)
    scores = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask
    lse = scores.logsumexp(-1)
    return (scores - lse[..., None]).exp() @ v, lse
