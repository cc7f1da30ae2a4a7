"""The GPU check of issue 13: the CUDA decode path against the CPU reference, then its speed.

1. Correctness, on a tiny random GGUF model (tests/tinymodels.py): 3 prompts, 32 greedy tokens
   each, through the Engine on the CPU (float32, the reference) and on the device (bf16) by
   the default torch path ("eager") and by fixed-shape decode ("graph": captured CUDA graphs,
   with either attention, "graph-indexed" for indexed_attention.py's); token agreement and
   the first decode step's largest logit difference.
2. Speed, on a random-weight model of Llama-3-8B shape in bf16, built on the device (no file):
   32 slots of ctx 8192, each holding a few hundred positions of random KV; decode steps at
   batch 1, 8 and 32 (the head included, sampling not), median of 20 after 3 warm-ups, for the
   per-row reference path, the fixed-shape function run eagerly, and its graph replays; and
   one more batch-1 row whose slot holds ~8,100 positions (an agent's conversation). Each for
   three decoders (CONFIGS): norms, RoPE and SiLU compiled (the default on CUDA) with
   attention over gathered copies (the default) or indexed_attention's, and torch's ops with
   gathered copies.
   The limit: a step must read every weight once, weight bytes / the card's memory bandwidth
   by its datasheet (DATASHEET_BANDWIDTH: 4.8 TB/s on an H200, 3.35 on an H100 SXM; for a
   card not listed, what the copy below moved, and the report says so); "of limit" is that
   time over the measured one. Beside it, what a 1 GiB
   device-to-device copy moves there, and batch-1 steps under torch's profiler, at the short
   and the long context: their kernels' count and time, and the costliest of them.

Prints a compact report, each part as soon as it is measured; with $OUT set, also writes it to
$OUT/gpu_check.json at the end. About 3-4 minutes on an H200 (2 before the indexed attention
and the long row: not timed since).

On this workplace's device machine: `bash bench/gpu_session.sh`, which runs this script
beside the rest of the GPU checks (its header has the device command and the wheels it needs).

Elsewhere, with a CUDA build of torch in the venv (`pip install torch` on a machine with a GPU;
`pip install -e .` for mashbox):  .venv/bin/python bench/gpu_check.py
The script itself, on a CPU, in seconds:  .venv/bin/python bench/gpu_check.py --smoke --device cpu
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]  # this tree's mashbox; tinymodels

from mashbox.engine import indexed_attention  # noqa: E402
from mashbox.engine.config import ModelConfig  # noqa: E402
from mashbox.engine.engine import Engine, compiles_so_far  # noqa: E402
from mashbox.engine.graph_decode import GraphDecoder, reads_in_place  # noqa: E402
from mashbox.engine.kv_cache import KVCache  # noqa: E402
from mashbox.engine.model import TORCH_GLUE, KernelGlue, Model  # noqa: E402
from support.tinymodels import no_tokenizer, random_weights, step_by_step, write_gguf  # noqa: E402

# Memory bandwidth by datasheet, bytes/s, for the names torch gives the cards this check may
# meet (most specific first). The device machine has been offered as an H200 and as an H100.
DATASHEET_BANDWIDTH = (
    ("H200", 4.8e12),  # HBM3e
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # SXM, "NVIDIA H100 80GB HBM3"
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),  # the 40 GB cards
)


def datasheet_bandwidth(device_name: str) -> float | None:
    """The card's memory bandwidth by its datasheet; None for a card not in the table."""
    return next((bw for key, bw in DATASHEET_BANDWIDTH if key in device_name), None)


LLAMA3_8B = ModelConfig(
    arch="llama", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128,
    d_ff=14336, vocab_size=128256, max_context=8192, rope_theta=500000.0,
)  # fmt: skip
SMOKE_SHAPE = ModelConfig(
    arch="llama", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16,
    d_ff=128, vocab_size=256, max_context=512,
)  # fmt: skip
TINY_VOCAB = 97


# 1. Correctness ---------------------------------------------------------------------------


@torch.inference_mode()
def first_decode_logits(engine: Engine, prompts, first_tokens: list[int]) -> torch.Tensor:
    """The logits of the first decode step after each prompt (its KV is still in the slot),
    fed the same tokens on every engine; float32 on the CPU."""
    device = engine.device
    ids = torch.tensor(first_tokens, device=device)
    positions = torch.tensor([len(p) for p in prompts], device=device)
    hidden = engine.decoder.decode(list(range(len(prompts))), ids, positions)
    return engine.model.logits(hidden).float().cpu()


def agreement(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for sa, sb in zip(a, b, strict=True) for x, y in zip(sa, sb, strict=True))


