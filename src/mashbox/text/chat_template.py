"""Render a conversation into a prompt with the model's Jinja chat template, as HF does."""

from __future__ import annotations

import datetime
import json
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when a model ships no template of its own.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The chat template failed to compile or render; the message is safe to show a client."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF's tojson: keeps non-ASCII, no HTML escaping, keys in the order given.
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    """Return a Jinja environment set up as transformers sets it up for chat templates."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template."""

    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "") -> None:
        self.source = CHATML_TEMPLATE if source is None else source
        self.bos_token = bos_token
        self.eos_token = eos_token
        env = _environment()
        try:
            ast = env.parse(self.source)
            self._template = env.from_string(ast)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e
        # A template that never looks at `tools` needs tools described some other way.
        self.uses_tools = "tools" in jinja2.meta.find_undeclared_variables(ast)

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Return the prompt for messages; extra keyword arguments become template variables.

        Raise ChatTemplateError when the template raises (raise_exception) or fails.
        """
        variables = {
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **kwargs,
        }
        try:
            return self._template.render(**variables)
        except ChatTemplateError:
            raise
        except Exception as e:  # a template can fail in any way; the caller answers 400
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
