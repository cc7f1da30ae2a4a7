"""vLLM's tokenizer routes, past the seeds: `POST /tokenize`, `POST /detokenize` and
`GET /tokenizer_info`. Evaluation harnesses count a context's tokens with the server's own
tokenizer (lm-eval's `tokenizer_backend=remote`), so a loglikelihood request's `ctxlen` is
the server's. A text is tokenized as `/v1/completions` tokenizes its prompt: special tokens
spelled in it are theirs, and `add_special_tokens` puts the model's bos first where it
wants one.

Scripts and clients written for llama-server speak the same two routes with its fields (an
answer's tokens counted as `{"content": text, "add_special": false}`, say): `/tokenize` takes
`content` and answers each token with its piece where asked, and `/detokenize` answers
`content` beside vLLM's `prompt`."""

from __future__ import annotations

from .errors import bad_request, not_ready, too_long
from .generation import biasable_tokens, check_model, check_token_ids, encode_prompt
from .openai_completions import is_token
from .state import ServerState
from .validate import Body

# Tokens one /detokenize may name, and /tokenize may answer with pieces: both are made on the
# event loop (~0.3 us a token to decode, ~1 us a piece).
MAX_DETOKENIZE = 131072


async def tokenize(state: ServerState, data, tenant: str = "") -> dict:
    """{"prompt", "add_special_tokens"} -> {"tokens", "count", "max_model_len"}."""
    if not state.ready:
        raise not_ready()
    body = Body(data)
    check_model(body, state)
    if body.has("content"):
        if body.has("prompt"):
            raise bad_request(
                "send prompt (vLLM's form) or content (llama-server's), not both", "content"
            )
        return await llama_tokenize(state, body, tenant)
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
    tok = state.tokenizer
    spelled = b"".join(_spelled(tok, t) for t in tokens).decode("utf-8", errors="replace")
    # vLLM's key, the text as an answer spells it; llama-server's, control tokens' texts too.
    return {"prompt": tok.decode(tokens), "content": spelled}


async def llama_tokenize(state: ServerState, body: Body, tenant: str) -> dict:
    """llama-server's form: `content` is a text, or token ids and texts mixed (each text's
    tokens in its place); `add_special` (default false) puts the bos first where the model
    wants one and the first item is a text; `parse_special` false reads special tokens'
    texts as plain text; `with_pieces` answers each token as {"id", "piece"}, the piece its
    text (or its bytes, where they are not UTF-8 alone)."""
    add_special = body.bool("add_special", False)
    parse_special = body.bool("parse_special", True)
    with_pieces = body.bool("with_pieces", False)
    content = body.raw("content")
    pieces = content if isinstance(content, list) else [content]
    if not isinstance(content, (str, list)) or not all(
        isinstance(p, str) or is_token(p) for p in pieces
    ):
        raise bad_request("content must be a string, or a list of token ids and strings", "content")
    tok = state.tokenizer
    chars = sum(len(p) for p in pieces if isinstance(p, str))
    if len(pieces) > state.ctx or chars > state.ctx * tok.max_token_chars:
        raise too_long(
            f"content: {len(pieces)} items, {chars} characters; more than a "
            f"{state.ctx}-token context can hold",
            "content",
        )
    given = [p for p in pieces if not isinstance(p, str)]
    check_token_ids(given, biasable_tokens(state), "content")
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if not isinstance(piece, str):
            ids.append(piece)
            continue
        # Defused, every special token's text in it is plain text (encode_rendered).
        text = piece if parse_special else tok.defuse(piece)
        bos = add_special and i == 0 and tok.add_bos
        ids += await encode_prompt(
            state, text, "content", tenant=tenant, rendered=not parse_special, add_bos=bos
        )
    if with_pieces and len(ids) > MAX_DETOKENIZE:  # pieces are made on the event loop
        raise bad_request(
            f"with_pieces: content is {len(ids)} tokens; pieces for at most {MAX_DETOKENIZE}",
            "with_pieces",
        )
    tokens = [_with_piece(tok, t) for t in ids] if with_pieces else ids
    return {"tokens": tokens, "count": len(ids), "max_model_len": state.ctx}


def _spelled(tok, token: int) -> bytes:
    """A token's bytes as llama-server spells it: a control token's are its text."""
    raw = tok.token_bytes(token)
    if not raw and tok.is_special(token):
        raw = tok.token_text(token).encode()
    return raw


def _with_piece(tok, token: int) -> dict:
    """llama-server's {"id", "piece"}: the piece its text, or its bytes' values."""
    raw = _spelled(tok, token)
    try:
        piece = raw.decode("utf-8")
    except UnicodeDecodeError:
        piece = list(raw)
    return {"id": token, "piece": piece}


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
