"""Tool-call parsers on fixed texts: one-shot parse, and streamed (the text fed a few characters at a time) assembling
to the same content and calls; forced-choice schemas; tool_choice rules."""

from __future__ import annotations

import json

import jsonschema
import pytest
from loraplex.frontend.errors import InputError
from loraplex.frontend.tools.base import ToolCall
from loraplex.frontend.tools.forced import NamedParser, RequiredParser, named_schema, required_schema
from loraplex.frontend.tools.parsers import PARSERS
from loraplex.frontend.tools.request import FunctionDef, FunctionName, NamedToolChoice, Tool, ToolPlan, tool_plan
from loraplex.frontend.tools.stream import ToolCallStream, tool_answer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}}}}
TOOLS = [WEATHER, SEARCH]
TWO_CALLS = [ToolCall("get_weather", '{"city": "Paris", "days": 2}'), ToolCall("search", '{"query": "a [b], c"}')]

HARMONY_TWO_CALLS = (
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 2}<|call|>'
    '<|start|>assistant to=functions.search<|channel|>commentary <|constrain|>json<|message|>{"query": "a [b], c"}'
    "<|call|>")
# DeepSeek-V3's calls (type, name, fenced JSON) and V3.1's (name, JSON), as their chat templates write them back
DEEPSEEK_V3_TWO_CALLS = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n'
    '{"query": "a [b], c"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
DEEPSEEK_V31_TWO_CALLS = (
    '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 2}'
    "<｜tool▁call▁end｜>"
    '<｜tool▁call▁begin｜>search<｜tool▁sep｜>{"query": "a [b], c"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
KIMI_TWO_CALLS = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Paris", "days": 2}<|tool_call_end|><|tool_call_begin|>functions.search:1<|tool_call_argument_begin|>'
    '{"query": "a [b], c"}<|tool_call_end|><|tool_calls_section_end|>')
KIMI_IDS = [ToolCall(c.name, c.arguments, f"functions.{c.name}:{i}") for i, c in enumerate(TWO_CALLS)]

