"""The engine alone: loading, KV-cached forward against a plain reference, sampling."""

from __future__ import annotations

import math

import attrs
import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mashbox.engine import weights as weights_mod
from mashbox.engine.dequant import dequantize
from mashbox.engine.engine import Engine
from mashbox.engine.sampling import apply_penalties, sample, uniforms
from mashbox.protocol import Admit, Branch, Decide, Decode, Prefill, SamplingParams, Step
from support.tinymodels import no_tokenizer, random_weights, write_gguf

VOCAB = 97


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    arch = request.param
    w = random_weights(vocab=VOCAB, qkv_bias=arch == "qwen2", tied=arch == "qwen2", seed=3)
    path = write_gguf(tmp_path_factory.mktemp(arch) / "m.gguf", w, no_tokenizer, arch=arch)
    return arch, w, path


def reference_hidden(w: dict, ids: list[int], n_heads=4, n_kv=2, eps=1e-5, theta=10000.0):
    """A plain full-sequence forward, written independently of mashbox's model."""
    t = {k: torch.from_numpy(v) for k, v in w.items()}
    x = t["token_embd.weight"][torch.tensor(ids)]
    n = len(ids)
    hd = x.shape[1] // n_heads
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    cos, sin = torch.cat([ang.cos()] * 2, -1).float(), torch.cat([ang.sin()] * 2, -1).float()

    def norm(v, g):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * g

    def rot(v):  # [heads, n, hd]
        a, b = v[..., : hd // 2], v[..., hd // 2 :]
        return v * cos + torch.cat([-b, a], -1) * sin

    layers = sum(1 for k in w if k.endswith("attn_norm.weight"))
    for i in range(layers):
        p = f"blk.{i}."
        h = norm(x, t[p + "attn_norm.weight"])
        q = h @ t[p + "attn_q.weight"].T + t.get(p + "attn_q.bias", 0)
        k = h @ t[p + "attn_k.weight"].T + t.get(p + "attn_k.bias", 0)
        v = h @ t[p + "attn_v.weight"].T + t.get(p + "attn_v.bias", 0)
        q = rot(q.view(n, n_heads, hd).transpose(0, 1))
        k = rot(k.view(n, n_kv, hd).transpose(0, 1)).repeat_interleave(n_heads // n_kv, 0)
        v = v.view(n, n_kv, hd).transpose(0, 1).repeat_interleave(n_heads // n_kv, 0)
        att = (q @ k.transpose(1, 2)) / hd**0.5
        att = att.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
        o = (att.softmax(-1) @ v).transpose(0, 1).reshape(n, -1)
        x = x + o @ t[p + "attn_output.weight"].T
        h = norm(x, t[p + "ffn_norm.weight"])
        x = (
            x
            + (F.silu(h @ t[p + "ffn_gate.weight"].T) * (h @ t[p + "ffn_up.weight"].T))
            @ t[p + "ffn_down.weight"].T.contiguous()
        )
    return norm(x, t["output_norm.weight"])


def test_gguf_loads_the_weights_that_were_written(tiny):
    arch, w, path = tiny
    loaded = weights_mod.load(path)
    assert loaded.config.arch == arch
    assert loaded.config.tied_embeddings == (arch == "qwen2")
    for name, array in w.items():
        np.testing.assert_array_equal(loaded.tensors[name].numpy(), array, err_msg=name)


def test_chunked_prefill_and_decode_match_the_reference(tiny):
    _, w, path = tiny
    engine = Engine(path, slots=3, ctx=64)
    ids = [5, 17, 3, 88, 42, 7, 19, 60, 2, 33, 71, 8]
    ref = reference_hidden(w, ids)
    cache, model = engine.cache, engine.model
    # Prefill the first 7 tokens in two chunks into slot 2, then decode the rest one by one.
    model.prefill(cache, 2, 0, torch.tensor(ids[:4]))
    h = model.prefill(cache, 2, 4, torch.tensor(ids[4:7]))
    torch.testing.assert_close(h, ref[6], rtol=1e-4, atol=1e-4)
    for pos in range(7, len(ids)):
        h = model.decode(cache, [2], torch.tensor([ids[pos]]), torch.tensor([pos]))
        torch.testing.assert_close(h[0], ref[pos], rtol=1e-4, atol=1e-4)


def test_prefills_of_several_slots_in_one_forward_match_the_reference(tiny):
    """One forward for a whole prompt in slot 0 and the rest of one in slot 1 (its first
    token already cached): each chunk attends to its own slot only."""
    _, w, path = tiny
    engine = Engine(path, slots=3, ctx=64)
    a, b = [5, 17, 3, 88, 42, 7], [9, 8, 7, 60]
    model, cache = engine.model, engine.cache
    model.prefill(cache, 1, 0, torch.tensor(b[:1]))
    hidden = model.prefill_many(cache, [(0, 0, torch.tensor(a)), (1, 1, torch.tensor(b[1:]))])
    torch.testing.assert_close(hidden[: len(a)], reference_hidden(w, a), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hidden[len(a) :], reference_hidden(w, b)[1:], rtol=1e-4, atol=1e-4)
    # The caches hold what decoding needs: the next token of each matches the reference.
    h = model.decode(cache, [0, 1], torch.tensor([19, 33]), torch.tensor([len(a), len(b)]))
    torch.testing.assert_close(h[0], reference_hidden(w, [*a, 19])[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(h[1], reference_hidden(w, [*b, 33])[-1], rtol=1e-4, atol=1e-4)


def test_batched_decode_rows_are_independent(tiny):
    _, w, path = tiny
    engine = Engine(path, slots=3, ctx=64)
    a, b = [1, 2, 3, 4, 5, 6], [9, 8, 7]
    ref_a, ref_b = reference_hidden(w, a), reference_hidden(w, b)
    engine.model.prefill(engine.cache, 0, 0, torch.tensor(a[:-1]))
    engine.model.prefill(engine.cache, 1, 0, torch.tensor(b[:-1]))
    h = engine.model.decode(
        engine.cache, [1, 0], torch.tensor([b[-1], a[-1]]), torch.tensor([len(b) - 1, len(a) - 1])
    )
    torch.testing.assert_close(h[0], ref_b[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(h[1], ref_a[-1], rtol=1e-4, atol=1e-4)


def test_engine_steps_greedy_tokens_equal_reference(tiny):
    _, w, path = tiny
    engine = Engine(path, slots=2, ctx=64)
    prompt = [4, 8, 15, 16, 23, 42]
    greedy = SamplingParams()
    res = engine.step(
        Step(
            admits=(Admit(1, greedy, tuple(prompt)),),
            prefills=(Prefill(1, 0, tuple(prompt), True),),
        )
    )
    seq = prompt + [res.tokens[1]]
    for _ in range(5):
        res = engine.step(Step(decodes=(Decode(1, seq[-1], len(seq) - 1),)))
        seq.append(res.tokens[1])
    expected = list(prompt)
    for _ in range(6):
        hidden = reference_hidden(w, expected)
        logits = hidden[-1] @ torch.from_numpy(w.get("output.weight", w["token_embd.weight"])).T
        expected.append(int(logits.argmax()))
    assert seq == expected


def reference_logprobs(w: dict, ids: list[int]) -> torch.Tensor:
    hidden = reference_hidden(w, ids)
    head = torch.from_numpy(w.get("output.weight", w["token_embd.weight"]))
    return torch.log_softmax(hidden[-1] @ head.T, -1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_log_probabilities_are_the_models_before_sampling(tiny, temperature):
    """Each sampled token's log-prob and the 5 likeliest tokens' are the model's float32
    log-softmax at its position (the independent reference), whatever the temperature; a
    slot that asks for none gets none."""
    _, w, path = tiny
    engine = Engine(path, slots=2, ctx=64)
    prompt = (4, 8, 15, 16, 23, 42)
    asks = SamplingParams(temperature=temperature, seed=5, logprobs=5)
    res = engine.step(
        Step(
            admits=(Admit(0, asks, prompt), Admit(1, SamplingParams(), prompt)),
            prefills=(Prefill(0, 0, prompt, True), Prefill(1, 0, prompt, True)),
        )
    )
    seq, readings = list(prompt), []
    for _ in range(6):
        assert 1 not in res.logprobs
        readings.append((list(seq), res.tokens[0], res.logprobs[0]))
        seq.append(res.tokens[0])
        res = engine.step(Step(decodes=(Decode(0, seq[-1], len(seq) - 1),)))
    for ids, token, (chosen, top) in readings:
        ref = reference_logprobs(w, ids)
        assert chosen == pytest.approx(float(ref[token]), abs=1e-4)
        best = ref.topk(5)
        assert [t for t, _ in top] == best.indices.tolist()
        assert [v for _, v in top] == pytest.approx(best.values.tolist(), abs=1e-4)
        assert sum(math.exp(v) for _, v in top) <= 1 + 1e-6
        if temperature == 0.0:
            assert top[0][0] == token  # greedy takes the likeliest


def test_decide_reads_branches_after_the_prefix_like_whole_prompts(tiny):
    """Each branch (suffix, leaves) reads what the whole prompt prefix + suffix (+ leaf)
    gives, although the suffixes share one forward and are never written to the slot."""
    _, w, path = tiny
    engine = Engine(path, slots=2, ctx=64)
    prefix = [4, 8, 15, 16, 23, 42, 5]
    branches = (
        Branch((7, 9, 11), ((1, 2, 3), (5, 6), (90, 1)), leaves=(2, 3)),
        Branch((30,), ((4, 50),)),
        Branch((12, 13, 14, 15, 16), ((8,), (9, 10)), leaves=(8,)),
    )
    result = engine.step(
        Step(
            admits=(Admit(1, SamplingParams(), tuple(prefix)),),
            prefills=(Prefill(1, 0, tuple(prefix), False),),
            decides=(Decide(1, len(prefix), branches),),
        )
    )
    assert result.tokens == {}
    reads = result.decisions[1]
    for branch, got in zip(branches, reads, strict=True):
        ids = prefix + list(branch.token_ids)
        contexts = [ids] + [ids + [leaf] for leaf in branch.leaves]
        for context, candidates, values in zip(contexts, branch.candidates, got, strict=True):
            expected = reference_logprobs(w, context)[list(candidates)]
            torch.testing.assert_close(torch.tensor(values), expected, rtol=1e-4, atol=1e-4)
    # The slot still holds the prefix alone: a decode after it sees no suffix.
    h = engine.model.decode(engine.cache, [1], torch.tensor([3]), torch.tensor([len(prefix)]))
    torch.testing.assert_close(h[0], reference_hidden(w, prefix + [3])[-1], rtol=1e-4, atol=1e-4)


def test_a_long_question_written_in_pieces_then_read_reads_the_whole_prompt(tiny):
    """A question longer than a chunk, as the batch core runs it (`Batch._read`): its suffix
    written after the prefix a piece a step, beside another slot's prompt, then its last
    piece and leaves read. Each read is what the whole prompt gives; the next question's
    pieces overwrite the first's, and the prefix stays as it was."""
    _, w, path = tiny
    engine = Engine(path, slots=2, ctx=64)
    prefix = (4, 8, 15, 16, 23, 42, 5)
    other = (3, 1, 4, 1, 5, 9, 2, 6)
    piece = 4
    first = Branch(tuple(range(30, 41)), ((1, 2), (5, 6), (7,)), leaves=(2, 3))
    second = Branch(tuple(range(50, 57)), ((8, 9),))
    engine.step(
        Step(
            admits=(Admit(0, SamplingParams(), prefix), Admit(1, SamplingParams(), other)),
            prefills=(Prefill(0, 0, prefix, False),),
        )
    )

    def read(branch: Branch, beside: tuple[int, ...]):
        tail = (len(branch.token_ids) - 1) // piece * piece
        for start in range(0, tail, piece):
            chunk = branch.token_ids[start : start + piece]
            prefills = [Prefill(0, len(prefix) + start, chunk, False, alone=True)]
            if beside:  # another slot's prompt shares the forward
                prefills.append(Prefill(1, start, beside[start : start + piece], False))
            engine.step(Step(prefills=tuple(prefills)))
        rest = attrs.evolve(branch, token_ids=branch.token_ids[tail:])
        step = Step(decides=(Decide(0, len(prefix) + tail, (rest,)),))
        return engine.step(step).decisions[0][0]

    for branch in (first, second):
        got = read(branch, other)
        ids = list(prefix) + list(branch.token_ids)
        contexts = [ids] + [ids + [leaf] for leaf in branch.leaves]
        for context, candidates, values in zip(contexts, branch.candidates, got, strict=True):
            expected = reference_logprobs(w, context)[list(candidates)]
            torch.testing.assert_close(torch.tensor(values), expected, rtol=1e-4, atol=1e-4)
    assert read(first, ()) == read(first, other)  # the same bits whatever shares its steps


def test_a_branch_reads_the_same_alone_and_among_others(tiny):
    _, _, path = tiny
    engine = Engine(path, slots=1, ctx=64)
    prefix = (4, 8, 15, 16, 23, 42)
    target = Branch((7, 9, 11), ((1, 2, 3), (5, 6)), leaves=(2,))
    others = [Branch(tuple(range(10 + i, 14 + 2 * i)), ((1, 2),)) for i in range(5)]
    engine.step(
        Step(admits=(Admit(0, SamplingParams(), prefix),), prefills=(Prefill(0, 0, prefix, False),))
    )

    def read(branches):
        step = Step(decides=(Decide(0, len(prefix), tuple(branches)),))
        return engine.step(step).decisions[0]

    alone = read([target])[0]
    assert read([*others[:2], target, *others[2:]])[2] == alone
    assert read([target, *others])[0] == alone


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_torch_dequantization_matches_gguf(qtype):
    qt = gguf.GGMLQuantizationType[qtype]
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    raw = gguf.quants.quantize(x, qt)
    expected = gguf.quants.dequantize(raw, qt)
    np.testing.assert_array_equal(dequantize(raw, qt, (8, 64)).numpy(), expected)


@pytest.mark.parametrize(("qtype", "block_bytes", "halves"), [("Q5_0", 22, 1), ("Q5_1", 24, 2)])
def test_torch_q5_dequantization_matches_gguf(qtype, block_bytes, halves):
    """Any bytes are a valid block once the f16 scale fields hold finite numbers."""
    qt = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, size=(8, 2 * block_bytes), dtype=np.uint8)
    for block in range(2):
        for h in range(halves):
            start = block * block_bytes + 2 * h
            raw[:, start : start + 2] = (
                rng.uniform(-0.1, 0.1, 8).astype(np.float16).view(np.uint8).reshape(8, 2)
            )
    expected = gguf.quants.dequantize(raw, qt)
    np.testing.assert_array_equal(dequantize(raw, qt, (8, 64)).numpy(), expected)


def test_uniforms_are_a_pure_function_of_seed_and_position():
    a = uniforms(123, 7, 1000, "cpu")
    assert torch.equal(a, uniforms(123, 7, 1000, "cpu"))
    assert not torch.equal(a, uniforms(123, 8, 1000, "cpu"))
    assert not torch.equal(a, uniforms(124, 7, 1000, "cpu"))
    assert 0.0 < float(a.min()) and float(a.max()) < 1.0
    assert abs(float(a.mean()) - 0.5) < 0.05


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(temperature=1.0, seed=99)
    counts = np.bincount([sample(logits, params, pos) for pos in range(4000)], minlength=4)
    np.testing.assert_allclose(counts / 4000, [0.5, 0.3, 0.15, 0.05], atol=0.03)
    top_k = SamplingParams(temperature=1.0, top_k=2, seed=1)
    assert {sample(logits, top_k, pos) for pos in range(300)} == {0, 1}
    top_p = SamplingParams(temperature=1.0, top_p=0.7, seed=1)
    assert {sample(logits, top_p, pos) for pos in range(300)} == {0, 1}
    min_p = SamplingParams(temperature=1.0, min_p=0.5, seed=1)
    assert {sample(logits, min_p, pos) for pos in range(300)} == {0, 1}


def whole_vocabulary_draw(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The sampler as it was written first (torch, stop 29): the vocabulary sorted whole for
    top_p, and Gumbel noise for every token, so no pruning can hide in it."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[0]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0 or params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        if params.min_p > 0.0:
            logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            drop_sorted = torch.cumsum(sorted_probs, 0) - sorted_probs >= params.top_p
            drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
    gumbel = -torch.log(-torch.log(uniforms(params.seed, position, logits.shape[0])))
    return int(torch.argmax(logits.double() + gumbel))


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])  # flat to peaked: few to most pruned
def test_the_sampler_picks_what_a_draw_over_the_whole_vocabulary_picks(scale):
    """`sample` gives noise only to tokens that can still win and sorts only the likeliest
    for top_p: the same picks as the whole-vocabulary draw, token for token."""
    g = torch.Generator().manual_seed(int(scale * 10))
    logits = torch.randn(4096, generator=g) * scale
    settings = [
        SamplingParams(temperature=0.8, seed=3),
        SamplingParams(temperature=1.0, top_p=0.9, seed=4),
        SamplingParams(temperature=0.7, top_k=40, seed=5),
        SamplingParams(temperature=1.3, min_p=0.05, seed=2**63 + 6),
        SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=7),
        SamplingParams(temperature=2.0, top_p=0.5, seed=8),
    ]
    varied = 0
    for params in settings:
        picks = [sample(logits, params, pos) for pos in range(60)]
        assert picks == [whole_vocabulary_draw(logits, params, pos) for pos in range(60)]
        varied += len(set(picks)) > 1
    assert varied >= 2  # draws, not argmaxes (a peaked nucleus may hold one token)


def test_penalties():
    logits = torch.tensor([2.0, -1.0, 0.5, 0.0])
    prompt = torch.tensor([True, True, False, False])
    counts = torch.tensor([0, 0, 3, 0], dtype=torch.int32)
    rep = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), prompt, counts)
    # Seen tokens (prompt or output) shrink towards "less likely": divided if > 0, times if < 0.
    assert rep.tolist() == [1.0, -2.0, 0.25, 0.0]
    freq = apply_penalties(logits, SamplingParams(frequency_penalty=0.5), prompt, counts)
    assert freq.tolist() == [2.0, -1.0, -1.0, 0.0]  # output counts only
    pres = apply_penalties(logits, SamplingParams(presence_penalty=0.5), prompt, counts)
    assert pres.tolist() == [2.0, -1.0, 0.0, 0.0]
    assert torch.equal(apply_penalties(logits, SamplingParams(), prompt, counts), logits)


def test_sampling_parameters_past_float32s_range_pick_their_limits():
    """The API takes any temperature in [0, 4] and any repetition penalty > 0; in float32 a
    temperature of 1e-309 is 0, one of 1e-40 overflows the logits, a penalty of 1e308 is
    infinity (and 0 times it NaN): the sampler raised on two of them, which took the engine
    process down (fuzzing). Each now picks its limit, with no NaN on the way."""
    logits = torch.tensor([2.0, 7.5, -2.0, 0.0, 6.0])
    seen = torch.ones(5, dtype=torch.bool)
    none = torch.zeros(5, dtype=torch.int32)
    with np.errstate(invalid="raise", divide="raise"):  # a NaN, or a division by 0
        for temperature in (2.2e-309, 1e-40):  # the limit of a vanishing temperature: greedy
            assert sample(logits, SamplingParams(temperature=temperature, seed=3), 9) == 1
        huge = SamplingParams(temperature=1.0, repetition_penalty=8.5e307, seed=3)
        penalized = apply_penalties(logits, huge, seen, none)
        # positive logits to ~0, negative ones banned, a zero stays 0: no NaN
        assert penalized[2] == -math.inf and penalized[3] == 0 and 0 < penalized[1] < 1e-37
        assert all(sample(penalized, huge, p) in (0, 1, 3, 4) for p in range(20))
        tiny = SamplingParams(temperature=1.0, repetition_penalty=1e-300, seed=3)
        penalized = apply_penalties(logits, tiny, seen, none)
        # divided past float32's range: those two alone remain, alike
        assert penalized.tolist() == [-math.inf, 0.0, -math.inf, -math.inf, 0.0]
        picks = {sample(penalized, attrs.evolve(tiny, seed=s), 9) for s in range(20)}
        assert picks == {1, 4}  # the two certain tokens, equally likely


@pytest.mark.parametrize("which", ["tiny", "tiny_llama"])
def test_lean_gguf_reader_matches_gguf(tiny, tiny_llama, which):
    """tiny_llama carries a tokenizer: string and number arrays to skip."""
    from gguf import GGUFReader

    from mashbox.engine import gguf_file

    path = tiny[2] if which == "tiny" else tiny_llama
    fields, tensors = gguf_file.read(path)
    reader = GGUFReader(path)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or len(field.types) > 1 or field.types[0].name == "ARRAY":
            continue
        assert fields[key] == field.contents(), key
    assert [t.name for t in tensors] == [t.name for t in reader.tensors]
    for mine, theirs in zip(tensors, reader.tensors, strict=True):
        assert mine.shape == tuple(int(d) for d in reversed(theirs.shape.tolist()))
        assert mine.qtype == theirs.tensor_type
        assert mine.data.tobytes() == np.asarray(theirs.data).tobytes()


def test_int8_decode_weights_are_close_and_prefill_stays_float():
    from mashbox.engine.int8_weight import INT8_MAX_ROWS, Int8Weight

    w = torch.randn(96, 64)
    weight = Int8Weight(w)
    x = torch.randn(4, 64)
    exact = x @ w.T
    approx = weight(x)
    assert approx.dtype == torch.float32
    assert (approx - exact).norm() / exact.norm() < 0.02  # per-channel int8, bf16 activations
    big = torch.randn(INT8_MAX_ROWS + 1, 64)
    assert torch.equal(weight(big), F.linear(big, w))  # prefill-sized batches: the float path


def test_int8_engine_decodes(tiny):
    """int8 decode reads the int8 weights (its logits are never float's bits) and stays close
    to float decode step after step, both fed float's greedy tokens: within 1.9% here, on
    mashbox's kernels and on torch's. Not the same greedy tokens: the tiny llama's first one
    is a near-tie (0.002 apart in float) that int8 on torch's ops turns the other way."""
    _, _, path = tiny
    float_engine = Engine(path, slots=1, ctx=64)
    engine = Engine(path, slots=1, ctx=64, decode_weights="int8")
    assert engine.model.decode_kind == "int8"
    prompt = (4, 8, 15, 16, 23, 42)
    admit = Step(
        admits=(Admit(0, SamplingParams(), prompt),), prefills=(Prefill(0, 0, prompt, True),)
    )
    seq = [*prompt, float_engine.step(admit).tokens[0]]
    res = engine.step(admit)
    res = engine.step(Step(decodes=(Decode(0, res.tokens[0], len(prompt)),)))
    assert 0 <= res.tokens[0] < VOCAB
    for _ in range(8):  # from position len(prompt) again: float's token's KV over int8's
        ids, positions = torch.tensor([seq[-1]]), torch.tensor([len(seq) - 1])
        exact, approx = (
            e.model.logits(e.decoder.decode([0], ids, positions)) for e in (float_engine, engine)
        )
        assert not torch.equal(approx, exact)
        assert (approx - exact).norm() / exact.norm() < 0.03
        seq.append(int(exact.argmax()))
