"""A GLM-4.5-shaped model (q/k/v biases, partial rotary, q/k norms, grouped sigmoid router, shared experts, a dense
first layer) served end to end with chunked prefill and the prefix cache: one batch mixing the base model and the
attention adapter equals HF + peft, cold and from the cache, and the adapter on attention, experts and shared experts
equals HF with it merged; and GLM-4.5's tool calls through `--tool-call-parser glm45` and its reasoning through
`--reasoning-parser glm45` come back through the `openai` client, whole and streamed. Random weights write garbage, so
the model's text is pinned by a structured_outputs choice: with thinking off (the constraint would otherwise wait for
`</think>`), or on a model whose weights are set to write `<think>plan</think>` first (thinking_dir); and a LangChain
agent's round trip (call, tool result, answer) on GLM-format calls."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from tests.expert_adapters import merged_reference
from tests.glm4_moe_models import build_glm4_moe_set
from tests.reference import (
    SHARED_PREFIX_PROMPTS,
    assert_greedy_match,
    assert_mixed_batch_equals_peft,
    greedy_with_margins,
)
from tests.server_utils import CHUNKED_ARGS, ServerProcess

MAX_NEW = 8
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}},
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "Weather in Paris, and the time?"}]
TWO_CALLS = (
    "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
    "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>\n<tool_call>get_time\n"
    "<arg_key>zone</arg_key>\n<arg_value>CET</arg_value>\n</tool_call>"
)
MALFORMED = "<tool_call>get_time\n<arg_key>zone</arg_key>\nCET\n</tool_call>"
TEXT_ONLY = "It is sunny in Paris."
# GLM-4.5's roles and tags, written for these tests (no GLM-4.5 tokenizer_config is available here to copy its
# template): tools, an assistant's earlier calls and tool results rendered, and thinking closed when it is off.
TEMPLATE = (
    "[gMASK]<sop>{% if tools %}<|system|>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|observation|>\n<tool_response>{{ m.content }}</tool_response>"
    "{% else %}<|{{ m.role }}|>\n{{ m.content or '' }}{% for call in m.tool_calls or [] %}<tool_call>"
    "{{ call.function.name }}\n<arg_key>arguments</arg_key>\n<arg_value>{{ call.function.arguments }}</arg_value>\n"
    "</tool_call>{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def glm_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    return build_glm4_moe_set(tmp_path_factory.mktemp("glm4_moe"), with_tokenizer=True)


@pytest.fixture(scope="module")
def server(glm_set, tmp_path_factory: pytest.TempPathFactory):
    model_dir, adapters = glm_set
    template = tmp_path_factory.mktemp("template") / "glm.jinja"
    template.write_text(TEMPLATE)
    lora_paths = [f"{name}={path}" for name, path in adapters.items()]
    with ServerProcess("--model-path", str(model_dir), "--lora-paths", *lora_paths, "--dtype", "float32",
                       "--enable-auto-tool-choice", "--tool-call-parser", "glm45", "--reasoning-parser", "glm45",
                       "--chat-template", str(template), *CHUNKED_ARGS,
                       "--context-length", "1024") as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_glm4_moe_mixed_batch_equals_the_references_with_chunks_and_prefix_cache(
    server: ServerProcess, glm_set
) -> None:
    model_dir, adapters = glm_set
    info = server.get("/server_info").json()
    assert info["model_type"] == "glm4_moe" and info["num_hidden_layers"] == 2
    assert_mixed_batch_equals_peft(server, model_dir, adapters, [None, "a4", None, "a4"], GREEDY)
    # a8 (attention, every expert, the shared experts): HF with the adapter merged is its reference
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    merged = merged_reference(model_dir, adapters["a8"])
    prompt = SHARED_PREFIX_PROMPTS[1]
    ref, margins = greedy_with_margins(merged, tokenizer(prompt)["input_ids"], MAX_NEW)
    resp = server.post("/generate", {"text": prompt, "lora_path": "a8", "sampling_params": GREEDY})
    assert resp.status_code == 200, resp.text
    assert assert_greedy_match(resp.json()["output_ids"], ref, margins, "a8") >= MAX_NEW // 2


def ask(client, text: str, stream: bool):
    """The chat answer to ASK with the tools on adapter a8, the model's text pinned to `text` (spelled in as many as
    one token per byte); streamed: assembled by the client's stream helper."""
    kwargs = dict(
        model="a8",
        messages=ASK,
        tools=TOOLS,
        max_tokens=400,
        extra_body={"structured_outputs": {"choice": [text]}, "chat_template_kwargs": {"enable_thinking": False}},
    )
    if not stream:
        return client.chat.completions.create(**kwargs)
    with client.chat.completions.stream(**kwargs) as s:
        events = [event.type for event in s]
        out = s.get_final_completion()
    assert ("tool_calls.function.arguments.done" in events) == bool(out.choices[0].message.tool_calls)
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_glm45_tool_calls_come_back_through_the_openai_client(client, stream: bool) -> None:
    out = ask(client, TWO_CALLS, stream)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check.\n"
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("get_time", {"zone": "CET"}),
    ]
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
    for text in (TEXT_ONLY, MALFORMED):  # no call: the text is the answer
        message = ask(client, text, stream).choices[0].message
        assert message.content == text and not message.tool_calls


