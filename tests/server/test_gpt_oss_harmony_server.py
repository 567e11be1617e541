"""gpt-oss's harmony tool calls through `--tool-call-parser openai` on a tiny gpt-oss model, through the `openai`
client, whole and streamed. Random weights write garbage, so the model's text is pinned by a structured_outputs
choice (spelled in as many as one token per byte: the test tokenizer has no harmony tokens). The reasoning parser
(`openai_gptoss`) is not run here: its constraint waits for `<|channel|>final<|message|>`, which random weights never
write; tests/unit/test_harmony.py covers it with the tool parser."""

from __future__ import annotations

import json

import openai
import pytest

from tests.gpt_oss_models import build_gpt_oss_model
from tests.server_utils import ServerProcess

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}},
]  # fmt: skip
ASK = [{"role": "user", "content": "Weather in Paris, and the time?"}]
ANALYSIS = "<|channel|>analysis<|message|>Two tools.<|end|>"
TWO_CALLS = (
    ANALYSIS + '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": '
    '"Paris", "days": 2}<|call|><|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>'
    '{"zone": "CET"}'
)
FINAL = "<|channel|>final<|message|>It is sunny in Paris."
CUT = '<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"zone": "CE'
# Harmony's roles, written for these tests: each message `<|start|>ROLE<|message|>TEXT<|end|>`, the answer opened
# with `<|start|>assistant` as gpt-oss's own template does.
TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content or '' }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("gpt_oss_harmony")
    build_gpt_oss_model(root / "model", with_tokenizer=True)
    template = root / "harmony.jinja"
    template.write_text(TEMPLATE)
    with ServerProcess("--model-path", str(root / "model"), "--dtype", "float32", "--enable-auto-tool-choice",
                       "--tool-call-parser", "openai", "--chat-template", str(template),
                       "--context-length", "512") as server:  # fmt: skip
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def ask(client, text: str, stream: bool):
    kwargs = dict(model=client.models.list().data[0].id, messages=ASK, tools=TOOLS, max_tokens=300,
                  extra_body={"structured_outputs": {"choice": [text]}})  # fmt: skip
    if not stream:
        return client.chat.completions.create(**kwargs)
    with client.chat.completions.stream(**kwargs) as s:
        events = [event.type for event in s]
        out = s.get_final_completion()
    assert ("tool_calls.function.arguments.done" in events) == bool(out.choices[0].message.tool_calls)
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_harmony_calls_come_back_through_the_openai_client(client, stream: bool) -> None:
    choice = ask(client, TWO_CALLS, stream).choices[0]
    # without --reasoning-parser openai_gptoss, the analysis channel's text is content
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Two tools."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("get_time", {"zone": "CET"}),
    ]
    message = ask(client, FINAL, stream).choices[0].message
    assert message.content == "It is sunny in Paris." and not message.tool_calls
    message = ask(client, CUT, stream).choices[0].message  # arguments that do not parse: content, as written
    assert message.content == CUT and not message.tool_calls


def test_streamed_deltas_send_names_then_arguments(client) -> None:
    chunks = client.chat.completions.create(model=client.models.list().data[0].id, messages=ASK, tools=TOOLS,
                                            max_tokens=300, stream=True,
                                            extra_body={"structured_outputs": {"choice": [TWO_CALLS]}})  # fmt: skip
    deltas = [d for chunk in chunks if chunk.choices for d in chunk.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (0, "get_weather", ""), (0, None, '{"city": "Paris", "days": 2}'), (1, "get_time", ""),
        (1, None, '{"zone": "CET"}')]  # fmt: skip
    assert all(d.id.startswith("call_") for d in deltas if d.function.name)