def correctness(device: str, workdir: Path, n_tokens: int = 32) -> dict:
    weights = random_weights(vocab=TINY_VOCAB, seed=7)
    path = write_gguf(workdir / "tiny.gguf", weights, no_tokenizer)
    # The long prompt crosses the L=256 context bucket while decoding; 3 rows pad to B=4.
    prompts = [(4, 8, 15, 16, 23, 42), tuple(i % TINY_VOCAB for i in range(240)), (9, 8, 7)]
    engines = {
        "cpu-float32": Engine(path, slots=4, ctx=512, device="cpu", graph_decode=False),
        f"{device}-eager": Engine(path, slots=4, ctx=512, device=device, graph_decode=False),
        f"{device}-graph": Engine(path, slots=4, ctx=512, device=device, graph_decode=True),
    }
    os.environ[indexed_attention.ENV] = "indexed"
    try:
        engines[f"{device}-graph-indexed"] = Engine(
            path, slots=4, ctx=512, device=device, graph_decode=True
        )
    finally:
        del os.environ[indexed_attention.ENV]
    tokens = {name: step_by_step(e, prompts, n_tokens) for name, e in engines.items()}
    first = [seq[0] for seq in tokens["cpu-float32"]]
    logits = {name: first_decode_logits(e, prompts, first) for name, e in engines.items()}
    total = len(prompts) * n_tokens

    def versus(name: str, base: str) -> dict:
        return {
            "tokens_equal": agreement(tokens[name], tokens[base]),
            "of": total,
            "max_logit_diff": float((logits[name] - logits[base]).abs().max()),
        }

    decoder = engines[f"{device}-graph"].decoder
    return {
        "model": "tiny llama (2 layers, d_model 64, vocab 97)",
        "vs_cpu_float32": {name: versus(name, "cpu-float32") for name in list(engines)[1:]},
        "graph_vs_eager": versus(f"{device}-graph", f"{device}-eager"),
        "graphs": len(decoder.graphs),
        "eager_reason": decoder.eager_reason,
        "indexed_compiled": engines[f"{device}-graph-indexed"].decoder.indexed is not None,
        "logit_scale": float(logits["cpu-float32"].abs().max()),
    }


# 2. Speed ---------------------------------------------------------------------------------


def random_model(cfg: ModelConfig, device, dtype, ctx: int) -> Model:
    """Random weights under GGUF names, made on the device (Q/K order is irrelevant here)."""
    generator = torch.Generator(device=device).manual_seed(0)

    def mat(rows: int, cols: int) -> torch.Tensor:
        w = torch.randn(rows, cols, generator=generator, device=device, dtype=dtype)
        return w.mul_(cols**-0.5)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    d, hd = cfg.d_model, cfg.head_dim
    tensors = {"token_embd.weight": mat(cfg.vocab_size, d), "output_norm.weight": ones(d)}
    tensors["output.weight"] = mat(cfg.vocab_size, d)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        tensors |= {
            p + "attn_norm.weight": ones(d),
            p + "attn_q.weight": mat(cfg.n_heads * hd, d),
            p + "attn_k.weight": mat(cfg.n_kv_heads * hd, d),
            p + "attn_v.weight": mat(cfg.n_kv_heads * hd, d),
            p + "attn_output.weight": mat(d, cfg.n_heads * hd),
            p + "ffn_norm.weight": ones(d),
            p + "ffn_gate.weight": mat(cfg.d_ff, d),
            p + "ffn_up.weight": mat(cfg.d_ff, d),
            p + "ffn_down.weight": mat(d, cfg.d_ff),
        }
    return Model(cfg, tensors, device, dtype, n_positions=ctx)


def median_seconds(step, device: torch.device, warmup: int, steps: int) -> float:
    """Median step time: CUDA events on a GPU (idle gaps while the host launches count),
    the wall clock elsewhere."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes a second of a large device-to-device copy, read plus written (the ceiling a
    decode step's weight reads can hope for); 0 off CUDA."""
    if device.type != "cuda":
        return 0.0
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, 3, 10)
    return 2 * src.numel() / seconds


