"""The 2026 families' chat templates (faithful minimal copies of their tool parts in tests/data/chat_templates)
through render_chat: the prompt names the tools; an agent's round trip (the assistant's call, the tool's result, the
next prompt) renders, and the call as the template writes it back reads as the same call with the family's
tool-call parser."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from loraplex.frontend.chat_template import ChatOptions, render_chat
from loraplex.frontend.errors import InputError
from loraplex.frontend.openai.schemas import ChatMessage, chat_messages
from loraplex.frontend.tools.parsers import PARSERS

from tests.builders import make_tokenizer

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}},
]  # fmt: skip
ASK = {"role": "user", "content": "Weather in Oslo?"}
RESULT = "sunny, 21 C"
ARGUMENTS = {"city": "Oslo", "days": 2}

FAMILIES = [  # (model type, template, tool-call parser, the text that opens an assistant turn)
    ("deepseek_v3", "deepseek_v3.jinja", "deepseek_v3", "<｜Assistant｜>"),
    ("kimi_k2 (deepseek_v3)", "kimi_k2.jinja", "kimi_k2", "<|im_assistant|>assistant<|im_middle|>"),
    ("llama4", "llama4_pythonic.jinja", "llama4_pythonic", "<|header_start|>assistant<|header_end|>\n\n"),
    ("glm4_moe", "glm4_moe.jinja", "glm45", "<|assistant|>"),
    ("gpt_oss", "gpt_oss.jinja", "openai", "<|start|>assistant"),
    ("qwen3_5, qwen3-coder", "qwen3_coder.jinja", "qwen3_coder", "<|im_start|>assistant\n"),
    ("qwen3_next", "hermes.jinja", "hermes", "<|im_start|>assistant\n"),
]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def round_trip(call_id: str) -> list[dict]:
    """The messages as the chat route gives them to a template (OpenAI's JSON arguments read as an object)."""
    call = {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGUMENTS)}}
    sent = [
        ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": RESULT},
    ]
    return chat_messages(msgspec.convert(sent, list[ChatMessage]))


@pytest.mark.parametrize("family, template, parser, opener", FAMILIES, ids=[f[1] for f in FAMILIES])
def test_template_renders_tools_and_a_tool_round_trip(tokenizer, family, template, parser, opener) -> None:
    source = (TEMPLATES / template).read_text()
    prompt = render_chat(tokenizer, source, [ASK], ChatOptions(tools=TOOLS))
    for name in ("get_weather", "get_time", "Weather for a city", "city", "zone"):
        assert name in prompt, (family, name)
    assert prompt[prompt.rindex(opener) + len(opener) :].strip() in ("", "</think>")  # the answer's turn opened
    call_id = "functions.get_weather:0" if parser == "kimi_k2" else "call_1"
    text = render_chat(tokenizer, source, round_trip(call_id), ChatOptions(tools=TOOLS))
    result_at = text.index(RESULT)
    turn = text[text.rindex(opener, 0, result_at) + len(opener) : result_at]  # the assistant's turn with the call
    calls = PARSERS[parser](TOOLS).parse(turn).calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", ARGUMENTS)], (family, turn)
    if parser == "kimi_k2":  # Kimi's ids go back with the call and its result
        assert calls[0].id == call_id and f"## Return of {call_id}\n{RESULT}" in text


def test_deepseek_v3_thinking_opens_the_answer_inside_the_reasoning(tokenizer) -> None:
    """`chat_template_kwargs.thinking` (the deepseek_v3 reasoning parser's switch) opens <think>; off, it is closed."""
    source = (TEMPLATES / "deepseek_v3.jinja").read_text()
    on = render_chat(tokenizer, source, [ASK], ChatOptions(template_kwargs={"thinking": True}))
    off = render_chat(tokenizer, source, [ASK], ChatOptions())
    assert on.endswith("<｜Assistant｜><think>") and off.endswith("<｜Assistant｜></think>")


def test_a_template_that_joins_arguments_as_text_gets_them_as_text(tokenizer) -> None:
    """DeepSeek's released template fails on the arguments object templates are given; render_chat renders it again
    with OpenAI's JSON text, and a template that fails for other reasons is still the client's error."""
    source = (TEMPLATES / "deepseek_v3.jinja").read_text()
    with pytest.raises(TypeError):
        tokenizer.apply_chat_template(round_trip("call_1"), chat_template=source, tokenize=False)
    text = render_chat(tokenizer, source, round_trip("call_1"), ChatOptions())
    assert '<｜tool▁sep｜>{"city": "Oslo", "days": 2}<｜tool▁call▁end｜>' in text
    with pytest.raises(InputError, match="the chat template rejected the messages"):
        render_chat(tokenizer, "{{ messages[0].content + 1 }}", round_trip("call_1"), ChatOptions())