CASES = [  # (parser, model text, content, calls)
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
     '</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"query": "a [b], c"}}\n</tool_call>',
     "Let me look.\n", TWO_CALLS),
    ("hermes", '<tool_call>\n{"name": "search", "arguments": {"query": "a [b], c"}}', "", TWO_CALLS[1:]),  # unclosed
    ("hermes", "No tools needed: 1 < 2.", "No tools needed: 1 < 2.", []),
    ("hermes", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
     '{"name": "search", "parameters": {"query": "a [b], c"}}', "", TWO_CALLS),
    ("llama3_json", '<|python_tag|>{"name": "search", "parameters": {"query": "a [b], c"}}', "", TWO_CALLS[1:]),
    ("llama3_json", "The weather is {fine}.", "The weather is {fine}.", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
     '{"name": "search", "arguments": {"query": "a [b], c"}}]', "", TWO_CALLS),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "search", "arguments": {"query": "a [b], c"}}]', "Sure. ",
     TWO_CALLS[1:]),
    ("mistral", "Plain [answer].", "Plain [answer].", []),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]search[ARGS]'
     '{"query": "a [b], c"}', "", TWO_CALLS),
    ("qwen3_coder", "I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=search>\n"
     "<parameter=query>\na [b], c\n</parameter>\n</function>\n</tool_call>", "I will check.\n", TWO_CALLS),
    ("xml", "<tool_call><function=get_weather><parameter=city>Paris</parameter><parameter=days>2</parameter>"
     "</function></tool_call>", "", TWO_CALLS[:1]),
    ("pythonic", '[get_weather(city="Paris", days=2), search(query=\'a [b], c\')]', "", TWO_CALLS),
    ("pythonic", '<|python_start|>[search(query="a [b], c")]<|python_end|>', "", TWO_CALLS[1:]),
    ("pythonic", "[not a call]", "[not a call]", []),
    ("pythonic", "Hello there (friend).", "Hello there (friend).", []),
    ("glm45", "I will check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
     "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>\n<tool_call>search\n<arg_key>query</arg_key>\n"
     "<arg_value>a [b], c</arg_value>\n</tool_call>", "I will check.\n", TWO_CALLS),
    ("glm45", "<tool_call>search<arg_key>query</arg_key><arg_value>a [b], c</arg_value></tool_call>", "",
     TWO_CALLS[1:]),  # no newlines between the tags
    ("glm45", "No tools needed: 1 < 2 and <b>bold</b>.", "No tools needed: 1 < 2 and <b>bold</b>.", []),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\nParis\n</tool_call>",  # a value outside its tags
     "<tool_call>get_weather\n<arg_key>city</arg_key>\nParis\n</tool_call>", []),
    ("glm45", "<tool_call>search<arg_key>a</arg_key>x<arg_key>query</arg_key><arg_value>v</arg_value></tool_call>",
     "<tool_call>search<arg_key>a</arg_key>x<arg_key>query</arg_key><arg_value>v</arg_value></tool_call>", []),
    ("glm45", "<tool_call>\n<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>",  # no name
     "<tool_call>\n<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>", []),
    ("glm45", "Cut: <tool_call>search\n<arg_key>query</arg_key>\n<arg_value>a [b]",  # cut by max_tokens
     "Cut: <tool_call>search\n<arg_key>query</arg_key>\n<arg_value>a [b]", []),
    # gpt-oss harmony (the output opens after `<|start|>assistant`; `<|call|>` may be absent: it is a stop token)
    ("openai", HARMONY_TWO_CALLS, "", TWO_CALLS),
    ("openai", "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.search <|constrain|>json<|message|>{"query": "a [b], c"}', "Need the weather.", TWO_CALLS[1:]),
    ("openai", ' to=functions.search<|channel|>commentary json<|message|>{"query": "a [b], c"}<|call|>', "",
     TWO_CALLS[1:]),  # the recipient before the channel
    ("openai", "<|channel|>final<|message|>No tools needed: 1 < 2.<|return|>", "No tools needed: 1 < 2.", []),
    ("openai", "<|channel|>commentary to=functions.search <|constrain|>json<|message|>not json<|call|>"
     "<|start|>assistant<|channel|>final<|message|>ok", "<|start|>assistant<|channel|>commentary to=functions.search "
     "<|constrain|>json<|message|>not json<|call|>ok", []),  # malformed: as written, in the content
    ("deepseek_v3", "Let me look." + DEEPSEEK_V3_TWO_CALLS, "Let me look.", TWO_CALLS),
    ("deepseek_v3", DEEPSEEK_V31_TWO_CALLS, "", TWO_CALLS),
    ("deepseek_v3", "Plain {answer}: 1 < 2.", "Plain {answer}: 1 < 2.", []),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>not json<｜tool▁call▁end｜>",
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>not json<｜tool▁call▁end｜>", []),
    ("kimi_k2", "I will check." + KIMI_TWO_CALLS, "I will check.", KIMI_IDS),
    ("kimi_k2", " <|tool_call_section_begin|> <|tool_call_begin|> functions.search:1 <|tool_call_argument_begin|> "
     '{"query": "a [b], c"} <|tool_call_end|> <|tool_call_section_end|>', " ", KIMI_IDS[1:]),  # spaced, singular
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>search<|tool_call_argument_begin|>{}<|tool_call_end|>",
     "<|tool_calls_section_begin|><|tool_call_begin|>search<|tool_call_argument_begin|>{}<|tool_call_end|>",
     []),  # no `:IDX`: not Kimi's call id
    ("llama4_pythonic", '<|python_start|>[get_weather(city="Paris", days=2), search(query="a [b], c")]'
     "<|python_end|>", "", TWO_CALLS),
    ("llama4_pythonic", '[search(query="a [b], c")]', "", TWO_CALLS[1:]),
    ("llama4_pythonic", "It is [sunny].", "It is [sunny].", []),
]


