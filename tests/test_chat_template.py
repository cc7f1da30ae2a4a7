"""ChatTemplate: rendering model templates as transformers does."""

from __future__ import annotations

import json

import pytest

from mashbox.text.chat_template import ChatTemplate, ChatTemplateError
from support import tinytok

# tokenizer.chat_template of SmolLM2-135M-Instruct, copied from its GGUF file.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CONVERSATION = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Japan?"},
]


def test_smollm2_template_adds_default_system_prompt():
    prompt = ChatTemplate(SMOLLM2_TEMPLATE).render(CONVERSATION[:1])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_smollm2_template_keeps_given_system_prompt():
    messages = [{"role": "system", "content": "Be brief."}, *CONVERSATION]
    prompt = ChatTemplate(SMOLLM2_TEMPLATE).render(messages, add_generation_prompt=False)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\nParis.<|im_end|>\n"
        "<|im_start|>user\nAnd of Japan?<|im_end|>\n"
    )


def test_builtin_chatml():
    template = ChatTemplate(None)
    assert template.render(CONVERSATION[:2]) == (
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\nParis.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]}]
    assert template.render(parts, add_generation_prompt=False) == "<|im_start|>user\nab<|im_end|>\n"
    empty = [{"role": "assistant", "content": None}]
    assert template.render(empty, add_generation_prompt=False) == (
        "<|im_start|>assistant\n<|im_end|>\n"
    )


def test_tinytok_template_matches_builtin_with_system_prompt():
    messages = [{"role": "system", "content": "S"}, *CONVERSATION]
    assert ChatTemplate(tinytok.CHATML_TEMPLATE).render(messages) == ChatTemplate(None).render(
        messages
    )
    assert (
        ChatTemplate(tinytok.CHATML_TEMPLATE)
        .render(CONVERSATION[:1])
        .startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    )


def test_raise_exception_becomes_chat_template_error():
    source = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('Conversation roles must start with user') }}{% endif %}ok"
    )
    template = ChatTemplate(source)
    assert template.render(CONVERSATION) == "ok"
    with pytest.raises(ChatTemplateError, match="Conversation roles must start with user"):
        template.render([{"role": "assistant", "content": "hi"}])


def test_render_failures_become_chat_template_error():
    # A None content concatenated to a string fails inside the template.
    with pytest.raises(ChatTemplateError):
        ChatTemplate(SMOLLM2_TEMPLATE).render([{"role": "user", "content": None}])
    with pytest.raises(ChatTemplateError, match="compile"):
        ChatTemplate("{% for x in %}")


def test_sandbox_blocks_unsafe_access():
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% set _ = messages.append(1) %}").render([])


def test_variables_tools_tokens_and_kwargs():
    source = (
        "{{ bos_token }}"
        "{% if tools %}{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{% endif %}"
        "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}"
        "{{ eos_token }}"
    )
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    assert template.uses_tools
    tool = {"name": "météo", "parameters": {"b": 1, "a": 2}}
    assert template.render([], tools=[tool], enable_thinking=False) == (
        '<s>{"name": "météo", "parameters": {"b": 1, "a": 2}}\n/no_think</s>'
    )
    assert template.render([]) == "<s></s>"
    assert not ChatTemplate(SMOLLM2_TEMPLATE).uses_tools


def test_tojson_options_and_loop_controls():
    source = (
        "{{ messages[0] | tojson(indent=2) }}|{{ messages[0] | tojson(separators=(',', ':')) }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}"
        "{% endfor %}"
    )
    msg = {"role": "user", "content": "<é>"}
    out = ChatTemplate(source).render([msg, msg])
    assert (
        out
        == json.dumps(msg, indent=2, ensure_ascii=False) + '|{"role":"user","content":"<é>"}|user'
    )


def test_strftime_now():
    out = ChatTemplate("{{ strftime_now('%Y') }}").render([])
    assert out.isdigit() and len(out) == 4


def test_trim_and_lstrip_blocks():
    source = "{% for m in messages %}\n    {{ m['content'] }}\n{% endfor %}"
    assert ChatTemplate(source).render([{"content": "a"}, {"content": "b"}]) == "    a\n    b\n"
