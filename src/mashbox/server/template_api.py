"""llama-server's `POST /apply-template`, past the seeds: the prompt a chat request's
messages (with its tools and thinking) render to through the model's template, exactly as
/v1/chat/completions renders them, without generating. Clients edit it (start the answer,
say) and send it to /completion."""

from __future__ import annotations

from ..text.tokenizer import DEFUSE
from . import chat
from .errors import not_ready
from .generation import check_model
from .openai_chat import chat_messages, chat_tool_choice, chat_tools, thinking_requested
from .state import ServerState
from .validate import Body


def apply_template(state: ServerState, data) -> dict:
    """{"messages", "tools", "tool_choice", "chat_template_kwargs"} -> {"prompt"}."""
    if not state.ready:
        raise not_ready()
    body = Body(data)
    check_model(body, state)
    tools, choice = chat_tools(body), chat_tool_choice(body)
    messages, thinking = chat_messages(body), thinking_requested(body)
    prompt = chat.render(state, messages, tools=tools, tool_choice=choice, thinking=thinking)
    # The marks that keep the client's special-token texts plain are the server's own.
    return {"prompt": prompt.text.replace(DEFUSE, "")}