def streamed(plan: ToolPlan, text: str, step: int, whole_calls: bool = True) -> tuple[str, list[ToolCall], list]:
    """Feed text `step` characters at a time; assemble the deltas as OpenAI's clients do."""
    stream = ToolCallStream(plan, whole_calls)
    content, calls, deltas = "", {}, []
    for end in [*range(step, len(text), step), len(text)]:
        for piece, call_deltas in stream.update(text[:end], final=end == len(text)):
            content += piece
            deltas += call_deltas
    for delta in deltas:
        if delta.id is not None:  # a call's first delta: id, type, name and empty arguments
            assert delta.index == len(calls) and delta.type == "function" and delta.function.arguments == ""
            model_id = None if delta.id.startswith("call_") else delta.id  # made ids read as None, as parsers give
            calls[delta.index] = [delta.function.name, "", model_id]
        else:
            assert delta.function.name is None
            calls[delta.index][1] += delta.function.arguments
    return content, [ToolCall(*call) for call in calls.values()], deltas


@pytest.mark.parametrize("name, text, content, calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_parser_one_shot_and_streamed(name: str, text: str, content: str, calls: list[ToolCall]) -> None:
    parser = PARSERS[name](TOOLS)
    parsed = parser.parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments), c.id) for c in parsed.calls] == [
        (c.name, json.loads(c.arguments), c.id) for c in calls]
    for step in (1, 3, 7, len(text)):
        for whole_calls in (True, False):
            got_content, got_calls, _ = streamed(ToolPlan(parser), text, step, whole_calls)
            assert (got_content, got_calls) == (parsed.content, parsed.calls), (step, whole_calls)


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "openai", "deepseek_v3", "kimi_k2"])
def test_json_formats_stream_arguments_as_they_are_written(name: str) -> None:
    text = next(t for n, t, _, calls in CASES if n == name and len(calls) == 2)
    _, calls, deltas = streamed(ToolPlan(PARSERS[name](TOOLS)), text, 2, whole_calls=False)
    pieces = [d for d in deltas if d.id is None and d.index == 0]
    assert len(pieces) > 5 and "".join(p.function.arguments for p in pieces) == calls[0].arguments
    assert calls[0].arguments == '{"city": "Paris", "days": 2}'  # as the model wrote it
    # whole_calls (chat): each call in one piece, once it is complete
    _, whole, deltas = streamed(ToolPlan(PARSERS[name](TOOLS)), text, 2)
    assert whole == calls and [d.function.arguments for d in deltas if d.id is None] == [c.arguments for c in calls]


def test_kimi_k2_calls_keep_the_models_ids_whole_and_streamed() -> None:
    """Kimi's template writes `functions.NAME:IDX` back with the tool's result, so it is the call's id."""
    plan = ToolPlan(PARSERS["kimi_k2"](TOOLS))
    content, calls = tool_answer(KIMI_TWO_CALLS, plan)
    assert content is None and [c.id for c in calls] == ["functions.get_weather:0", "functions.search:1"]
    for whole_calls in (True, False):
        _, _, deltas = streamed(plan, KIMI_TWO_CALLS, 1, whole_calls)
        assert [d.id for d in deltas if d.id is not None] == ["functions.get_weather:0", "functions.search:1"]


def test_deepseek_v3_streams_a_call_as_its_arguments_are_written() -> None:
    stream = ToolCallStream(ToolPlan(PARSERS["deepseek_v3"](TOOLS)), whole_calls=False)
    head = "Ok<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n``"
    assert stream.update("Ok<｜tool▁calls", final=False) == [("Ok", [])]
    assert stream.update(head, final=False) == []  # the fence not yet written: no head yet
    out = stream.update(head + '`json\n{"city": "Pa', final=False)
    assert [(d.function.name, d.function.arguments) for _, deltas in out for d in deltas] == [
        ("get_weather", ""), (None, '{"city": "Pa')]


GLM_TOOLS = [WEATHER, SEARCH, {"type": "function", "function": {"name": "get_time", "parameters": {}}}]