def kernel_profile(step, top: int = 6) -> dict:
    """One step under torch's profiler: its kernels' count and summed time, the costliest."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    costliest = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "kernels": len(kernels),
        "kernel_us": round(sum(sum(v) for v in by_name.values()), 1),
        "top": [[name[:60], len(v), round(sum(v), 1)] for name, v in costliest],
    }


# What each timed decoder runs: its norms, RoPE and SiLU (the model's own, compiled on CUDA,
# or torch's ops) and its attention ("gathered": SDPA over copies of the rows' slots, the
# default; "indexed": indexed_attention.py, reading the slots in place).
CONFIGS = (("model's", "gathered"), ("model's", "indexed"), ("torch", "gathered"))


def glue_kind(glue) -> str:
    return (
        "torch" if glue is TORCH_GLUE else "kernels" if isinstance(glue, KernelGlue) else "compiled"
    )


@torch.inference_mode()
def speed(cfg, device: torch.device, *, slots, ctx, batches, warmup, steps, fill) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(cfg, device, dtype, ctx)
    glues = {"model's": model.glue, "torch": TORCH_GLUE}
    if model.glue is TORCH_GLUE:  # not compiled here (where it failed)
        glues.pop("torch")
    cache = KVCache(cfg, slots, ctx, device, dtype, scratch_slot=True)
    # As if each slot held some earlier prompt: `fill` positions of random KV...
    cache.k.normal_()
    cache.v.normal_()
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(fill[0], fill[1], (slots,), generator=generator).tolist()
    # ...and, for one more batch-1 row, an agent's long conversation: slot 0 nearly full.
    long_lengths = [ctx - warmup - steps - 64, *lengths[1:]]
    weight_bytes = model.decode_nbytes
    copy = copy_bandwidth(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bandwidth = datasheet_bandwidth(name)
    source = "datasheet" if bandwidth else "measured copy (card not in DATASHEET_BANDWIDTH)"
    bandwidth = bandwidth or copy or float("inf")
    report = {
        "shape": "llama-3-8b" if cfg == LLAMA3_8B else "smoke",
        "dtype": str(dtype).removeprefix("torch."),
        "slots": slots,
        "ctx": ctx,
        "weight_bytes": weight_bytes,
        "limit_ms": round(weight_bytes / bandwidth * 1e3, 3),
        "bandwidth": bandwidth,
        "bandwidth_source": source,
        "copy_bandwidth": copy,
        "capture": {},
        "profile_batch_1_eager": {},
        "max_memory_allocated": 0,
        "steps": [],
    }
    limit_s = weight_bytes / bandwidth
    print_speed_header(report)
    rows = report["steps"]
    for glue_name, attention in CONFIGS:
        if glue_name not in glues:
            continue
        model.glue = glues[glue_name]
        config = f"{glue_kind(model.glue)}/{attention}"
        compiles, t0 = compiles_so_far(), time.perf_counter()
        decoder = GraphDecoder(model, cache, indexed=attention == "indexed")
        capture = {
            "graphs": len(decoder.graphs),
            "compiles": compiles_so_far() - compiles,
            "seconds": round(time.perf_counter() - t0, 2),
            "eager_reason": decoder.eager_reason,
        }
        if attention == "indexed" and decoder.indexed is None:  # it did not compile
            capture["eager_reason"] = "indexed attention did not compile (see the log)"
        report["capture"][config] = capture
        print_capture(config, capture)
        if attention == "indexed" and decoder.indexed is None:
            continue
        modes = {
            "fixed-eager": lambda s, i, p, d=decoder: d.decode(s, i, p, eager=True),
            "graph": lambda s, i, p, d=decoder: d.decode(s, i, p),
        }
        if not rows:  # the model alone, per row: once
            modes = {"reference": lambda s, i, p: model.decode(cache, s, i, p), **modes}
        timed = speed_rows(
            cfg, model, cache, decoder, modes, lengths, batches, warmup, steps, limit_s
        )
        graph = {"graph": modes["graph"]}
        timed += speed_rows(
            cfg, model, cache, decoder, graph, long_lengths, (1,), warmup, steps, limit_s
        )
        timed = [{"config": config, **row} for row in timed]
        print_rows(timed)
        rows += timed
        if device.type == "cuda":
            for context, at in (("short", lengths[0]), ("long", long_lengths[0] + steps + 8)):
                one = (torch.tensor([7], device=device), torch.tensor([at], device=device))
                try:
                    profile = kernel_profile(
                        functools.partial(decoder.decode, [0], *one, eager=True)
                    )
                except Exception as e:  # a profile is a bonus: the numbers above stand alone
                    profile = {"kernels": 0, "kernel_us": 0, "top": [[repr(e), 0, 0]]}
                case = f"{config}, {context} context ({at + 1} keys)"
                report["profile_batch_1_eager"][case] = profile
                print_profile(case, profile)
    if device.type == "cuda":
        report["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    return report


def speed_rows(cfg, model, cache, decoder, modes, lengths, batches, warmup, steps, limit_s) -> list:
    device, rows = model.device, []
    for batch in batches:
        slots_b = list(range(batch))
        for mode, decode in modes.items():
            offset = [0]  # each step one position further, as decoding goes

            def step(slots_b=slots_b, decode=decode, offset=offset):
                positions = [lengths[s] + offset[0] for s in slots_b]
                offset[0] += 1
                ids = torch.randint(0, cfg.vocab_size, (len(slots_b),), device=device)
                model.logits(decode(slots_b, ids, torch.tensor(positions, device=device)))

            seconds = median_seconds(step, device, warmup, steps)
            longest = max(lengths[s] for s in slots_b) + offset[0]
            b, length = decoder.bucket(batch, longest)
            # Key rows read: the per-row reference reads its own lengths; the fixed-shape
            # step its bucket's rows once (indexed), all slots in place, or its bucket's
            # rows 3 times (gather, copy, attend).
            if decoder.indexed is not None:
                read_rows = b
            elif reads_in_place(b, cache.k.shape[1]):
                read_rows = cache.k.shape[1]
            else:
                read_rows = 3 * b
            kv_real = sum(lengths[s] + offset[0] for s in slots_b) * cache.bytes_per_token
            kv_bucketed = read_rows * length * cache.bytes_per_token
            rows.append(
                {
                    "batch": batch,
                    "mode": mode,
                    "ms": round(seconds * 1e3, 3),
                    "tok_s": round(batch / seconds, 1),
                    "of_limit": round(limit_s / seconds, 3),
                    "kv_bytes_real": kv_real,
                    "kv_bytes_read": kv_real if mode == "reference" else kv_bucketed,
                    "bucket": [b, length],
                }
            )
    return rows


# Report -----------------------------------------------------------------------------------


# Each part is printed as soon as it is measured: a run cut short by its timeout (a lent GPU's
# minutes are few) still shows everything it got to.


def print_correctness(c: dict) -> None:
    print(f"correctness: {c['model']}, 3 prompts x 32 greedy tokens, first-step logits")
    print(f"  (logits up to {c['logit_scale']:.2f} in magnitude)")
    for name, v in [*c["vs_cpu_float32"].items(), ("graph vs eager", c["graph_vs_eager"])]:
        print(
            f"  {name:<22} tokens equal {v['tokens_equal']:>3}/{v['of']}"
            f"  max |logit diff| {v['max_logit_diff']:.4f}"
        )
    print(f"  graphs captured: {c['graphs']} {c['eager_reason'] or ''}".rstrip())
    print(f"  indexed attention compiled: {c['indexed_compiled']}", flush=True)


def print_speed_header(s: dict) -> None:
    print(
        f"speed: {s['shape']} {s['dtype']}, {s['slots']} slots, ctx {s['ctx']}; weights "
        f"{s['weight_bytes'] / 1e9:.2f} GB/step, limit {s['limit_ms']:.3f} ms at "
        f"{s['bandwidth'] / 1e12:.2f} TB/s, {s['bandwidth_source']}"
        f" (a copy moved {s['copy_bandwidth'] / 1e12:.2f} TB/s)"
    )
    print("  batch config            mode         ms/step     tok/s  of limit  KV MB: needed / "
          "read   B,L", flush=True)  # fmt: skip


def print_capture(config: str, cap: dict) -> None:
    print(f"  {config}: {cap['graphs']} graphs, {cap['compiles']} compiles in all, "
          f"{cap['seconds']} s {cap['eager_reason']}", flush=True)  # fmt: skip


def print_rows(rows: list) -> None:
    for r in rows:
        print(
            f"  {r['batch']:>5} {r['config']:<17} {r['mode']:<12} {r['ms']:>8.3f}"
            f" {r['tok_s']:>9.1f}"
            f"  {r['of_limit']:>8.3f}  {r['kv_bytes_real'] / 1e6:>10.1f} /"
            f" {r['kv_bytes_read'] / 1e6:<10.1f} {r['bucket'][0]},{r['bucket'][1]}",
            flush=True,
        )


def print_profile(case: str, prof: dict) -> None:
    print(f"  {case}, batch 1 eager: {prof['kernels']} kernels, {prof['kernel_us']} us")
    for name, count, us in prof["top"]:
        print(f"      {us:>9.1f} us {count:>5}x {name}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape, in seconds")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # a check of the script, not of the CPU
    if args.smoke:
        shape = dict(slots=4, ctx=512, batches=(1, 2, 4), warmup=1, steps=3, fill=(100, 300))
        cfg = SMOKE_SHAPE
    else:
        shape = dict(slots=32, ctx=8192, batches=(1, 8, 32), warmup=3, steps=20, fill=(200, 500))
        cfg = LLAMA3_8B
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {"device": name, "torch": torch.__version__}
    print(f"gpu_check on {name} (torch {torch.__version__})", flush=True)
    with tempfile.TemporaryDirectory() as workdir:
        report["correctness"] = correctness(args.device, Path(workdir))
    print_correctness(report["correctness"])
    report["speed"] = speed(cfg, device, **shape)
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "gpu_check.json"
        out.write_text(json.dumps(report, indent=1))
        print(f"report written to {out}")


if __name__ == "__main__":
    main()
