"""Chat templates and tool calls with the real `openai` client, against a server on the tiny random model and an
adapter. Random weights write garbage, so calls are forced (tool_choice named or required: the grammar makes them
parse) or, for the parser of tool_choice auto, the text is pinned by a structured_outputs choice."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest
from loraplex.frontend.chat_template import ChatOptions, render_chat
from transformers import AutoTokenizer

from tests.server_utils import ServerProcess

# ChatML with tools in the system turn, an assistant's tool_calls and tool results (Qwen2.5's shape, shortened), and
# Qwen3's enable_thinking switch.
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|im_start|>system\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}"
    "{% endif %}{% for call in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": WEATHER_PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME["function"]["parameters"]}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(llama_dir, adapter_dirs, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chatml_tools.jinja"
    template.write_text(TEMPLATE)
    name, path = next(iter(adapter_dirs.items()))
    with ServerProcess("--model-path", str(llama_dir), "--lora-paths", f"tool-lora={path}", "--chat-template",
                       str(template), "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                       "--max-total-tokens", "4096", "--context-length", "1024") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def check_calls(calls, names=("get_weather", "get_time")) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


@pytest.mark.parametrize("model", ["base", "tool-lora"])
def test_named_and_required_choices_always_parse(client, model, llama_dir) -> None:
    model = llama_dir.name if model == "base" else model
    for seed in range(3):
        out = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=NAMED, seed=seed,
                                             max_tokens=64)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        check_calls(choice.message.tool_calls, ["get_weather"])
        for parallel in (True, False):
            out = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                                 parallel_tool_calls=parallel, seed=seed, max_tokens=128)
            choice = out.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            check_calls(choice.message.tool_calls)
            assert parallel or len(choice.message.tool_calls) == 1


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_streamed_calls_assemble_in_the_clients_stream_helper(client, choice) -> None:
    with client.chat.completions.stream(model="tool-lora", messages=ASK, tools=TOOLS, tool_choice=choice, seed=1,
                                        max_tokens=128) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in events
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls" and not message.content
    check_calls(message.tool_calls)
    # the same request whole gives the same calls
    whole = client.chat.completions.create(model="tool-lora", messages=ASK, tools=TOOLS, tool_choice=choice, seed=1,
                                           max_tokens=128).choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in whole] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls]


def test_streamed_deltas_have_openais_shape(client) -> None:
    deltas = [chunk.choices[0].delta for chunk in client.chat.completions.create(
        model="tool-lora", messages=ASK, tools=TOOLS, tool_choice=NAMED, seed=2, max_tokens=64, stream=True)
        if chunk.choices and chunk.choices[0].delta.tool_calls]
    first, rest = deltas[0].tool_calls[0], [d.tool_calls[0] for d in deltas[1:]]
    assert (first.index, first.type, first.function.name, first.function.arguments) == (0, "function", "get_weather",
                                                                                        "")
    assert first.id.startswith("call_") and rest and all(d.id is None and d.function.name is None for d in rest)
    json.loads("".join(d.function.arguments for d in rest))


AUTO_TEXT = 'Checking.<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_choice_reads_the_models_calls_with_the_parser(client, stream) -> None:
    """tool_choice auto (the default with tools): the hermes parser reads the text, pinned here by a choice."""
    kwargs = dict(model="tool-lora", messages=ASK, tools=TOOLS, max_tokens=128,
                  extra_body={"structured_outputs": {"choice": [AUTO_TEXT]}})
    if stream:
        with client.chat.completions.stream(**kwargs) as s:
            for _ in s:
                pass
            out = s.get_final_completion()
    else:
        out = client.chat.completions.create(**kwargs)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_time", {"zone": "CET"})]
    # tool_choice none: the same text stays text
    out = client.chat.completions.create(**{**kwargs, "tool_choice": "none"})
    assert out.choices[0].message.content == AUTO_TEXT and not out.choices[0].message.tool_calls


def test_two_step_tool_loop_on_an_adapter(client) -> None:
    messages = list(ASK)
    first = client.chat.completions.create(model="tool-lora", messages=messages, tools=TOOLS, tool_choice=NAMED,
                                           max_tokens=64, seed=3)
    call = first.choices[0].message.tool_calls[0]
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'})
    second = client.chat.completions.create(model="tool-lora", messages=messages, tools=TOOLS, tool_choice="none",
                                            max_tokens=8, seed=3)
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.tool_calls in (None, [])
    assert isinstance(answer.message.content, str)
    # the call and its result reached the prompt: it grew by them
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 20


def test_parse_with_a_pydantic_response_format(client) -> None:
    class Forecast(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=6)
        sunny: bool

    out = client.chat.completions.parse(model="tool-lora", messages=ASK, response_format=Forecast, max_tokens=64,
                                        seed=0)
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Forecast) and len(parsed.city) <= 6


def test_chat_template_options(client, server, llama_dir) -> None:
    def prompt_tokens(**extra) -> int:
        return client.chat.completions.create(model="tool-lora", messages=ASK, max_tokens=1, extra_body=extra
                                              ).usage.prompt_tokens

    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) > prompt_tokens()
    # /tokenize renders as the chat route does: the same tokens the template gives here
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    for options in ({}, {"tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}}):
        out = server.post("/tokenize", {"model": "tool-lora", "messages": ASK, **options})
        text = render_chat(tokenizer, TEMPLATE, ASK, ChatOptions(
            tools=options.get("tools"), template_kwargs=options.get("chat_template_kwargs", {})))
        expected = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert out.status_code == 200 and out.json()["tokens"] == expected
        assert prompt_tokens(**options) == out.json()["count"]
    assert prompt_tokens(add_generation_prompt=False) < prompt_tokens()
    cont = [*ASK, {"role": "assistant", "content": "It is"}]
    out = server.post("/v1/chat/completions", {"model": "tool-lora", "messages": cont, "max_tokens": 1,
                                               "add_generation_prompt": False, "continue_final_message": True})
    assert out.status_code == 200, out.text
    ids = server.post("/tokenize", {"messages": cont, "add_generation_prompt": False,
                                    "continue_final_message": True}).json()["tokens"]
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\nIt is")  # the answer goes on from there
    for body, problem in (
        ({"messages": cont, "continue_final_message": True}, "Cannot set both"),
        ({"messages": ASK, "chat_template_kwargs": {"tokenize": True}}, "may not set tokenize"),
        ({"messages": ASK, "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "cannot be given with it"),
        ({"messages": ASK, "tool_choice": "required"}, "`tools` must be set"),
        ({"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "Tool 'x' has not been passed"),
    ):
        out = server.post("/v1/chat/completions", {"model": "tool-lora", "max_tokens": 1, **body})
        assert out.status_code == 400 and problem in out.json()["error"]["message"], out.text


def test_template_renders_tools_calls_and_results(llama_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    messages = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = render_chat(tokenizer, TEMPLATE, messages, ChatOptions(tools=TOOLS))
    assert '"name": "get_weather"' in text and "Weather for a city" in text and "<|im_start|>tool\nsunny" in text
    assert '"arguments": {"city": "Oslo"}' in text and text.endswith("<|im_start|>assistant\n")


def test_langchain_agent_completes_a_two_step_tool_loop(server) -> None:
    """LangChain's ChatOpenAI with bind_tools, the tool forced by name: call, run the tool, answer."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    llm = ChatOpenAI(model="tool-lora", base_url=server.url + "/v1", api_key="none", max_tokens=32, seed=0,
                     max_retries=0, timeout=120)
    messages = [HumanMessage("What is the weather in Paris?")]
    asked = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(messages)
    [call] = asked.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Oslo") and call["id"]
    messages += [asked, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    answer = llm.bind_tools([get_weather], tool_choice="none").invoke(messages)
    assert isinstance(answer.content, str) and not answer.tool_calls
    assert answer.usage_metadata["input_tokens"] > asked.usage_metadata["input_tokens"]


def test_unknown_fields_in_any_object_are_refused_naming_their_path(server) -> None:
    """Every object of a chat body is strict, an assistant's earlier tool calls included (tests/unit/
    test_strict_bodies.py walks every object type; here the answer over HTTP)."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    body = {"model": "tool-lora", "messages": history, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 2}
    assert server.post("/v1/chat/completions", body).status_code == 200
    bad = {  # the object given an unknown field: the path the 400 names
        "messages[1].tool_calls[0].flavour": lambda b: b["messages"][1]["tool_calls"][0],
        "messages[1].tool_calls[0].function.flavour": lambda b: b["messages"][1]["tool_calls"][0]["function"],
        "messages[1].flavour": lambda b: b["messages"][1],
        "tools[0].function.flavour": lambda b: b["tools"][0]["function"],
        "tool_choice.function.flavour": lambda b: b["tool_choice"]["function"],
    }
    for path, target in bad.items():
        wrong = json.loads(json.dumps(body))
        target(wrong)["flavour"] = "mint"
        out = server.post("/v1/chat/completions", wrong)
        assert out.status_code == 400 and out.json()["error"]["message"] == f"unknown field '{path}'", out.text


def chat_both_ways(client, **kwargs) -> tuple:
    """The same request whole and streamed (raw chunks, as LangChain reads them): (whole choice, streamed content,
    streamed tool call deltas, streamed finish_reason)."""
    whole = client.chat.completions.create(**kwargs).choices[0]
    content, deltas, reason = "", [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            deltas += choice.delta.tool_calls or []
            reason = choice.finish_reason or reason
    return whole, content, deltas, reason


@pytest.mark.parametrize(("choice", "inside"), [(NAMED, '{"'), ("required", '"parameters": {"')])
def test_a_forced_call_cut_by_max_tokens_is_content_whole_and_streamed(client, server, choice, inside) -> None:
    """A cut call is never presented as one: whole, its text is the content (finish_reason length, no calls); streamed,
    no tool call delta goes out (a client would assemble a call from the pieces) and the same text is the content."""
    kwargs = dict(model="tool-lora", messages=ASK, tools=TOOLS, tool_choice=choice, seed=1)
    for limit in range(2, 60):  # the first limit that cuts inside the arguments
        whole = client.chat.completions.create(**kwargs, max_tokens=limit).choices[0]
        if inside in (whole.message.content or ""):
            break
    assert whole.finish_reason == "length" and not whole.message.tool_calls, whole
    whole, content, deltas, reason = chat_both_ways(client, **kwargs, max_tokens=limit)
    assert whole.finish_reason == "length" and not whole.message.tool_calls and inside in whole.message.content
    assert (content, deltas, reason) == (whole.message.content, [], "length")
    # LangChain, streaming: it would assemble a call from any pieces; it gets the text
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="tool-lora", base_url=server.url + "/v1", api_key="none", max_tokens=limit, seed=1,
                     max_retries=0, timeout=120)
    bound = llm.bind_tools(TOOLS, tool_choice=choice["function"]["name"] if isinstance(choice, dict) else choice)
    chunks = list(bound.stream([HumanMessage(ASK[0]["content"])]))
    streamed = sum(chunks[1:], chunks[0])
    assert not streamed.tool_calls and not streamed.tool_call_chunks and streamed.content == whole.message.content
    # not cut: the same calls whole and streamed, each streamed call in one piece once it parsed
    whole, content, deltas, reason = chat_both_ways(client, **kwargs, max_tokens=128)
    assert whole.finish_reason == reason == "tool_calls" and not content
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [
        (d.function.name, a.function.arguments) for d, a in zip(deltas[::2], deltas[1::2], strict=True)]


def test_an_auto_call_cut_by_max_tokens_is_content_whole_and_streamed(client) -> None:
    """tool_choice auto: a call cut inside its arguments does not parse, so the whole answer is its text; streamed, the
    call is not sent either, and the content adds up to the same text."""
    kwargs = dict(model="tool-lora", messages=ASK, tools=TOOLS, temperature=0,
                  extra_body={"structured_outputs": {"choice": [AUTO_TEXT]}})
    for limit in range(4, 60):  # the first limit that cuts inside the call's arguments
        whole = client.chat.completions.create(**kwargs, max_tokens=limit).choices[0]
        if '"arguments": {"' in (whole.message.content or ""):
            break
    text = whole.message.content
    assert whole.finish_reason == "length" and not whole.message.tool_calls and AUTO_TEXT.startswith(text)
    _, content, deltas, reason = chat_both_ways(client, **kwargs, max_tokens=limit)
    assert (content, deltas, reason) == (text, [], "length")


# ---- /v1/responses, tool_choice auto: the parser's calls as function_call items ---------------------------------

RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's flat tool shape
TWO_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')


def response_kwargs(text: str) -> dict:
    """A Responses request whose output is pinned to `text` (vLLM's structured_outputs extension)."""
    return dict(model="tool-lora", input="What is the weather in Paris?", tools=RESPONSE_TOOLS, max_output_tokens=400,
                extra_body={"structured_outputs": {"choice": [text]}})


def summary(output) -> list[tuple]:
    return [(item.type, item.content[0].text) if item.type == "message" else
            (item.type, item.name, json.loads(item.arguments), item.status) for item in output]


@pytest.mark.parametrize(("text", "expected"), [
    (AUTO_TEXT, [("message", "Checking."), ("function_call", "get_time", {"zone": "CET"}, "completed")]),
    (TWO_CALLS, [("function_call", "get_weather", {"city": "Oslo", "days": 2}, "completed"),
                 ("function_call", "get_time", {"zone": "UTC"}, "completed")]),
])
def test_responses_auto_choice_reads_the_models_calls(client, text, expected) -> None:
    """tool_choice auto (the default) under --tool-call-parser: the text is read into function_call items, whole and
    streamed (assembled by the openai client's responses.stream), the calls as chat's parser reads them."""
    out = client.responses.create(**response_kwargs(text))
    assert out.status == "completed" and summary(out.output) == expected
    calls = [item for item in out.output if item.type == "function_call"]
    assert all(c.call_id.startswith("call_") and c.id.startswith("fc_") for c in calls)
    assert len({c.call_id for c in calls}) == len(calls)
    chat = client.chat.completions.create(model="tool-lora", messages=ASK, tools=TOOLS, max_tokens=400,
                                          extra_body={"structured_outputs": {"choice": [text]}}).choices[0].message
    assert [(c.function.name, c.function.arguments) for c in chat.tool_calls] == [(c.name, c.arguments) for c in calls]
    with client.responses.stream(**response_kwargs(text)) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert summary(final.output) == expected and final.status == "completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e for e in events if e.type == "response.output_item.added"]
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.output_index for e in added] == [e.output_index for e in done] == list(range(len(expected)))
    assert [e.item.id for e in added] == [e.item.id for e in done] == [item.id for item in final.output]
    for index, item in enumerate(final.output):  # each item's pieces add up to it, between its added and done
        kinds = [e.type for e in events if getattr(e, "output_index", None) == index]
        if item.type == "function_call":
            pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"
                      and e.output_index == index]
            assert "".join(pieces) == item.arguments
            assert kinds[0] == "response.output_item.added" and kinds[-2:] == [
                "response.function_call_arguments.done", "response.output_item.done"]
        else:
            pieces = [e.delta for e in events if e.type == "response.output_text.delta" and e.output_index == index]
            assert "".join(pieces) == item.content[0].text
            assert kinds[-3:] == ["response.output_text.done", "response.content_part.done",
                                  "response.output_item.done"]
    ends = ("response.output_item.added", "response.output_item.done")  # one item after the other, never interleaved
    assert [(e.type, e.output_index) for e in events if e.type in ends] == [
        (kind, index) for index in range(len(expected)) for kind in ends]
    assert events[-1].type == "response.completed"