def test_glm45_values_are_typed_by_the_schema_or_read_as_json() -> None:
    """A string-typed parameter stays text ("007"); others are JSON where they parse (an object, a number), text
    where they do not; a call with no pairs has empty arguments."""
    text = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>007</arg_value>\n<arg_key>days</arg_key>\n"
            "<arg_value>three</arg_value>\n<arg_key>extra</arg_key>\n<arg_value>{\"a\": [1, 2.5], \"b\": null}"
            "</arg_value>\n<arg_key>n</arg_key>\n<arg_value>12</arg_value>\n</tool_call><tool_call>get_time\n</tool_call>")
    calls = PARSERS["glm45"](GLM_TOOLS).parse(text).calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "007", "days": "three", "extra": {"a": [1, 2.5], "b": None}, "n": 12}),
        ("get_time", {})]


@pytest.mark.parametrize("step", [1, 2, 5, 11])
@pytest.mark.parametrize("whole_calls", [True, False])
def test_glm45_streams_each_call_name_first_then_its_arguments(step: int, whole_calls: bool) -> None:
    """Whatever the chunks (cut inside tags, names and values), each call goes out once closed: a head with its name,
    then its arguments in one piece; the content before the calls goes out before them, the marker never."""
    text = next(t for n, t, _, calls in CASES if n == "glm45" and len(calls) == 2)
    parser = PARSERS["glm45"](TOOLS)
    content, calls, deltas = streamed(ToolPlan(parser), text, step, whole_calls)
    assert (content, calls) == ("I will check.\n", parser.parse(text).calls)
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (0, "get_weather", ""), (0, None, calls[0].arguments), (1, "search", ""), (1, None, calls[1].arguments)]


def test_glm45_sends_a_call_only_once_it_closes() -> None:
    stream = ToolCallStream(ToolPlan(PARSERS["glm45"](TOOLS)), whole_calls=False)
    assert stream.update("Ok <tool_ca", final=False) == [("Ok ", [])]
    assert stream.update("Ok <tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>",
                         final=False) == []
    out = stream.update("Ok <tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>",
                        final=False)
    assert [(d.function.name, d.function.arguments) for _, deltas in out for d in deltas] == [
        ("get_weather", ""), (None, '{"city": "Oslo"}')]


