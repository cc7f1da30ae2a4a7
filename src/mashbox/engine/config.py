"""Model hyper-parameters, read from GGUF metadata or an HF config.json."""

from __future__ import annotations

import attrs


@attrs.frozen
class ModelConfig:
    """A Llama-family decoder; Mistral, Qwen2 and Qwen3 differ only in these flags."""

    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    max_context: int
    rope_theta: float = 10000.0
    rope_scale: float = 1.0  # linear position scaling
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    qk_norm: bool = False
    tied_embeddings: bool = False


def from_gguf_fields(fields: dict, vocab_size: int, tied: bool, has_bias: bool) -> ModelConfig:
    """Build the config from GGUF key/values (already decoded to Python values)."""
    arch = fields["general.architecture"]
    if arch not in ("llama", "qwen2", "qwen3", "mistral"):
        raise ValueError(f"unsupported architecture {arch!r} (llama, qwen2, qwen3, mistral)")

    def get(key, default=None):
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    n_heads = int(get("attention.head_count"))
    d_model = int(get("embedding_length"))
    head_dim = int(fields.get(f"{arch}.attention.key_length", d_model // n_heads))
    scaling = fields.get(f"{arch}.rope.scaling.type")
    scale = float(fields.get(f"{arch}.rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
    return ModelConfig(
        arch=arch,
        n_layers=int(get("block_count")),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        d_ff=int(get("feed_forward_length")),
        vocab_size=vocab_size,
        max_context=int(get("context_length", 4096)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scale=scale,
        norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        qkv_bias=has_bias,
        qk_norm=arch == "qwen3",
        tied_embeddings=tied,
    )


def from_hf_config(cfg: dict) -> ModelConfig:
    """Build the config from a Hugging Face config.json."""
    arch_name = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
    arch = {
        "LlamaForCausalLM": "llama",
        "MistralForCausalLM": "mistral",
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
    }.get(arch_name)
    if arch is None:
        raise ValueError(f"unsupported architecture {arch_name!r}")
    n_heads = cfg["num_attention_heads"]
    scaling = cfg.get("rope_scaling") or {}
    linear = scaling.get("type", scaling.get("rope_type")) == "linear"
    return ModelConfig(
        arch=arch,
        n_layers=cfg["num_hidden_layers"],
        d_model=cfg["hidden_size"],
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads", n_heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        d_ff=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        max_context=cfg.get("max_position_embeddings", 4096),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rope_scale=float(scaling.get("factor", 1.0)) if linear else 1.0,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=arch == "qwen3",
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
