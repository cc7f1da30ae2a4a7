"""A tiny Llama trained to give scripted answers: thinking blocks, tool calls, tool results.

End-to-end tests need a real model that reliably emits specific completions, so that the
real sampling, detokenizing and parsing path sees `<think>` blocks and `<tool_call>`s.
`build_trained_model` trains one (2 layers, d_model 64, float32 GGUF) in about 15-30 s on
one CPU thread, with teacher forcing on random conversations rendered with TOOL_TEMPLATE
(ChatML, Qwen2.5-style tools, Qwen3-style thinking) and tokenized exactly as the server
tokenizes them. Every step draws fresh conversations; training stops when greedy decoding
gives the SCRIPT completion, each token by a logit margin of MARGIN, for every HELD_OUT
conversation and for CHECK_SIZE random conversations it never trained on.

The rules (`expected_completion`), first match wins:

1. the last message is a tool result: "It is sunny in Paris." (thinking on or off);
2. the last user message contains "weather" (any case): a get_weather(city=Paris) call,
   after a short <think> block when thinking is on;
3. anything else: a greeting, after a short <think> block when thinking is on.

`tools` never changes the answer. Thinking is on unless enable_thinking is False, as in
Qwen3's template. Every completion ends with <|im_end|>, the EOS, which the texts here omit
(a detokenizer prints nothing for it).

What it was trained on, so what to expect of it: user texts are natural sentences or random
words, with or without "weather"; there may be a system prompt, tools (any names and
descriptions), an earlier greeting turn, or an earlier weather question answered by tool
calls and results (then maybe "It is sunny in Paris." and a new user message). Earlier
turns follow the script. A user message straight after tool results was never trained on,
and a system prompt that mentions weather, without tools, can still win over a very short
user message.
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm
import torch
import torch.nn.functional as F

from mashbox.engine.config import ModelConfig
from mashbox.engine.model import apply_rope, rms_norm, rope_tables
from mashbox.text.chat_template import ChatTemplate
from mashbox.text.tokenizer import Tokenizer

from . import tinytok
from .tinymodels import random_weights, write_gguf

# ChatML with Qwen2.5's tool prompt, <tool_call>/<tool_response> turns and Qwen3's thinking.
TOOL_TEMPLATE = r"""{%- macro text(content) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content %}
        {%- for part in content %}
            {{- part['text'] }}
        {%- endfor %}
    {%- endif %}
{%- endmacro %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- text(messages[0]['content']) + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and '
        'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": '
        '<function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + text(messages[0]['content']) + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {%- if not loop.first %}
            {{- '<|im_start|>system\n' + text(message['content']) + '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message['role'] == 'user' %}
        {{- '<|im_start|>user\n' + text(message['content']) + '<|im_end|>\n' }}
    {%- elif message['role'] == 'assistant' %}
        {%- set content = text(message['content']) %}
        {{- '<|im_start|>assistant\n' }}
        {%- if message['reasoning_content'] %}
            {{- '<think>\n' + message['reasoning_content'].strip('\n') + '\n</think>\n\n' }}
        {%- endif %}
        {{- content }}
        {%- for call in message['tool_calls'] or [] %}
            {%- if call['function'] is defined %}
                {%- set call = call['function'] %}
            {%- endif %}
            {%- if not loop.first or content %}
                {{- '\n' }}
            {%- endif %}
            {{- '<tool_call>\n{"name": "' + call['name'] + '", "arguments": ' }}
            {%- if call['arguments'] is string %}
                {{- call['arguments'] }}
            {%- else %}
                {{- call['arguments'] | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message['role'] == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + text(message['content']) + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('unknown role: ' + message['role']) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

# Tags that are single (user-defined, printed) tokens, as in Qwen's vocabularies.
TAGS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<tools>",
    "</tools>",
]

WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER_THOUGHT = "<think>\nThe user wants the weather.\n</think>\n\n"
GREETING = "Hello! How can I help?"
GREETING_THOUGHT = "<think>\nA greeting.\n</think>\n\n"
SUNNY = "It is sunny in Paris."

# (condition, completion); expected_completion picks one, first match wins.
SCRIPT: list[tuple[str, str]] = [
    ("the last message is a tool result", SUNNY),
    ("the last user message mentions weather, thinking on", WEATHER_THOUGHT + WEATHER_CALL),
    ("the last user message mentions weather, thinking off", WEATHER_CALL),
    ("anything else, thinking on", GREETING_THOUGHT + GREETING),
    ("anything else, thinking off", GREETING),
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

# Model shape: small enough to train in seconds on two cores.
D_MODEL, N_LAYERS, N_HEADS, N_KV_HEADS, D_FF = 64, 2, 4, 2, 128
VOCAB_SIZE = 1024
SPM_CONVERSATIONS = 256
CONTEXT = 512
BATCH_SIZE = 16
LR = 7e-3
DECAY_STEPS = 300
MAX_STEPS = 1000
DECIDING_TOKENS, DECIDING_WEIGHT = 3, 5.0
CHECK_SIZE = 100  # random conversations checked, besides HELD_OUT
FIRST_CHECK, CHECK_EVERY = 100, 25
TOOLS_P = 0.3  # how many conversations offer tools
SEED = 0
MARGIN = 1.0  # the right token's logit must beat every other by this much


def _mentions_weather(content: Any) -> bool:
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content)
    return "weather" in (content or "").lower()


def expected_completion(
    messages: list[dict], tools: list[dict] | None = None, enable_thinking: bool | None = True
) -> str:
    """The SCRIPT completion the model gives (without the final <|im_end|>).

    enable_thinking None means the template's default, which is on; tools change nothing.
    """
    del tools
    thinking = enable_thinking is not False
    if messages and messages[-1]["role"] == "tool":
        return SUNNY
    users = [m for m in messages if m["role"] == "user"]
    if users and _mentions_weather(users[-1].get("content")):
        return (WEATHER_THOUGHT if thinking else "") + WEATHER_CALL
    return (GREETING_THOUGHT if thinking else "") + GREETING


# --- conversations ----------------------------------------------------------------------------

Conversation = tuple[list[dict], list[dict] | None, bool]  # messages, tools, enable_thinking

SYSTEMS = [
    "You are a helpful assistant.",
    "Be brief.",
    "You answer questions.",
    "You are a friendly assistant. Answer in English.",
    "You can check the weather.",
]
TOOL_RESULTS = [
    '{"temperature": 21, "condition": "sunny"}',
    "Sunny, 21 degrees.",
    '{"city": "Paris", "weather": "sunny"}',
    "sunny",
]
WEATHER_TEXTS = [
    "What is the weather in Paris?",
    "How is the weather today?",
    "weather",
    "Weather in Berlin, please.",
    "Tell me the weather.",
    "Is the weather nice in Rome?",
    "What's the weather like?",
    "I want to know the weather in Nice.",
]
OTHER_TEXTS = [
    "Hello!",
    "Hi there.",
    "What is the capital of France?",
    "Thanks!",
    "Who are you?",
    "Tell me about Paris.",
    "How do tokenizers work?",
    "What is 2 + 2?",
    "Good evening.",
    "Where is the river Seine?",
]
TOOL_NAMES = ["get_weather", "get_time", "search", "lookup", "convert_units", "send_email"]
PARAMETERS = ["city", "location", "query", "unit", "to", "text"]
_WORDS = sorted(
    {w for w in re.findall(r"[A-Za-z]+", tinytok.TRAIN_TEXT) if len(w) > 1} - {"weather"}
)


def _words(rng: random.Random, weather: bool, most: int = 8) -> str:
    """Random words from tinytok.TRAIN_TEXT; one is "weather" (or "Weather") if asked."""
    words = rng.sample(_WORDS, rng.randint(1, most))
    if weather:
        # First (as "weather" or "Weather") or within: three different tokens.
        words.insert(0 if rng.random() < 0.6 else rng.randint(1, len(words)), "weather")
    text = " ".join(words)
    if rng.random() < 0.5:
        text = text[0].upper() + text[1:]
    return text + rng.choice(["", "?", ".", "!"])


def _user_text(rng: random.Random, weather: bool) -> str:
    if rng.random() < 0.3:
        return rng.choice(WEATHER_TEXTS if weather else OTHER_TEXTS)
    return _words(rng, weather)


def _tool(rng: random.Random) -> dict:
    if rng.random() < 0.3:
        return WEATHER_TOOL
    function: dict[str, Any] = {"name": rng.choice(TOOL_NAMES)}
    if rng.random() < 0.7:
        function["description"] = _words(rng, rng.random() < 0.3, 6)
    names = rng.sample(PARAMETERS, rng.randint(0, 2))
    if names or rng.random() < 0.5:
        function["parameters"] = {
            "type": "object",
            "properties": {name: {"type": "string"} for name in names},
            "required": names[:1],
        }
    return {"type": "function", "function": function}


def _tool_call(arguments_as_string: bool) -> dict:
    arguments: Any = {"city": "Paris"}
    if arguments_as_string:
        arguments = json.dumps(arguments)
    return {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def _conversation(rng: random.Random) -> Conversation:
    """A random conversation: maybe a system prompt, tools and earlier turns, then a user
    message or tool results; user texts and tool descriptions mention weather at random."""
    thinking = rng.random() < 0.5
    tools = [_tool(rng) for _ in range(rng.randint(1, 2))] if rng.random() < TOOLS_P else None
    messages: list[dict] = []
    if rng.random() < 0.4:
        messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
    history = rng.choice(["none", "none", "chat", "tool", "tool"])
    if history == "chat":
        # Earlier turns follow the script: only a tool call answers a weather question.
        messages.append({"role": "user", "content": _user_text(rng, False)})
        messages.append({"role": "assistant", "content": GREETING})
    elif history == "tool":
        messages.append({"role": "user", "content": _user_text(rng, True)})
        calls = [_tool_call(rng.random() < 0.5) for _ in range(1 if rng.random() < 0.8 else 2)]
        call = {"role": "assistant", "content": rng.choice(["", None]), "tool_calls": calls}
        if rng.random() < 0.4:
            call["reasoning_content"] = "The user wants the weather."
        messages.append(call)
        for _ in calls:
            result = rng.choice(TOOL_RESULTS) if rng.random() < 0.5 else _words(rng, False, 4)
            messages.append({"role": "tool", "content": result})
        # The model answers tool results; no user message comes straight after them.
        if rng.random() < 0.4:
            messages.append({"role": "assistant", "content": SUNNY})
    if not messages or messages[-1]["role"] != "tool":
        messages.append({"role": "user", "content": _user_text(rng, rng.random() < 0.5)})
    return messages, tools, thinking


def _conversations(rng: random.Random, n: int) -> list[Conversation]:
    return [_conversation(rng) for _ in range(n)]


# Hand-written conversations (user texts never trained on): training stops only when greedy
# decoding gets these right too, and the tests generate them with the real engine.
HELD_OUT: list[Conversation] = [
    ([{"role": "user", "content": "How is the weather in Lyon tomorrow?"}], None, True),
    ([{"role": "user", "content": "How is the weather in Lyon tomorrow?"}], None, False),
    (
        [{"role": "user", "content": "Could you check the weather for Madrid?"}],
        [WEATHER_TOOL],
        True,
    ),
    (
        [{"role": "user", "content": "Could you check the weather for Madrid?"}],
        [WEATHER_TOOL],
        False,
    ),
    ([{"role": "user", "content": "Good morning!"}], None, True),
    ([{"role": "user", "content": "Good morning!"}], None, False),
    ([{"role": "user", "content": "Where is the Eiffel Tower?"}], [WEATHER_TOOL], True),
    ([{"role": "user", "content": "Where is the Eiffel Tower?"}], [WEATHER_TOOL], False),
    (
        [
            {"role": "user", "content": "What is the weather in Toulouse?"},
            {"role": "assistant", "content": None, "tool_calls": [_tool_call(False)]},
            {"role": "tool", "content": '{"temperature": 24, "condition": "sunny"}'},
        ],
        [WEATHER_TOOL],
        False,
    ),
    (
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Weather for Orléans?"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "The user wants the weather.",
                "tool_calls": [_tool_call(True)],
            },
            {"role": "tool", "content": "Sunny and warm."},
        ],
        [WEATHER_TOOL, TIME_TOOL],
        True,
    ),
    (
        [
            {"role": "user", "content": "Is it raining? Check the weather."},
            {"role": "assistant", "content": "", "tool_calls": [_tool_call(False)]},
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": SUNNY},
            {"role": "user", "content": "Thank you!"},
        ],
        [WEATHER_TOOL],
        False,
    ),
    (
        [
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": GREETING},
            {"role": "user", "content": "And the weather in Nice?"},
        ],
        None,
        True,
    ),
]


# --- tokenizer --------------------------------------------------------------------------------


def _train_spm(workdir: Path, template: ChatTemplate) -> Path:
    """tinytok's SentencePiece settings, plus the tags as symbols and the chat's own text."""
    lines = tinytok.TRAIN_TEXT.splitlines()
    for messages, tools, thinking in _conversations(random.Random(1), SPM_CONVERSATIONS):
        prompt = template.render(messages, tools=tools, enable_thinking=thinking)
        lines += (prompt + expected_completion(messages, tools, thinking)).splitlines()
    prefix = workdir / "trained-spm"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(prefix),
        vocab_size=VOCAB_SIZE,
        model_type="bpe",
        byte_fallback=True,
        user_defined_symbols=tinytok.SPECIAL_TOKENS + TAGS,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        # No leading space on each fragment: a completion then encodes to the tokens that
        # decode to exactly its text, whatever special token precedes it.
        add_dummy_prefix=False,
        character_coverage=1.0,
        split_digits=True,
        num_threads=1,
        minloglevel=2,
    )
    return prefix.with_suffix(".model")


def _add_tokenizer(writer, model_path: Path) -> None:
    """tinytok's SentencePiece keys, with the tags USER_DEFINED and no space prefix."""
    tinytok.add_spm_tokenizer(
        writer,
        model_path,
        chat_template=TOOL_TEMPLATE,
        user_defined=frozenset(TAGS),
        add_space_prefix=False,
    )


# --- model ------------------------------------------------------------------------------------


def _config(vocab: int) -> ModelConfig:
    return ModelConfig(
        arch="llama",
        n_layers=N_LAYERS,
        d_model=D_MODEL,
        n_heads=N_HEADS,
        n_kv_heads=N_KV_HEADS,
        head_dim=D_MODEL // N_HEADS,
        d_ff=D_FF,
        vocab_size=vocab,
        max_context=CONTEXT,
    )


def _hidden(w: dict[str, torch.Tensor], cfg: ModelConfig, ids: torch.Tensor, cos, sin):
    """mashbox.engine.model.Model.forward over a right-padded batch [B, T] (causal)."""
    b, t = ids.shape
    hd = cfg.head_dim
    cos, sin = cos[:t], sin[:t]
    x = F.embedding(ids, w["token_embd.weight"])
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        h = rms_norm(x, w[p + "attn_norm.weight"], cfg.norm_eps)
        q = F.linear(h, w[p + "attn_q.weight"]).view(b, t, cfg.n_heads, hd)
        k = F.linear(h, w[p + "attn_k.weight"]).view(b, t, cfg.n_kv_heads, hd)
        v = F.linear(h, w[p + "attn_v.weight"]).view(b, t, cfg.n_kv_heads, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        x = x + F.linear(out.transpose(1, 2).reshape(b, t, -1), w[p + "attn_output.weight"])
        h = rms_norm(x, w[p + "ffn_norm.weight"], cfg.norm_eps)
        gate = F.linear(h, w[p + "ffn_gate.weight"])
        x = x + F.linear(
            F.silu(gate) * F.linear(h, w[p + "ffn_up.weight"]), w[p + "ffn_down.weight"]
        )
    return rms_norm(x, w["output_norm.weight"], cfg.norm_eps)


class _Batch:
    """Prompts + completions, right-padded; targets are the completion tokens (EOS included)."""

    def __init__(self, sequences: list[tuple[list[int], list[int]]]):
        length = max(len(p) + len(c) - 1 for p, c in sequences)
        self.ids = torch.zeros(len(sequences), length, dtype=torch.long)
        self.mask = torch.zeros(len(sequences), length, dtype=torch.bool)
        targets = []
        for row, (prompt, completion) in enumerate(sequences):
            seq = prompt + completion[:-1]
            self.ids[row, : len(seq)] = torch.tensor(seq)
            self.mask[row, len(prompt) - 1 : len(seq)] = True
            targets += completion
        self.targets = torch.tensor(targets)
        # The first tokens of a completion decide which one it is: they weigh more.
        position = self.mask.long().cumsum(1)[self.mask]
        self.weights = torch.where(position <= DECIDING_TOKENS, DECIDING_WEIGHT, 1.0)

    def logits(self, w, cfg, cos, sin) -> torch.Tensor:
        return F.linear(_hidden(w, cfg, self.ids, cos, sin)[self.mask], w["output.weight"])

    def margins(self, logits: torch.Tensor) -> torch.Tensor:
        """Per sequence, the least gap between a target's logit and the best other logit.

        Greedy decoding reproduces a completion exactly when its margin is positive.
        """
        right = logits.gather(1, self.targets[:, None])[:, 0]
        other = logits.scatter(1, self.targets[:, None], float("-inf")).amax(1)
        gaps = torch.full(self.mask.shape, float("inf"))
        gaps[self.mask] = right - other
        return gaps.amin(1)


def _encode(tok: Tokenizer, template: ChatTemplate, conversations) -> list:
    out = []
    for messages, tools, thinking in conversations:
        prompt = template.render(messages, tools=tools, enable_thinking=thinking)
        completion = tok.encode(expected_completion(messages, tools, thinking)) + [tok.eos_id]
        out.append((tok.encode(prompt, add_bos=tok.add_bos), completion))
    return out


def _batches(tok, template, rng: random.Random, size: int):
    """Endless fresh minibatches; each pool of 4 is cut by length, to pad less."""
    while True:
        pool = sorted(_encode(tok, template, _conversations(rng, 4 * size)), key=_length)
        batches = [_Batch(pool[i : i + size]) for i in range(0, len(pool), size)]
        rng.shuffle(batches)
        yield from batches


def _length(sequence: tuple[list[int], list[int]]) -> int:
    return len(sequence[0]) + len(sequence[1])


def build_trained_model(workdir: Path, *, verbose: bool = False) -> Path:
    """Train the scripted model and write workdir/trained.gguf (float32); return its path.

    The file is a cache: when it exists it is returned as it is.
    """
    workdir = Path(workdir)
    path = workdir / "trained.gguf"
    if path.exists():
        return path
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    template = ChatTemplate(TOOL_TEMPLATE)
    model_file = _train_spm(workdir, template)
    vocab = spm.SentencePieceProcessor(model_file=str(model_file)).get_piece_size()

    def add_tokenizer(writer):
        _add_tokenizer(writer, model_file)

    init = random_weights(
        vocab=vocab, d_model=D_MODEL, n_layers=N_LAYERS, n_heads=N_HEADS,
        n_kv_heads=N_KV_HEADS, d_ff=D_FF, seed=SEED,
    )  # fmt: skip
    # Tokenize exactly as the server will: through a GGUF file's own metadata.
    probe = write_gguf(workdir / "tokenizer.gguf", init, add_tokenizer, context=CONTEXT)
    tok = Tokenizer.from_gguf(probe)
    probe.unlink()
    # Never trained on: the hand-written conversations and fresh random ones.
    checks = [*HELD_OUT, *_conversations(random.Random(SEED + 1000), CHECK_SIZE)]
    pairs = zip(_encode(tok, template, checks), checks, strict=True)
    encoded = sorted(pairs, key=lambda e: _length(e[0]))
    checks = [c for _, c in encoded]
    check = [_Batch([e for e, _ in encoded[i : i + 16]]) for i in range(0, len(encoded), 16)]
    batches = _batches(tok, template, random.Random(SEED), BATCH_SIZE)

    cfg = _config(vocab)
    cos, sin = rope_tables(cfg, CONTEXT, "cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(SEED)
        # "weather", "Weather" and " weather" start out as one token: it learns faster.
        forms = [tok.encode(text)[-1] for text in ("weather", "Weather", "a weather")]
        init["token_embd.weight"][forms] = init["token_embd.weight"][forms[0]]
        w = {k: torch.tensor(v, requires_grad=True) for k, v in init.items()}
        opt = torch.optim.Adam(w.values(), lr=LR)
        # Linear decay to a tenth over DECAY_STEPS, then flat.
        decay = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: max(0.1, 1.0 - step / DECAY_STEPS)
        )
        for step in range(MAX_STEPS + 1):
            if step >= FIRST_CHECK and step % CHECK_EVERY == 0:
                with torch.no_grad():
                    margins = torch.cat([b.margins(b.logits(w, cfg, cos, sin)) for b in check])
                bad = [i for i, m in enumerate(margins.tolist()) if m <= MARGIN]
                if verbose:
                    print(
                        f"step {step} {time.perf_counter() - t0:.1f}s: "
                        f"least margin {margins.min():.2f}, below {MARGIN}: {bad}"
                    )
                if not bad:
                    break
            if step == MAX_STEPS:
                if verbose:
                    for i in bad:
                        print(f"{margins[i]:.2f}", checks[i])
                raise RuntimeError(f"the scripted model did not converge in {MAX_STEPS} steps")
            batch = next(batches)
            losses = F.cross_entropy(
                batch.logits(w, cfg, cos, sin), batch.targets, reduction="none"
            )
            loss = (losses * batch.weights).sum() / batch.weights.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            decay.step()
    finally:
        torch.set_num_threads(threads)
    weights = {k: v.detach().numpy().astype(np.float32) for k, v in w.items()}
    partial = workdir / "trained.gguf.partial"
    write_gguf(partial, weights, add_tokenizer, n_heads=N_HEADS, n_kv_heads=N_KV_HEADS,
               context=CONTEXT)  # fmt: skip
    os.replace(partial, path)
    if verbose:
        print(f"trained in {step} steps, {time.perf_counter() - t0:.1f}s")
    return path


if __name__ == "__main__":
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        build_trained_model(Path(sys.argv[1] if len(sys.argv) > 1 else d), verbose=True)