def test_glm45_streamed_deltas_send_names_then_arguments(client) -> None:
    deltas = [
        d
        for chunk in client.chat.completions.create(
            model="a8",
            messages=ASK,
            tools=TOOLS,
            max_tokens=400,
            stream=True,
            extra_body={
                "structured_outputs": {"choice": [TWO_CALLS]},
                "chat_template_kwargs": {"enable_thinking": False},
            },
        )
        if chunk.choices
        for d in chunk.choices[0].delta.tool_calls or []
    ]
    assert [(d.index, d.function.name) for d in deltas if d.id is not None] == [(0, "get_weather"), (1, "get_time")]
    for index in (0, 1):
        pieces = [d for d in deltas if d.index == index]
        assert pieces[0].id is not None and pieces[0].function.arguments == ""
        assert all(d.id is None and d.function.name is None for d in pieces[1:])
        json.loads("".join(d.function.arguments for d in pieces[1:]))


def test_langchain_agent_round_trip_with_glm45_calls(server) -> None:
    """LangChain's ChatOpenAI with bind_tools (tool_choice auto): the model's GLM-format call (pinned) comes back as
    a tool call, the tool runs, its result goes back in the next turn's prompt, and the answer is text."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_time(zone: str) -> str:
        """The time in a zone."""
        return f"12:00 {zone}"

    def llm(text: str) -> ChatOpenAI:
        return ChatOpenAI(
            model="a8",
            base_url=server.url + "/v1",
            api_key="none",
            max_tokens=400,
            max_retries=0,
            timeout=120,
            extra_body={"structured_outputs": {"choice": [text]}, "chat_template_kwargs": {"enable_thinking": False}},
        )

    messages = [HumanMessage("What time is it in CET?")]
    call_text = "<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>CET</arg_value>\n</tool_call>"
    asked = llm(call_text).bind_tools([get_time]).invoke(messages)
    [call] = asked.tool_calls
    assert (call["name"], call["args"]) == ("get_time", {"zone": "CET"}) and call["id"].startswith("call_")
    messages += [asked, ToolMessage(get_time.invoke(call["args"]), tool_call_id=call["id"])]
    answer = llm("It is noon.").bind_tools([get_time]).invoke(messages)
    assert answer.content == "It is noon." and not answer.tool_calls
    # the call and its result reached the prompt
    assert answer.usage_metadata["input_tokens"] > asked.usage_metadata["input_tokens"] + 20


REASONING = "plan"


@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GLM-4.5-shaped model that thinks as GLM-4.5 does: its tokenizer has `<think>` and `</think>` as added (not
    special) tokens, and its weights make it a bigram table (every o_proj and down_proj zero, so each position's
    final hidden state is its normed embedding; the head's row of each designed next token aligned with it): after
    the generation prompt it writes `<think>plan</think>`, then what the request's constraint allows."""
    from tests.builders import add_tokenizer_words, build_tokenizer, make_bigram_model, tokenizer_vocab_size
    from tests.glm4_moe_models import build_glm4_moe_model

    path = tmp_path_factory.mktemp("thinking") / "glm4_moe"
    build_glm4_moe_model(path, vocab_size=tokenizer_vocab_size() + 2, bos_token_id=None, eos_token_id=None)
    build_tokenizer(path)
    tokenizer = add_tokenizer_words(path, ["<think>", "</think>"])
    prompt = tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    prompt_end = tokenizer(prompt, add_special_tokens=False)["input_ids"][-1]
    chain = [prompt_end, *tokenizer.convert_tokens_to_ids(["<think>", *REASONING, "</think>"])]
    assert tokenizer.decode(chain[1:]) == f"<think>{REASONING}</think>" and len(set(chain[:-1])) == len(chain) - 1
    make_bigram_model(path, [(token, next_token, 60.0) for token, next_token in zip(chain, chain[1:], strict=False)])
    return path


@pytest.fixture(scope="module")
def thinking_client(thinking_dir):
    with ServerProcess("--model-path", str(thinking_dir), "--dtype", "float32", "--enable-auto-tool-choice",
                       "--tool-call-parser", "glm45", "--reasoning-parser", "glm45", "--context-length", "512",
                       "--max-total-tokens", "2048") as server:  # fmt: skip
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.parametrize("stream", [False, True])
def test_glm45_reasoning_then_tool_calls_through_the_openai_client(thinking_client, stream: bool) -> None:
    """The model writes `<think>plan</think>` and then the calls (pinned by a constraint, which applies after
    `</think>`): the reasoning comes back as reasoning_content, the calls as tool_calls, whole and streamed."""
    kwargs = dict(
        model=thinking_client.models.list().data[0].id,
        messages=ASK,
        tools=TOOLS,
        max_tokens=400,
        extra_body={"structured_outputs": {"choice": [TWO_CALLS]}},
    )
    if stream:
        chunks = list(thinking_client.chat.completions.create(**kwargs, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
        heads = [t.function.name for d in deltas for t in d.tool_calls or [] if t.id is not None]
        assert (reasoning, content, heads) == (REASONING, "Let me check.\n", ["get_weather", "get_time"])
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        return
    choice = thinking_client.chat.completions.create(**kwargs).choices[0]
    message = choice.message
    assert (getattr(message, "reasoning_content", None), message.content) == (REASONING, "Let me check.\n")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("get_time", {"zone": "CET"}),
    ]
    assert choice.finish_reason == "tool_calls"
    # thinking off: the template would have closed the reasoning, so none is parsed and the text is the answer
    off = thinking_client.chat.completions.create(
        **{
            **kwargs,
            "tools": None,
            "extra_body": {
                "structured_outputs": {"choice": [TEXT_ONLY]},
                "chat_template_kwargs": {"enable_thinking": False},
            },
        }
    )
    assert (getattr(off.choices[0].message, "reasoning_content", None), off.choices[0].message.content) == (
        None,
        TEXT_ONLY,
    )