CUT = [  # (plan, an output cut by max_tokens): whole and streamed (whole_calls), it is text, and no call goes out
    (ToolPlan(NamedParser(TOOLS, "get_weather")), '{"city": "Paris", "da'),
    (ToolPlan(RequiredParser(TOOLS, True)), '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "se'),
    (ToolPlan(RequiredParser(TOOLS, True)), '[{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    (ToolPlan(RequiredParser(TOOLS, False)), '{"name": "get_weather", "parameters": {"city": "Pa'),
    (ToolPlan(PARSERS["hermes"](TOOLS)), 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),
    (ToolPlan(PARSERS["llama3_json"](TOOLS)), '{"name": "get_weather", "parameters": {"city": "Par'),
    (ToolPlan(PARSERS["glm45"](TOOLS)), "Checking.<tool_call>get_weather\n<arg_key>city</arg_key><arg_value>Paris"
     "</arg_value>"),
    (ToolPlan(PARSERS["openai"](TOOLS)), "<|start|>assistant<|channel|>commentary to=functions.get_weather "
     '<|constrain|>json<|message|>{"city": "Par'),
    (ToolPlan(PARSERS["deepseek_v3"](TOOLS)), DEEPSEEK_V3_TWO_CALLS[:90]),
    (ToolPlan(PARSERS["deepseek_v3"](TOOLS)), "Checking." + DEEPSEEK_V31_TWO_CALLS[:75]),
    (ToolPlan(PARSERS["kimi_k2"](TOOLS)), "Checking." + KIMI_TWO_CALLS[:100]),
]


@pytest.mark.parametrize("plan, text", CUT, ids=[f"{type(p.parser).__name__}-{i}" for i, (p, _) in enumerate(CUT)])
def test_a_cut_call_is_text_whole_and_streamed(plan: ToolPlan, text: str) -> None:
    assert tool_answer(text, plan) == (text, [])
    for step in (1, 4, len(text)):
        content, calls, deltas = streamed(plan, text, step)
        assert (content, calls, deltas) == (text, [], []), step


def test_complete_calls_before_a_cut_one_agree_whole_and_streamed() -> None:
    plan = ToolPlan(PARSERS["hermes"](TOOLS))
    text = ('Checking.<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"ci')
    content, calls = tool_answer(text, plan)
    assert content == "Checking." and [(c.function.name, c.function.arguments) for c in calls] == [
        ("search", '{"query": "x"}')]
    for step in (1, 5, len(text)):
        got_content, got_calls, _ = streamed(plan, text, step)
        assert (got_content, got_calls) == (content, [ToolCall("search", '{"query": "x"}')]), step


def test_streamed_content_never_sends_the_start_of_a_call() -> None:
    stream = ToolCallStream(ToolPlan(PARSERS["hermes"](TOOLS)), whole_calls=True)
    assert stream.update("Hi <tool_", final=False) == [("Hi ", [])]
    assert stream.update("Hi <tool_call>", final=False) == []
    assert stream.update("Hi <tooth>", final=True) == [("<tooth>", [])]


def test_answer_content_is_null_with_calls_alone() -> None:
    content, calls = tool_answer('<tool_call>{"name": "search", "arguments": {}}</tool_call>',
                                 ToolPlan(PARSERS["hermes"](TOOLS)))
    assert content is None and [c.function.name for c in calls] == ["search"]
    assert calls[0].id.startswith("call_") and calls[0].type == "function" and calls[0].function.arguments == "{}"


def test_named_choice_sends_its_call_once_it_parses() -> None:
    plan = ToolPlan(NamedParser(TOOLS, "get_weather"))
    text = '{"city": "Paris", "days": 2}'
    content, calls, deltas = streamed(plan, text, 4)
    assert content == "" and calls == [ToolCall("get_weather", text)] and len(deltas) == 2  # head, arguments
    assert tool_answer(text, plan)[1][0].function.arguments == text


@pytest.mark.parametrize("parallel", [True, False])
def test_required_schema_admits_exactly_the_calls_its_parser_reads(parallel: bool) -> None:
    schema = required_schema(TOOLS, parallel)
    one = {"name": "get_weather", "parameters": {"city": "Oslo"}}
    good = [one, {"name": "search", "parameters": {"query": "x"}}] if parallel else one
    jsonschema.validate(good, schema)
    for bad in ([] if parallel else [one], {"name": "nope", "parameters": {}}, {"name": "get_weather"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    text = json.dumps(good)
    parser = RequiredParser(TOOLS, parallel)
    assert [c.name for c in parser.parse(text).calls] == [c["name"] for c in (good if parallel else [good])]
    assert streamed(ToolPlan(parser), text, 5)[1] == parser.parse(text).calls
    assert named_schema(WEATHER) == WEATHER["function"]["parameters"]


def typed_tools() -> list[Tool]:
    return [Tool(type="function", function=FunctionDef(**t["function"])) for t in TOOLS]


def test_tool_choice_rules_are_vllms() -> None:
    tools = typed_tools()
    assert tool_plan(None, None, None, None) is None
    assert tool_plan(tools, "none", None, "hermes") is None
    with pytest.raises(InputError, match="requires --enable-auto-tool-choice"):
        tool_plan(tools, None, None, None)  # tools without tool_choice mean auto
    with pytest.raises(InputError, match="`tools` must be set"):
        tool_plan(None, "required", None, None)
    with pytest.raises(InputError, match="Tool 'other' has not been passed"):
        tool_plan(tools, NamedToolChoice("function", FunctionName("other")), None, None)
    named = tool_plan(tools, NamedToolChoice("function", FunctionName("search")), None, None)
    assert named.parser.name == "search" and json.loads(named.constraint.source) == SEARCH["function"]["parameters"]
    required = tool_plan(tools, "required", False, None)
    assert json.loads(required.constraint.source) == required_schema(TOOLS, parallel=False)
    assert isinstance(tool_plan(tools, "auto", None, "pythonic").parser, PARSERS["pythonic"])
