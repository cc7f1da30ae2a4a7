"""A Llama-family decoder over static per-slot KV caches (Llama, Mistral, Qwen2, Qwen3)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import ModelConfig


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm in float32 whatever the activation dtype, as the reference models do."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


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


INT8_MAX_ROWS = 16  # up to this many rows (decode batches) use the int8 weights


class Int8Weight:
    """A weight kept twice: float for prefill-sized batches, int8 per output channel with
    bf16 scales for decode, where reading the weights is the whole cost (4x fewer bytes)."""

    def __init__(self, w: Tensor):
        self.w = w
        scale = w.float().abs().amax(dim=1).clamp_min(1e-12) / 127.0
        self.q = torch.round(w.float() / scale[:, None]).to(torch.int8).contiguous()
        self.scale = scale.to(torch.bfloat16)

    def __call__(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        if x.shape[0] > INT8_MAX_ROWS:
            return F.linear(x, self.w, bias)
        # The int8 kernel wants bf16 activations (float32 ones take a scalar path).
        y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.q, self.scale)
        y = y.to(x.dtype)
        return y + bias if bias is not None else y


def linear(x: Tensor, w, bias: Tensor | None = None) -> Tensor:
    """F.linear, or the int8 decode path for an Int8Weight."""
    return w(x, bias) if isinstance(w, Int8Weight) else F.linear(x, w, bias)


class KVCache:
    """One whole context per slot: k/v are [layers, slots, kv_heads, ctx, head_dim]."""

    def __init__(self, cfg: ModelConfig, slots: int, ctx: int, device, dtype):
        shape = (cfg.n_layers, slots, cfg.n_kv_heads, ctx, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    @property
    def bytes_per_token(self) -> int:
        layers, _, heads, _, dim = self.k.shape
        return 2 * layers * heads * dim * self.k.element_size()

    def copy_out(self, slot: int, n: int) -> tuple[Tensor, Tensor]:
        """The first n positions of a slot, copied to host memory."""
        k, v = self.k[:, slot, :, :n], self.v[:, slot, :, :n]
        return k.to("cpu", copy=True), v.to("cpu", copy=True)

    def copy_in(self, slot: int, saved: tuple[Tensor, Tensor], n: int) -> None:
        """Put the first n positions of a saved prefix back into a slot."""
        k, v = saved
        self.k[:, slot, :, :n].copy_(k[:, :, :n])
        self.v[:, slot, :, :n].copy_(v[:, :, :n])


class Model:
    """Weights as plain tensors and a forward pass over flat token batches."""

    def __init__(
        self, cfg: ModelConfig, tensors: dict, device, dtype, n_positions: int = 0, int8=False
    ):
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype

        def t(name: str) -> Tensor:
            return tensors[name].to(device=self.device, dtype=dtype)

        def maybe(name: str) -> Tensor | None:
            return t(name) if name in tensors else None

        self.embed = t("token_embd.weight")
        self.lm_head = self.embed if cfg.tied_embeddings else t("output.weight")
        self.final_norm = t("output_norm.weight")
        self.layers = []
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            self.layers.append(
                {
                    "attn_norm": t(p + "attn_norm.weight"),
                    # q, k and v as one matrix: one matmul instead of three.
                    "wqkv": torch.cat(
                        [t(p + "attn_q.weight"), t(p + "attn_k.weight"), t(p + "attn_v.weight")]
                    ),
                    "bqkv": (
                        torch.cat(
                            [t(p + "attn_q.bias"), t(p + "attn_k.bias"), t(p + "attn_v.bias")]
                        )
                        if cfg.qkv_bias
                        else None
                    ),
                    "q_norm": maybe(p + "attn_q_norm.weight"),
                    "k_norm": maybe(p + "attn_k_norm.weight"),
                    "wo": t(p + "attn_output.weight"),
                    "ffn_norm": t(p + "ffn_norm.weight"),
                    "w_gate_up": torch.cat([t(p + "ffn_gate.weight"), t(p + "ffn_up.weight")]),
                    "w_down": t(p + "ffn_down.weight"),
                }
            )
        self.cos, self.sin = rope_tables(cfg, max(n_positions, cfg.max_context), self.device)
        if int8:
            for layer in self.layers:
                for name in ("wqkv", "wo", "w_gate_up", "w_down"):
                    layer[name] = Int8Weight(layer[name])
            self.lm_head = Int8Weight(self.lm_head)

    def forward(self, token_ids: Tensor, positions: Tensor, attend) -> Tensor:
        """Run the decoder on flat tokens; `attend(layer, q, k, v)` owns the KV cache.

        token_ids and positions are [T]; returns the final hidden states [T, d_model].
        """
        cfg = self.cfg
        x = F.embedding(token_ids, self.embed)
        cos, sin = self.cos[positions], self.sin[positions]
        nq, nkv, hd = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.head_dim
        for i, w in enumerate(self.layers):
            h = rms_norm(x, w["attn_norm"], cfg.norm_eps)
            qkv = linear(h, w["wqkv"], w["bqkv"])
            q = qkv[:, :nq].view(-1, cfg.n_heads, hd)
            k = qkv[:, nq : nq + nkv].view(-1, cfg.n_kv_heads, hd)
            v = qkv[:, nq + nkv :].view(-1, cfg.n_kv_heads, hd)
            if w["q_norm"] is not None:
                q = rms_norm(q, w["q_norm"], cfg.norm_eps)
                k = rms_norm(k, w["k_norm"], cfg.norm_eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            x = x + linear(attend(i, q, k, v), w["wo"])
            h = rms_norm(x, w["ffn_norm"], cfg.norm_eps)
            gate, up = linear(h, w["w_gate_up"]).chunk(2, dim=-1)
            x = x + linear(F.silu(gate) * up, w["w_down"])
        return rms_norm(x, self.final_norm, cfg.norm_eps)

    def logits(self, hidden: Tensor) -> Tensor:
        """Project hidden states to float32 vocabulary logits."""
        return linear(hidden, self.lm_head).float()

    def prefill(
        self, cache: KVCache, slot: int, start: int, token_ids: Tensor, *, all_rows: bool = False
    ) -> Tensor:
        """Write KV for a chunk of one slot at positions start..; return the last hidden state
        (or every row's, for pooling)."""
        n = token_ids.shape[0]
        end = start + n
        positions = torch.arange(start, end, device=self.device)
        if start == 0:
            mask = None
        else:
            # Row i (position start + i) sees every key up to and including its own position.
            keys = torch.arange(end, device=self.device)
            mask = keys[None, :] <= positions[:, None]

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            cache.k[layer, slot, :, start:end] = k.transpose(0, 1)
            cache.v[layer, slot, :, start:end] = v.transpose(0, 1)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                cache.k[layer, slot, :, :end][None],
                cache.v[layer, slot, :, :end][None],
                attn_mask=mask,
                is_causal=mask is None,
                enable_gqa=True,
            )
            return out[0].transpose(0, 1).reshape(n, -1)

        hidden = self.forward(token_ids, positions, attend)
        return hidden if all_rows else hidden[-1]

    def decode(self, cache: KVCache, slots: list[int], token_ids: Tensor, positions: Tensor):
        """Feed one token per slot (a batch); return hidden states [len(slots), d_model]."""
        slot_index = torch.tensor(slots, device=self.device)
        lengths = [int(p) + 1 for p in positions.tolist()]

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            cache.k[layer, slot_index, :, positions] = k
            cache.v[layer, slot_index, :, positions] = v
            # Each row attends over its own filled length only, never over empty cache.
            rows = [
                F.scaled_dot_product_attention(
                    q[b, :, None][None],
                    cache.k[layer, s, :, :n][None],
                    cache.v[layer, s, :, :n][None],
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
        and to its own rows only, so its answer cannot depend on the other branches; with at
        least MIN_GEMM_ROWS rows the float32 CPU matmuls give every row the same bits
        whatever the batch (tests/test_engine.py checks that).
        """
        spans, ids, positions = [], [], []
        rows = sum(len(suffix) + len(leaves) for suffix, leaves in branches)
        if rows < MIN_GEMM_ROWS:  # a padding branch, read by no one
            branches = [*branches, ([0] * (MIN_GEMM_ROWS - rows), [])]
        for suffix, leaves in branches:
            n, m = len(suffix), len(leaves)
            spans.append((len(ids), n, m))
            ids += [*suffix, *leaves]
            positions += [*range(prefix, prefix + n), *[prefix + n] * m]
        masks = {(n, m): _tree_mask(n, m, self.device) for _, n, m in spans}
        scale = self.cfg.head_dim**-0.5
        groups = self.cfg.n_heads // self.cfg.n_kv_heads

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            kp = cache.k[layer, slot, :, :prefix].float()  # [kv_heads, prefix, head_dim]
            vp = cache.v[layer, slot, :, :prefix].float()
            out = []
            for start, n, m in spans:
                rows = n + m
                # Query heads grouped by their KV head: [kv_heads, groups * rows, head_dim].
                qb = q[start : start + rows].float().transpose(0, 1)
                qb = qb.reshape(self.cfg.n_kv_heads, groups * rows, -1)
                kb = k[start : start + rows].float().transpose(0, 1)
                vb = v[start : start + rows].float().transpose(0, 1)
                own = (qb @ kb.transpose(1, 2)) * scale
                own = own.masked_fill(~masks[n, m].repeat(groups, 1), -math.inf)
                shared = (qb @ kp.transpose(1, 2)) * scale
                # One softmax over the prefix's keys and the branch's own keys.
                top = torch.maximum(shared.amax(-1, keepdim=True), own.amax(-1, keepdim=True))
                es, eo = (shared - top).exp(), (own - top).exp()
                mixed = (es @ vp + eo @ vb) / (es.sum(-1, keepdim=True) + eo.sum(-1, keepdim=True))
                mixed = mixed.reshape(self.cfg.n_heads, rows, -1).transpose(0, 1)
                out.append(mixed.reshape(rows, -1).to(q.dtype))
            return torch.cat(out)

        token_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return self.forward(token_ids, pos, attend)


# Below this many rows, CPU sgemm takes small-M paths whose rounding depends on M.
MIN_GEMM_ROWS = 16


def _tree_mask(n: int, m: int, device) -> Tensor:
    """Which of a branch's own rows each row sees: the suffix causally, each leaf the whole
    suffix and itself."""
    rows = n + m
    mask = torch.ones(rows, rows, dtype=torch.bool, device=device).tril()
    mask[n:, n:] = torch.eye(m, dtype=torch.bool, device=device)
    return mask
