"""A chat's prompt text: its messages and tools through the chat template — `--chat-template` (a file, or inline
Jinja) or the tokenizer's own — with vLLM's request options add_generation_prompt, continue_final_message and
chat_template_kwargs (e.g. Qwen3's enable_thinking)."""

from __future__ import annotations

import json
import os
from typing import Any

import msgspec
from loraplex.frontend.errors import InputError
from loraplex.protocol.config import ConfigError

# apply_chat_template's own parameters: chat_template_kwargs may not set them (the request has fields for some).
RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})


class ChatOptions(msgspec.Struct, frozen=True, kw_only=True):
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict] | None = None
    template_kwargs: dict[str, Any] = {}


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file's text, or the value itself when it reads as Jinja (vLLM's rule)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if any(c in value for c in "{}\n"):
        return value
    raise ConfigError(f"--chat-template {value}: no such file, and not an inline Jinja template")


def render_chat(tokenizer: Any, template: str | None, messages: list[dict], options: ChatOptions) -> str:
    """The prompt text; a template that refuses the messages is the client's error (400)."""
    if options.add_generation_prompt and options.continue_final_message:
        raise InputError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    if options.continue_final_message and messages[-1]["role"] != "assistant":
        raise InputError("continue_final_message needs the last message to be the assistant's")
    reserved = sorted(RESERVED_KWARGS & options.template_kwargs.keys())
    if reserved:
        raise InputError(f"chat_template_kwargs may not set {', '.join(reserved)}")
    template = template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise InputError("the model has no chat template, so it cannot take 'messages' (start with --chat-template)")
    try:
        try:
            return apply_template(tokenizer, template, messages, options)
        except TypeError:
            # Templates take a call's arguments as an object (transformers' rule, and vLLM's); some released ones
            # (DeepSeek-V3 / V3.1's) join them to text as OpenAI's JSON text and fail on an object: they get the text.
            as_text = arguments_as_text(messages)
            if as_text == messages:
                raise
            return apply_template(tokenizer, template, as_text, options)
    except Exception as e:  # noqa: BLE001 - a template that rejects these messages is a client error
        raise InputError(f"the chat template rejected the messages: {e}") from e


def apply_template(tokenizer: Any, template: str, messages: list[dict], options: ChatOptions) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=options.tools, chat_template=template, tokenize=False,
        add_generation_prompt=options.add_generation_prompt,
        continue_final_message=options.continue_final_message, **options.template_kwargs)


def arguments_as_text(messages: list[dict]) -> list[dict]:
    """The messages with each earlier call's arguments as JSON text where they are an object."""
    def call_as_text(call: dict) -> dict:
        function = call.get("function")
        if not isinstance(function, dict) or isinstance(function.get("arguments"), str):
            return call
        return {**call, "function": {**function, "arguments": json.dumps(function.get("arguments"),
                                                                          ensure_ascii=False)}}

    return [{**m, "tool_calls": [call_as_text(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m
            for m in messages]
