"""vLLM's tokenizer routes, past the seeds: `POST /tokenize`, `POST /detokenize` and
`GET /tokenizer_info`. Evaluation harnesses count a context's tokens with the server's own
tokenizer (lm-eval's `tokenizer_backend=remote`), so a loglikelihood request's `ctxlen` is
the server's. A text is tokenized as `/v1/completions` tokenizes its prompt: special tokens
spelled in it are theirs, and `add_special_tokens` puts the model's bos first where it
wants one."""

from __future__ import annotations

from .errors import bad_request, not_ready
from .generation import biasable_tokens, check_model, check_token_ids, encode_prompt
from .state import ServerState
from .validate import Body

# Tokens one /detokenize may name: decoding runs on the event loop (~0.3 us a token).
MAX_DETOKENIZE = 131072


async def tokenize(state: ServerState, data, tenant: str = "") -> dict:
    """{"prompt", "add_special_tokens"} -> {"tokens", "count", "max_model_len"}."""
    if not state.ready:
        raise not_ready()
    body = Body(data)
    check_model(body, state)
    if body.has("messages"):
        raise bad_request("messages are not tokenized here: send the prompt text", "messages")
    text = body.str("prompt")
    if text is None:
        raise bad_request("prompt is required: the text to tokenize", "prompt")
    bos = body.bool("add_special_tokens", True) and state.tokenizer.add_bos
    tokens = await encode_prompt(state, text, "prompt", tenant=tenant, add_bos=bos)
    return {"tokens": tokens, "count": len(tokens), "max_model_len": state.ctx}


def detokenize(state: ServerState, data) -> dict:
    """{"tokens"} -> {"prompt"}: their text, as an answer spells it."""
    if not state.ready:
        raise not_ready()
    body = Body(data)
    check_model(body, state)
    tokens = body.raw("tokens")
    if not isinstance(tokens, list):
        raise bad_request("tokens must be a list of token ids", "tokens")
    if len(tokens) > MAX_DETOKENIZE:
        raise bad_request(f"tokens: {len(tokens)} ids; at most {MAX_DETOKENIZE}", "tokens")
    check_token_ids(tokens, biasable_tokens(state), "tokens")
    return {"prompt": state.tokenizer.decode(tokens)}


def tokenizer_info(state: ServerState) -> dict:
    """The special tokens' texts and the chat template, as vLLM's /tokenizer_info gives."""
    if not state.ready:
        raise not_ready()
    tok = state.tokenizer
    template = state.template
    return {
        "tokenizer_class": "mashbox",
        "bos_token": tok.bos_token or None,
        "eos_token": tok.eos_token or None,
        "pad_token": None,
        "add_bos_token": tok.add_bos,
        "model_max_length": state.ctx,
        "chat_template": template.source if template else None,
    }