def test_responses_auto_choice_call_cut_by_max_output_tokens(client) -> None:
    """A call cut inside its arguments does not parse: whole, the answer is its text as a message; streamed, the
    call went out as far as it got (incomplete), then the text as a message, so the messages hold the same text."""
    cut = None
    for limit in range(8, 80, 2):  # the first limit that cuts after the call's name is written
        out = client.responses.create(**{**response_kwargs(AUTO_TEXT), "max_output_tokens": limit}, temperature=0)
        text = out.output[0].content[0].text if out.output[0].type == "message" else ""
        if '"name": "get_time", "arguments": {"' in text:
            cut = limit
            break
    assert cut is not None and out.status == "incomplete" and summary(out.output) == [("message", text)]
    assert AUTO_TEXT.startswith(text) and text != AUTO_TEXT
    with client.responses.stream(**{**response_kwargs(AUTO_TEXT), "max_output_tokens": cut}, temperature=0) as stream:
        events = list(stream)
    final = events[-1].response  # response.incomplete, as OpenAI ends a cut stream
    assert events[-1].type == "response.incomplete" and final.status == "incomplete"
    assert final.incomplete_details.reason == "max_output_tokens"
    assert "".join(item.content[0].text for item in final.output if item.type == "message") == text
    assert [(c.name, c.status) for c in final.output if c.type == "function_call"] == [("get_time", "incomplete")]


def test_responses_auto_choice_leaves_text_and_refusals(client, server) -> None:
    # no call in the text, or tool_choice none: one message with the text as it is
    plain = client.responses.create(**response_kwargs("Sunny, I think."))
    assert summary(plain.output) == [("message", "Sunny, I think.")]
    kept = client.responses.create(**response_kwargs(AUTO_TEXT), tool_choice="none")
    assert summary(kept.output) == [("message", AUTO_TEXT)]
    # a forced choice fixes the output's shape: structured_outputs cannot come with it
    body = {"model": "tool-lora", "input": "Hi", "tools": RESPONSE_TOOLS, "tool_choice": "required",
            "structured_outputs": {"choice": ["x"]}}
    out = server.post("/v1/responses", body)
    assert out.status_code == 400 and "structured_outputs" in out.json()["error"]["message"], out.text
