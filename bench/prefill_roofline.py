"""A long prompt's prefill against the machine's FLOP/s: where the time goes (layer matmuls,
attention, the rest) and how close each comes to the practical peak.

    python bench/prefill_roofline.py                                  # SmolLM2, 2,048 tokens
    python bench/prefill_roofline.py --model qwen2.5-coder-0.5b-instruct --tokens 20480

The Engine alone (no server), the prompt fed in --chunk-token chunks as the scheduler feeds
it (`--prefill-chunk`). FLOPs: 2 per weight per token for the layer matmuls, 4 * keys *
head_dim per query head per layer for attention (QK^T and AV over the keys each row sees).
The peak is measured, not quoted: float32 sgemm (torch.mm, MKL) of 2048 x 2048 matrices on
the same threads, best of 5. On 2 cores nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from mashbox.engine.engine import Engine
from mashbox.registry import DEFAULT_MODEL, default_models_dir, fetch, resolve


def sgemm_peak(n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of float32 torch.mm at n x n x n, best of `repeats`."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = min(_seconds(lambda: torch.mm(a, b)) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def layer_weights(engine: Engine) -> int:
    """Weights of the layer matrices one token multiplies (q/k/v, o, gate/up, down)."""
    return sum(
        layer[name].w.numel() if hasattr(layer[name], "w") else layer[name].numel()
        for layer in engine.model.layers
        for name in ("wqkv", "wo", "w_gate_up", "w_down")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--decode-weights", default="int4a16")
    args = parser.parse_args()
    ref = resolve(args.model)
    path = fetch(ref, default_models_dir())
    engine = Engine(path, slots=1, ctx=args.tokens + 8, decode_weights=args.decode_weights)
    cfg = engine.model.cfg
    peak = sgemm_peak()
    print(f"{ref.id}, {args.tokens} tokens in chunks of {args.chunk}, {torch.get_num_threads()} "
          f"threads; float32 sgemm peak here: {peak:.1f} GFLOP/s")  # fmt: skip

    attention_s = 0.0
    original = F.scaled_dot_product_attention

    def timed(*a, **k):
        nonlocal attention_s
        t0 = time.perf_counter()
        out = original(*a, **k)
        attention_s += time.perf_counter() - t0
        return out

    ids = torch.randint(100, cfg.vocab_size - 100, (args.tokens,), generator=torch.Generator())
    F.scaled_dot_product_attention = timed
    total = 0.0
    with torch.inference_mode():
        for start in range(0, args.tokens, args.chunk):
            t0 = time.perf_counter()
            engine.model.prefill(engine.cache, 0, start, ids[start : start + args.chunk])
            total += time.perf_counter() - t0
    F.scaled_dot_product_attention = original

    n = args.tokens
    matmul_flop = 2 * layer_weights(engine) * n
    # Row p sees p + 1 keys: sum over rows = n (n + 1) / 2.
    attention_flop = 4 * cfg.head_dim * cfg.n_heads * cfg.n_layers * n * (n + 1) / 2
    rest_s = total - attention_s
    print(f"total {total:.2f} s: {n / total:.0f} tokens/s, "
          f"{(matmul_flop + attention_flop) / total / 1e9:.1f} GFLOP/s overall "
          f"({(matmul_flop + attention_flop) / total / 1e9 / peak:.0%} of sgemm's)")  # fmt: skip
    for part, flop, seconds in (
        ("attention", attention_flop, attention_s),
        ("matmuls and the rest", matmul_flop, rest_s),
    ):
        rate = flop / seconds / 1e9
        print(f"  {part:22} {seconds:7.2f} s  {flop / 1e12:6.2f} TFLOP  {rate:6.1f} GFLOP/s "
              f"({rate / peak:.0%} of sgemm's)")  # fmt: skip


if __name__ == "__main__":
    main()
